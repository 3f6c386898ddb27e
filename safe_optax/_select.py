"""Exact top-k selection kernels: radix select across leaves, ranks within groups.

These are the array-level kernels under :func:`safe_optax.project_topk`. Every
kernel returns boolean keep-masks with *exactly* the requested number of
``True`` entries, breaking ties deterministically: among equal scores the entry
that comes first (leaves in pytree-flatten order, entries in row-major order)
is kept.

Scores are compared through :func:`order_keys`, an order-preserving map from
floats to ``uint32``. Every NaN maps to the largest key, so NaN ranks above
``+inf`` and is always kept; callers use :func:`has_nan` to poison the result
instead of keeping or dropping a NaN silently.
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

_RADIX_BITS = 16
_NUM_BINS = 1 << _RADIX_BITS
_NAN_KEY = 0xFFFFFFFF
# Relative nudge applied to a traced (float32) sparsity times count, so that a
# decimal sparsity such as 0.9 (stored as 0.89999998) prunes floor(0.9 * n).
_F32_SNAP = 1.0 + 2.0**-21


def num_keep(size: int, sparsity) -> int | jax.Array:
  """Number of entries kept out of ``size`` at ``sparsity``: ``size - floor(sparsity * size)``.

  A Python ``sparsity`` is read as the decimal it prints as, so ``0.29`` of 100
  prunes exactly 29 (plain float arithmetic gives ``0.29 * 100 = 28.99...``).
  A traced ``sparsity`` is evaluated in float32 with a relative nudge of
  ``2**-21``, which is exact for decimal sparsities while ``size < 2**21``
  and otherwise within ``size * 2**-21`` entries of the decimal answer.

  Args:
    size: number of candidate entries (a Python int).
    sparsity: fraction to prune, in ``[0, 1)``; a Python number or a scalar array.

  Returns:
    A Python int for a Python ``sparsity``, else an int32 scalar array.

  Examples:
    >>> from safe_optax import num_keep
    >>> num_keep(100, 0.29), num_keep(10, 0.95), num_keep(7, 0.0)
    (71, 1, 7)
  """
  if isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool):
    pruned = math.floor(fractions.Fraction(repr(float(sparsity))) * size)
    return size - pruned
  s = jnp.asarray(sparsity, jnp.float32)
  pruned = jnp.floor(s * jnp.float32(size) * _F32_SNAP).astype(jnp.int32)
  pruned = jnp.clip(pruned, 0, size)
  return jnp.int32(size) - pruned


def order_keys(scores: jax.Array) -> jax.Array:
  """Maps float scores to ``uint32`` keys whose unsigned order is the float order.

  Negative floats have all bits flipped, non-negative ones get the sign bit
  set, and every NaN becomes ``0xFFFFFFFF`` (above ``+inf``). ``-0.0`` sorts
  just below ``+0.0``. Low-precision floats are widened to float32 exactly.
  """
  x = scores.astype(jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  sign = jnp.uint32(0x80000000)
  keys = jnp.where((bits & sign) != 0, ~bits, bits | sign)
  return jnp.where(jnp.isnan(x), jnp.uint32(_NAN_KEY), keys)


def has_nan(keys: Sequence[jax.Array]) -> jax.Array:
  """True where any of the ``order_keys`` leaves holds a NaN."""
  flags = [jnp.any(k == jnp.uint32(_NAN_KEY)) for k in keys]
  return jnp.stack(flags).any() if flags else jnp.bool_(False)


def _histogram(digits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """Counts of each 16-bit digit value; entries with ``valid == False`` are not counted."""
  digits = digits.reshape(-1).astype(jnp.int32)
  if valid is not None:
    digits = jnp.where(valid.reshape(-1), digits, _NUM_BINS)
  return jnp.bincount(digits, length=_NUM_BINS + 1)[:_NUM_BINS]


def _pick_bin(hist: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns the bin holding the k-th largest entry and the count strictly above it."""
  # at_or_above[b] = number of entries in bins >= b (non-increasing in b).
  at_or_above = jnp.cumsum(hist[::-1])[::-1]
  b = jnp.sum(at_or_above >= k).astype(jnp.int32) - 1
  return b, at_or_above[b] - hist[b]


def _chunks(sizes: Sequence[int], cap: int) -> list[list[int]]:
  """Groups consecutive leaf indices so each group holds at most ``cap`` entries.

  A leaf larger than ``cap`` forms its own group. Grouping small leaves bounds
  the number of histogram ops (and compile time) for models with hundreds of
  leaves while never copying more than ``cap`` entries at a time.
  """
  groups: list[list[int]] = []
  total = cap
  for i, size in enumerate(sizes):
    if total + size > cap:
      groups.append([])
      total = 0
    groups[-1].append(i)
    total += size
  return groups


def topk_masks(keys: Sequence[jax.Array], k, *, chunk_size: int = 1 << 22) -> list[jax.Array]:
  """Keep-masks for the ``k`` largest keys across all ``keys`` leaves together.

  Two 16-bit radix passes find the exact k-th largest key ``t`` without
  sorting: histograms of the high digit are summed across leaves, then the
  low digit is histogrammed among entries in the chosen high bin. Entries
  ``> t`` are kept, plus the first ``k - count(> t)`` entries equal to ``t``
  in flatten order. Consecutive small leaves are processed in chunks of at
  most ``chunk_size`` entries; larger leaves are never copied.

  Args:
    keys: ``uint32`` arrays from :func:`order_keys`, any shapes.
    k: number of entries to keep, ``1 <= k <= total size`` (int or traced int32).
    chunk_size: most entries gathered into one chunk of small leaves.

  Returns:
    One boolean array per input leaf with exactly ``k`` ``True`` entries in all.
  """
  k = jnp.asarray(k, jnp.int32)
  groups = _chunks([key.size for key in keys], chunk_size)
  chunks = [
      keys[g[0]].reshape(-1) if len(g) == 1
      else jnp.concatenate([keys[i].reshape(-1) for i in g])
      for g in groups
  ]
  high = [chunk >> _RADIX_BITS for chunk in chunks]
  hist_high = sum(_histogram(h) for h in high)
  bin_high, above_high = _pick_bin(hist_high, k)
  hist_low = sum(
      _histogram(chunk & jnp.uint32(_NUM_BINS - 1), h == bin_high.astype(jnp.uint32))
      for chunk, h in zip(chunks, high)
  )
  bin_low, above_low = _pick_bin(hist_low, k - above_high)
  threshold = (bin_high.astype(jnp.uint32) << _RADIX_BITS) | bin_low.astype(jnp.uint32)
  ties_to_keep = k - above_high - above_low

  def without_tie_break():
    return [chunk >= threshold for chunk in chunks]

  def with_tie_break():
    masks, offset = [], jnp.int32(0)
    for chunk in chunks:
      ties = chunk == threshold
      rank = jnp.cumsum(ties, dtype=jnp.int32) - 1 + offset
      masks.append((chunk > threshold) | (ties & (rank < ties_to_keep)))
      offset = offset + jnp.sum(ties, dtype=jnp.int32)
    return masks

  # Ties at the threshold are rare for real weights; skip the cumsum pass then.
  chunk_masks = lax.cond(
      ties_to_keep == hist_low[bin_low], without_tie_break, with_tie_break
  )
  masks: list[jax.Array] = [None] * len(keys)  # type: ignore[list-item]
  for g, chunk_mask in zip(groups, chunk_masks):
    start = 0
    for i in g:
      masks[i] = chunk_mask[start:start + keys[i].size].reshape(keys[i].shape)
      start += keys[i].size
  return masks


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
