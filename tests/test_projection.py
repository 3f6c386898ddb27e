"""Tests for the exact top-k projection kernels (`project_topk`, `num_keep`, prunable selection).

Everything is checked against a plain numpy reference:

* unstructured: concatenate the prunable leaves of a scope in `jax.tree` flatten
  order (row-major within a leaf) and keep the first ``k`` entries of a stable
  ``(NaN first, score descending, position ascending)`` ordering;
* N:M / PerOutput: the same ranking inside every group, groups built with
  ``np.ndindex`` (so the order inside a group is the lower index first).

Masks must match exactly, projected values bit for bit (so ``-0.0`` kept stays
``-0.0``, dropped entries are ``+0.0``), and a NaN value or score must show as
NaN at its own entry (kept or not) and nowhere else.

Compilation dominates the runtime (each new shape / static argument compiles the
radix-select kernel, 1-3 s on CPU), so the property tests draw from a handful of
fixed tree templates and use a traced sparsity (one compilation per template,
scope and scores/no-scores) while hypothesis varies the values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import safe_optax
from safe_optax import _select
from safe_optax import (NM, Global, PerLeaf, PerOutput, default_prunable, num_keep, project_topk,
                        prunable_mask)

F32, F16, BF16, I32 = np.float32, np.float16, jnp.bfloat16, np.int32


# --------------------------------------------------------------------------- #
# Reference implementation                                                    #
# --------------------------------------------------------------------------- #


def keep_decimal(n: int, sparsity: str | Fraction) -> int:
  """Kept count for a decimal sparsity given as a string: n - floor(s * n), exactly."""
  return n - math.floor(Fraction(sparsity) * n)


def keep_traced(n: int, sparsity: float) -> int:
  """Kept count the contract promises for a traced (float32) sparsity."""
  return int(num_keep(n, jnp.float32(sparsity)))


def to_f64(x) -> np.ndarray:
  """Exact float64 copy of a float16/bfloat16/float32 array (via float32, exact)."""
  return np.asarray(x).astype(np.float32).astype(np.float64)


def ref_keep(score, k: int) -> np.ndarray:
  """Flat mask keeping the k highest scores; NaN ranks highest; ties: earlier wins."""
  s = np.asarray(score, np.float64).ravel()
  nan = np.isnan(s)
  v = np.where(nan, 0.0, s)
  # np.lexsort: the LAST key is the primary one. NaN first, then larger score,
  # then smaller position. -0.0 and +0.0 compare equal here.
  order = np.lexsort((np.arange(s.size), -v, ~nan))
  keep = np.zeros(s.size, bool)
  keep[order[:k]] = True
  return keep


def is_default_prunable(leaf) -> bool:
  return jnp.issubdtype(np.asarray(leaf).dtype, jnp.floating) and np.ndim(leaf) >= 2


def leaf_score(leaf, score) -> np.ndarray:
  return np.abs(to_f64(leaf)) if score is None else to_f64(score)


def ref_unstructured(leaves, flags, score_leaves, scope, k_of):
  """Reference (projected, masks, NaN entries) lists for global / per_leaf scope."""
  pruned = [i for i, f in enumerate(flags) if f]
  groups = [pruned] if scope == "global" else [[i] for i in pruned]
  masks = [np.ones(np.shape(x), bool) for x in leaves]
  projected = [np.asarray(x) for x in leaves]
  nan_entries = [np.zeros(np.shape(x), bool) for x in leaves]
  for group in groups:
    flat = np.concatenate([leaf_score(leaves[i], score_leaves[i]).ravel() for i in group])
    keep = ref_keep(flat, k_of(flat.size))
    offset = 0
    for i in group:
      leaf = np.asarray(leaves[i])
      masks[i] = keep[offset:offset + leaf.size].reshape(leaf.shape)
      offset += leaf.size
      nan_entries[i] = _ref_nan_entries(leaf, score_leaves[i])
      projected[i] = _ref_apply(leaf, masks[i], nan_entries[i])
  return projected, masks, nan_entries


def _ref_nan_entries(leaf, score):
  """Entries whose value or score is NaN: NaN in the projection, kept or not."""
  return np.isnan(to_f64(leaf)) | np.isnan(leaf_score(leaf, score))


def _ref_apply(leaf, mask, nan_entries):
  kept = np.where(mask, leaf, np.zeros((), leaf.dtype)).astype(leaf.dtype)
  return np.where(nan_entries, np.array(np.nan, leaf.dtype), kept).astype(leaf.dtype)


def ref_groups(shape, structure):
  """Lists of index tuples, one list per group, members in increasing index order."""
  axis = structure.axis % len(shape)
  groups: dict[Any, list] = {}
  for idx in np.ndindex(*shape):
    if isinstance(structure, NM):
      key = (idx[:axis] + idx[axis + 1:], idx[axis] // structure.m)
    else:
      key = idx[axis]
    groups.setdefault(key, []).append(idx)
  return list(groups.values())


def ref_structured(leaves, flags, score_leaves, structure, sparsity: str | None):
  masks = [np.ones(np.shape(x), bool) for x in leaves]
  projected = [np.asarray(x) for x in leaves]
  nan_entries = [np.zeros(np.shape(x), bool) for x in leaves]
  for i, flag in enumerate(flags):
    if not flag:
      continue
    leaf = np.asarray(leaves[i])
    score = leaf_score(leaf, score_leaves[i])
    mask = np.zeros(leaf.shape, bool)
    for members in ref_groups(leaf.shape, structure):
      k = structure.n if isinstance(structure, NM) else keep_decimal(len(members), sparsity)
      keep = ref_keep([score[idx] for idx in members], k)
      for idx, kept in zip(members, keep):
        mask[idx] = kept
    masks[i], nan_entries[i] = mask, _ref_nan_entries(leaf, score_leaves[i])
    projected[i] = _ref_apply(leaf, mask, nan_entries[i])
  return projected, masks, nan_entries


def bits(x) -> np.ndarray:
  x = np.ascontiguousarray(np.asarray(x))
  return x.view(f"u{x.dtype.itemsize}")


def assert_matches(out, masks, treedef, leaves, ref):
  """Compares a project_topk result with a reference (projected, masks, NaN entries)."""
  ref_projected, ref_masks, ref_nan_entries = ref
  assert jax.tree.structure(out) == treedef
  assert jax.tree.structure(masks) == treedef
  got_leaves, got_masks = jax.tree.leaves(out), jax.tree.leaves(masks)
  assert len(got_leaves) == len(leaves) == len(got_masks)
  for i, (leaf, got, got_mask, want, want_mask, nan_entries) in enumerate(
      zip(leaves, got_leaves, got_masks, ref_projected, ref_masks, ref_nan_entries)):
    got, got_mask = np.asarray(got), np.asarray(got_mask)
    assert got_mask.dtype == np.bool_ and got_mask.shape == np.shape(leaf), i
    np.testing.assert_array_equal(got_mask, want_mask, err_msg=f"mask of leaf {i}")
    assert got.dtype == np.asarray(leaf).dtype, (i, got.dtype)
    assert got.shape == np.shape(leaf), i
    # NaN exactly where the reference has it (a prunable leaf's NaN entries, or a
    # NaN passed through in a dense leaf); every other entry bit for bit.
    got_nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(got_nan, np.isnan(want.astype(np.float32)),
                                  err_msg=f"NaN entries of leaf {i}")
    assert not (nan_entries & ~got_nan).any(), i
    np.testing.assert_array_equal(bits(got)[~got_nan], bits(want)[~got_nan],
                                  err_msg=f"values of leaf {i}")


def assert_optimal(score_flat, keep_flat):
  """Every kept score >= every dropped score (NaN-free scores)."""
  kept, dropped = score_flat[keep_flat], score_flat[~keep_flat]
  if kept.size and dropped.size:
    assert kept.min() >= dropped.max()


# --------------------------------------------------------------------------- #
# Tree templates and value generation                                         #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Block:
  kernel: Any
  bias: Any
  scale: Any


jax.tree_util.register_dataclass(Block, data_fields=["kernel", "bias", "scale"], meta_fields=[])


class Pair(NamedTuple):
  block: Any
  step: Any


TEMPLATES = {
    # a bare array is a single-leaf tree
    "bare": lambda mk: mk((5, 7), F32),
    # Linen-like params; keys deliberately not in sorted order
    "linen": lambda mk: {"params": {
        "Dense_0": {"kernel": mk((9, 13), F32), "bias": mk((13,), F32)},
        "Conv_0": {"kernel": mk((7, 1, 3), BF16), "bias": mk((3,), BF16)},
    }},
    # tuple / list containers, float16 and bfloat16, an int matrix (not prunable)
    "tuple": lambda mk: (mk((4, 4), F16), [mk((2, 3, 4), F32), mk((5,), F32)],
                         mk((3, 3), I32), mk((1, 1), BF16)),
    # registered dataclass inside a NamedTuple: one prunable leaf among non-prunable ones
    "custom": lambda mk: Pair(Block(mk((16, 8), F32), mk((8,), F32), mk((), F32)), mk((3, 3), I32)),
}

VALUE_KINDS = ("ties", "ties", "normal", "const", "signed_zero", "specials", "denormal", "adjacent")


def make_values(rng, kind, shape, dtype) -> np.ndarray:
  if not jnp.issubdtype(dtype, jnp.floating):
    return rng.integers(-5, 6, shape).astype(dtype)
  if kind == "ties":  # many exact ties, including |-2| == |2| and zeros
    x = rng.integers(-3, 4, shape).astype(np.float32)
  elif kind == "normal":
    x = rng.standard_normal(shape).astype(np.float32)
  elif kind == "const":  # an all-equal leaf
    x = np.full(shape, rng.choice([-1.5, 0.0, -0.0, 2.0]), np.float32)
  elif kind == "signed_zero":
    x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0], np.float32), shape)
  elif kind == "specials":
    x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 3.0, np.inf, -np.inf], np.float32), shape)
  elif kind == "adjacent":  # neighbouring float32 values: differ only in the last mantissa bits
    x = (1.0 + rng.integers(0, 6, shape) * 2.0**-23) * rng.choice([-1.0, 1.0], shape)
  elif kind == "denormal":
    x = rng.choice(np.array([0.0, -0.0, 1e-45, -1e-45, 3e-45, 1e-39, -1e-39, 1.0], np.float32), shape)
  else:
    raise AssertionError(kind)
  return np.asarray(x, np.float32).astype(dtype)


def make_scores(rng, kind, shape) -> np.ndarray:
  if kind == "ties":
    s = rng.integers(-2, 3, shape).astype(np.float32)
  elif kind == "adjacent":
    s = np.float32(2.0) + rng.integers(-3, 4, shape).astype(np.float32) * np.float32(2.0**-22)
  elif kind == "const":
    s = np.full(shape, 0.5, np.float32)
  else:
    s = rng.standard_normal(shape).astype(np.float32)
  # `+ 0.0` turns -0.0 into +0.0: the library orders -0.0 below +0.0 (see
  # test_negative_zero_scores_tie_with_positive_zero), kept out of the property tests.
  return s + np.float32(0.0)


class Case(NamedTuple):
  tree: Any
  scores: Any
  treedef: Any
  leaves: list
  score_leaves: list
  flags: list


def draw_case(data, template, *, use_scores: bool, allow_nan: bool = True) -> Case:
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))

  def mk(shape, dtype):
    return make_values(rng, data.draw(st.sampled_from(VALUE_KINDS), label="kind"), shape, dtype)

  leaves, treedef = jax.tree.flatten(template(mk))
  flags = [is_default_prunable(x) for x in leaves]
  score_leaves = [None] * len(leaves)
  if use_scores:
    kind = data.draw(st.sampled_from(["ties", "normal", "const", "adjacent"]), label="score kind")
    sdtype = data.draw(st.sampled_from([F32, F32, BF16]), label="score dtype")
    score_leaves = [make_scores(rng, kind, np.shape(x)).astype(sdtype) if f else None
                    for x, f in zip(leaves, flags)]
  # NaN in a non-prunable float leaf must change nothing; in a prunable value or
  # score it poisons the scope.
  dense = [j for j, (x, f) in enumerate(zip(leaves, flags))
           if not f and np.size(x) and jnp.issubdtype(np.asarray(x).dtype, jnp.floating)]
  choices = ["none"] * 4 + ["value"] + ["score"] * use_scores + ["dense"] * bool(dense)
  nan_at = data.draw(st.sampled_from(choices if allow_nan else ["none"]), label="nan")
  if nan_at != "none":
    candidates = dense if nan_at == "dense" else [j for j, f in enumerate(flags) if f]
    i = data.draw(st.sampled_from(candidates), label="nan leaf")
    target = score_leaves if nan_at == "score" else leaves
    target[i] = np.array(target[i], copy=True)
    target[i].flat[rng.integers(target[i].size)] = np.nan
  tree = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])
  scores = None
  if use_scores:
    scores = jax.tree.unflatten(treedef, [None if s is None else jnp.asarray(s) for s in score_leaves])
  return Case(tree, scores, treedef, leaves, score_leaves, flags)


# The reference's names for the unstructured structures.
UNSTRUCTURED = {"global": Global(), "per_leaf": PerLeaf()}


@functools.partial(jax.jit, static_argnames=("structure",))
def jit_project(tree, sparsity, scores, structure=Global()):
  """project_topk under jit with a traced sparsity (one compilation per template/config)."""
  return project_topk(tree, sparsity, structure=structure, scores=scores)


DECIMALS = ("0", "0.1", "0.29", "0.5", "0.75", "0.9", "0.999")
sparsities = st.one_of(st.sampled_from(DECIMALS), st.floats(0.0, 0.999).map(lambda s: float(np.float32(s))))


# --------------------------------------------------------------------------- #
# num_keep                                                                    #
# --------------------------------------------------------------------------- #


def test_num_keep_examples():
  assert num_keep(100, 0.29) == 71  # plain float arithmetic gives 0.29 * 100 = 28.99...
  assert num_keep(10, 0.95) == 1
  assert num_keep(7, 0.0) == 7
  assert num_keep(1, 0.999) == 1
  assert num_keep(1000, 0.999) == 1
  assert num_keep(100, 0.57) == 43
  assert num_keep(100, 0) == 100
  assert type(num_keep(100, 0.29)) is int


@given(n=st.integers(1, 10**7), digits=st.integers(1, 4), data=st.data())
def test_num_keep_python_float_reads_decimal(n, digits, data):
  numerator = data.draw(st.integers(0, 10**digits - 1))
  text = f"0.{numerator:0{digits}d}"
  assert num_keep(n, float(text)) == keep_decimal(n, text)


def keep_traced_reference(n, s32):
  """The documented float32 rule: prune floor((s + ulp(s) / 2) * n), keep at least one."""
  s = np.float32(s32)
  upper = Fraction(float(s)) + Fraction(float(np.spacing(s))) / 2
  return n - min(math.floor(upper * n), n - 1)


@given(n=st.integers(1, 2**31 - 1), s=st.floats(0.0, 1.0, exclude_max=True, width=32))
@example(n=3001, s=0.999)
@example(n=1_100_001, s=0.9)
@example(n=2**31 - 1, s=0.9)
@example(n=10**6, s=0.9999999)
def test_num_keep_traced_follows_the_float32_rule_exactly(n, s):
  got = num_keep(n, jnp.float32(s))
  assert got.dtype == jnp.int32 and got.shape == ()
  assert int(got) == keep_traced_reference(n, s), (n, s)


@given(n=st.integers(1, 2**21 - 1), digits=st.integers(1, 4), data=st.data())
@example(n=3001, digits=3, data=None)  # 0.999 * 3001 = 2997.999 -> keep 4
@example(n=1_100_001, digits=1, data=None)  # 0.9 * n = 990000.9 -> keep 110001
def test_num_keep_traced_matches_decimal_unless_just_below_an_integer(n, digits, data):
  """Documented: the decimal answer unless sparsity * n lies within n * ulp(s) below an integer."""
  if data is None:  # explicit examples
    text = {3: "0.999", 1: "0.9"}[digits]
  else:
    numerator = data.draw(st.integers(0, 10**digits - 1))
    text = f"0.{numerator:0{digits}d}"
  got = int(num_keep(n, jnp.float32(float(text))))
  product = Fraction(text) * n
  gap = math.ceil(product) - product
  if gap == 0 or gap > n * float(np.spacing(np.float32(float(text)))):
    assert got == keep_decimal(n, text), (n, text)
  else:
    assert got in (keep_decimal(n, text), keep_decimal(n, text) - 1), (n, text)


def test_traced_sparsity_below_one_keeps_at_least_one_entry():
  """s < 1 must keep n - floor(s * n) >= 1 entries; float32(0.9999999) = 0.99999988 < 1."""
  s = jnp.float32(0.9999999)
  assert float(s) < 1.0
  n = 10**6
  assert num_keep(n, float(s)) == 1  # Python path on the same value
  assert int(num_keep(n, s)) >= 1
  tree = {"w": jnp.arange(1.0, n + 1.0).reshape(1000, 1000)}
  out, masks = jax.jit(project_topk)(tree, s)
  assert int(masks["w"].sum()) == 1 and float(out["w"][-1, -1]) == float(n)


def test_num_keep_traced_exact_for_two_digit_decimals():
  """float32(0.13) * 900 rounds to 116.99998 in float32: such counts need the upward nudge."""
  sizes = (150, 300, 450, 900, 1000, 1999)
  texts = [f"0.{j:02d}" for j in range(100)]
  counts = jax.jit(jax.vmap(lambda s: jnp.stack([num_keep(n, s) for n in sizes])))(
      jnp.array([float(t) for t in texts], jnp.float32))
  assert counts.dtype == jnp.int32
  assert counts.tolist() == [[keep_decimal(n, t) for n in sizes] for t in texts]


def test_num_keep_under_jit_matches_eager():
  f = jax.jit(lambda s: num_keep(12345, s))
  for s in (0.0, 0.1, 0.29, 0.5, 0.9):
    assert int(f(jnp.float32(s))) == int(num_keep(12345, jnp.float32(s))) == keep_decimal(12345, repr(s))


# --------------------------------------------------------------------------- #
# Hand-computed small cases                                                   #
# --------------------------------------------------------------------------- #


def test_global_tie_break_follows_flatten_order_not_insertion_order():
  # Flatten order sorts dict keys: 'a' comes before 'z' although inserted later.
  tree = {"z": jnp.array([[3.0, 0.0]]), "a": jnp.array([[1.0, -3.0]])}
  out, masks = project_topk(tree, 0.75)  # 4 entries, keep 1: |-3| in 'a' ties with 3 in 'z'
  assert masks["a"].tolist() == [[False, True]]
  assert masks["z"].tolist() == [[False, False]]
  assert out["a"].tolist() == [[0.0, -3.0]]
  assert out["z"].tolist() == [[0.0, 0.0]]


def test_docstring_example_and_row_major_tie_break():
  params = {"w": jnp.array([[3.0, -1.0], [0.5, -4.0]]), "b": jnp.array([9.0, 9.0]),
            "c": jnp.full((2, 3), -2.0)}
  out, masks = project_topk(params, 0.5, structure=PerLeaf())
  assert out["w"].tolist() == [[3.0, 0.0], [0.0, -4.0]]
  assert out["b"].tolist() == [9.0, 9.0] and masks["b"].tolist() == [True, True]
  # all-equal leaf: the first entries in row-major order win
  assert masks["c"].tolist() == [[True, True, True], [False, False, False]]
  assert out["c"].tolist() == [[-2.0, -2.0, -2.0], [0.0, 0.0, 0.0]]


def test_nm_2_of_4_dense_kernel_hand_computed():
  kernel = jnp.array([
      [1.0, 0.0],
      [-5.0, 0.0],
      [3.0, 0.0],
      [0.0, 0.0],   # column 1, rows 0-3: all zero -> rows 0, 1 kept
      [2.0, 4.0],
      [2.0, -1.0],
      [-2.0, 4.0],  # column 0, rows 4-7: 2, 2, 2, 7 -> row 7 and the first 2 (row 4)
      [7.0, 1.0],
  ])
  expected = [[False, True], [True, True], [True, False], [False, False],
              [True, True], [False, False], [False, True], [True, False]]
  for sparsity in (None, 0.5):
    out, masks = project_topk({"params": {"Dense_0": {"kernel": kernel, "bias": jnp.ones(2)}}},
                              sparsity, structure=NM(2, 4))
    assert masks["params"]["Dense_0"]["kernel"].tolist() == expected
    assert masks["params"]["Dense_0"]["bias"].tolist() == [True, True]
    np.testing.assert_array_equal(out["params"]["Dense_0"]["kernel"],
                                  np.where(np.array(expected), kernel, 0.0))


def test_nm_2_of_4_conv_kernel_hand_computed():
  # (h, w, in, out) = (1, 1, 4, 2): groups run along `in`.
  kernel = jnp.array([[1.0, 0.0], [-3.0, 0.0], [3.0, -0.0], [2.0, 5.0]]).reshape(1, 1, 4, 2)
  out, masks = project_topk({"conv": kernel}, structure=NM(2, 4))
  expected = [[False, True], [True, False], [True, False], [False, True]]
  assert masks["conv"].shape == (1, 1, 4, 2)
  assert masks["conv"][0, 0].tolist() == expected
  assert out["conv"][0, 0].tolist() == [[0.0, 0.0], [-3.0, 0.0], [3.0, 0.0], [0.0, 5.0]]


def test_per_output_hand_computed():
  w = jnp.array([[1.0, 5.0], [-3.0, 5.0], [2.0, -5.0]])
  # axis=-1: each column is a group of 3; keep 3 - floor(1.5) = 2 per column
  _, masks = project_topk({"w": w}, 0.5, structure=PerOutput())
  assert masks["w"].tolist() == [[False, True], [True, True], [True, False]]
  # axis=0: each row is a group of 2; keep 1 per row (ties -> lower column)
  v = jnp.array([[1.0, 5.0], [-3.0, 3.0], [4.0, -2.0]])
  out, masks = project_topk({"w": v}, 0.5, structure=PerOutput(axis=0))
  assert masks["w"].tolist() == [[False, True], [True, False], [True, False]]
  assert out["w"].tolist() == [[0.0, 5.0], [-3.0, 0.0], [4.0, 0.0]]


@pytest.mark.slow
def test_per_leaf_reads_python_float_as_decimal():
  # 0.29 * 100 and 0.29 * 200 are 28.99.. and 57.99.. in binary floating point.
  assert math.floor(0.29 * 100) == 28 and math.floor(0.29 * 200) == 57
  tree = {"a": jnp.arange(1.0, 101.0).reshape(10, 10), "b": -jnp.arange(1.0, 201.0).reshape(20, 10)}
  out, masks = project_topk(tree, 0.29, structure=PerLeaf())
  assert int(masks["a"].sum()) == 71 and int(masks["b"].sum()) == 142
  # largest magnitudes kept
  assert bool(masks["a"].reshape(-1)[29:].all()) and not bool(masks["a"].reshape(-1)[:29].any())
  out, masks = project_topk(tree, 0.29)
  assert int(masks["a"].sum()) + int(masks["b"].sum()) == 300 - 87


def test_sparsity_zero_keeps_everything_and_near_one_keeps_one():
  tree = {"w": jnp.zeros((3, 5)), "v": jnp.full((2, 2), -0.0)}
  out, masks = project_topk(tree, 0.0)
  assert all(bool(m.all()) for m in jax.tree.leaves(masks))
  assert np.signbit(np.asarray(out["v"])).all()  # kept -0.0 stays -0.0
  out, masks = project_topk(tree, 0.999)  # 19 entries, keep 19 - 18 = 1: the first
  assert int(masks["v"].sum()) == 1 and bool(masks["v"][0, 0])
  assert not bool(masks["w"].any())


def test_nan_shows_only_at_its_entry_and_masks_keep_exact_counts():
  tree = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.array([[5.0, jnp.nan, 0.0]])}
  out, masks = project_topk(tree, 0.5)  # 7 entries, keep 4: NaN ranks highest
  np.testing.assert_array_equal(out["a"], [[0.0, 0.0], [3.0, 4.0]])
  np.testing.assert_array_equal(out["b"], [[5.0, np.nan, 0.0]])
  assert masks["b"].tolist() == [[True, True, False]]
  assert masks["a"].tolist() == [[False, False], [True, True]]
  out, masks = project_topk(tree, 0.5, structure=PerLeaf())
  np.testing.assert_array_equal(out["a"], [[0.0, 0.0], [3.0, 4.0]])  # other leaf untouched
  np.testing.assert_array_equal(out["b"], [[5.0, np.nan, 0.0]])
  assert masks["b"].tolist() == [[True, True, False]]


def test_nan_score_ranks_highest_and_shows_at_its_entry():
  tree = {"a": jnp.array([[1.0, 2.0, 3.0]])}
  scores = {"a": jnp.array([[jnp.nan, 0.0, 1.0]])}
  out, masks = project_topk(tree, 0.5, scores=scores)  # keep 3 - 1 = 2
  assert masks["a"].tolist() == [[True, False, True]]
  np.testing.assert_array_equal(out["a"], [[np.nan, 0.0, 3.0]])


def test_nan_value_with_a_finite_score_is_nan_even_where_pruned():
  """A dropped NaN weight is not silently zeroed: it stays NaN (finalize raises on it)."""
  tree = {"a": jnp.array([[jnp.nan, 2.0, 3.0, 4.0]])}
  scores = {"a": jnp.array([[0.0, 1.0, 2.0, 3.0]])}
  out, masks = project_topk(tree, 0.5, scores=scores)
  assert masks["a"].tolist() == [[False, False, True, True]]
  np.testing.assert_array_equal(out["a"], [[np.nan, 0.0, 3.0, 4.0]])
  with pytest.raises(RuntimeError, match="NaN"):
    safe_optax.finalize(tree, 0.5, scores=scores)


def test_one_nan_leaves_the_rest_of_a_global_projection_as_numpy_computes_it():
  rng = np.random.default_rng(3)
  w = rng.normal(size=(5, 6)).astype(np.float32)
  v = rng.normal(size=(4, 3)).astype(np.float32)
  w[2, 3] = np.nan
  out, masks = project_topk({"v": jnp.asarray(v), "w": jnp.asarray(w)}, 0.6)
  flat = np.concatenate([v.ravel(), w.ravel()])
  k = safe_optax.num_keep(flat.size, 0.6)
  keep = ref_keep(np.abs(flat), k)  # the NaN takes one kept slot
  want = np.where(keep, flat, 0.0)
  got = np.concatenate([np.asarray(out["v"]).ravel(), np.asarray(out["w"]).ravel()])
  np.testing.assert_array_equal(got, want)  # NaN == NaN for assert_array_equal
  assert int(sum(np.sum(m) for m in jax.tree.leaves(masks))) == k
  assert np.isnan(got).sum() == 1


def test_scores_override_magnitude():
  tree = {"w": jnp.array([[10.0, -20.0], [0.5, 0.1]]), "b": jnp.ones(2)}
  # scores of non-prunable leaves may be None or arrays; either way they are ignored
  scores = {"w": jnp.array([[0.0, 1.0], [3.0, 2.0]]), "b": jnp.array([jnp.nan, 5.0])}
  out, masks = project_topk(tree, 0.5, scores=scores)
  assert masks["w"].tolist() == [[False, False], [True, True]]
  np.testing.assert_array_equal(out["w"], np.array([[0.0, 0.0], [0.5, 0.1]], np.float32))


def test_negative_zero_scores_tie_with_positive_zero():
  """-0.0 == +0.0, so the earlier entry must win the tie (contract: equal scores -> earlier)."""
  tree = {"w": jnp.ones((2, 2))}
  scores = {"w": jnp.array([[-0.0, 0.0], [-1.0, -1.0]])}
  _, masks = project_topk(tree, 0.75, scores=scores)  # keep 1 of 4; best score is 0 (twice)
  assert masks["w"].tolist() == [[True, False], [False, False]]


def test_numpy_float32_sparsity_counts_like_jax_float32():
  """A float32 sparsity should give the same count whether it is a numpy or a jax scalar."""
  # num_keep itself agrees: numpy and jax float32 both take the float32 route
  assert int(num_keep(100, np.float32(0.29))) == int(num_keep(100, jnp.float32(0.29))) == 71
  tree = {"w": jnp.arange(1.0, 101.0).reshape(10, 10)}
  _, masks = project_topk(tree, np.float32(0.29))
  assert int(masks["w"].sum()) == 71


# --------------------------------------------------------------------------- #
# Property tests against the reference                                        #
# --------------------------------------------------------------------------- #


@given(data=st.data())
def test_unstructured_matches_reference(data):
  # 'custom' (dataclass + NamedTuple) is covered by the Python-float test below.
  template = data.draw(st.sampled_from(["bare", "linen", "tuple"]), label="template")
  # The default structure is tested outside jit.
  scope = data.draw(st.sampled_from(["global", "per_leaf"]), label="scope")
  # Scores only change where the ranking keys come from (the same code for both
  # scopes); per_leaf with scores is covered by the Python-float test below.
  # This halves the compilations of the per-leaf kernels.
  use_scores = scope != "per_leaf" and data.draw(st.booleans(), label="scores")
  sparsity = data.draw(sparsities, label="sparsity")
  case = draw_case(data, TEMPLATES[template], use_scores=use_scores)
  s = float(sparsity)
  out, masks = jit_project(case.tree, jnp.float32(s), case.scores,
                           structure=UNSTRUCTURED[scope])

  def k_of(n):
    k = keep_traced(n, s)
    if isinstance(sparsity, str):  # decimal sparsity, n < 2**21 / 1000: must equal the decimal count
      assert k == keep_decimal(n, sparsity)
    return k

  ref = ref_unstructured(case.leaves, case.flags, case.score_leaves, scope, k_of)
  assert_matches(out, masks, case.treedef, case.leaves, ref)
  # exact counts, per scope
  mask_leaves = jax.tree.leaves(masks)
  pruned = [i for i, f in enumerate(case.flags) if f]
  scopes = [pruned] if scope == "global" else [[i] for i in pruned]
  for group in scopes:
    n = sum(case.leaves[i].size for i in group)
    assert sum(int(mask_leaves[i].sum()) for i in group) == k_of(n)
  for i, f in enumerate(case.flags):
    if not f:
      assert bool(mask_leaves[i].all())
  # optimality, independently of the tie-break
  for group in scopes:
    flat = np.concatenate([leaf_score(case.leaves[i], case.score_leaves[i]).ravel() for i in group])
    keep = np.concatenate([np.asarray(mask_leaves[i]).ravel() for i in group])
    if not np.isnan(flat).any():
      assert_optimal(flat, keep)


def many_mixed_template(mk):
  """45 leaves: repeated kernel shapes (one compiled kernel per shape, each leaf
  with its own flat positions), one-row kernels, three float dtypes, empty,
  1-D and integer (not prunable) leaves in between (zero-size prunable leaves:
  test_zero_size_prunable_leaves_anywhere)."""
  shapes = [((3, 5), F32), ((1, 7), BF16), ((3, 5), F32), ((2, 2, 3), F16), ((0,), F32),
            ((4,), F32), ((3, 5), BF16), ((5, 1), F32), ((3, 3), I32)]
  return {f"layer_{i:02d}": mk(shape, dtype) for i, (shape, dtype) in enumerate(shapes * 5)}


@pytest.mark.slow
@given(data=st.data())
def test_many_mixed_leaves_match_reference(data):
  """Global projection of a many-leaf tree: exact masks, values and counts, ties across leaves."""
  use_scores = data.draw(st.booleans(), label="scores")
  s = float(data.draw(sparsities, label="sparsity"))
  case = draw_case(data, many_mixed_template, use_scores=use_scores)
  out, masks = jit_project(case.tree, jnp.float32(s), case.scores)
  ref = ref_unstructured(case.leaves, case.flags, case.score_leaves, "global",
                         lambda n: keep_traced(n, s))
  assert_matches(out, masks, case.treedef, case.leaves, ref)
  pruned = [i for i, f in enumerate(case.flags) if f]
  n = sum(case.leaves[i].size for i in pruned)
  assert sum(int(jax.tree.leaves(masks)[i].sum()) for i in pruned) == keep_traced(n, s)


STATIC_CASES = [("tuple", "per_leaf", "0.999", True), ("custom", None, "0", True)]


@pytest.mark.slow
@pytest.mark.parametrize("template,scope,sparsity,use_scores", STATIC_CASES)
@given(data=st.data())
def test_unstructured_python_float_sparsity_matches_reference(template, scope, sparsity, use_scores, data):
  case = draw_case(data, TEMPLATES[template], use_scores=use_scores)
  kwargs = {} if scope is None else {"structure": UNSTRUCTURED[scope]}  # None: the default
  out, masks = project_topk(case.tree, float(sparsity), scores=case.scores, **kwargs)
  ref = ref_unstructured(case.leaves, case.flags, case.score_leaves, scope or "global",
                         lambda n: keep_decimal(n, sparsity))
  assert_matches(out, masks, case.treedef, case.leaves, ref)


# (structure, template, pass sparsity=1-n/m instead of None, use scores); fixed per
# case to bound the number of compilations.
NM_CASES = {
    "dense_conv_2of4": (NM(2, 4), lambda mk: {"params": {
        "Dense_0": {"kernel": mk((8, 3), F32), "bias": mk((3,), F32)},
        "Conv_0": {"kernel": mk((1, 3, 4, 2), BF16)}}}, False, True),
    "axis0_1of2": (NM(1, 2, axis=0), lambda mk: [mk((6, 5), F32), mk((2, 3, 4), F16)], True, False),
    "last_axis_4of8": (NM(4, 8, axis=-1), lambda mk: (mk((3, 16), F16), mk((3, 3), I32)), False, True),
    "3of4": (NM(3, 4), lambda mk: {"w": mk((4, 2), F32)}, True, True),
    "2of2": (NM(2, 2), lambda mk: {"w": mk((4, 3), F32)}, True, False),
    "5of20_long_groups": (NM(5, 20), lambda mk: {"w": mk((40, 2), F32)}, False, True),
}


@given(data=st.data())
def test_nm_matches_reference(data):
  name = data.draw(st.sampled_from(sorted(NM_CASES)), label="case")
  structure, template, pass_sparsity, use_scores = NM_CASES[name]
  case = draw_case(data, template, use_scores=use_scores)
  sparsity = 1 - structure.n / structure.m if pass_sparsity else None
  out, masks = project_topk(case.tree, sparsity, structure=structure, scores=case.scores)
  ref = ref_structured(case.leaves, case.flags, case.score_leaves, structure, None)
  assert_matches(out, masks, case.treedef, case.leaves, ref)
  # exactly n kept in every group of m
  for leaf, mask, flag in zip(case.leaves, jax.tree.leaves(masks), case.flags):
    if flag:
      moved = np.moveaxis(np.asarray(mask), structure.axis, -1)
      counts = moved.reshape(moved.shape[:-1] + (-1, structure.m)).sum(-1)
      assert (counts == structure.n).all()


# (structure, template, use scores)
PO_CASES = {
    # group sizes 3 (pairwise-rank path) and 18 (sort path)
    "dense_conv": (PerOutput(), lambda mk: {"k": mk((3, 5), F32), "c": mk((3, 3, 2, 4), BF16),
                                            "b": mk((4,), F32)}, True),
    "axis0": (PerOutput(axis=0), lambda mk: [mk((7, 1, 3), F16)], False),
    "axis1": (PerOutput(axis=1), lambda mk: {"w": mk((2, 9, 3), F32)}, True),
}


@given(data=st.data())
def test_per_output_matches_reference(data):
  name = data.draw(st.sampled_from(sorted(PO_CASES)), label="case")
  structure, template, use_scores = PO_CASES[name]
  sparsity = data.draw(st.sampled_from(["0.5", "0.9"]), label="sparsity")
  case = draw_case(data, template, use_scores=use_scores)
  out, masks = project_topk(case.tree, float(sparsity), structure=structure, scores=case.scores)
  ref = ref_structured(case.leaves, case.flags, case.score_leaves, structure, sparsity)
  assert_matches(out, masks, case.treedef, case.leaves, ref)
  for leaf, mask, flag in zip(case.leaves, jax.tree.leaves(masks), case.flags):
    if flag:
      rows = np.moveaxis(np.asarray(mask), structure.axis, 0).reshape(leaf.shape[structure.axis], -1)
      assert (rows.sum(1) == keep_decimal(rows.shape[1], sparsity)).all()


# --------------------------------------------------------------------------- #
# Traced sparsity                                                             #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("config", [dict(structure=Global()), dict(structure=PerLeaf()),
                                    dict(structure=PerOutput())])
def test_traced_sparsity_does_not_recompile(config):
  rng = np.random.default_rng(0)
  leaves = [rng.integers(-3, 4, (6, 5)).astype(np.float32), rng.standard_normal((2, 3, 4)).astype(np.float32)]
  tree = {"a": jnp.asarray(leaves[0]), "b": jnp.asarray(leaves[1]), "bias": jnp.ones(5)}
  traces = []

  @jax.jit
  def step(tree, sparsity):
    traces.append(None)  # Python side effect: runs once per trace
    return project_topk(tree, sparsity, **config)

  for text in DECIMALS:
    out, masks = step(tree, jnp.float32(float(text)))
    all_leaves = [leaves[0], leaves[1], np.ones(5, np.float32)]
    flags = [True, True, False]
    if isinstance(config["structure"], PerOutput):
      ref = ref_structured(all_leaves, flags, [None] * 3, config["structure"], text)
    else:
      scope = "global" if config["structure"] == Global() else "per_leaf"
      ref = ref_unstructured(all_leaves, flags, [None] * 3, scope,
                             lambda n: keep_decimal(n, text))
    assert_matches(out, masks, jax.tree.structure(tree), all_leaves, ref)
  assert len(traces) == 1
  assert step._cache_size() == 1


def test_concrete_array_sparsity_outside_jit_does_not_recompile():
  from safe_optax import _projection  # the jitted kernel behind project_topk

  tree = {"w": jnp.arange(1.0, 101.0).reshape(4, 25)}
  project_topk(tree, jnp.float32(0.1))
  before = _projection._project_leaves._cache_size()
  for s in (0.29, 0.5, 0.9):
    _, masks = project_topk(tree, jnp.float32(s))
    assert int(masks["w"].sum()) == keep_traced(100, s) == keep_decimal(100, repr(s))
  assert _projection._project_leaves._cache_size() == before


def test_nm_under_jit_with_traced_sparsity():
  kernel = np.random.default_rng(1).integers(-2, 3, (8, 4)).astype(np.float32)
  out, masks = jax.jit(lambda t, s: project_topk(t, s, structure=NM(2, 4)))(
      {"k": jnp.asarray(kernel)}, jnp.float32(0.5))
  ref = ref_structured([kernel], [True], [None], NM(2, 4), None)
  assert_matches(out, masks, jax.tree.structure({"k": 0}), [kernel], ref)


# --------------------------------------------------------------------------- #
# Pytree kinds and prunable selection                                         #
# --------------------------------------------------------------------------- #


def test_prunable_bool_tree_prefix_and_callable():
  rng = np.random.default_rng(2)
  tree = {"params": {"Dense_0": {"kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
                                 "bias": jnp.asarray(rng.standard_normal(3), jnp.float32)},
                     "Dense_1": {"kernel": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)}}}
  prefix = {"params": {"Dense_0": True, "Dense_1": False}}
  flags = prunable_mask(tree, prefix)
  assert flags == {"params": {"Dense_0": {"kernel": True, "bias": True}, "Dense_1": {"kernel": False}}}
  by_name = lambda path, leaf: "Dense_0" in jax.tree_util.keystr(path)
  assert prunable_mask(tree, by_name) == flags
  full = {"params": {"Dense_0": {"kernel": True, "bias": True}, "Dense_1": {"kernel": False}}}
  assert prunable_mask(tree, full) == flags
  assert prunable_mask(tree) == {"params": {"Dense_0": {"kernel": True, "bias": False},
                                            "Dense_1": {"kernel": True}}}
  leaves, treedef = jax.tree.flatten(tree)
  flag_list = jax.tree.leaves(flags)
  ref = ref_unstructured(leaves, flag_list, [None] * len(leaves), "global", lambda n: keep_decimal(n, "0.6"))
  for prunable in (prefix, by_name, full):
    out, masks = project_topk(tree, 0.6, prunable=prunable)
    assert_matches(out, masks, treedef, leaves, ref)
  assert int(jax.tree.leaves(masks)[0].sum()) + int(jax.tree.leaves(masks)[1].sum()) == 15 - 9


def test_default_prunable_rule():
  assert default_prunable((), jnp.zeros((3, 4)))
  assert default_prunable((), jnp.zeros((1, 1, 2), jnp.bfloat16))
  assert default_prunable((), np.zeros((2, 2), np.float16))
  assert not default_prunable((), jnp.zeros(4))
  assert not default_prunable((), jnp.zeros(()))
  assert not default_prunable((), jnp.zeros((3, 3), jnp.int32))
  assert not default_prunable((), jnp.zeros((3, 3), bool))
  assert not default_prunable((), 3.0)


def test_flax_nnx_state():
  nnx = pytest.importorskip("flax.nnx")

  rng = np.random.default_rng(4)
  # numpy initialisers: jax.random initialisers would compile a dozen eager ops
  init = lambda key, shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), kernel_init=init, bias_init=init, rngs=rngs)
      self.norm = nnx.BatchNorm(4, rngs=rngs)
      self.dense = nnx.Linear(4, 5, kernel_init=init, bias_init=init, rngs=rngs)

  model = Model(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, treedef = jax.tree.flatten(params)
  flags = [is_default_prunable(x) for x in leaves]
  assert sum(flags) == 2  # conv and dense kernels
  assert jax.tree.leaves(prunable_mask(params)) == flags
  out, masks = project_topk(params, 0.75)
  assert type(out) is type(params)
  ref = ref_unstructured(leaves, flags, [None] * len(leaves), "global", lambda n: keep_decimal(n, "0.75"))
  assert_matches(out, masks, treedef, leaves, ref)
  # the projected state merges back into a model
  sparse = nnx.merge(graphdef, out, rest)
  assert int((sparse.conv.kernel[...] != 0).sum() + (sparse.dense.kernel[...] != 0).sum()) == 108 + 20 - 96
  np.testing.assert_array_equal(sparse.conv.bias[...], model.conv.bias[...])
  # selection by key path works on NNX paths too
  only_dense = lambda path, leaf: "dense" in jax.tree_util.keystr(path) and jnp.ndim(leaf) == 2
  selected = [(jax.tree_util.keystr(p), flag) for p, flag in
              jax.tree_util.tree_flatten_with_path(prunable_mask(params, only_dense))[0]]
  assert [name for name, flag in selected if flag] == [
      name for name, _ in selected if "dense" in name and "kernel" in name]
  assert sum(flag for _, flag in selected) == 1
  # errors name NNX leaves by their path (conv kernel (3, 3, 3, 4): 3 inputs, not a multiple of 4)
  with pytest.raises(ValueError, match="conv/kernel"):
    project_topk(params, structure=NM(2, 4))


def test_non_prunable_leaves_unchanged_and_input_not_mutated():
  w = np.array([[1.0, -2.0, 3.0], [0.0, 5.0, -6.0]], np.float32)
  b = np.array([7.0, 8.0], np.float32)
  step = jnp.array([[3, 4]], jnp.int32)
  half = jnp.array([[1.5, -2.5]], jnp.bfloat16)
  tree = {"w": w, "b": b, "step": step, "scale": jnp.float16(2.0)}
  snapshot = {k: np.array(v, copy=True) for k, v in tree.items()}
  keys_before = list(tree)
  out, masks = project_topk(tree, 0.5)
  assert list(tree) == keys_before and tree["w"] is w and tree["b"] is b
  for k, v in snapshot.items():
    np.testing.assert_array_equal(bits(tree[k]), bits(v))
  for k in ("b", "step", "scale"):
    assert np.asarray(out[k]).dtype == np.asarray(tree[k]).dtype
    np.testing.assert_array_equal(bits(out[k]), bits(tree[k]))
    assert np.asarray(masks[k]).shape == np.shape(tree[k]) and bool(np.all(masks[k]))
  assert out["w"].tolist() == [[0.0, 0.0, 3.0], [0.0, 5.0, -6.0]]
  # bfloat16 / float16 prunable leaves keep their dtype
  out, _ = project_topk({"h": half, "f": jnp.array([[1.0, 4.0]], jnp.float16)}, 0.5)
  assert out["h"].dtype == jnp.bfloat16 and out["f"].dtype == jnp.float16
  assert out["h"].tolist() == [[0.0, -2.5]] and out["f"].tolist() == [[0.0, 4.0]]


# --------------------------------------------------------------------------- #
# Errors                                                                      #
# --------------------------------------------------------------------------- #

TREE = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), jnp.float32(1.0)])
def test_sparsity_out_of_range(bad):
  with pytest.raises(ValueError, match="sparsity"):
    project_topk(TREE, bad)
  with pytest.raises(ValueError, match="sparsity"):
    project_topk(TREE, bad, structure=PerOutput())


@pytest.mark.parametrize("bad", ["0.5", [0.5], jnp.array([0.1, 0.2]), object()])
def test_sparsity_not_a_number(bad):
  with pytest.raises(TypeError, match="sparsity"):
    project_topk(TREE, bad)


def test_sparsity_required_for_unstructured():
  with pytest.raises(ValueError, match="sparsity"):
    project_topk(TREE)
  with pytest.raises(ValueError, match="sparsity"):
    project_topk(TREE, structure=PerOutput())


def test_bad_structure():
  with pytest.raises(TypeError, match="structure"):
    project_topk(TREE, 0.5, structure="2:4")


@pytest.mark.parametrize("n, m", [(3, 2), (0, 4), (-1, 4), (2.0, 4)])
def test_bad_nm(n, m):
  with pytest.raises(ValueError, match="NM"):  # raised by NM itself, before any projection
    NM(n, m)
  with pytest.raises(ValueError, match="NM"):  # and by the projection, if built by _replace
    project_topk(TREE, structure=NM(2, 4)._replace(n=n, m=m))


def test_nm_sparsity_contradiction():
  with pytest.raises(ValueError, match="sparsity"):
    project_topk(TREE, 0.4, structure=NM(2, 4))
  with pytest.raises(ValueError, match="sparsity"):
    project_topk(TREE, 0.75, structure=NM(2, 4))


def test_nm_axis_not_divisible_names_leaf():
  tree = {"params": {"Dense_0": {"kernel": jnp.ones((6, 4))}}}
  with pytest.raises(ValueError, match="params/Dense_0/kernel"):
    project_topk(tree, structure=NM(2, 4))
  with pytest.raises(ValueError, match="params/Dense_0/kernel"):
    project_topk(tree, 0.5, structure=PerOutput(axis=2))


def test_no_prunable_leaves():
  with pytest.raises(ValueError, match="prunable"):
    project_topk({"b": jnp.ones(4), "step": jnp.ones((3, 3), jnp.int32)}, 0.5)
  with pytest.raises(ValueError, match="prunable"):
    project_topk(TREE, 0.5, prunable=False)
  with pytest.raises(ValueError, match="prunable"):
    prunable_mask({"b": jnp.ones(4)})


def test_integer_leaf_selected_as_prunable_names_path():
  tree = {"params": {"w": jnp.ones((2, 2)), "step": jnp.ones((2, 2), jnp.int32)}}
  with pytest.raises(TypeError, match="params/step"):
    project_topk(tree, 0.5, prunable={"params": {"w": True, "step": True}})
  with pytest.raises(TypeError, match="params/step"):
    project_topk(tree, 0.5, prunable=lambda path, leaf: True)
  with pytest.raises(TypeError, match="params/step"):
    prunable_mask(tree, True)


def test_prunable_structure_mismatch():
  with pytest.raises(ValueError, match="prunable"):
    project_topk(TREE, 0.5, prunable={"w": True, "other": False})


def test_scores_wrong_shape_or_structure():
  with pytest.raises(ValueError, match="scores"):
    project_topk(TREE, 0.5, scores={"w": jnp.ones((4, 3)), "b": None})
  with pytest.raises(ValueError, match="scores"):
    project_topk(TREE, 0.5, scores={"w": None, "b": jnp.ones(4)})
  with pytest.raises(ValueError, match="scores"):
    project_topk(TREE, 0.5, scores={"w": jnp.ones((4, 4))})
  with pytest.raises(ValueError, match="scores"):
    project_topk(TREE, 0.5, scores=[jnp.ones((4, 4)), jnp.ones(4)])


# --------------------------------------------------------------------------- #
# Chunked radix select (kernel level) and a model-sized tree                  #
# --------------------------------------------------------------------------- #


@given(data=st.data())
def test_topk_masks_ties_across_chunks(data):
  """Small leaves are concatenated into chunks; the tie rank must carry across chunks.

  Private kernel: with the default chunk size (4M entries) chunking only happens
  on very large models, so it is exercised here with chunk_size=7.
  """
  sizes = (2, 3, 2, 10, 1, 1)  # chunk_size=7 groups them as [0, 1, 2], [3], [4, 5]
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
  leaves = [rng.integers(0, 3, s).astype(np.float32) for s in sizes]
  k = data.draw(st.integers(1, sum(sizes)))
  masks = _topk_chunked([jnp.asarray(x) for x in leaves], jnp.int32(k))
  want = ref_keep(np.concatenate(leaves), k)
  np.testing.assert_array_equal(np.concatenate([np.asarray(m) for m in masks]), want)


@jax.jit
def _topk_chunked(leaves, k):
  return _select.topk_masks([_select.order_keys(x) for x in leaves], k, chunk_size=7)[0]


@given(data=st.data())
def test_topk_masks_reports_nan_from_the_histogram(data):
  """The NaN flag comes from the first histogram's top bin: only NaN keys land there.

  +inf, the largest finite floats and -NaN payloads are the keys next to that
  bin, so they are drawn often.
  """
  special = [np.nan, -np.nan, np.inf, -np.inf, np.finfo(np.float32).max,
             -np.finfo(np.float32).max, 0.0, -0.0, 1.0]
  sizes = (3, 4, 1)
  leaves = [np.array(data.draw(st.lists(st.sampled_from(special), min_size=s, max_size=s)),
                     np.float32) for s in sizes]
  k = data.draw(st.integers(1, sum(sizes)))
  masks, nan = _topk_nan(tuple(jnp.asarray(x) for x in leaves), jnp.int32(k))
  assert bool(nan) == any(np.isnan(x).any() for x in leaves)
  assert sum(int(np.sum(m)) for m in masks) == k


@pytest.mark.parametrize("values", [np.ones(4), np.arange(4.0)], ids=["ties", "distinct"])
def test_zero_size_prunable_leaves_anywhere(values):
  """Empty kernels (first, middle, last) hold no entries and never shift the count."""
  tree = {"a": jnp.zeros((0, 3)), "b": jnp.asarray(values.reshape(2, 2), jnp.float32),
          "c": jnp.zeros((3, 0)), "d": jnp.asarray(values[::-1].reshape(2, 2), jnp.float32)}
  projected, masks = jax.jit(lambda t: project_topk(t, 0.5))(tree)
  assert projected["a"].shape == (0, 3) and projected["c"].shape == (3, 0)
  flat = np.concatenate([np.asarray(tree[k]).ravel() for k in "bd"])
  want = ref_keep(flat, 4)
  got = np.concatenate([np.asarray(masks[k]).ravel() for k in "bd"])
  np.testing.assert_array_equal(got, want)


@jax.jit
def _topk_nan(leaves, k):
  return _select.topk_masks([_select.order_keys(x) for x in leaves], k)


# VGG-like conv stack plus a classifier: 1,147,072 prunable entries.
LARGE_SHAPES = [(3, 3, 3, 64), (3, 3, 64, 64), (3, 3, 64, 128), (3, 3, 128, 128),
                (3, 3, 128, 256), (3, 3, 256, 256), (256, 10)]


def _large_tree():
  rng = np.random.default_rng(3)
  leaves = []
  for i, shape in enumerate(LARGE_SHAPES):
    x = rng.standard_normal(shape).astype(np.float32) * 0.05
    if i % 2:  # quantized leaves: many exact ties around the threshold
      x = np.round(x * 64) / 64
    leaves.append(x)
  tree = {"params": {f"layer_{i:02d}": {"kernel": jnp.asarray(x), "bias": jnp.zeros(x.shape[-1])}
                     for i, x in enumerate(leaves)}}
  return tree, leaves


def _check_large(masks, leaves, k):
  got = np.concatenate([np.asarray(masks["params"][f"layer_{i:02d}"]["kernel"]).ravel()
                        for i in range(len(leaves))])
  scores = np.abs(np.concatenate([x.ravel() for x in leaves]).astype(np.float64))
  assert int(got.sum()) == k
  assert_optimal(scores, got)
  np.testing.assert_array_equal(got, ref_keep(scores, k))


@pytest.mark.slow
def test_large_tree_global_09():
  tree, leaves = _large_tree()
  n = sum(x.size for x in leaves)
  assert 1_100_000 < n < 1_200_000
  out, masks = project_topk(tree, 0.9)
  _check_large(masks, leaves, keep_decimal(n, "0.9"))
  assert all(bool(masks["params"][name]["bias"].all()) for name in masks["params"])
  kernel = np.asarray(out["params"]["layer_05"]["kernel"])
  np.testing.assert_array_equal(kernel, np.where(np.asarray(masks["params"]["layer_05"]["kernel"]),
                                                 leaves[5], 0.0))


def test_large_tree_global_09_traced():
  """Same model under jit with a traced sparsity of 0.9 (n < 2**21): must prune floor(0.9 n)."""
  tree, leaves = _large_tree()
  n = sum(x.size for x in leaves)
  _, masks = jax.jit(project_topk)(tree, jnp.float32(0.9))
  _check_large(masks, leaves, keep_traced(n, 0.9))  # internal consistency: always holds
  assert keep_traced(n, 0.9) == keep_decimal(n, "0.9")  # documented exactness for n < 2**21


def test_public_api():
  assert set(safe_optax.__all__) >= {"NM", "PerOutput", "default_prunable", "num_keep",
                                     "project_topk", "prunable_mask"}
  assert NM(2, 4).axis == -2 and PerOutput().axis == -1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_exact_count_when_a_low_precision_leaf_is_computed_in_the_same_program(dtype):
  # |a| has a tie at the median in bf16; x = a - 0.001 is computed inside the jitted
  # program, where XLA may keep it in float32 in one fusion and round it in another.
  a = jnp.asarray(np.random.default_rng(3).normal(size=(8, 8)), dtype)
  project = jax.jit(lambda p: safe_optax.project_topk(
      jax.tree.map(lambda v: v - jnp.asarray(0.001, v.dtype), p), 0.5))
  out = project({"a": a, "bias": jnp.ones((8,), dtype)})
  out = out[0] if isinstance(out, tuple) else out
  assert int(jnp.count_nonzero(out["a"])) == 32
  stored = np.abs(np.asarray((a - jnp.asarray(0.001, dtype)).astype(jnp.float32)))
  kept = np.asarray(out["a"].astype(jnp.float32)) != 0
  assert stored[kept].min() >= stored[~kept].max()


# NaNs of both signs, quiet and signalling, with payloads: their bit patterns differ.
NAN_BITS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC00123], np.uint32)


@pytest.mark.parametrize("k", [1, 3, 5, 6, 9])
def test_magnitude_masks_rank_every_nan_bit_pattern_as_one_top_key(k):
  """Leaf masks compare the bits of |w| (not ``magnitude_keys``); NaNs must still tie."""
  nans = NAN_BITS.view(np.float32)
  leaves = [np.array([[1.0, nans[0]], [nans[1], 2.0]], np.float32),
            np.array([nans[2], -3.0, nans[3], 0.5, nans[4]], np.float32)]
  masks, nan = jax.jit(lambda ws, k: _select.topk_masks(ws, k, key_fn=_select.magnitude_keys))(
      [jnp.asarray(w) for w in leaves], jnp.int32(k))
  got = np.concatenate([np.asarray(m).ravel() for m in masks])
  # The 5 NaNs first (flatten order among them), then |w| descending.
  assert bool(nan) and int(got.sum()) == k
  with np.errstate(invalid="ignore"):  # casting a signalling NaN to float64
    scores = np.abs(np.concatenate([w.ravel() for w in leaves]).astype(np.float64))
  np.testing.assert_array_equal(got, ref_keep(scores, k))


def test_leaves_of_one_shape_share_one_traced_mask_and_projection():
  """Each leaf's mask and projection are traced (and lowered) once per shape, not per leaf."""
  tree = {f"w{i:02d}": jnp.ones((4, 5)) * i for i in range(12)}
  tree["odd"] = jnp.ones((3, 2))
  closed = jax.make_jaxpr(lambda t: project_topk(t, 0.5))(tree)
  bodies: dict[str, set[int]] = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("pjit", "jit"):  # renamed to "jit" in newer JAX
        bodies.setdefault(eqn.params["name"], set()).add(id(eqn.params["jaxpr"]))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(closed.jaxpr)
  # Two shapes, so two traced bodies each (jnp helpers' own pjits are not per leaf).
  assert len(bodies["_leaf_mask"]) == 2 and len(bodies["_project_leaf"]) == 2
