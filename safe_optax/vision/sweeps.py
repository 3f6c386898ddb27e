"""Many runs of the vision trainer: one folder per run, the sweep and its table.

The pieces that the ``sweep`` command and the evidence benchmarks
(``benchmarks/claims/sparsity_sweep.py``, ``benchmarks/claims/label_noise.py``) share:

* :func:`run_dir` names a run's folder by every setting that differs between
  the runs of a sweep; :func:`run_or_load` trains a configuration there, or
  reads its finished ``results.json`` after checking that the recorded
  configuration is the one asked for (a folder of another run is refused, so
  stale results are never reused);
* :func:`convergence` says whether a finished run converged: the training
  loss's change over the last 10 % of epochs, ``||x - z||`` and the accuracy
  that the final projection costs;
* :func:`sweep` runs the ``sweep`` command's grid (runs that share a
  program in packs, :func:`train_packs`) and writes its table
  (:func:`summarize`).

Choosing lambda on a validation split is :mod:`~safe_optax.vision.selection`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from safe_optax import distributed
from safe_optax import experiment
from safe_optax import methods
from safe_optax.vision import configs
from safe_optax.vision import workdirs

_LOG = logging.getLogger(__name__)

SAFE_FAMILY = tuple(name for name, m in methods.REGISTRY.items() if m.penalty_field == "penalty")
"""Methods whose lambda is ``Config.penalty`` (cosine ramp by default)."""
PENALTY_METHODS = SAFE_FAMILY + tuple(name for name, m in methods.REGISTRY.items()
                                      if m.penalty_field not in (None, "penalty"))
"""Methods with a lambda to choose (ADMM's is ``Config.admm_penalty``)."""
TUNED_METHODS = PENALTY_METHODS + tuple(name for name, m in methods.REGISTRY.items()
                                        if m.penalty_field is None and m.tuned_field)
"""Methods with a hyperparameter a sweep chooses: the penalty methods' lambda, CrAM's rho."""
DEFAULT_RHO = configs.Config.rho
"""The SAM radius a run folder does not name (another one adds ``-rho<value>``)."""


def penalty_field(method: str) -> str:
  """The config field that holds ``method``'s lambda.

  Examples:
    >>> penalty_field("admm"), penalty_field("safe")
    ('admm_penalty', 'penalty')
  """
  field = methods.get(method).penalty_field
  if field is None:
    raise ValueError(f"method {method!r} has no penalty; penalty methods: "
                     f"{list(PENALTY_METHODS)}.")
  return field


def tuned_field(method: str) -> str:
  """The config field a sweep chooses for ``method``: its lambda's, or CrAM's ``rho``.

  Examples:
    >>> tuned_field("admm"), tuned_field("safe"), tuned_field("cram")
    ('admm_penalty', 'penalty', 'rho')
  """
  field = methods.get(method).selected_field
  if field is None:
    raise ValueError(f"method {method!r} has no hyperparameter to choose; tuned methods: "
                     f"{list(TUNED_METHODS)}.")
  return field


def run_dir(root: os.PathLike, config: configs.Config) -> pathlib.Path:
  """``root/[noise<r>-]<method>-s<sparsity>[-perleaf][-lam<lambda>][-rho<rho>][-rescaled]-seed<seed>``.

  ``-lam``: a penalty method's lambda; ``-rho``: CrAM's radius (its tuned
  value), or another SAM-type method's when it is not the default
  ``Config.rho``; ``-rescaled``: a SAFE-family run with ``rescale_dual``
  (another update, so another folder); ``-perleaf``: ``structure="per_leaf"``
  (another sparsity set); ``-2of4``: N:M sparsity ``structure="2:4"`` (no colon in a
  folder name).

  Examples:
    >>> c = configs.get_config("mlp-mnist", method="admm", sparsity=0.9, admm_penalty=0.01)
    >>> run_dir("out", c).as_posix()
    'out/admm-s0.9-lam0.01-seed0'
    >>> run_dir("out", c.replace(method="cram", rho=0.05)).as_posix()
    'out/cram-s0.9-rho0.05-seed0'
    >>> run_dir("out", c.replace(method="safe", penalty=1.0, rho=0.02)).as_posix()
    'out/safe-s0.9-lam1-rho0.02-seed0'
    >>> run_dir("out", c.replace(method="gmp", structure="per_leaf")).as_posix()
    'out/gmp-s0.9-perleaf-seed0'
    >>> run_dir("out", c.replace(method="safe", sparsity=0.5, structure="2:4")).as_posix()
    'out/safe-s0.5-2of4-lam0.1-seed0'
  """
  name = f"{config.method}-s{config.sparsity:g}"
  if config.structure != "global" and config.method != "dense":
    name += "-" + config.structure.replace("_", "").replace(":", "of")
  if config.label_noise > 0:
    name = f"noise{config.label_noise:g}-{name}"
  if config.method in PENALTY_METHODS:
    name += f"-lam{methods.penalty(config):g}"
  entry = methods.get(config.method)
  if entry.uses_grad_fn and (entry.tuned_field == "rho" or config.rho != DEFAULT_RHO):
    name += f"-rho{config.rho:g}"
  if config.rescale_dual and config.method in SAFE_FAMILY:
    name += "-rescaled"
  return pathlib.Path(root) / f"{name}-seed{config.seed}"


def differing_settings(recorded: configs.Config, requested: configs.Config) -> list[str]:
  """Names of the config fields whose values differ, sorted.

  Examples:
    >>> a = configs.get_config("mlp-mnist")
    >>> differing_settings(a, a.replace(epochs=30, learning_rate=0.05))
    ['epochs', 'learning_rate']
  """
  old, new = configs.to_dict(recorded), configs.to_dict(requested)
  return sorted(k for k in new if old.get(k) != new[k])


def run_or_load(config: configs.Config, workdir: os.PathLike, *, data: Any,
                data_dir: os.PathLike, progress: bool = False) -> dict[str, Any]:
  """Trains ``config`` in ``workdir``, or reads the run already finished there.

  Returns:
    The run's ``results.json`` content.

  Raises:
    ValueError: ``workdir`` holds a finished run of another configuration
      (the message names the differing settings).
  """
  from safe_optax.vision import train as train_lib  # pylint: disable=import-outside-toplevel
  results_file = pathlib.Path(workdir) / "results.json"
  if results_file.exists():
    results, recorded = workdirs.read_results(
        workdir, way_out=f"delete '{workdir}' to train that run again.")
    differ = differing_settings(recorded, config)
    if differ:
      raise ValueError(f"'{workdir}' holds a finished run with other settings ({differ}); "
                       "use another --workdir or delete that folder.")
    return results
  if distributed.is_primary():
    _LOG.info("training %s", pathlib.Path(workdir).name)
  return train_lib.train_and_evaluate(config, workdir, data_dir=data_dir, dataset=data,
                                      progress=progress).results


def convergence(results: dict[str, Any]) -> dict[str, Any]:
  """Has a finished run converged? Its loss plateau, ``||x - z||`` and projection cost.

  ``loss_change_last_tenth`` is the mean training loss of the second-to-last
  tenth of the epochs minus that of the last tenth, relative to the last
  (about 0 on a plateau); ``constraint_distance`` is ``||x - z||`` of the
  ADMM-type methods at the end; ``projection_cost`` is the test (or
  validation) accuracy of the dense iterate minus that of the projected model.
  """
  history = results["history"]
  losses = np.asarray([h["train_loss"] for h in history], np.float64)
  tail = max(1, len(losses) // 10)
  out: dict[str, Any] = {
      "final_train_loss": float(losses[-1]),
      "loss_change_last_tenth": float(
          (losses[-2 * tail:-tail].mean() - losses[-tail:].mean())
          / max(losses[-tail:].mean(), 1e-12)) if len(losses) >= 2 * tail else None,
      "distance_to_projection": history[-1].get("distance_to_projection"),
      "constraint_distance": history[-1].get("distance_to_z"),
  }
  final = results["final"]
  if "sparse_accuracy_before_bnt" in final:
    out["projection_cost"] = final["dense_accuracy"] - final["sparse_accuracy_before_bnt"]
  return out


def _settings(config: configs.Config) -> dict[str, Any]:
  """The settings a sweep's row records, finished or diverged."""
  return {"method": config.method, "sparsity": config.sparsity, "seed": config.seed,
          "noise": config.label_noise, "penalty": methods.penalty(config),
          "rho": config.rho if methods.get(config.method).uses_grad_fn else None,
          "rescale_dual": config.rescale_dual and config.method in SAFE_FAMILY,
          "structure": config.structure}


def divergence(err: workdirs.TrainingDiverged) -> dict[str, Any]:
  """What a run that diverged records of it: the step and the last finite epoch's loss."""
  return {"step": err.step, "last_finite_loss": err.last_finite_loss}


def diverged_record(config: configs.Config, err: workdirs.TrainingDiverged) -> dict[str, Any]:
  """:func:`record`'s row for a run that diverged: ``accuracy`` is ``None`` (the evidence
  report scores it as chance) and ``diverged`` is its :func:`divergence`."""
  return {**_settings(config), "accuracy": None, "diverged": divergence(err)}


def record(config: configs.Config, results: dict[str, Any]) -> dict[str, Any]:
  """One row of a sweep: the settings, the reported accuracy and :func:`convergence`."""
  final = results["final"]
  return {**_settings(config),
          "accuracy": final.get("sparse_accuracy", final["dense_accuracy"]),
          "accuracy_before_bnt": final.get("sparse_accuracy_before_bnt"),
          "dense_accuracy": final["dense_accuracy"], "achieved_sparsity": final["sparsity"],
          "images_per_second": results["images_per_second"],
          "steady_images_per_second": results.get("steady_images_per_second"),
          "wall_seconds": results["wall_seconds"],
          "evaluated_on": results["data"].get("evaluated_on", "test"),
          **convergence(results)}


def _cell(values: Sequence[float]) -> str:
  mean, se = experiment.mean_se([100 * v for v in values])
  return f"{mean:.2f} ± {se:.2f}" if se is not None else f"{mean:.2f}"


def summarize(runs: Sequence[dict[str, Any]], sparsities: Sequence[float]) -> dict[str, Any]:
  """Groups per-run results into the paper's Table-5 form.

  Args:
    runs: records with ``method``, ``sparsity``, ``seed``, ``accuracy`` (the
      reported accuracy: sparse after BNT, or dense for ``dense``) and
      optionally ``accuracy_before_bnt``, ``dense_accuracy``,
      ``achieved_sparsity``, ``images_per_second``, ``wall_seconds``.
    sparsities: the table's columns.

  Returns:
    ``{"markdown": str, "rows": [...]}``: one row per method, one cell per
    sparsity, ``mean ± s.e.`` in percent over seeds; the dense row repeats
    its accuracy in every column. A run that diverged (``accuracy`` ``None``)
    is left out of the mean and counted beside it.

  Examples:
    >>> runs = [{"method": "safe", "sparsity": 0.9, "seed": s, "accuracy": a}
    ...         for s, a in enumerate([0.91, 0.93])]
    >>> print(summarize(runs, [0.9])["markdown"])
    | method | 90% |
    |---|---|
    | safe | 92.00 ± 1.00 |
    >>> runs.append({"method": "safe", "sparsity": 0.9, "seed": 2, "accuracy": None})
    >>> print(summarize(runs, [0.9])["markdown"].splitlines()[-1])
    | safe | 92.00 ± 1.00 (1 of 3 diverged) |
  """
  names = list(dict.fromkeys(r["method"] for r in runs))
  header = "| method | " + " | ".join(f"{100 * s:g}%" for s in sparsities) + " |"
  lines = [header, "|---|" + "---|" * len(sparsities)]
  rows = []
  for method in names:
    cells = []
    # Dense has no target sparsity: one group, shown in every column.
    for s in ([0.0] if method == "dense" else sparsities):
      group = [r for r in runs if r["method"] == method and (
          method == "dense" or math.isclose(r["sparsity"], s))]
      finished = [r["accuracy"] for r in group if r["accuracy"] is not None]
      lost = len(group) - len(finished)
      cells.append("–" if not group else "diverged" if not finished else
                   _cell(finished) + (f" ({lost} of {len(group)} diverged)" if lost else ""))
      if not group:
        continue
      row = {"method": method, "sparsity": s, "seeds": sorted(r["seed"] for r in group),
             "diverged": lost}
      for key in ("accuracy", "accuracy_before_bnt", "dense_accuracy", "achieved_sparsity",
                  "images_per_second", "steady_images_per_second", "wall_seconds"):
        values = [r[key] for r in group if r.get(key) is not None]
        if values:
          row[key + "_mean"], row[key + "_se"] = experiment.mean_se(values)
      rows.append(row)
    if method == "dense":
      cells = cells * len(sparsities)
    lines.append(f"| {method} | " + " | ".join(cells) + " |")
  return {"markdown": "\n".join(lines), "rows": rows}


def train_packs(jobs: Sequence[tuple[configs.Config, pathlib.Path]], pack: int, *, data: Any,
                checkpoint_seconds: Optional[float] = None, progress: bool = True) -> None:
  """Trains the unfinished runs of ``jobs`` (config, folder) in packs of at most ``pack``.

  Runs are packed when they share every setting but the seed
  (:func:`~safe_optax.vision.packing.pack_key`) and their checkpoints are at
  one step; the others form packs of their own. A folder with a
  ``results.json`` is left to :func:`run_or_load`.
  """
  from safe_optax.vision import packing  # pylint: disable=import-outside-toplevel
  todo = [(c, d) for c, d in jobs if not (d / "results.json").exists()]
  steps = [checkpoint_step(d) for _, d in todo]
  # One step per pack: the seed slot of the key carries the checkpoint step.
  keys = [dataclasses.replace(packing.pack_key(c), seed=-1 if s is None else s)
          for (c, _), s in zip(todo, steps)]
  groups: dict[configs.Config, list[int]] = {}
  for i, key in enumerate(keys):
    groups.setdefault(key, []).append(i)
  for members in groups.values():
    for j in range(0, len(members), pack):
      chosen = [todo[i] for i in members[j:j + pack]]
      if distributed.is_primary():
        _LOG.info("training a pack of %d: %s", len(chosen), ", ".join(d.name for _, d in chosen))
      packing.train_packed([c for c, _ in chosen], [d for _, d in chosen], data=data,
                           checkpoint_seconds=checkpoint_seconds, progress=progress)


def checkpoint_step(workdir: os.PathLike) -> Optional[int]:
  """The step of the newest checkpoint in ``workdir/checkpoints``, or ``None``."""
  from safe_optax.vision import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  folder = pathlib.Path(workdir) / "checkpoints"
  if not folder.is_dir():
    return None
  ckpt = checkpoint_lib.Checkpointer(folder)
  try:
    return ckpt.latest_step()
  finally:
    ckpt.close()


def sweep(base: configs.Config, methods_: Sequence[str], sparsities: Sequence[float],
          seeds: Sequence[int], workdir: os.PathLike, *, data: Any, data_dir: os.PathLike,
          source: str, progress: bool = True, pack: int = 1,
          checkpoint_seconds: Optional[float] = None) -> str:
  """The ``sweep`` command: every (method, sparsity, seed) of ``base`` in its own folder.

  Runs ``workdir/<method>-s<sparsity>-seed<seed>`` through :func:`run_or_load`
  (``dense`` once per seed), then writes ``sweep.json`` (the runs and the
  :func:`summarize` rows) and ``table.md`` in ``workdir`` (process 0).

  Args:
    base: the configuration every run starts from.
    methods_, sparsities, seeds: the grid.
    workdir: the sweep's folder.
    data, data_dir: the loaded data set and where it came from.
    source: how ``base`` was given, for the table's caption.
    progress: tqdm bars.
    pack: train up to this many runs that share a program (every setting but
      the seed) as one vmapped program (:func:`train_packs`) first.
    checkpoint_seconds: packs also checkpoint after this many seconds.

  Returns:
    The markdown table with its caption.
  """
  workdir = pathlib.Path(workdir)
  methods.check_positive_int(pack, "pack")
  jobs = [(base.replace(method=method, sparsity=s, seed=seed),
           workdir / f"{method}-s{s:g}-seed{seed}") for method in methods_
          for s in ([0.0] if method == "dense" else sparsities) for seed in seeds]
  if pack > 1:
    train_packs(jobs, pack, data=data, checkpoint_seconds=checkpoint_seconds,
                progress=progress)
  runs = []
  for i, (config, folder) in enumerate(jobs):
    method, s, seed = config.method, config.sparsity, config.seed
    if distributed.is_primary():
      _LOG.info("[%d/%d] %s sparsity %g seed %d", i + 1, len(jobs), method, s, seed)
    results = run_or_load(config, folder, data=data, data_dir=data_dir, progress=progress)
    runs.append({**record(config, results), "workdir": str(folder)})
  table = summarize(runs, sparsities)
  command = "safe-optax-vision " + " ".join(sys.argv[1:]) if sys.argv else None
  summary = {"command": command, "config": configs.to_dict(base), "runs": runs,
             "table": table["rows"], "versions": experiment.versions()}
  markdown = (f"Test accuracy (%) after the final projection and BNT, mean ± s.e. over seeds "
              f"{list(seeds)}; {source}.\n\n{table['markdown']}\n")
  if distributed.is_primary():
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "sweep.json", "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=1)
      f.write("\n")
    with open(workdir / "table.md", "w", encoding="utf-8") as f:
      f.write(markdown)
  return markdown
