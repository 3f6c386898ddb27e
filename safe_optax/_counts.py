"""Keep counts: how many entries a sparsity keeps, in a leaf or under ERK.

``num_keep(n, s) = n - floor(s * n)`` for a Python or a traced sparsity (the
traced floor computed exactly, so it agrees with Python's), and RigL's
Erdős–Rényi-Kernel allocation of one global count across leaves
(:func:`erk_keep_counts`), exact up to rounding ties broken by leaf order.
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def is_python_number(value: Any) -> bool:
  """True for Python ``int`` / ``float`` (not ``bool``, not numpy or jax scalars)."""
  return isinstance(value, (int, float)) and not isinstance(value, (bool, np.generic))


def _floor_scaled_product(a: jax.Array, n: int, shift: jax.Array) -> jax.Array:
  """Exact ``floor(a * n / 2**shift)`` for uint32 ``a < 2**25``, ``0 < n < 2**31``.

  The product needs up to 56 bits, so it is formed from 16-bit limbs as a
  (high, low) pair of uint32 words (JAX runs without 64-bit types by default).
  """
  u32 = jnp.uint32
  a1, a0 = a >> 16, a & u32(0xFFFF)
  n1, n0 = u32(n >> 16), u32(n & 0xFFFF)
  mid = a1 * n0 + a0 * n1                       # < 2**32
  low_part = a0 * n0                             # < 2**32
  mid_low = mid << 16
  low = low_part + mid_low
  carry = (low < low_part).astype(jnp.uint32)
  high = a1 * n1 + (mid >> 16) + carry
  shift = shift.astype(jnp.uint32)
  # Shifts of 32 or more are out of range for uint32: select the word instead.
  from_high = jnp.where(shift - u32(32) < u32(32), high >> (shift - u32(32)), u32(0))
  small = jnp.minimum(shift, u32(31))
  from_both = (low >> small) | jnp.where(small == 0, u32(0), high << (u32(32) - small))
  return jnp.where(shift >= u32(32), from_high, from_both)


def num_keep(size: int, sparsity) -> int | jax.Array:
  """Number of entries kept out of ``size`` at ``sparsity``: ``size - floor(sparsity * size)``.

  A Python ``sparsity`` is read as the decimal it prints as, so ``0.29`` of 100
  prunes exactly 29 (plain float arithmetic gives ``0.29 * 100 = 28.99...``).
  A float32 / traced ``sparsity`` ``s`` stands for every real that rounds to
  it: ``floor((s + ulp(s) / 2) * size)`` entries are pruned, computed exactly
  in integer arithmetic. That is the decimal answer unless ``sparsity * size``
  lies within ``size * ulp(s) / 2`` below an integer. At least one entry is
  always kept.

  Args:
    size: number of candidate entries (a Python int).
    sparsity: fraction to prune, in ``[0, 1)``; a Python number or a scalar array.

  Returns:
    A Python int for a Python ``sparsity``, else an int32 scalar array.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import num_keep
    >>> num_keep(100, 0.29), num_keep(10, 0.95), num_keep(7, 0.0)
    (71, 1, 7)
    >>> int(num_keep(100, jnp.float32(0.29))), int(num_keep(3001, jnp.float32(0.999)))
    (71, 4)
  """
  if is_python_number(sparsity):
    pruned = math.floor(fractions.Fraction(repr(float(sparsity))) * size)
    return size - min(max(pruned, 0), max(size - 1, 0))
  if size == 0:
    return jnp.int32(0)
  bits = lax.bitcast_convert_type(jnp.asarray(sparsity, jnp.float32), jnp.uint32)
  biased_exp = (bits >> 23) & jnp.uint32(0xFF)
  mantissa = bits & jnp.uint32(0x7FFFFF)
  normal = biased_exp != 0
  mantissa = jnp.where(normal, mantissa | jnp.uint32(0x800000), mantissa)
  # s = mantissa * 2**(e - 150), so s + ulp/2 = (2 * mantissa + 1) * 2**(e - 151).
  shift = jnp.uint32(151) - jnp.where(normal, biased_exp, jnp.uint32(1))
  pruned = _floor_scaled_product(jnp.uint32(2) * mantissa + jnp.uint32(1), size, shift)
  negative = (bits >> 31) == 1
  pruned = jnp.where(negative, jnp.uint32(0), jnp.minimum(pruned, jnp.uint32(size - 1)))
  return jnp.int32(size) - pruned.astype(jnp.int32)


def _check_shapes(shapes: Any) -> list[tuple[int, ...]]:
  try:
    out = [tuple(shape) for shape in shapes]
  except TypeError as err:
    raise ValueError(f"`shapes` must be a sequence of leaf shapes, got {shapes!r}.") from err
  for shape in out:
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
               for d in shape):
      raise ValueError(f"`shapes` must hold tuples of non-negative ints, got {shape!r}.")
  return [tuple(int(d) for d in shape) for shape in out]


def erk_keep_counts(shapes: Sequence[Sequence[int]], sparsity,
                    power_scale: float = 1.0) -> list[int] | list[jax.Array]:
  r"""Entries kept in each leaf under the Erdős–Rényi-Kernel allocation.

  Leaf ``i`` of shape ``(d_1, ..., d_r)`` and size ``n_i`` has the raw density
  ``r_i = ((d_1 + ... + d_r) / n_i) ** power_scale``. A common scale ``eps``
  meets the budget ``num_keep(sum n_i, sparsity)``; a leaf whose
  ``eps * r_i`` would pass 1 is made dense and ``eps`` recomputed for the
  rest (RigL's loop; here in one pass, since the dense leaves are always the
  ones with the largest ``r_i``). The real counts ``eps * r_i * n_i`` are
  rounded by largest remainder (ties: the earlier leaf), so the counts add up
  to exactly ``num_keep(sum n_i, sparsity)``: the same total as
  :class:`safe_optax.Global`.

  A Python or concrete ``sparsity`` is allocated in float64 on the host and
  gives Python ints. A traced one (a schedule inside ``jit``) is allocated
  in float32 and gives int32 scalars; their total is still exact, and each
  may differ from the float64 count by one entry where rounding differs
  (tested up to 45M-entry leaves of an 808M-entry model; a float32 error past
  one entry per leaf is moved to the leaf with the most room).

  Args:
    shapes: the shapes of the prunable leaves, in flatten order.
    sparsity: fraction of all their entries to prune, in ``[0, 1)``.
    power_scale: exponent of the raw density: ``1`` is ERK, ``0`` uniform.

  Returns:
    One kept count per shape.

  Raises:
    ValueError: a bad shape, a sparsity outside ``[0, 1)`` or a negative
      ``power_scale`` (``TypeError`` for a non-number).

  Examples:
    >>> from safe_optax import erk_keep_counts
    >>> erk_keep_counts([(784, 300), (300, 100), (100, 10)], 0.9)  # MLP: output dense
    [18714, 6906, 1000]
    >>> erk_keep_counts([(784, 300), (300, 100), (100, 10)], 0.9, power_scale=0.0)
    [23520, 3000, 100]
  """
  # Deferred: _structures sits above the kernels (it imports _prunable).
  from safe_optax import _structures  # pylint: disable=g-import-not-at-top
  shapes = _check_shapes(shapes)
  power_scale = _structures.check_power_scale(power_scale)
  _structures.validate_sparsity(sparsity)
  if not shapes:
    return []
  sizes = np.array([math.prod(shape) for shape in shapes], np.int64)
  raw = np.array([(sum(shape) / n) ** power_scale if n else 0.0
                  for shape, n in zip(shapes, sizes)])
  # Largest raw density first (earlier leaf first on ties); empty leaves last.
  order = np.lexsort((np.arange(len(shapes)), -raw))
  ns, rs = sizes[order], raw[order]
  dense_before = np.concatenate([[0], np.cumsum(ns)])          # the first j leaves dense
  mass_after = np.concatenate([np.cumsum((rs * ns)[::-1])[::-1], [0.0]])
  next_raw = np.concatenate([rs, [0.0]])
  target = num_keep(int(sizes.sum()), sparsity)
  traced = isinstance(target, jax.core.Tracer)
  xp = jnp if traced else np
  if traced:
    ns_x, rs_x = jnp.asarray(ns, jnp.float32), jnp.asarray(rs, jnp.float32)
    budget = target.astype(jnp.float32) - jnp.asarray(dense_before, jnp.float32)
    mass, nxt = jnp.asarray(mass_after, jnp.float32), jnp.asarray(next_raw, jnp.float32)
  else:
    target = int(target)
    ns_x, rs_x = ns.astype(np.float64), rs
    budget, mass, nxt = target - dense_before.astype(np.float64), mass_after, next_raw
  safe_mass = xp.where(mass > 0, mass, 1.0)
  eps = xp.where(mass > 0, budget / safe_mass, 0.0)
  # RigL's loop stops at the first j where the densest leaf left fits under 1.
  j = xp.argmax((mass <= 0) | (eps * nxt <= 1.0))
  position = xp.arange(len(shapes))
  real = xp.minimum(xp.where(position < j, ns_x, eps[j] * rs_x * ns_x), ns_x)
  real = xp.maximum(real, 0.0)
  floor = xp.floor(real)
  unsort = np.argsort(order)                                   # back to flatten order
  frac = (real - floor)[unsort]
  if not traced:
    # float64 remainders that differ only by rounding error tie (the earlier leaf
    # wins), as equal remainders do in exact arithmetic (RigL's loop on rationals).
    quantum = float(np.finfo(np.float64).eps) * 64 * max(float(sizes.max()), 1.0)
    frac = np.round(frac / quantum) * quantum
  counts = floor.astype(xp.int32 if traced else np.int64)[unsort]
  sizes_x = xp.asarray(sizes, counts.dtype) if traced else sizes
  counts = _largest_remainder(xp, counts, frac, sizes_x, target - counts.sum())
  if traced:
    return [counts[i] for i in range(len(shapes))]
  return [int(c) for c in counts]


def _largest_remainder(xp, counts, frac, sizes, deficit):
  """Adds the ``deficit`` to ``counts``: one entry each, largest remainder first.

  A negative deficit (float32 rounding up) takes one entry each from the
  smallest remainders; whatever is left over (only when the rounding error
  passes one entry per leaf) goes to the leaf with the most room.
  """
  index = xp.arange(counts.shape[0])
  rank_down = xp.argsort(xp.lexsort((index, -frac)))            # 0: largest remainder
  rank_up = xp.argsort(xp.lexsort((index, frac)))
  step = (xp.where((rank_down < deficit) & (counts < sizes), 1, 0)
          - xp.where((rank_up < -deficit) & (counts > 0), 1, 0)).astype(counts.dtype)
  counts = counts + step
  left = deficit - step.sum()
  widest = xp.argmax(xp.where(left >= 0, sizes - counts, counts))
  left = xp.clip(left, -counts, sizes - counts)                 # never past empty or dense
  return counts + xp.where(index == widest, left, 0).astype(counts.dtype)
