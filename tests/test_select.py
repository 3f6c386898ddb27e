"""Tests for the radix-select kernel (`safe_optax._select.topk_masks`) against numpy.

The reference is a plain stable sort: concatenate the leaves in the order given
(row-major within a leaf), order by (NaN first, score descending, position
ascending) with ``-0.0 == +0.0``, and keep the first ``k``. The kernel must
return exactly that mask, for every ``k`` from 1 (sparsity near 1) to the total
size (sparsity 0), whatever the ties. The per-row kernel
(`_select.group_topk_mask`, N:M groups and Wanda's per-output rows) is checked
the same way, row by row, for every ``k`` from 0 to the row length.

Every new leaf shape costs a jit compilation, so property tests draw values
for a handful of fixed leaf layouts and vary ``k`` as traced data.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import safe_optax
from safe_optax import _select

SPECIALS = (np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0,
            np.finfo(np.float32).max, -np.finfo(np.float32).max,
            np.finfo(np.float32).tiny, float(np.nextafter(np.float32(1), np.float32(2))))


def reference_keep(leaves: list[np.ndarray], k: int) -> np.ndarray:
  """Flat keep-mask of the k largest scores: NaN first, then larger, then earlier."""
  s = np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])
  nan = np.isnan(s)
  value = np.where(nan, 0.0, s) + 0.0  # + 0.0 turns -0.0 into +0.0
  order = np.lexsort((np.arange(s.size), -value, ~nan))  # last key is the primary one
  keep = np.zeros(s.size, bool)
  keep[order[:k]] = True
  return keep


@jax.jit
def _masks(leaves, k):
  return _select.topk_masks([_select.order_keys(x) for x in leaves], k)


def check(leaves: list[np.ndarray], k: int) -> None:
  masks, nan = _masks([jnp.asarray(x) for x in leaves], jnp.int32(k))
  for mask, leaf in zip(masks, leaves):
    assert mask.shape == leaf.shape and mask.dtype == jnp.bool_
  got = np.concatenate([np.asarray(m).ravel() for m in masks])
  assert int(got.sum()) == k
  np.testing.assert_array_equal(got, reference_keep(leaves, k))
  assert bool(nan) == any(np.isnan(x).any() for x in leaves)


# Leaf layouts: a single leaf, odd shapes with a scalar and empty leaves, many small leaves.
LAYOUTS = {
    "single": [(7, 5)],
    "odd": [(3,), (), (2, 0), (5, 1, 3), (1,), (4, 4)],
    "many_small": [(1,), (2,), (3,), (1, 1)] * 10,
}

values_from = {
    "few_distinct": st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, 0.5]),
    "specials": st.sampled_from(SPECIALS),
    "any_float32": st.floats(width=32, allow_nan=True, allow_infinity=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("values", list(values_from))
@given(data=st.data())
def test_topk_masks_matches_the_sort_reference(layout, values, data):
  shapes = LAYOUTS[layout]
  leaves = [np.array(data.draw(st.lists(values_from[values], min_size=math.prod(shape),
                                        max_size=math.prod(shape))),
                     np.float32).reshape(shape) for shape in shapes]
  n = sum(x.size for x in leaves)
  k = data.draw(st.one_of(st.just(1), st.just(n), st.integers(1, n)))
  check(leaves, k)


@pytest.mark.parametrize("k_of_n", [lambda n: 1, lambda n: n // 2, lambda n: n - 1, lambda n: n],
                         ids=["one", "half", "all_but_one", "all"])
@pytest.mark.parametrize("value", [0.0, -0.0, 3.0, np.inf, np.nan])
def test_all_equal_inputs_keep_the_first_k(k_of_n, value):
  leaves = [np.full((5, 3), value, np.float32), np.full((4,), value, np.float32),
            np.full((2, 2, 2), value, np.float32)]
  n = sum(x.size for x in leaves)
  check(leaves, k_of_n(n))


def test_zero_signs_tie():
  """-0.0 and +0.0 are one score: the earlier one is kept whatever its sign."""
  leaves = [np.array([-0.0, 0.0, -0.0, 0.0], np.float32), np.array([[0.0, -0.0]], np.float32)]
  for k in range(1, 7):
    check(leaves, k)


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
@given(data=st.data())
def test_tie_cut_carries_across_blocks_and_leaves(block, data):
  """Ties are ranked in blocks of ``chunk_size`` entries; the rank must carry across both."""
  sizes = (2, 3, 2, 10, 1, 1, 40)
  seed = data.draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  leaves = [rng.integers(0, 3, s).astype(np.float32) for s in sizes]
  k = data.draw(st.integers(1, sum(sizes)))
  masks, _ = _masks_blocks(tuple(jnp.asarray(x) for x in leaves), jnp.int32(k), block)
  got = np.concatenate([np.asarray(m) for m in masks])
  np.testing.assert_array_equal(got, reference_keep(leaves, k))


@jax.jit(static_argnums=2)
def _masks_blocks(leaves, k, block):
  return _select.topk_masks([_select.order_keys(x) for x in leaves], k, chunk_size=block)


@pytest.mark.parametrize("decimals", [2, None], ids=["rounded", "continuous"])
def test_model_sized_tree_with_ties(decimals):
  """300K entries in VGG-like leaves; rounded weights put ~10^4 ties at the threshold."""
  rng = np.random.default_rng(0)
  shapes = [(3, 3, 3, 64), (3, 3, 64, 64), (3, 3, 64, 128), (3, 3, 128, 128), (128, 10)]
  leaves = [0.05 * rng.standard_normal(s).astype(np.float32) for s in shapes]
  if decimals is not None:
    leaves = [np.round(x, decimals) for x in leaves]
  n = sum(x.size for x in leaves)
  for sparsity in (0.0, 0.5, 0.9, 0.999):
    k = safe_optax.num_keep(n, sparsity)
    scores = [np.abs(x) for x in leaves]
    check(scores, k)


def test_project_topk_global_uses_the_kernel_order():
  """Through the public API: |w| ranks, exact count, ties to the earlier leaf / entry."""
  tree = {"a": jnp.array([[1.0, -2.0], [2.0, 0.5]]), "b": jnp.array([[-2.0, 3.0, 0.5]])}
  _, masks = jax.jit(lambda t, s: safe_optax.project_topk(t, s))(tree, jnp.float32(0.6))
  # 7 entries, keep 3: the 3, then two of the three 2s (leaf "a" comes first).
  np.testing.assert_array_equal(masks["a"], [[False, True], [True, False]])
  np.testing.assert_array_equal(masks["b"], [[False, True, False]])


def _scatter_count(num_leaves: int) -> int:
  # Large enough that no leaf would be grouped with another.
  leaves = [jax.ShapeDtypeStruct((300, 300 + i), jnp.float32) for i in range(num_leaves)]
  text = jax.jit(_masks).lower(leaves, jax.ShapeDtypeStruct((), jnp.int32)).as_text()
  return text.count("stablehlo.scatter")


def test_histogram_ops_do_not_grow_with_the_leaf_count():
  """Compile time stays flat in the leaf count: the kernel emits a fixed number of scatters."""
  assert _scatter_count(3) == _scatter_count(60)


# --------------------------------------------------------------------------- #
# Many leaves, mixed shapes and dtypes, keys computed by the kernel (key_fn)  #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@given(data=st.data())
def test_magnitude_keys_are_order_keys_of_abs(dtype, data):
  values = data.draw(st.lists(st.one_of(st.sampled_from(SPECIALS),
                                        st.floats(width=32, allow_nan=True)), min_size=1,
                              max_size=40))
  with np.errstate(over="ignore"):  # float32 max overflows to inf in float16: fine here
    x = jnp.asarray(np.array(values, np.float32).astype(dtype))
  np.testing.assert_array_equal(_select.magnitude_keys(x), _select.order_keys(jnp.abs(x)))


# Repeated shapes (one compiled mask kernel per shape, each leaf with its own
# positions), one-row and one-column leaves, a scalar, empty leaves, three
# float dtypes: 35 leaves.
MIXED = [((3, 4), np.float32), ((1, 6), jnp.bfloat16), ((3, 4), np.float32), ((2, 0), np.float32),
         ((3, 4), np.float16), ((), np.float32), ((5, 1), np.float32)] * 5


@jax.jit
def _magnitude_masks(leaves, k):
  return _select.topk_masks(leaves, k, key_fn=_select.magnitude_keys)


@pytest.mark.slow
@pytest.mark.parametrize("values", ["few_distinct", "any_float32"])
@given(data=st.data())
def test_many_mixed_leaves_with_key_fn_match_the_sort_reference(values, data):
  """Ranking by |x| through ``key_fn`` equals the reference on |x|, ties across leaves included."""
  with np.errstate(over="ignore"):  # float32 max overflows to inf in float16: fine here
    leaves = [np.array(data.draw(st.lists(values_from[values], min_size=math.prod(shape),
                                          max_size=math.prod(shape))),
                       np.float32).reshape(shape).astype(dtype) for shape, dtype in MIXED]
  n = sum(x.size for x in leaves)
  k = data.draw(st.one_of(st.just(1), st.just(n), st.integers(1, n)))
  masks, nan = _magnitude_masks([jnp.asarray(x) for x in leaves], jnp.int32(k))
  for mask, leaf in zip(masks, leaves):
    assert mask.shape == leaf.shape and mask.dtype == jnp.bool_
  got = np.concatenate([np.asarray(m).ravel() for m in masks])
  assert int(got.sum()) == k
  magnitudes = [np.abs(np.asarray(x, np.float64)) for x in leaves]
  np.testing.assert_array_equal(got, reference_keep(magnitudes, k))
  assert bool(nan) == any(np.isnan(x).any() for x in magnitudes)


def _per_leaf_kernels(num_leaves: int) -> int:
  """Distinct compiled computations that touch a leaf-shaped array, for equal-shape leaves."""
  leaves = [jax.ShapeDtypeStruct((6, 7), jnp.float32)] * num_leaves

  def project(ws, k):
    masks, _ = _select.topk_masks(ws, k, key_fn=_select.magnitude_keys)
    return [jnp.where(m, w, 0.0) for m, w in zip(masks, ws)]

  text = jax.jit(project).lower(leaves, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
  bodies = set()
  for computation in text.split("\n\n"):
    header, _, body = computation.strip().partition("\n")
    if header.startswith("%") and "[6,7]" in header:
      # Names and metadata differ between copies of one computation; bodies do not.
      bodies.add(re.sub(r"%[\w.\-]+", "%x", re.sub(r", metadata=\{[^}]*\}", "", body)))
  return len(bodies)


def test_compiled_per_leaf_kernels_do_not_grow_with_the_leaf_count():
  """Equal-shape leaves share compiled kernels (each new one costs ~30 ms of compile time).

  A per-leaf offset baked in as a scalar constant would give every leaf a
  kernel of its own (the count would grow with the leaves).
  """
  assert _per_leaf_kernels(40) == _per_leaf_kernels(12) <= 3


@pytest.mark.parametrize("size", [1000, _select._MANY_ENTRIES + 7], ids=["one_copy", "copies"])
@pytest.mark.parametrize("with_keep", [False, True])
def test_histogram_counts_like_bincount(size, with_keep):
  """Both histogram layouts (one copy for small inputs, interleaved copies for large)."""
  rng = np.random.default_rng(size)
  # Few distinct digits, so many entries collide in one bin (the case the copies are for).
  digits = rng.choice(np.array([0, 1, 7, _select._NUM_BINS - 1], np.uint32), size)
  keep = rng.random(size) < 0.5 if with_keep else None
  got = jax.jit(_select._histogram)(jnp.asarray(digits), None if keep is None else jnp.asarray(keep))
  want = np.bincount(digits[keep] if with_keep else digits, minlength=_select._NUM_BINS)
  np.testing.assert_array_equal(got, want)


_pick_bin = jax.jit(_select._pick_bin)


@given(data=st.data())
def test_pick_bin_matches_suffix_sums(data):
  """The two-level bin pick equals a plain suffix-sum search (bins at row edges included)."""
  bins = data.draw(st.lists(st.one_of(st.sampled_from([0, 255, 256, 65279, 65280, 65535]),
                                      st.integers(0, _select._NUM_BINS - 1)),
                            min_size=1, max_size=8), label="bins")
  counts = data.draw(st.lists(st.integers(1, 50), min_size=len(bins), max_size=len(bins)))
  hist = np.zeros(_select._NUM_BINS, np.int32)
  np.add.at(hist, bins, counts)
  k = data.draw(st.integers(1, int(hist.sum())), label="k")
  at_or_above = np.cumsum(hist[::-1])[::-1]
  want = int(np.flatnonzero(at_or_above >= k)[-1])
  b, above = _pick_bin(jnp.asarray(hist), jnp.int32(k))
  assert (int(b), int(above)) == (want, int(at_or_above[want] - hist[want]))


# Keys next to the edges of the uint32 range and of the radix passes, drawn often.
_EDGE_KEYS = (0, 1, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFE, 0xFFFFFFFF, 0x8000FFFF)


def ref_group_keep(keys: np.ndarray, k: int) -> np.ndarray:
  """Per row: the k largest unsigned keys, ties to the lower column (a stable sort)."""
  order = np.argsort(-keys.astype(np.int64), axis=-1, kind="stable")
  keep = np.zeros(keys.shape, bool)
  np.put_along_axis(keep, order[:, :k], True, axis=-1)
  return keep


@pytest.mark.parametrize("rows,size,k", [(0, 20, 3), (1, 1, 1), (1, 17, 0), (1, 40, 40),
                                          (3, 16, 16), (2, 17, 17)])
def test_group_topk_mask_empty_single_none_and_all(rows, size, k):
  keys = np.arange(rows * size, dtype=np.uint32).reshape(rows, size) % 3
  got = np.asarray(_group_mask(jnp.asarray(keys), jnp.int32(k)))
  np.testing.assert_array_equal(got, ref_group_keep(keys, k))


@given(data=st.data())
def test_group_topk_mask_matches_a_stable_sort(data):
  """Kernel level: rows of any length, any k in [0, size], heavy ties, NaN and edge keys.

  Rows of at most 16 entries take the pairwise-rank path, longer ones the
  long-row path; ``k`` is traced, so one program serves every count.
  """
  rows = data.draw(st.integers(1, 5), label="rows")
  size = data.draw(st.sampled_from([2, 5, 16, 17, 31, 64, 257]), label="size")
  pool = data.draw(st.lists(st.one_of(st.sampled_from(_EDGE_KEYS),
                                      st.integers(0, 2**32 - 1)), min_size=1, max_size=6),
                   label="distinct keys")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  keys = rng.choice(np.asarray(pool, np.uint32), (rows, size))
  k = data.draw(st.integers(0, size), label="k")
  got = np.asarray(_group_mask(jnp.asarray(keys), jnp.int32(k)))
  np.testing.assert_array_equal(got, ref_group_keep(keys, k))
  assert (got.sum(-1) == k).all()


@jax.jit
def _group_mask(keys, k):
  return _select.group_topk_mask(keys, k)
