"""The training loop of the vision models (SAFE and the paper's baselines).

Shaped like the google/flax examples: :func:`train_and_evaluate` (``config,
workdir``) runs a whole experiment; the state is
:mod:`~safe_optax.vision.train_state`, the pure steps
:mod:`~safe_optax.vision.steps`, their compiled programs
:mod:`~safe_optax.vision.programs`.

* the training set stays in host memory; every process computes the same
  global batch indices (a permutation fixed by ``(seed, epoch)``, every
  example exactly once per epoch, the last batch may be short), gathers only
  its own rows of each batch and hands them to the step as one global array
  (:func:`~safe_optax.vision.datasets.gather_batch`); the step augments the
  global batch (pad 4, random crop, flip, keyed by the step) and normalises
  it in JAX;
* data parallelism with :mod:`jax.sharding` over every device of every
  process (:func:`safe_optax.distributed.data_mesh`): the batch sharded over
  the 1-D mesh, parameters and optimizer state replicated (``jax.jit`` does
  the cross-device means, SAM's second gradient included), so N processes
  train exactly as one process with as many devices;
* in a multi-process run (:func:`safe_optax.distributed.initialize`) every
  process computes everything, but only process 0 writes ``config.json``,
  metrics, results, plots and prints; every process writes its part of the
  Orbax checkpoints;
* SAM / SAFE steps keep the BatchNorm statistics of the clean pass
  (:mod:`safe_optax.flax_utils`);
* Orbax checkpoints after every epoch and on ``KeyboardInterrupt``; a run
  restarted in the same ``workdir`` resumes bit-exactly (same step, same data
  order, same augmentation keys);
* per-epoch JSONL metrics (loss, accuracies, ``||x - Proj(x)||``, sparsity,
  images/s and, for the ADMM-based methods, ``||x - z||`` and the mean mask
  churn), each with the epoch's per-step rows, which the step writes into the
  state every ``log_every`` steps and the host reads once an epoch
  (:mod:`~safe_optax.vision.metrics`); the same as TensorBoard scalars in
  ``tensorboard/`` when ``tensorboardX`` is installed; then
  :func:`safe_optax.vision.finish.finish`: the final projection, BatchNorm
  re-estimation on ``bnt_samples`` training images, ``results.json`` and
  matplotlib plots.

The optimizers are :mod:`~safe_optax.methods`' registry, the data
:mod:`~safe_optax.vision.datasets`, the run's folder
:mod:`~safe_optax.vision.workdirs`.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from safe_optax import distributed
from safe_optax import experiment
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import datasets
from safe_optax.vision import finish as finish_lib
from safe_optax.vision import input_pipeline
from safe_optax.vision import metrics as metrics_lib
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import workdirs
from safe_optax.vision.configs import Config
from safe_optax.vision.train_state import TrainState, zero_metrics

_LOG = logging.getLogger(__name__)


class Outcome(NamedTuple):
  """What :func:`train_and_evaluate` returns."""

  state: TrainState
  """The final (dense, unprojected) training state."""
  sparse_params: Any
  """``finalize(params)`` (the dense params for ``method='dense'``)."""
  model_state: Any
  """The model state after BatchNorm re-estimation of the sparse model."""
  results: Optional[dict[str, Any]]
  """The ``results.json`` content; ``None`` when stopped early."""


def train_and_evaluate(config: Config, workdir: os.PathLike, *, data_dir: os.PathLike,
                       dataset: Optional[input_pipeline.Dataset] = None,
                       stop_after_epoch: Optional[int] = None,
                       on_step: Optional[Callable[[int], None]] = None,
                       progress: bool = False, restart: bool = False,
                       tensorboard: Optional[bool] = None) -> Outcome:
  """Trains ``config`` in ``workdir`` (resuming from its checkpoint), then evaluates.

  Args:
    config: a validated :class:`~safe_optax.vision.configs.Config`.
    workdir: output folder: ``config.json``, ``checkpoints/``,
      ``metrics.jsonl`` (one record an epoch, with its per-step rows),
      ``tensorboard/``, ``results.json``, ``accuracy.png``, ``distance.png``.
    data_dir: where :func:`~safe_optax.vision.datasets.load_dataset` finds the data.
    dataset: an already loaded data set (skips ``data_dir``).
    stop_after_epoch: stop (with a checkpoint) once this many epochs are done.
    on_step: called with the step number after each step (on the host).
    progress: show tqdm progress bars.
    restart: discard what ``workdir`` holds (checkpoints, metrics, results)
      and train from scratch, whatever settings it was run with.
    tensorboard: also write the metrics as TensorBoard event files in
      ``workdir/tensorboard`` (``None``: when ``tensorboardX`` is installed).

  A workdir is one run: the resolved config is written to ``config.json`` at
  the start, and a workdir whose run has other settings is refused (the
  error names them) unless ``restart``; with the same settings the run
  resumes from its last checkpoint.

  Under several processes (:func:`safe_optax.distributed.initialize`) every
  process calls this with the same arguments and the same data, and returns
  the same :class:`Outcome`; only process 0 writes files other than
  checkpoints, prints, or shows progress bars. ``workdir`` must be one folder
  that every process sees (a shared file system), as Orbax requires.

  Returns:
    An :class:`Outcome`. On ``KeyboardInterrupt`` a checkpoint of the last
    completed step is written and
    :class:`~safe_optax.vision.checkpoint.Interrupted` (a ``KeyboardInterrupt``
    naming the step and the checkpoint folder) is raised.

  Raises:
    ValueError: ``workdir`` holds a run of other settings.
    ImportError: ``tensorboard=True`` without ``tensorboardX``.
    ~safe_optax.vision.workdirs.TrainingDiverged: the training loss of an epoch was not finite (training
      stops at the end of that epoch; ``diverged.json`` records where).
  """
  wall_start = time.perf_counter()
  workdir = pathlib.Path(workdir)
  if tensorboard and not metrics_lib.tensorboard_available():
    raise ImportError("tensorboard=True (CLI --tensorboard) needs tensorboardX: "
                      "pip install tensorboardX, or safe-optax[vision].")
  workdirs.claim_workdir(workdir, config, restart=restart)
  data = dataset if dataset is not None else datasets.load_dataset(config, data_dir)
  num_train = len(data.train_labels)
  spe = input_pipeline.num_batches(num_train, config.batch_size)
  total_steps = config.epochs * spe
  programs = programs_lib.for_data(config, data)
  primary = distributed.is_primary()

  state = programs.init(jax.random.PRNGKey(config.seed))
  ckpt = checkpoint_lib.Checkpointer(workdir / "checkpoints")
  workdirs.raise_if_diverged(workdir)
  latest = ckpt.latest_step()
  if latest is not None:
    state = ckpt.restore(latest, state)
    if primary:
      _LOG.info("%s: resuming from step %d of %d", workdir, latest, total_steps)
  start_step = int(state.step)
  metrics_path = workdir / "metrics.jsonl"
  history = workdirs.read_history(metrics_path, start_step // spe)
  distributed.barrier("train_and_evaluate:history read")  # before process 0 rewrites it
  if primary:
    workdirs.write_history(metrics_path, history)
  if tensorboard is None:
    tensorboard = metrics_lib.tensorboard_available()
  board = (metrics_lib.TensorBoard(workdir / workdirs.TENSORBOARD_DIR, purge_step=start_step)
           if tensorboard and primary else None)

  epochs_run = 0
  last_saved = start_step
  bar = experiment.progress(total_steps, initial=start_step,
                            desc=f"{config.method}@{config.sparsity:g}",
                            enabled=progress and primary)
  try:
    for epoch in range(start_step // spe, config.epochs):
      if stop_after_epoch is not None and epoch >= stop_after_epoch:
        break
      epoch_start = time.perf_counter()
      position = position_start = int(state.step) - epoch * spe
      batches = datasets.epoch_batches(num_train, config.batch_size, config.seed, epoch)
      for indices in batches[position:]:
        images, labels = datasets.gather_batch(programs.mesh, (data.train_images, data.train_labels),
                                      indices)
        # The step donates the old state's buffers: a Ctrl-C between the dispatch and the
        # rebinding would leave `state` deleted, so it is held back until `state` is new.
        with checkpoint_lib.sigint_deferred():
          state = programs_lib.run_step(programs, config, state, images, labels, epoch * spe + position)
        position += 1
        bar.update(1)
        if on_step is not None:
          on_step(epoch * spe + position)
      state = jax.block_until_ready(state)
      epoch_seconds = time.perf_counter() - epoch_start
      record = epoch_record(programs, config, state, data, epoch, epoch_seconds,
                             trained=sum(len(b) for b in batches[position_start:]),
                             includes_compile=epochs_run == 0)
      epochs_run += 1
      history.append(record)
      bar.set_postfix_str(f"loss {record['train_loss']:.3f} "
                          f"test {record.get('test_accuracy', 0):.3f}")
      if primary:
        with open(metrics_path, "a", encoding="utf-8") as f:
          f.write(json.dumps(record) + "\n")
      if board is not None:
        board.write(record)
      if not np.isfinite(record["train_loss"]):
        workdirs.diverged(workdir, history, int(state.step))
      state = state._replace(metrics=jax.device_put(
          zero_metrics(programs.step_logger.empty()), programs.replicated))
      if (epoch + 1) % config.checkpoint_every == 0 or epoch + 1 == config.epochs:
        ckpt.save(int(state.step), state)
        last_saved = int(state.step)
  except KeyboardInterrupt:
    # An interrupt held back by ckpt.save arrives after that save committed
    # (before last_saved was updated): the checkpoint is already there.
    if (alive(state) and int(state.step) != last_saved
        and ckpt.latest_step() != int(state.step)):
      ckpt.save(int(state.step), state)
    saved = ckpt.latest_step()
    if saved is None:
      raise
    raise checkpoint_lib.Interrupted(saved, workdir / "checkpoints") from None
  finally:
    bar.close()
    ckpt.close()
    if board is not None:
      board.close()
  if int(state.step) < total_steps:
    return Outcome(state, None, None, None)
  # results.json keeps the per-epoch history; the per-step rows stay in metrics.jsonl.
  sparse_params, model_state, results = finish_lib.finish(
      programs, config, state.params, state.model_state, data,
      [metrics_lib.without_step_rows(r) for r in history], workdir,
      wall_seconds=time.perf_counter() - wall_start)
  return Outcome(state, sparse_params, model_state, results)


def alive(state: TrainState) -> bool:
  """Whether no buffer of ``state`` was donated away (a deleted state cannot be saved)."""
  return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state)
                 if isinstance(leaf, jax.Array))


def epoch_record(programs: programs_lib.Programs, config: Config, state: TrainState,
                  data: input_pipeline.Dataset, epoch: int, seconds: float, *, trained: int,
                  includes_compile: bool) -> dict[str, Any]:
  """The ``metrics.jsonl`` record of epoch ``epoch``: the state's running sums and step log,
  sparsity, distances and, when due, the test accuracy (dense and projected)."""
  metrics = jax.device_get(state.metrics)
  steps, dual_updates = programs.step_logger.rows(metrics.log)
  record: dict[str, Any] = {
      "epoch": epoch, "step": int(state.step),
      "train_loss": float(metrics.loss_sum) / max(int(metrics.count), 1),
      "train_accuracy": int(metrics.correct) / max(int(metrics.count), 1),
      "train_examples": int(metrics.count), "epoch_seconds": seconds,
      # Images this process trained in ``seconds``, and whether they include compiling.
      "trained_images": trained, "includes_compile": includes_compile,
      "images_per_second": trained / seconds if seconds > 0 else None,
      "sparsity": float(programs.sparsity(state.params)),
  }
  if programs.distance is not None:
    record["distance_to_projection"] = float(programs.distance(state.params))
  if programs.distance_to_z is not None:
    record["distance_to_z"] = float(programs.distance_to_z(state.params, state.opt_state))
  if dual_updates:
    record["mask_churn"] = float(np.mean([r["mask_churn"] for r in dual_updates]))
  if (epoch + 1) % config.eval_every == 0 or epoch + 1 == config.epochs:
    dense = finish_lib.evaluate(programs.eval, state.params, state.model_state, data.test_images,
                     data.test_labels, config.eval_batch_size, mesh=programs.mesh)
    record.update(test_accuracy=dense["accuracy"], test_loss=dense["loss"])
    if config.sparsity > 0 and config.method != "dense":
      sparse = finish_lib.evaluate(programs.eval, programs.project(state.params), state.model_state,
                        data.test_images, data.test_labels, config.eval_batch_size,
                        mesh=programs.mesh)
      record["test_accuracy_projected"] = sparse["accuracy"]
  record.update(steps=steps, dual_updates=dual_updates)
  return record
