"""The compiled programs of a vision configuration, and which of them runs a given step.

:func:`build_programs` jits the steps of :mod:`~safe_optax.vision.steps` with a
configuration's model, optimizer, data mesh and logger bound, once per
configuration; :func:`run_step` runs training step ``t`` with them;
:func:`restore_finished` reads back the last state of a finished run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

import safe_optax
from safe_optax import distributed
from safe_optax import methods
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import finish as finish_lib
from safe_optax.vision import input_pipeline
from safe_optax.vision import metrics as metrics_lib
from safe_optax.vision import steps as steps_lib
from safe_optax.vision.configs import Config
from safe_optax.vision.datasets import NORMALIZATION, prepare_images
from safe_optax.vision.models import create_model
from safe_optax.vision.train_state import TrainState, zero_metrics


class Programs(NamedTuple):
  """The jitted functions of a configuration."""

  model: nn.Module
  """The Linen model."""
  tx: optax.GradientTransformation
  """The optimizer (:func:`~safe_optax.methods.make_optimizer`)."""
  mesh: Mesh
  """The 1-D data-parallel mesh over every device of every process."""
  replicated: NamedSharding
  """Replicated over ``mesh`` (parameters, optimizer state, metrics)."""
  init: Callable[..., Any]
  """``init(key) -> TrainState``."""
  train_step: Callable[..., Any]
  """:func:`~safe_optax.vision.steps.train_step` with the configuration bound, not jitted
  (:mod:`~safe_optax.vision.packing` maps it over a pack of runs)."""
  train: Callable[..., Any]
  """:attr:`train_step` jitted, the state donated; ``dual_due`` static
  (two programs for the ADMM-based methods, one without the projection)."""
  dual_step: Optional[Callable[..., Any]]
  """:func:`~safe_optax.vision.steps.dual_step` with the configuration bound, not jitted,
  for the methods whose dual update runs alone, else ``None``."""
  dual: Optional[Callable[..., Any]]
  """:func:`~safe_optax.vision.steps.dual_step` (the state not donated;
  :func:`~safe_optax.vision.steps.with_dual_step` applies its output),
  for the methods whose dual update runs alone
  (:attr:`~safe_optax.methods.Method.dual_alone`), else ``None``."""
  eval: Callable[..., Any]
  """:func:`~safe_optax.vision.steps.eval_step` (its sums replicated)."""
  distance: Optional[Callable[..., Any]]
  """``params -> ||x - Proj(x)||`` (``None`` without a sparsity)."""
  project: Optional[Callable[..., Any]]
  """``params -> Proj(params)``, the final projection (``None`` without a sparsity)."""
  distance_to_z: Optional[Callable[..., Any]]
  """``(params, opt_state) -> ||x - z||`` of the ADMM-based methods, else ``None``."""
  prepare: Callable[..., Any]
  """``prepare(images, key or None)``: :func:`~safe_optax.vision.datasets.prepare_images`
  with the data set's constants."""
  scores: Callable[..., Any]
  """SAFE+'s per-batch final scores (:func:`safe_optax.vision.finish.score_fn`), replicated."""
  step_logger: metrics_lib.StepLogger
  """What the step logs (its :meth:`~safe_optax.vision.metrics.StepLogger.empty` log)."""
  sparsity: Callable[..., Any]
  """``params -> sparsity``: the fraction of zeros in the prunable leaves."""


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
  tx = methods.make_optimizer(config, spe)
  step_logger = _step_logger(config, spe)
  mesh = distributed.data_mesh()
  replicated = distributed.replicated(mesh)
  mean, std = NORMALIZATION[config.dataset]

  def init(key):
    init_key, data_key = jax.random.split(key)
    variables = model.init(init_key, jnp.zeros((1,) + image_shape, jnp.float32), train=False)
    model_state, params = flax.core.pop(dict(variables), "params")
    return TrainState(jnp.zeros([], jnp.int32), data_key, params, dict(model_state),
                      tx.init(params), zero_metrics(step_logger.empty()))

  step = functools.partial(
      steps_lib.train_step, apply_fn=model.apply, tx=tx, uses_grad_fn=method.uses_grad_fn,
      augment=config.augment, mean=mean, std=std, step_logger=step_logger)
  evaluate_batch = functools.partial(steps_lib.eval_step, apply_fn=model.apply, mean=mean, std=std)
  prepare = functools.partial(prepare_images, mean=mean, std=std)
  dual = (functools.partial(steps_lib.dual_step, tx=tx, step_logger=step_logger)
          if method.dual_alone else None)
  projection = methods.projection(config) if config.sparsity > 0 else None
  return Programs(
      model=model, tx=tx, mesh=mesh, replicated=replicated,
      init=jax.jit(init, out_shardings=replicated),
      train_step=step,
      train=jax.jit(step, donate_argnums=0, out_shardings=replicated,
                    static_argnames="dual_due"),
      dual_step=dual,
      # Not donated: on XLA:CPU the donated dual program ran 4-5 ms in most calls, the
      # undonated one 0.7-1.3 ms (benchmarks/perf/dual_step_breakdown.py); only z and u are
      # new buffers.
      dual=jax.jit(dual, out_shardings=replicated) if dual is not None else None,
      eval=jax.jit(evaluate_batch, out_shardings=replicated),
      distance=jax.jit(functools.partial(steps_lib.distance_to_projection, **projection))
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
                                methods.learning_rate_schedule(config, steps_per_epoch), penalty,
                                config.dual_every)


def dual_due(config: Config, step: int) -> Optional[bool]:
  """Whether step ``step`` runs the dual update (ADMM-based methods), else ``None``.

  The optimizer's update count is the training step (both start at 0 and a
  resumed run restores both), so the host knows it without reading the state.
  """
  if not methods.get(config.method).has_admm_state:
    return None
  return safe_optax.experimental.is_dual_step(step, config.dual_every)


def plan(programs: Programs, config: Config, step: int) -> tuple[bool, Optional[bool]]:
  """``(run programs.dual first, the dual_due of programs.train)`` for step ``step``.

  On a dual step of a method whose dual update reads no gradient, the dual
  update runs as a program of its own and the step without it: on XLA:CPU a
  step that also holds the projection fell into a slow mode in some processes
  (README, "Step overhead").
  """
  due = dual_due(config, step)
  if due and programs.dual is not None:
    return True, False
  return False, due


def run_step(programs: Programs, config: Config, state: TrainState, images: jax.Array,
             labels: jax.Array, step: int) -> TrainState:
  """Training step ``step`` (the host's count of ``state.step``): the dual program when
  :func:`plan` says so, then :attr:`Programs.train`."""
  run_dual, due = plan(programs, config, step)
  if run_dual:
    state = steps_lib.with_dual_step(state, programs.dual(state))
  return programs.train(state, images, labels, dual_due=due)


def for_data(config: Config, data: input_pipeline.Dataset) -> Programs:
  """:func:`build_programs` for the data set ``data``."""
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
  programs = for_data(config, data)
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
