"""Exact top-k selection kernels: radix select across leaves, ranks within groups.

These are the array-level kernels under :func:`safe_optax.project_topk`. Every
kernel returns boolean keep-masks with *exactly* the requested number of
``True`` entries, breaking ties deterministically: among equal scores the entry
that comes first (leaves in pytree-flatten order, entries in row-major order)
is kept.

Scores are compared through :func:`order_keys`, an order-preserving map from
floats to ``uint32``. Every NaN maps to the largest key, so NaN ranks above
``+inf`` and is always kept; the caller (``project_topk``) makes every NaN
entry NaN in its result, so a NaN is never kept or dropped silently
(:func:`topk_masks` also reports whether the keys held a NaN, for free).
"""

from __future__ import annotations

import fractions
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_RADIX_BITS = 16
_NUM_BINS = 1 << _RADIX_BITS
_ROW_BINS = 1 << (_RADIX_BITS // 2)
_NAN_KEY = 0xFFFFFFFF
_COPIES = 4
_MANY_ENTRIES = 1 << 20


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


def order_keys(scores: jax.Array) -> jax.Array:
  """Maps float scores to ``uint32`` keys whose unsigned order is the float order.

  Negative floats have all bits flipped, non-negative ones get the sign bit
  set, ``-0.0`` is read as ``+0.0`` (equal scores tie), and every NaN becomes
  ``0xFFFFFFFF`` (above ``+inf``). Low-precision floats widen to float32 exactly.
  """
  # lax ops, not jnp's wrappers: this runs once per leaf at trace time, and the
  # wrappers tripled the tracing time of a 300-leaf projection.
  x = lax.convert_element_type(scores, jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  sign = _full_like(bits, 0x80000000)
  bits = lax.select(lax.eq(bits, sign), _full_like(bits, 0), bits)
  negative = lax.ne(lax.bitwise_and(bits, sign), _full_like(bits, 0))
  keys = lax.select(negative, lax.bitwise_not(bits), lax.bitwise_or(bits, sign))
  return lax.select(lax.ne(x, x), _full_like(bits, _NAN_KEY), keys)


def magnitude_keys(values: jax.Array) -> jax.Array:
  """``order_keys(abs(values))`` in fewer operations (no negative scores to flip)."""
  x = lax.abs(lax.convert_element_type(values, jnp.float32))
  keys = lax.bitwise_or(lax.bitcast_convert_type(x, jnp.uint32), np.uint32(0x80000000))
  return lax.select(lax.ne(x, x), _full_like(keys, _NAN_KEY), keys)


def _full_like(x: jax.Array, value: int) -> jax.Array:
  return lax.full(x.shape, value, x.dtype)


def _histogram(digits: jax.Array, keep: jax.Array | None = None) -> jax.Array:
  """Counts of each value in ``[0, _NUM_BINS)`` of the flat ``digits``, where ``keep``.

  From ``_MANY_ENTRIES`` entries on, the scatter-add runs over ``_COPIES``
  histograms, entry ``i`` adding to copy ``i % _COPIES``, summed at the end:
  when most entries share a bin (all-equal or mostly-zero inputs, a few
  distinct values), consecutive increments of one counter would each wait for
  the previous one. Below, clearing and summing the extra copies costs more
  than the waits (266K entries: 1.6 against 2.2 ms a projection, 2.0 against
  2.7 ms with rounded weights). Entries outside ``keep`` get an out-of-range
  index and are dropped by the scatter, which costs less than counting them in
  a spill bin (where they would all collide).
  """
  copies = _COPIES if digits.size >= _MANY_ENTRIES else 1
  index = digits.astype(jnp.int32)
  if copies > 1:
    index = index + (lax.broadcasted_iota(jnp.int32, digits.shape, 0) & (copies - 1)) * _NUM_BINS
  size = copies * _NUM_BINS
  if keep is not None:
    index = jnp.where(keep, index, size)
  hist = jnp.zeros(size, jnp.int32).at[index].add(
      1, mode="promise_in_bounds" if keep is None else "drop")
  return hist.reshape(copies, _NUM_BINS).sum(axis=0)


def _pick_bin(hist: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns the bin holding the k-th largest entry and the count strictly above it.

  Two levels of ``sqrt(_NUM_BINS)`` bins: the row holding the k-th entry from
  cumulative row totals, then the bin inside that row. A cumulative sum over
  all 65536 bins took 0.30 ms on CPU, these two short ones 0.05 ms.
  """
  rows = hist.reshape(_ROW_BINS, _ROW_BINS)
  row_total = rows.sum(axis=1)
  # *_at_or_above[i] = entries in rows (bins) >= i, non-increasing in i.
  rows_at_or_above = jnp.cumsum(row_total[::-1])[::-1]
  r = jnp.sum(rows_at_or_above >= k).astype(jnp.int32) - 1
  row = lax.dynamic_index_in_dim(rows, r, keepdims=False)
  at_or_above = rows_at_or_above[r] - row_total[r] + jnp.cumsum(row[::-1])[::-1]
  c = jnp.sum(at_or_above >= k).astype(jnp.int32) - 1
  return r * _ROW_BINS + c, at_or_above[c] - row[c]


class _Threshold(NamedTuple):
  """The exact k-th largest key and the counts around it."""

  key: jax.Array    # uint32: the k-th largest key t
  above: jax.Array  # int32: entries with key > t
  equal: jax.Array  # int32: entries with key == t
  nan: jax.Array    # bool: any NaN key


def _threshold(flat: jax.Array, k: jax.Array) -> _Threshold:
  """Exact k-th largest key of the flat ``uint32`` array by two 16-bit radix passes."""
  high = flat >> _RADIX_BITS
  hist_high = _histogram(high)
  bin_high, above_high = _pick_bin(hist_high, k)
  hist_low = _histogram(flat & jnp.uint32(_NUM_BINS - 1),
                        keep=high == bin_high.astype(jnp.uint32))
  bin_low, above_low = _pick_bin(hist_low, k - above_high)
  key = (bin_high.astype(jnp.uint32) << _RADIX_BITS) | bin_low.astype(jnp.uint32)
  # Only NaN keys reach the top high bin (+inf is 0xFF800000).
  nan = hist_high[_NAN_KEY >> _RADIX_BITS] > 0
  return _Threshold(key, above_high + above_low, hist_low[bin_low], nan)


def _tie_cut(flat: jax.Array, threshold: jax.Array, ties_to_keep: jax.Array,
             block: int) -> jax.Array:
  """Position just past the ``ties_to_keep``-th entry of ``flat`` equal to ``threshold``.

  Ties are counted per block of ``block`` entries (one fused compare-and-sum
  pass, no scan over the whole array), then ranked by a cumulative sum inside
  the one block where the kept ties run out. ``1 <= ties_to_keep <= ties``.
  """
  n = flat.size
  block = min(block, n)
  full = n // block
  ties = flat == threshold
  per_block = jnp.sum(ties[:full * block].reshape(full, block), axis=1, dtype=jnp.int32)
  if full * block < n:  # the tail is one more, shorter block
    per_block = jnp.append(per_block, jnp.sum(ties[full * block:], dtype=jnp.int32))
  through = jnp.cumsum(per_block)
  cut_block = jnp.sum(through < ties_to_keep, dtype=jnp.int32)
  before = through[cut_block] - per_block[cut_block]
  # dynamic_slice moves a window that would run past the end back inside the
  # array; entries before the block start are then masked out of the count.
  block_start = cut_block * block
  window_start = jnp.minimum(block_start, n - block)
  window = lax.dynamic_slice(ties, (window_start,), (block,))
  position = window_start + lax.iota(jnp.int32, block)
  ranks = before + jnp.cumsum(window & (position >= block_start), dtype=jnp.int32)
  return window_start + jnp.argmax(ranks >= ties_to_keep).astype(jnp.int32) + 1


def topk_masks(
    keys: Sequence[jax.Array], k, *, key_fn: Callable[[jax.Array], jax.Array] | None = None,
    chunk_size: int = 1 << 12,
) -> tuple[list[jax.Array], jax.Array]:
  """Keep-masks for the ``k`` largest keys across all ``keys`` leaves together.

  The leaves are concatenated into one flat array (one copy, so the histogram
  passes are two scatters whatever the leaf count). Two 16-bit radix passes
  find the exact k-th largest key ``t`` without sorting: a histogram of the
  high digit, then one of the low digit among entries in the chosen high bin.
  Entries ``> t`` are kept, plus the first ``k - count(> t)`` entries equal to
  ``t`` in flatten order, found by counting ties per block of ``chunk_size``
  entries only when some ties must be dropped.

  Compile time grows slowly with the leaf count: per leaf there is one
  elementwise kernel (the mask, fused with whatever the caller does with it),
  traced, lowered and compiled once per leaf shape and dtype; what remains per
  leaf is XLA's optimisation of each leaf's copy of it and the leaf's operand
  of the concatenation (``benchmarks/perf/projection.py --parts compile``).

  Args:
    keys: ``uint32`` arrays from :func:`order_keys`, any shapes; or, with
      ``key_fn``, arrays that ``key_fn`` maps to such keys.
    k: number of entries to keep, ``1 <= k <= total size`` (int or traced int32).
    key_fn: elementwise map from the given arrays to keys (e.g.
      ``lambda w: order_keys(jnp.abs(w))``), applied to their concatenation
      and again where each leaf's mask is formed, so keys are never stored per
      leaf (one pass and one compiled kernel per leaf shape fewer). For
      :func:`magnitude_keys` the masks compare the cheaper bits of ``|w|``.
    chunk_size: entries per block when ranking ties at the threshold.

  Returns:
    ``(masks, nan)``: one boolean array per input leaf with exactly ``k``
    ``True`` entries in all, and whether any key is a NaN key (read off the
    histograms, so NaN detection costs no pass of its own).
  """
  to_keys = key_fn if key_fn is not None else _identity
  total = sum(x.size for x in keys)
  if total == 0:
    return [jnp.zeros(x.shape, bool) for x in keys], jnp.bool_(False)
  k = jnp.asarray(k, jnp.int32)
  # Materialised once: fused into both scatters, the concatenation of every leaf
  # would be compiled (and copied) twice.
  keys = [_as_stored(x) for x in keys]
  flat = lax.optimization_barrier(jnp.concatenate([x.reshape(-1) for x in keys if x.size]))
  found = _threshold(to_keys(flat), k)
  threshold = found.key
  ties_to_keep = k - found.above
  # Ties at the threshold are rare for real weights; skip the counting pass then.
  cut = lax.cond(ties_to_keep == found.equal, lambda: jnp.int32(total),
                 lambda: _tie_cut(to_keys(flat), threshold, ties_to_keep, chunk_size))
  # Masks elementwise from each leaf, outside the cond, so the caller's use of a
  # mask (e.g. ``where(mask, leaf, 0)``) fuses with the key computation.
  leaf_keys, bounds = _LEAF_KEYS.get(key_fn, (to_keys, _equal_bounds))
  low, high = bounds(threshold)
  masks, start = [], 0
  for x in keys:
    masks.append(_leaf_mask(x, _row_starts(x.shape, start), low, high, cut, leaf_keys=leaf_keys))
    start += x.size
  return masks, found.nan


def _as_stored(x: jax.Array) -> jax.Array:
  """``x`` rounded to its own dtype, for bf16 / f16 leaves; other leaves unchanged.

  The keys are computed twice, from the concatenation and again in each leaf's
  mask kernel. XLA may keep a low-precision leaf that the caller computes in the
  same program (``params + updates``) in float32 inside a fusion
  (``xla_allow_excess_precision``), so the two computations could see different
  values: a weight tied with the threshold in one could fall below it in the
  other, and the mask would keep fewer than ``k``. ``reduce_precision`` is kept
  by XLA, so both see the values as stored.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
    return x
  info = jnp.finfo(x.dtype)
  return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _identity(x: jax.Array) -> jax.Array:
  return x


def _row_starts(shape: tuple[int, ...], start: int) -> np.ndarray:
  """Flat position of the first entry of each row of a leaf, ``start`` for its first entry.

  An array constant, never a scalar: XLA:CPU bakes scalar constants into the
  kernel, so each leaf would compile a kernel of its own (~30 ms each, compile
  time linear in the leaf count with a large slope), while array constants are
  passed to the kernel as buffers, so every leaf of one shape runs one compiled
  kernel.
  """
  size = math.prod(shape)
  rows = shape[0] if len(shape) >= 2 and size else 1
  cols = size // rows
  return np.asarray(start + np.arange(rows, dtype=np.int64) * cols, np.int32)


def _magnitude_bits(values: jax.Array) -> jax.Array:
  """The float32 bit pattern of ``|values|``: :func:`magnitude_keys` less the sign bit and NaN merge.

  Unsigned order is the order of ``|values|``, every NaN above ``+inf``; NaNs
  differ among themselves, so :func:`_magnitude_bounds` gives the NaN key a
  range.
  """
  return lax.bitcast_convert_type(lax.abs(lax.convert_element_type(values, jnp.float32)),
                                  jnp.uint32)


def _magnitude_bounds(threshold: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The :func:`_magnitude_bits` whose :func:`magnitude_keys` equal ``threshold``: ``[low, high]``."""
  bits = threshold & jnp.uint32(0x7FFFFFFF)
  nan = threshold == jnp.uint32(_NAN_KEY)
  return (jnp.where(nan, jnp.uint32(0x7F800001), bits),
          jnp.where(nan, jnp.uint32(0x7FFFFFFF), bits))


def _equal_bounds(threshold: jax.Array) -> tuple[jax.Array, jax.Array]:
  return threshold, threshold


# Per leaf, the masks compare a cheaper map than the key map given to topk_masks
# when one is known: fewer operations in each leaf's kernel, compiled once per
# shape but optimised (and traced, lowered) once per leaf. ``key_fn -> (leaf map,
# threshold key -> [low, high] of the leaf map's values with that key)``.
_LEAF_KEYS = {magnitude_keys: (_magnitude_bits, _magnitude_bounds)}


@functools.partial(jax.jit, static_argnames=("leaf_keys",))
def _leaf_mask(x: jax.Array, row_starts: jax.Array, low: jax.Array, high: jax.Array,
               cut: jax.Array, *, leaf_keys: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """One leaf's keep-mask: key above the threshold, or equal to it and before ``cut``.

  ``leaf_keys(x)`` in ``[low, high]`` is a key equal to the threshold.
  Jitted on its own so that it is traced and lowered once per leaf shape and
  dtype (XLA inlines the call, so it still fuses with the caller's use of the
  mask); traced inline, every leaf's operations were traced and lowered again.
  """
  key = leaf_keys(x)
  rows = row_starts.shape[0]
  positions = lax.reshape(
      lax.add(lax.broadcast_in_dim(row_starts, (rows, key.size // rows), (0,)),
              lax.broadcasted_iota(jnp.int32, (rows, key.size // rows), 1)), key.shape)
  before_cut = lax.lt(positions, lax.full(key.shape, cut, jnp.int32))
  return lax.bitwise_or(
      lax.gt(key, lax.full(key.shape, high, key.dtype)),
      lax.bitwise_and(lax.ge(key, lax.full(key.shape, low, key.dtype)), before_cut))


def group_topk_mask(keys: jax.Array, k) -> jax.Array:
  """Keep-mask for the ``k`` largest keys in every row of a 2D ``(groups, size)`` array.

  Ties keep the lower column index. ``k`` is an int or a traced int32 shared by
  all rows. Small rows (N:M groups) use pairwise ranks; long rows a stable sort.
  """
  size = keys.shape[-1]
  if size <= 16:
    # rank[i] = #{j : key_j > key_i or (key_j == key_i and j < i)}
    greater = keys[:, None, :] > keys[:, :, None]
    earlier_tie = (keys[:, None, :] == keys[:, :, None]) & jnp.tri(size, k=-1, dtype=bool)
    rank = jnp.sum(greater | earlier_tie, axis=-1)
    return rank < k
  order = jnp.argsort(~keys, axis=-1, stable=True)
  keep_sorted = jnp.broadcast_to(jnp.arange(size) < k, keys.shape)
  return jnp.put_along_axis(
      jnp.zeros(keys.shape, bool), order, keep_sorted, axis=-1, inplace=False
  )
