"""The pure steps of the vision trainer: a training step, the dual update alone, evaluation.

Jit them with their keywords bound (:func:`safe_optax.vision.programs.build_programs`
does, for a configuration).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

import safe_optax
from safe_optax import flax_utils
from safe_optax.experiment import cross_entropy
from safe_optax.vision import metrics as metrics_lib
from safe_optax.vision.datasets import prepare_images
from safe_optax.vision.train_state import EpochMetrics, TrainState


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
      update, known on the host (``safe_optax.experimental.is_dual_step``); a static
      argument, so the ``K - 1`` steps without one run a program without the
      projection (``None``: one program that decides inside). ``False`` on a
      dual step whose update :func:`dual_step` ran just before (see
      :func:`~safe_optax.vision.programs.run_step`).

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

  :func:`safe_optax.experimental.run_dual_update` on the state's optimizer state, its mask
  churn logged; the :func:`train_step` that follows takes ``dual_due=False``.
  Only for the methods whose dual update reads no gradient
  (:attr:`~safe_optax.methods.Method.dual_alone`).

  Returns:
    The new :class:`~safe_optax.ADMMState` nodes of the optimizer state, in
    tree order, and the epoch's log: only what changed, so that the undonated
    program copies no parameters (:func:`with_dual_step` puts them back).
  """
  opt_state = safe_optax.experimental.run_dual_update(tx, state.opt_state, state.params)
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
    **structure: the rest of :func:`~safe_optax.methods.projection`.

  Examples:
    >>> import jax.numpy as jnp
    >>> float(distance_to_projection({"w": jnp.array([[3.0, 4.0], [0.0, 1.0]])}, 0.5))
    1.0
  """
  projected, _ = safe_optax.project_topk(params, sparsity, **structure)
  return optax.tree.norm(optax.tree.sub(params, projected))
