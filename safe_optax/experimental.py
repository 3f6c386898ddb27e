"""Experimental: XLA:CPU workarounds, outside the stable API.

They exist for speed on XLA:CPU only and may change or go without notice:

* :func:`canonical_convs`: a function's convolutions in XLA:CPU's canonical
  order, for ``lax.scan`` / ``while_loop`` / ``cond`` bodies that
  differentiate conv nets on CPU;
* :func:`is_dual_step` and :func:`run_dual_update`: a training loop that
  counts steps on the host compiles the step without the projection on the
  ``K - 1`` steps of ``K`` that have no dual update (``update(...,
  dual_due=is_dual_step(t, K))``), or runs the dual update as a program of
  its own.
"""

from safe_optax._admm import is_dual_step
from safe_optax._admm import run_dual_update
from safe_optax._conv_layout import canonical_convs

__all__ = (
    "canonical_convs",
    "is_dual_step",
    "run_dual_update",
)
