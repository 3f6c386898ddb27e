"""What the vision trainer logs besides its epoch sums: per-step scalars and TensorBoard.

Per-step scalars never cost the training loop a host round-trip: the jitted
step writes them into small arrays of the training state (a :class:`StepLog`,
reset every epoch, checkpointed with it), and the host reads them once, with
the epoch's record. Every ``log_every`` steps of an epoch the step records

* ``loss`` and ``accuracy`` of its (clean, augmented) batch,
* ``learning_rate``, the rate of that step,
* ``sparsity``, the fraction of exact zeros in the prunable weights after it,
* for the ADMM-based methods, ``penalty`` (``lambda_t`` of that step) and
  ``constraint_distance`` (``||x - z||`` after it);

and, for the ADMM-based methods, every dual update after the first records
``mask_churn``: the fraction of prunable weights whose membership in the mask
(``z != 0``) changed since the previous dual update. A row's ``step`` is the
number of steps taken once that step is done, as the epoch record's.

:class:`TensorBoard` writes an epoch's record, these rows included, as
TensorBoard scalars (``train/<name>`` per step, ``epoch/<name>`` per epoch)
with ``tensorboardX``.

Examples:
  >>> import jax.numpy as jnp
  >>> old = {"w": jnp.array([1.0, 0.0, 2.0, 0.0])}
  >>> float(mask_churn(old, {"w": jnp.array([1.0, 3.0, 0.0, 0.0])}))  # 2 of 4 moved
  0.5
  >>> float(prunable_sparsity({"w": jnp.array([[1.0, 0.0], [0.0, 0.0]]), "b": jnp.zeros(2)}))
  0.75
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import safe_optax

STEP_FIELDS = ("loss", "accuracy", "learning_rate", "sparsity")
"""Per-step scalars of every method."""

ADMM_FIELDS = ("penalty", "constraint_distance")
"""Per-step scalars of the methods whose state holds an :class:`~safe_optax.ADMMState`."""

_NOT_SCALARS = ("epoch", "step", "includes_compile", "steps", "dual_updates")
"""Epoch-record entries that are no TensorBoard scalar (the x-axis, flags, per-step rows)."""


class StepLog(NamedTuple):
  """Per-step scalars of the current epoch, on the device (a field of the training state)."""

  steps: jax.Array
  """int32 ``[rows]``: the step count after each logged step; -1 for a row not written."""
  values: jax.Array
  """float32 ``[rows, fields]``: the logged scalars (:attr:`StepLogger.fields`)."""
  dual_steps: jax.Array
  """int32 ``[dual_rows]``: the step count after each dual update; -1 for a row not written."""
  mask_churn: jax.Array
  """float32 ``[dual_rows]``: the mask churn of each dual update."""


def empty_log(rows: int = 1, fields: int = len(STEP_FIELDS), dual_rows: int = 1) -> StepLog:
  """A :class:`StepLog` with no row written (host arrays: ``device_put`` places them anywhere).

  Unwritten rows are marked by step -1; their values are 0, not NaN, because a
  multi-process ``device_put`` checks that every process passes equal arrays and
  NaN never equals itself.
  """
  return StepLog(np.full([rows], -1, np.int32), np.zeros([rows, fields], np.float32),
                 np.full([dual_rows], -1, np.int32), np.zeros([dual_rows], np.float32))


def prunable_sparsity(params: Any) -> jax.Array:
  """The fraction of exact zeros in the prunable leaves (:func:`~safe_optax.default_prunable`).

  Args:
    params: the parameters.

  Returns:
    A float32 scalar.
  """
  leaves = [x for x, flag in zip(jax.tree.leaves(params),
                                 jax.tree.leaves(safe_optax.prunable_mask(params))) if flag]
  zeros = sum(jnp.sum(x == 0, dtype=jnp.float32) for x in leaves)
  return zeros / sum(x.size for x in leaves)


def mask_churn(z_old: Any, z_new: Any) -> jax.Array:
  """The fraction of entries whose mask (``z != 0``) differs between two sparse targets.

  Args:
    z_old, z_new: the ``z`` trees of two :class:`~safe_optax.ADMMState`
      (``optax.MaskedNode`` on leaves that are not pruned, which are skipped).

  Returns:
    A float32 scalar in ``[0, 1]``.
  """
  pairs = [(a, b) for a, b in zip(jax.tree.leaves(z_old, is_leaf=_is_masked),
                                  jax.tree.leaves(z_new, is_leaf=_is_masked))
           if not _is_masked(a)]
  changed = sum(jnp.sum((a != 0) != (b != 0), dtype=jnp.float32) for a, b in pairs)
  return changed / sum(a.size for a, _ in pairs)


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


@dataclasses.dataclass(frozen=True)
class StepLogger:
  """Which steps of an epoch are logged and how their scalars are computed (static).

  Args:
    every: log the steps at positions ``0, every, 2 every, ...`` of each epoch.
    steps_per_epoch: steps of an epoch (the last batch may be short).
    learning_rate: the optimizer's learning-rate schedule.
    penalty: ``lambda_t`` of the ADMM-based methods, ``None`` for the others
      (then no ADMM fields and no mask churn are logged).
    dual_every: ``K``, steps between dual updates (used with ``penalty``).
  """

  every: int
  steps_per_epoch: int
  learning_rate: optax.Schedule
  penalty: Optional[optax.Schedule] = None
  dual_every: int = 1

  @property
  def fields(self) -> tuple[str, ...]:
    """The names of :attr:`StepLog.values`' columns."""
    return STEP_FIELDS + (ADMM_FIELDS if self.penalty is not None else ())

  def empty(self) -> StepLog:
    """The log at the start of an epoch: room for every logged step and dual update."""
    rows = -(-self.steps_per_epoch // self.every)
    dual_rows = -(-self.steps_per_epoch // self.dual_every) if self.penalty is not None else 1
    return empty_log(rows, len(self.fields), dual_rows)

  def record(self, log: StepLog, step: jax.Array, *, loss: jax.Array, accuracy: jax.Array,
             params: Any, old_opt_state: Any, opt_state: Any,
             dual_in_step: bool = True) -> StepLog:
    """``log`` with step ``step``'s row and dual update written when they are due (in jit).

    Args:
      log: the epoch's :class:`StepLog`.
      step: the steps taken before this one (the state's ``step``).
      loss, accuracy: of this step's batch.
      params, opt_state: after this step.
      old_opt_state: before this step (its ``z`` is the previous dual update's).
      dual_in_step: whether this step's program can run a dual update (static);
        ``False`` for a ``dual_due=False`` step, whose dual update, if any, ran
        apart and was logged there (:meth:`record_dual`).

    Returns:
      The updated log. Only the branch of a due row computes anything beyond
      an integer test (``lax.cond``), so the steps between pay nothing else.
    """
    position = step % self.steps_per_epoch

    def write_row(log):
      values = [loss, accuracy, self.learning_rate(step), prunable_sparsity(params)]
      if self.penalty is not None:
        count = safe_optax.find_admm_state(old_opt_state).count  # the count lambda_t used
        values += [self.penalty(count), safe_optax.constraint_distance(params, opt_state)]
      row = position // self.every
      return log._replace(
          steps=log.steps.at[row].set(step + 1),
          values=log.values.at[row].set(jnp.stack([jnp.asarray(v, jnp.float32)
                                                   for v in values])))

    log = lax.cond(position % self.every == 0, write_row, lambda log: log, log)
    if self.penalty is None or not dual_in_step:
      return log
    return self.record_dual(log, step, old_opt_state, opt_state)

  def record_dual(self, log: StepLog, step: jax.Array, old_opt_state: Any,
                  opt_state: Any) -> StepLog:
    """``log`` with the mask churn of step ``step``'s dual update written, when it ran (in jit).

    Args:
      log: the epoch's :class:`StepLog`.
      step: the steps taken before this one.
      old_opt_state, opt_state: before and after the dual update (a whole step,
        or :func:`safe_optax.experimental.run_dual_update` alone).
    """
    position = step % self.steps_per_epoch
    old, new = (safe_optax.find_admm_state(s) for s in (old_opt_state, opt_state))
    # Dual updates fall at counts 0, K, 2K, ...; the one at 0 has no previous mask.
    due = (old.count % self.dual_every == 0) & (old.count > 0)

    def write_churn(log):
      row = position // self.dual_every  # K or more steps apart: one row each
      return log._replace(dual_steps=log.dual_steps.at[row].set(step + 1),
                          mask_churn=log.mask_churn.at[row].set(mask_churn(old.z, new.z)))

    return lax.cond(due, write_churn, lambda log: log, log)

  def rows(self, log: StepLog) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The written rows of ``log``, read on the host.

    Returns:
      ``(steps, dual_updates)``: ``[{"step": s, "loss": ..., ...}]`` and
      ``[{"step": s, "mask_churn": ...}]``, by step.
    """
    steps, values, dual_steps, churn = jax.device_get(log)
    step_rows = [{"step": int(s), **{k: float(v) for k, v in zip(self.fields, row)}}
                 for s, row in zip(steps, values) if s >= 0]
    dual_rows = [{"step": int(s), "mask_churn": float(c)} for s, c in zip(dual_steps, churn)
                 if s >= 0]
    return (sorted(step_rows, key=lambda r: r["step"]),
            sorted(dual_rows, key=lambda r: r["step"]))


def without_step_rows(record: dict[str, Any]) -> dict[str, Any]:
  """An epoch record without its per-step rows (what ``results.json``'s history keeps)."""
  return {k: v for k, v in record.items() if k not in ("steps", "dual_updates")}


def tensorboard_available() -> bool:
  """Whether ``tensorboardX`` can be imported."""
  return importlib.util.find_spec("tensorboardX") is not None


class TensorBoard:
  """Writes a run's epoch records as TensorBoard scalars (``tensorboardX``).

  Per step (x: the row's ``step``): ``train/<field>`` for each field of the
  record's ``steps`` rows and ``train/mask_churn`` for its ``dual_updates``.
  Per epoch (x: the record's ``step``): ``epoch/<key>`` for each number of the
  record (losses, accuracies, distances, ``images_per_second``, ...).

  Args:
    logdir: the event files' folder.
    purge_step: a resumed run's first step: TensorBoard hides what an earlier
      session logged from this step on (it is logged again).
  """

  def __init__(self, logdir: os.PathLike, purge_step: Optional[int] = None):
    import tensorboardX  # pylint: disable=import-outside-toplevel
    # tensorboardX names an event file by the second and the host only: a run
    # interrupted and resumed within one second would reopen (and truncate) the
    # first session's file, so each writer gets its own suffix, the time in ns,
    # which keeps the files in the order they were written when sorted by name
    # (as TensorBoard reads them).
    self._writer = tensorboardX.SummaryWriter(os.fspath(logdir), purge_step=purge_step or None,
                                              filename_suffix=f".{time.time_ns()}")

  def write(self, record: dict[str, Any]) -> None:
    """Adds one epoch record (with its per-step rows) and flushes."""
    for row in record.get("steps", ()):
      for key, value in row.items():
        if key != "step":
          self._writer.add_scalar(f"train/{key}", value, row["step"])
    for row in record.get("dual_updates", ()):
      self._writer.add_scalar("train/mask_churn", row["mask_churn"], row["step"])
    for key, value in record.items():
      if key not in _NOT_SCALARS and isinstance(value, (int, float)):
        self._writer.add_scalar(f"epoch/{key}", value, record["step"])
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()
