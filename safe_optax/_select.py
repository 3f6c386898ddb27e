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
How many entries to keep is ``_counts.py``'s job.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

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
  all rows, ``0 <= k <= size``. Small rows (N:M groups) use pairwise ranks; long
  rows (Wanda's per-output rows) find each row's k-th largest key by a bitwise
  binary search (:func:`_row_thresholds`), with no sort.
  """
  size = keys.shape[-1]
  if size <= 16:
    # rank[i] = #{j : key_j > key_i or (key_j == key_i and j < i)}
    greater = keys[:, None, :] > keys[:, :, None]
    earlier_tie = (keys[:, None, :] == keys[:, :, None]) & jnp.tri(size, k=-1, dtype=bool)
    rank = jnp.sum(greater | earlier_tie, axis=-1)
    return rank < k
  k = jnp.asarray(k, jnp.int32)
  threshold = _row_thresholds(keys, k)[:, None]
  above = keys > threshold
  ties = keys == threshold
  # Ties at a row's threshold to keep: the first ones in the row. Rare for real
  # weights, so the running count is skipped when every row keeps all of them.
  need = (k - jnp.sum(above, axis=-1, dtype=jnp.int32))[:, None]
  all_ties = jnp.all(need == jnp.sum(ties, axis=-1, dtype=jnp.int32, keepdims=True))
  first = lax.cond(all_ties, lambda: ties,
                   lambda: ties & (jnp.cumsum(ties, axis=-1, dtype=jnp.int32) <= need))
  return above | first


def _row_thresholds(keys: jax.Array, k: jax.Array) -> jax.Array:
  """Each row's k-th largest ``uint32`` key: the largest ``t`` with ``#{key >= t} >= k``.

  Decided one bit at a time from the top, 32 passes of a fused compare and row
  count, with no sort (against the stable row sort it replaced:
  ``benchmarks/perf/results/projection_per_output.json``). ``k = 0`` gives the
  largest key, so nothing is above it and no tie is kept.
  """

  def bit(i, prefix):
    candidate = prefix | (jnp.uint32(0x80000000) >> i.astype(jnp.uint32))
    count = jnp.sum(keys >= candidate[:, None], axis=-1, dtype=jnp.int32)
    return jnp.where(count >= k, candidate, prefix)

  return lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:1], jnp.uint32))
