"""Penalty schedules ``lambda_t`` for the ADMM penalty.

SAFE ramps the penalty from 0 to its target on a cosine curve for vision
(``lambda * 0.5 * (1 - cos(pi * t / T))``), linearly, or keeps it constant
(language). Any optax schedule ``step -> value`` is accepted as well.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax

PENALTY_SCHEDULES = ("constant", "linear", "cosine")


def check_nonnegative(value: Any, name: str) -> None:
  """Raises ``ValueError`` for a concrete negative (or non-finite) number; tracers pass."""
  if isinstance(value, jax.core.Tracer):
    return
  if not isinstance(value, (numbers.Real, jax.Array)) or jnp.ndim(value) != 0:
    raise TypeError(f"`{name}` must be a non-negative number, got {value!r}.")
  if not (float(value) >= 0.0 and jnp.isfinite(float(value))):
    raise ValueError(f"`{name}` must be a finite number >= 0, got {float(value)}.")


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

  Examples:
    >>> from safe_optax import penalty_schedule
    >>> lam = penalty_schedule(1e-3, "cosine", total_steps=100)
    >>> float(lam(0)), float(lam(50)), float(lam(100))
    (0.0, 0.0005, 0.001)
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
  if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1:
    raise ValueError(
        f"penalty_schedule={schedule!r} needs `total_steps`, a positive int, got {total_steps!r}."
    )

  def ramp(count):
    progress = jnp.minimum(jnp.asarray(count, jnp.float32) / total_steps, 1.0)
    if schedule == "linear":
      return penalty * progress
    return penalty * 0.5 * (1.0 - jnp.cos(jnp.pi * progress))

  return ramp
