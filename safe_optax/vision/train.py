"""Training of the vision models with SAFE and the paper's baselines: the step and the loop.

Shaped like the google/flax examples: a pure, jitted :func:`train_step`, an
:func:`eval_step`, and :func:`train_and_evaluate` (``config, workdir``) that
runs a whole experiment:

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

The optimizers are :mod:`~safe_optax.vision.methods`' registry, the data
:mod:`~safe_optax.vision.datasets`, the run's folder
:mod:`~safe_optax.vision.workdirs`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax import flax_utils
from safe_optax.experiment import cross_entropy
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import configs
from safe_optax.vision import finish as finish_lib
from safe_optax.vision import input_pipeline
from safe_optax.vision import methods
from safe_optax.vision import metrics as metrics_lib
from safe_optax.vision import workdirs
# Re-exported: the names callers (notebooks, benchmarks) know this module by.
from safe_optax.vision.datasets import (NORMALIZATION, epoch_batches, gather_batch,
                                        load_dataset, prepare_images)
from safe_optax.vision.finish import evaluate
from safe_optax.vision.methods import learning_rate_schedule, make_optimizer
from safe_optax.vision.models import create_model
from safe_optax.vision.workdirs import DIVERGED_FILE, TrainingDiverged, claim_workdir

Config = configs.Config

__all__ = ("NORMALIZATION", "DIVERGED_FILE", "Config", "EpochMetrics", "Outcome", "TrainState",
           "TrainingDiverged", "claim_workdir", "create_model", "cross_entropy",
           "distance_to_projection", "epoch_batches", "eval_step", "evaluate",
           "learning_rate_schedule", "load_dataset", "make_optimizer", "prepare_images",
           "Programs", "build_programs", "restore_finished", "train_and_evaluate", "train_step")


class EpochMetrics(NamedTuple):
  """Running sums over the current epoch, kept on the device (no per-step syncs)."""

  loss_sum: jax.Array
  """Sum over examples of the training loss (clean pass)."""
  correct: jax.Array
  """Correctly classified training examples (clean pass, augmented)."""
  count: jax.Array
  """Training examples used so far in this epoch."""
  log: metrics_lib.StepLog
  """This epoch's per-step scalars (:class:`~safe_optax.vision.metrics.StepLogger`)."""


def _zero_metrics(log: Optional[metrics_lib.StepLog] = None) -> EpochMetrics:
  # Host zeros: device_put places them on any sharding, one over several processes included.
  return EpochMetrics(np.zeros([], np.float32), np.zeros([], np.int32), np.zeros([], np.int32),
                      metrics_lib.empty_log() if log is None else log)


class TrainState(NamedTuple):
  """Everything that changes during training (what a checkpoint holds)."""

  step: jax.Array
  """Steps taken (int32); fixes the epoch and the position in it."""
  rng: jax.Array
  """The run's augmentation key; step ``t`` uses ``fold_in(rng, t)``."""
  params: Any
  """The ``'params'`` collection."""
  model_state: Any
  """The other collections, ``{'batch_stats': ...}`` or ``{}``."""
  opt_state: Any
  """The optax state."""
  metrics: EpochMetrics
  """Running sums of the current epoch."""


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


# ----------------------------------------------------------------------------- steps


def train_step(state: TrainState, images: jax.Array, labels: jax.Array,
               *, apply_fn: Callable[..., Any], tx: optax.GradientTransformation,
               uses_grad_fn: bool, augment: bool, mean: tuple[float, ...],
               std: tuple[float, ...],
               step_logger: Optional[metrics_lib.StepLogger] = None,
               dual_due: Optional[bool] = None) -> TrainState:
  """One training step on a global batch (pure; jit it with the keywords bound).

  The augmentation key is ``fold_in(state.rng, step)`` and it augments the
  global batch, so a resumed run, and a run of any number of processes, sees
  the same crops and flips. The clean pass updates the BatchNorm statistics;
  the SAM pass (``grad_fn``) reuses the same batch and drops its statistics.

  Args:
    state: the :class:`TrainState`.
    images, labels: the batch (uint8, int32), sharded over the data mesh
      (:func:`~safe_optax.vision.datasets.gather_batch`).
    apply_fn, tx: the model's ``apply`` and the optimizer.
    uses_grad_fn: pass ``grad_fn`` to ``tx.update`` (SAM-style methods).
    augment: pad-crop-flip the batch.
    mean, std: normalisation constants.
    step_logger: writes this step's scalars into ``state.metrics.log`` when due
      (``None``: the log is left as it is).
    dual_due: for the ADMM-based methods, whether this step runs the dual
      update, known on the host (``safe_optax.is_dual_step``); a static
      argument, so the ``K - 1`` steps without one run a program without the
      projection (``None``: one program that decides inside). ``False`` on a
      dual step whose update :func:`dual_step` ran just before (see
      :func:`run_step`).

  Returns:
    The new state (epoch metric sums and log updated).
  """
  key = jax.random.fold_in(state.rng, state.step)
  batch = (prepare_images(images, key if augment else None, mean, std), labels)
  (loss, (logits, new_model_state)), grads = flax_utils.loss_and_grad_with_state(
      apply_fn, state.params, state.model_state, batch, cross_entropy)
  extra = {} if dual_due is None else {"dual_due": dual_due}
  if uses_grad_fn:
    grad_fn = flax_utils.sam_grad_fn(apply_fn, state.model_state, batch, cross_entropy)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, grad_fn=grad_fn,
                                   **extra)
  else:
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
  n = labels.shape[0]
  correct = jnp.sum(jnp.argmax(logits, -1) == batch[1]).astype(jnp.int32)
  params = optax.apply_updates(state.params, updates)
  log = state.metrics.log
  if step_logger is not None:
    log = step_logger.record(log, state.step, loss=loss, accuracy=correct / n, params=params,
                             old_opt_state=state.opt_state, opt_state=opt_state,
                             dual_in_step=dual_due is not False)
  metrics = EpochMetrics(state.metrics.loss_sum + loss * n, state.metrics.correct + correct,
                         state.metrics.count + n, log)
  return TrainState(optax.safe_increment(state.step), state.rng, params, new_model_state,
                    opt_state, metrics)


def dual_step(state: TrainState, *, tx: optax.GradientTransformation,
              step_logger: Optional[metrics_lib.StepLogger] = None
              ) -> tuple[list[safe_optax.ADMMState], metrics_lib.StepLog]:
  """The dual update due at ``state.step``, alone (pure; jit it with the keywords bound).

  :func:`safe_optax.run_dual_update` on the state's optimizer state, its mask
  churn logged; the :func:`train_step` that follows takes ``dual_due=False``.
  Only for the methods whose dual update reads no gradient
  (:attr:`~safe_optax.vision.methods.Method.dual_alone`).

  Returns:
    The new :class:`~safe_optax.ADMMState` nodes of the optimizer state, in
    tree order, and the epoch's log: only what changed, so that the undonated
    program copies no parameters (:func:`with_dual_step` puts them back).
  """
  opt_state = safe_optax.run_dual_update(tx, state.opt_state, state.params)
  log = state.metrics.log
  if step_logger is not None and step_logger.penalty is not None:
    log = step_logger.record_dual(log, state.step, state.opt_state, opt_state)
  return _admm_nodes(opt_state), log


def _is_admm(node: Any) -> bool:
  return isinstance(node, safe_optax.ADMMState)


def _admm_nodes(opt_state: Any) -> list[safe_optax.ADMMState]:
  return [n for n in jax.tree.leaves(opt_state, is_leaf=_is_admm) if _is_admm(n)]


def with_dual_step(state: TrainState, out: tuple[list[Any], metrics_lib.StepLog]) -> TrainState:
  """``state`` with :func:`dual_step`'s output ``(ADMM nodes, log)`` put in (on the host)."""
  nodes, log = out
  it = iter(nodes)
  opt_state = jax.tree.map(lambda n: next(it) if _is_admm(n) else n, state.opt_state,
                           is_leaf=_is_admm)
  return state._replace(opt_state=opt_state, metrics=state.metrics._replace(log=log))


def eval_step(params: Any, model_state: Any, images: jax.Array, labels: jax.Array,
              valid: jax.Array, *, apply_fn: Callable[..., Any], mean: tuple[float, ...],
              std: tuple[float, ...]) -> tuple[jax.Array, jax.Array]:
  """``(correct, loss_sum)`` over the ``valid`` examples of a (padded) batch, inference mode."""
  logits = apply_fn({"params": params, **model_state}, prepare_images(images, None, mean, std),
                    train=False)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = jnp.sum(jnp.where(valid, jnp.argmax(logits, -1) == labels, False))
  return correct.astype(jnp.int32), jnp.sum(jnp.where(valid, losses, 0.0))


def distance_to_projection(params: Any, sparsity: float, **structure: Any) -> jax.Array:
  """``||x - Proj(x)||_2`` onto the sparsity set (only prunable leaves differ).

  Args:
    params: the parameters ``x``.
    sparsity: the target sparsity.
    **structure: the rest of :func:`~safe_optax.vision.methods.projection`.

  Examples:
    >>> import jax.numpy as jnp
    >>> float(distance_to_projection({"w": jnp.array([[3.0, 4.0], [0.0, 1.0]])}, 0.5))
    1.0
  """
  projected, _ = safe_optax.project_topk(params, sparsity, **structure)
  return optax.tree.norm(optax.tree.sub(params, projected))


def _dual_due(config: Config, step: int) -> Optional[bool]:
  """Whether step ``step`` runs the dual update (ADMM-based methods), else ``None``.

  The optimizer's update count is the training step (both start at 0 and a
  resumed run restores both), so the host knows it without reading the state.
  """
  if not methods.get(config.method).has_admm_state:
    return None
  return safe_optax.is_dual_step(step, config.dual_every)


def _plan(programs: "Programs", config: Config, step: int) -> tuple[bool, Optional[bool]]:
  """``(run programs.dual first, the dual_due of programs.train)`` for step ``step``.

  On a dual step of a method whose dual update reads no gradient, the dual
  update runs as a program of its own and the step without it: on XLA:CPU a
  step that also holds the projection fell into a slow mode in some processes
  (README, "Step overhead").
  """
  due = _dual_due(config, step)
  if due and programs.dual is not None:
    return True, False
  return False, due


def run_step(programs: "Programs", config: Config, state: TrainState, images: jax.Array,
             labels: jax.Array, step: int) -> TrainState:
  """Training step ``step`` (the host's count of ``state.step``): the dual program when
  :func:`_plan` says so, then :attr:`Programs.train`."""
  run_dual, dual_due = _plan(programs, config, step)
  if run_dual:
    state = with_dual_step(state, programs.dual(state))
  return programs.train(state, images, labels, dual_due=dual_due)


# ----------------------------------------------------------------------------- the run


class Programs(NamedTuple):
  """The jitted functions of a configuration."""

  model: nn.Module
  """The Linen model."""
  tx: optax.GradientTransformation
  """The optimizer (:func:`~safe_optax.vision.methods.make_optimizer`)."""
  mesh: Mesh
  """The 1-D data-parallel mesh over every device of every process."""
  replicated: NamedSharding
  """Replicated over ``mesh`` (parameters, optimizer state, metrics)."""
  init: Callable[..., Any]
  """``init(key) -> TrainState``."""
  train: Callable[..., Any]
  """:func:`train_step`, the state donated; ``dual_due`` static (two programs for the
  ADMM-based methods, one without the projection)."""
  dual: Optional[Callable[..., Any]]
  """:func:`dual_step` (the state not donated; :func:`with_dual_step` applies its output),
  for the methods whose dual update runs alone
  (:attr:`~safe_optax.vision.methods.Method.dual_alone`), else ``None``."""
  eval: Callable[..., Any]
  """:func:`eval_step` (its sums replicated)."""
  distance: Optional[Callable[..., Any]]
  """``params -> ||x - Proj(x)||`` (``None`` without a sparsity)."""
  project: Optional[Callable[..., Any]]
  """``params -> Proj(params)``, the final projection (``None`` without a sparsity)."""
  distance_to_z: Optional[Callable[..., Any]]
  """``(params, opt_state) -> ||x - z||`` of the ADMM-based methods, else ``None``."""
  prepare: Callable[..., Any]
  """``prepare(images, key or None)``: :func:`prepare_images` with the data set's constants."""
  scores: Callable[..., Any]
  """SAFE+'s per-batch final scores (:func:`safe_optax.vision.finish.score_fn`), replicated."""
  step_logger: metrics_lib.StepLogger
  """What the step logs (its :meth:`~safe_optax.vision.metrics.StepLogger.empty` log)."""
  sparsity: Callable[..., Any]
  """``params -> `` the fraction of zeros in the prunable leaves."""


def build_programs(config: Config, num_train: int, num_classes: int,
                   image_shape: tuple[int, ...]) -> Programs:
  """The jitted functions of a configuration (cached, so repeated runs compile once).

  The seed only enters the optimizer of the methods whose registry entry says
  so (SAFE-Multi's draws, OBD's probes); other methods share programs across
  seeds.
  """
  if not methods.get(config.method).seeded(config):
    config = dataclasses.replace(config, seed=0)
  return _cached_programs(config, num_train, num_classes, image_shape)


@functools.lru_cache(maxsize=8)
def _cached_programs(config: Config, num_train: int, num_classes: int,
                     image_shape: tuple[int, ...]) -> Programs:
  model = create_model(config, num_classes)
  method = methods.get(config.method)
  spe = input_pipeline.num_batches(num_train, config.batch_size)
  tx = make_optimizer(config, spe)
  step_logger = _step_logger(config, spe)
  mesh = distributed.data_mesh()
  replicated = distributed.replicated(mesh)
  mean, std = NORMALIZATION[config.dataset]

  def init(key):
    init_key, data_key = jax.random.split(key)
    variables = model.init(init_key, jnp.zeros((1,) + image_shape, jnp.float32), train=False)
    model_state, params = flax.core.pop(dict(variables), "params")
    return TrainState(jnp.zeros([], jnp.int32), data_key, params, dict(model_state),
                      tx.init(params), _zero_metrics(step_logger.empty()))

  step = functools.partial(
      train_step, apply_fn=model.apply, tx=tx, uses_grad_fn=method.uses_grad_fn,
      augment=config.augment, mean=mean, std=std, step_logger=step_logger)
  evaluate_batch = functools.partial(eval_step, apply_fn=model.apply, mean=mean, std=std)
  prepare = functools.partial(prepare_images, mean=mean, std=std)
  projection = methods.projection(config) if config.sparsity > 0 else None
  return Programs(
      model=model, tx=tx, mesh=mesh, replicated=replicated,
      init=jax.jit(init, out_shardings=replicated),
      train=jax.jit(step, donate_argnums=0, out_shardings=replicated,
                    static_argnames="dual_due"),
      # Not donated: on XLA:CPU the donated dual program ran 4-5 ms in most calls, the
      # undonated one 0.7-1.3 ms (benchmarks/perf/dual_step_breakdown.py); only z and u are new buffers.
      dual=jax.jit(functools.partial(dual_step, tx=tx, step_logger=step_logger),
                   out_shardings=replicated) if method.dual_alone else None,
      eval=jax.jit(evaluate_batch, out_shardings=replicated),
      distance=jax.jit(functools.partial(distance_to_projection, **projection))
      if projection else None,
      project=jax.jit(lambda p: safe_optax.finalize(p, **projection)[0]) if projection else None,
      distance_to_z=jax.jit(safe_optax.constraint_distance) if method.has_admm_state else None,
      prepare=jax.jit(prepare),
      scores=jax.jit(finish_lib.score_fn(model.apply, config.saliency, prepare),
                     out_shardings=replicated),
      step_logger=step_logger,
      sparsity=jax.jit(metrics_lib.prunable_sparsity),
  )


def _step_logger(config: Config, steps_per_epoch: int) -> metrics_lib.StepLogger:
  """The per-step scalars of ``config``: its schedules, and ``lambda_t`` for the ADMM methods."""
  penalty = None
  if methods.get(config.method).has_admm_state:
    # As methods.make_optimizer builds them: ADMM's penalty is constant (Zhang et al.).
    schedule = "constant" if config.method == "admm" else config.penalty_schedule
    penalty = safe_optax.penalty_schedule(methods.penalty(config), schedule,
                                          config.epochs * steps_per_epoch)
  return metrics_lib.StepLogger(config.log_every, steps_per_epoch,
                                learning_rate_schedule(config, steps_per_epoch), penalty,
                                config.dual_every)


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
    data_dir: where :func:`load_dataset` finds the data.
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
    TrainingDiverged: the training loss of an epoch was not finite (training
      stops at the end of that epoch; ``diverged.json`` records where).
  """
  wall_start = time.perf_counter()
  workdir = pathlib.Path(workdir)
  if tensorboard and not metrics_lib.tensorboard_available():
    raise ImportError("tensorboard=True (CLI --tensorboard) needs tensorboardX: "
                      "pip install tensorboardX, or safe-optax[vision].")
  claim_workdir(workdir, config, restart=restart)
  data = dataset if dataset is not None else load_dataset(config, data_dir)
  num_train = len(data.train_labels)
  spe = input_pipeline.num_batches(num_train, config.batch_size)
  total_steps = config.epochs * spe
  programs = _programs(config, data)
  primary = distributed.is_primary()

  state = programs.init(jax.random.PRNGKey(config.seed))
  ckpt = checkpoint_lib.Checkpointer(workdir / "checkpoints")
  workdirs.raise_if_diverged(workdir)
  latest = ckpt.latest_step()
  if latest is not None:
    state = ckpt.restore(latest, state)
    if primary:
      print(f"{workdir}: resuming from step {latest} of {total_steps}", file=sys.stderr,
            flush=True)
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
      batches = epoch_batches(num_train, config.batch_size, config.seed, epoch)
      for indices in batches[position:]:
        images, labels = gather_batch(programs.mesh, (data.train_images, data.train_labels),
                                      indices)
        # The step donates the old state's buffers: a Ctrl-C between the dispatch and the
        # rebinding would leave `state` deleted, so it is held back until `state` is new.
        with checkpoint_lib.sigint_deferred():
          state = run_step(programs, config, state, images, labels, epoch * spe + position)
        position += 1
        bar.update(1)
        if on_step is not None:
          on_step(epoch * spe + position)
      state = jax.block_until_ready(state)
      epoch_seconds = time.perf_counter() - epoch_start
      record = _epoch_record(programs, config, state, data, epoch, epoch_seconds,
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
          _zero_metrics(programs.step_logger.empty()), programs.replicated))
      if (epoch + 1) % config.checkpoint_every == 0 or epoch + 1 == config.epochs:
        ckpt.save(int(state.step), state)
        last_saved = int(state.step)
  except KeyboardInterrupt:
    # An interrupt held back by ckpt.save arrives after that save committed
    # (before last_saved was updated): the checkpoint is already there.
    if (_alive(state) and int(state.step) != last_saved
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


def _alive(state: TrainState) -> bool:
  """Whether no buffer of ``state`` was donated away (a deleted state cannot be saved)."""
  return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state)
                 if isinstance(leaf, jax.Array))


def _programs(config: Config, data: input_pipeline.Dataset) -> Programs:
  return build_programs(config, len(data.train_labels), data.num_classes,
                        tuple(data.train_images.shape[1:]))


def restore_finished(config: Config, workdir: os.PathLike, data: input_pipeline.Dataset
                     ) -> tuple[Programs, TrainState]:
  """The final training state of the finished run in ``workdir``, read from its checkpoint.

  Returns:
    ``(programs, state)`` (what :func:`safe_optax.vision.finish.deploy` takes,
    with the training set).

  Raises:
    RuntimeError: the run has no checkpoint of its last step (not finished).
  """
  programs = _programs(config, data)
  total_steps = config.epochs * input_pipeline.num_batches(len(data.train_labels),
                                                           config.batch_size)
  ckpt = checkpoint_lib.Checkpointer(pathlib.Path(workdir) / "checkpoints")
  try:
    if ckpt.latest_step() != total_steps:
      raise RuntimeError(f"the run in '{workdir}' is not finished (checkpoint step "
                         f"{ckpt.latest_step()} of {total_steps}); resume its training first.")
    state = ckpt.restore(total_steps, programs.init(jax.random.PRNGKey(config.seed)))
  finally:
    ckpt.close()
  return programs, state


def _epoch_record(programs: Programs, config: Config, state: TrainState,
                  data: input_pipeline.Dataset, epoch: int, seconds: float, *, trained: int,
                  includes_compile: bool) -> dict[str, Any]:
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
    dense = evaluate(programs.eval, state.params, state.model_state, data.test_images,
                     data.test_labels, config.eval_batch_size, mesh=programs.mesh)
    record.update(test_accuracy=dense["accuracy"], test_loss=dense["loss"])
    if config.sparsity > 0 and config.method != "dense":
      sparse = evaluate(programs.eval, programs.project(state.params), state.model_state,
                        data.test_images, data.test_labels, config.eval_batch_size,
                        mesh=programs.mesh)
      record["test_accuracy_projected"] = sparse["accuracy"]
  record.update(steps=steps, dual_updates=dual_updates)
  return record


