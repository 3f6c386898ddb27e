"""A vision run's folder: one run per workdir, its metric history, and divergence.

:func:`claim_workdir` makes a folder one run's (``config.json``; a folder of
another run is refused, naming what differs); :func:`read_history` /
:func:`write_history` keep ``metrics.jsonl`` in step with the checkpoint a
run resumes from; :func:`diverged` records a non-finite training loss in
``diverged.json`` and raises :class:`TrainingDiverged`, which a rerun of the
same settings raises again instead of retraining.

Under several processes every process reads and checks, and raises the same
errors; only process 0 writes (the others wait for it at a barrier).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Optional

import numpy as np

from safe_optax import distributed
from safe_optax import experiment
from safe_optax.vision import configs

DIVERGED_FILE = "diverged.json"
TENSORBOARD_DIR = "tensorboard"
"""The run's TensorBoard event files (:class:`safe_optax.vision.metrics.TensorBoard`)."""
_RUN_FILES = ("checkpoints", "metrics.jsonl", "results.json", "eval.json", "eval.md",
              "accuracy.png", "distance.png", DIVERGED_FILE, TENSORBOARD_DIR)

EXPORT_FORMAT = "safe_optax.vision.sparse_model/1"
"""The ``format`` metadata of a finished run's safetensors."""
EXPORT_FILES = ("sparse_params.safetensors", "masks.safetensors", "batch_stats.safetensors")
"""The deployed model of a finished run (:func:`safe_optax.vision.finish.export_sparse_model`)."""


class TrainingDiverged(RuntimeError):
  """The training loss stopped being finite; the run is stopped at the end of that epoch.

  Attributes:
    workdir: the run's folder (it keeps ``diverged.json``, so a rerun of the
      same settings reports the divergence again instead of retraining).
    step: the step count at the end of the epoch whose loss was not finite.
    last_finite_loss: the mean training loss of the last finite epoch
      (``None`` if the first epoch already diverged).
    last_finite_epoch: that epoch (``None`` likewise).
  """

  def __init__(self, workdir: str, step: int, last_finite_loss: Optional[float],
               last_finite_epoch: Optional[int]):
    self.workdir, self.step = workdir, step
    self.last_finite_loss, self.last_finite_epoch = last_finite_loss, last_finite_epoch
    last = ("no epoch had a finite loss" if last_finite_loss is None else
            f"last finite loss {last_finite_loss:.4g} in epoch {last_finite_epoch}")
    super().__init__(f"training diverged in '{workdir}': the training loss is not finite at "
                     f"step {step} ({last}); lower the learning rate or the penalty.")


def diverged(workdir: pathlib.Path, history: list[dict[str, Any]], step: int) -> None:
  """Writes ``diverged.json`` (the step and the last finite epoch; process 0) and raises.

  Raises:
    TrainingDiverged: always.
  """
  finite = [r for r in history if np.isfinite(r["train_loss"])]
  info = {"workdir": str(workdir), "step": step,
          "last_finite_loss": finite[-1]["train_loss"] if finite else None,
          "last_finite_epoch": finite[-1]["epoch"] if finite else None}
  if distributed.is_primary():
    with open(workdir / DIVERGED_FILE, "w", encoding="utf-8") as f:
      json.dump(info, f)
  raise TrainingDiverged(**info)


def check_creatable(workdir: os.PathLike) -> None:
  """Raises unless ``workdir`` is a folder or can be made one (nothing is written).

  Raises:
    ValueError: ``workdir`` or a folder above it is a file, or the first
      existing folder above it is not writable; the message names it.
  """
  workdir = pathlib.Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"'{workdir}' is a file, not a folder; choose another workdir.")
  existing = workdir
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if existing != workdir and not existing.is_dir():
    raise ValueError(f"cannot create '{workdir}': '{existing}' is a file, not a folder; "
                     "choose another workdir.")
  if existing != workdir and not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"cannot create '{workdir}': no permission to write in '{existing}'; "
                     "choose another workdir.")


def recorded_config(workdir: os.PathLike) -> Optional[configs.Config]:
  """The config of the run in ``workdir``: its ``config.json``, else its ``results.json``'s.

  Returns:
    ``None`` when ``workdir`` holds neither file.

  Raises:
    ValueError: the file cannot be read as a config (truncated, not JSON, an
      unknown field); the message names the file and the way out.
  """
  workdir = pathlib.Path(workdir)
  for name, get in (("config.json", lambda d: d), ("results.json", lambda d: d["config"])):
    path = workdir / name
    if path.exists():
      try:
        with open(path, encoding="utf-8") as f:
          return configs.from_dict(get(json.load(f)))
      except (ValueError, KeyError, TypeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"'{path}' cannot be read as the run's config ({detail}); restart "
                         "the run (restart=True, CLI --restart) to discard what the workdir "
                         "holds, or use another workdir.") from None
  return None


def read_results(workdir: os.PathLike, *, way_out: str) -> tuple[dict[str, Any], configs.Config]:
  """The ``results.json`` of the finished run in ``workdir``, and its config.

  Raises:
    ValueError: the file cannot be read (truncated, not JSON, no valid
      config); the message names it and ends with ``way_out``.
  """
  path = pathlib.Path(workdir) / "results.json"
  try:
    with open(path, encoding="utf-8") as f:
      results = json.load(f)
    return results, configs.from_dict(results["config"])
  except (ValueError, KeyError, TypeError) as err:
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    raise ValueError(f"'{path}' cannot be read ({detail}); {way_out}") from None


def check_workdir(workdir: os.PathLike, config: configs.Config, *,
                  restart: bool = False) -> None:
  """Raises unless ``config`` may run in ``workdir`` (read only, before any data is loaded).

  Raises:
    ValueError: ``workdir`` cannot be created (:func:`check_creatable`), or,
      unless ``restart``, its recorded config cannot be read
      (:func:`recorded_config`), differs from ``config`` (the message names
      the differing settings), or is missing beside checkpoints.
  """
  workdir = pathlib.Path(workdir)
  check_creatable(workdir)
  if restart:
    return
  recorded = recorded_config(workdir)
  if recorded is None and (workdir / "checkpoints").exists():
    raise ValueError(f"workdir '{workdir}' holds checkpoints of a run without a config.json; "
                     "restart it (restart=True, CLI --restart) or use another workdir.")
  if recorded is not None and recorded != config:
    old, new = configs.to_dict(recorded), configs.to_dict(config)
    differ = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in sorted(new)
                       if old.get(k) != new[k])
    raise ValueError(f"workdir '{workdir}' holds a run with other settings ({differ}); "
                     "use another workdir, or restart=True (CLI --restart) to discard it.")


def claim_workdir(workdir: pathlib.Path, config: configs.Config, *, restart: bool = False) -> None:
  """Makes ``workdir`` this run's: writes ``config.json``, refuses a run of other settings.

  Every process checks; process 0 writes, and every process returns once it has.

  Raises:
    ValueError: :func:`check_workdir` refuses ``workdir``.
  """
  workdir = pathlib.Path(workdir)
  check_workdir(workdir, config, restart=restart)
  distributed.barrier("claim_workdir:checked")  # every process has read before any writes
  if distributed.is_primary():
    workdir.mkdir(parents=True, exist_ok=True)
    if restart:
      for name in _RUN_FILES + EXPORT_FILES:
        path = workdir / name
        if path.is_dir():
          shutil.rmtree(path)
        elif path.exists():
          path.unlink()
    with experiment.atomic_write(workdir / "config.json") as tmp:
      tmp.write_text(json.dumps(configs.to_dict(config), indent=1) + "\n", encoding="utf-8")
  distributed.barrier("claim_workdir:written")


def read_history(path: pathlib.Path, epochs_done: int) -> list[dict[str, Any]]:
  """Metric records of the epochs a resumed run already has (later lines are dropped)."""
  if not path.exists():
    return []
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r for r in records if r["epoch"] < epochs_done]


def write_history(path: pathlib.Path, history: list[dict[str, Any]]) -> None:
  """Rewrites ``metrics.jsonl`` with ``history`` (one JSON record a line), whole or not at all."""
  with experiment.atomic_write(path) as tmp:
    tmp.write_text("".join(json.dumps(record) + "\n" for record in history), encoding="utf-8")


def raise_if_diverged(workdir: pathlib.Path) -> None:
  """Raises the :class:`TrainingDiverged` recorded in ``workdir``, if there is one."""
  if (workdir / DIVERGED_FILE).exists():
    with open(workdir / DIVERGED_FILE, encoding="utf-8") as f:
      raise TrainingDiverged(**json.load(f))
