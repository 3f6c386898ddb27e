"""Penalty schedules ``lambda_t`` for the ADMM penalty, and the checks of its hyperparameters.

SAFE ramps the penalty from 0 to its target on a cosine curve for vision
(``lambda * 0.5 * (1 - cos(pi * t / T))``), linearly, or keeps it constant
(language). Any optax schedule ``step -> value`` is accepted as well.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

PENALTY_SCHEDULES = ("constant", "linear", "cosine")


def check_nonnegative(value: Any, name: str) -> None:
  """Raises ``ValueError`` for a concrete negative (or non-finite) number; tracers pass."""
  if isinstance(value, jax.core.Tracer):
    return
  if not isinstance(value, (numbers.Real, jax.Array)) or jnp.ndim(value) != 0:
    raise TypeError(f"`{name}` must be a non-negative number, got {value!r}.")
  if not (float(value) >= 0.0 and math.isfinite(float(value))):
    raise ValueError(f"`{name}` must be a finite number >= 0, got {float(value)}.")


def check_positive_int(value: Any, name: str) -> None:
  """Raises ``ValueError`` unless ``value`` is an integer >= 1.

  Integer scalar arrays are accepted (``optax.inject_hyperparams`` turns ints
  into arrays) and tracers pass unchecked.
  """
  if isinstance(value, jax.core.Tracer) and jnp.issubdtype(value.dtype, jnp.integer):
    return
  is_int = (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (
      isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
      and jnp.issubdtype(value.dtype, jnp.integer))
  if not is_int or int(value) < 1:
    raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def penalty_schedule(
    penalty: Union[float, optax.Schedule],
    schedule: Optional[str] = "constant",
    total_steps: Optional[int] = None,
) -> optax.Schedule:
  r"""The penalty ``lambda_t`` as an optax schedule.

  * ``"constant"``: :math:`\lambda`;
  * ``"linear"``: :math:`\lambda \min(t/T, 1)`;
  * ``"cosine"``: :math:`\lambda\,\tfrac12 (1 - \cos(\pi \min(t/T, 1)))`.

  Args:
    penalty: target penalty ``lambda >= 0``, or a schedule ``step -> lambda``
      (then ``schedule`` must be None or ``"constant"``).
    schedule: ``"constant"``, ``"linear"`` or ``"cosine"``.
    total_steps: ``T``, required for the ramps.

  Returns:
    A schedule ``step -> lambda_t`` (float32), constant after ``T``.

  Raises:
    ValueError: unknown ``schedule``, a negative ``penalty``, a ramp without
      a positive ``total_steps``, or a ramp requested for a schedule.

  Examples:
    >>> from safe_optax import penalty_schedule
    >>> lam = penalty_schedule(1e-3, "cosine", total_steps=100)
    >>> float(lam(0)), float(lam(50)), float(lam(100))
    (0.0, 0.0005, 0.001)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (§3.5; App. B, hyperparameters; App. F, effect of the
    penalty schedule).
  """
  if callable(penalty):
    if schedule not in (None, "constant"):
      raise ValueError(
          f"`penalty` is already a schedule; `penalty_schedule`={schedule!r} would be "
          "ignored. Pass penalty_schedule=None or fold the ramp into the schedule."
      )
    return penalty
  check_nonnegative(penalty, "penalty")
  if schedule is None or schedule == "constant":
    return lambda count: jnp.asarray(penalty, jnp.float32)
  if schedule not in PENALTY_SCHEDULES:
    raise ValueError(f"`penalty_schedule` must be one of {PENALTY_SCHEDULES}, got {schedule!r}.")
  if total_steps is None:
    raise ValueError(f"penalty_schedule={schedule!r} needs `total_steps`, a positive int.")
  check_positive_int(total_steps, "total_steps")

  def ramp(count):
    progress = jnp.minimum(jnp.asarray(count, jnp.float32) / total_steps, 1.0)
    if schedule == "linear":
      return penalty * progress
    return penalty * 0.5 * (1.0 - jnp.cos(jnp.pi * progress))

  return ramp


def warn_if_no_dual_update(total_steps: Any, dual_every: Any) -> None:
  """Warns when a run of ``total_steps`` never reaches a dual update after the first.

  The dual update runs at counts ``0, K, 2K, ...``; count 0 only sets
  ``z = Proj(x0)``, so with ``T <= K`` the dual ``u`` never moves. Traced
  values (``inject_hyperparams``) cannot be compared here.
  """
  concrete = all(isinstance(v, (int, np.integer)) or (
      isinstance(v, (jax.Array, np.ndarray)) and not isinstance(v, jax.core.Tracer))
                 for v in (total_steps, dual_every))
  if total_steps is None or not concrete or int(total_steps) > int(dual_every):
    return
  warnings.warn(
      f"total_steps={int(total_steps)} with dual_every={int(dual_every)}: the dual update "
      f"runs every {int(dual_every)} steps, so after the first step (z = Proj(x0)) no dual "
      "update happens in this run and u stays 0. Pass dual_every < total_steps.",
      UserWarning, stacklevel=4)


def valid_or_zero(lam: jax.Array) -> jax.Array:
  """``lam``, or 0 where it is negative or not finite (an invalid penalty counts as 0)."""
  return jnp.where(jnp.isfinite(lam) & (lam >= 0), lam, jnp.zeros_like(lam))


def penalty_ratio(previous: jax.Array, current: jax.Array) -> jax.Array:
  """``previous / current``, 0 where ``current`` is 0 or either is not a valid penalty."""
  valid = jnp.isfinite(previous) & jnp.isfinite(current) & (previous >= 0) & (current > 0)
  return jnp.where(valid, previous / jnp.where(valid, current, 1.0), 0.0)
