"""The Erdős–Rényi-Kernel allocation (``ERK``, ``erk_keep_counts``).

The reference is the allocation loop of the RigL code (Evci et al., 2020,
``sparse_utils.get_sparsities``) written out plainly in exact rational
arithmetic (``fractions.Fraction``): start with every leaf sparse, compute the
common scale ``eps`` that meets the kept budget, make the leaf with the largest
raw density dense whenever ``eps * raw > 1``, and repeat. The real-valued kept
counts are then rounded by largest remainder (ties: the earlier leaf gets the
extra entry) so that they add up to exactly ``num_keep(total, sparsity)``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import safe_optax
from safe_optax import ERK, Global, PerLeaf, erk_keep_counts, num_keep, project_topk

# --------------------------------------------------------------------------- #
# Reference                                                                   #
# --------------------------------------------------------------------------- #


def ref_erk_real(shapes, sparsity: str, power: float = 1.0) -> tuple[int, list[Fraction]]:
  """RigL's loop in exact arithmetic: the budget and each leaf's real-valued count.

  With ``power`` 1 the raw densities are exact rationals; otherwise each is the
  exact rational value of its float64 power, and the loop is exact from there.
  """
  sizes = [math.prod(s) for s in shapes]
  total = sum(sizes)
  target = total - math.floor(Fraction(sparsity) * total)
  target = max(target, 1) if total else 0
  raw = [(Fraction(sum(s), n) if power == 1 else Fraction((sum(s) / n) ** power)) if n
         else Fraction(0) for s, n in zip(shapes, sizes)]
  dense: set[int] = {i for i, n in enumerate(sizes) if n == 0}  # nothing to allocate
  eps = Fraction(0)
  while True:
    budget = target - sum(sizes[i] for i in dense)
    mass = sum(raw[i] * sizes[i] for i in range(len(sizes)) if i not in dense)
    if mass == 0:
      break
    eps = budget / mass
    free = [i for i in range(len(sizes)) if i not in dense]
    top = max(raw[i] for i in free)
    if eps * top <= 1:
      break
    dense |= {i for i in free if raw[i] == top}
  real = [Fraction(sizes[i]) if i in dense else eps * raw[i] * sizes[i]
          for i in range(len(sizes))]
  return target, real


def ref_erk(shapes, sparsity: str) -> list[int]:
  """RigL's loop (power_scale 1) in exact arithmetic, then largest remainder."""
  target, real = ref_erk_real(shapes, sparsity)
  counts = [math.floor(x) for x in real]
  deficit = target - sum(counts)
  order = sorted(range(len(real)), key=lambda i: (-(real[i] - counts[i]), i))
  for i in order[:deficit]:
    counts[i] += 1
  return counts


shape_st = st.lists(st.integers(1, 40), min_size=1, max_size=4).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=8)
decimal_st = st.sampled_from(["0", "0.1", "0.5", "0.8", "0.9", "0.95", "0.98", "0.99", "0.995",
                              "0.999"])


# --------------------------------------------------------------------------- #
# The allocation                                                              #
# --------------------------------------------------------------------------- #


def test_hand_computed_mlp_allocation():
  # 784-300-100-10 at 90 %: 26620 of 266200 kept; raw densities 1084/235200,
  # 400/30000 and 110/1000. eps = 26620 / (1084 + 400 + 110) = 16.70 and
  # 16.70 * 0.11 > 1, so the output layer is dense (1000). Then eps = 25620 / 1484
  # and the others get 18714.34 and 6905.66: floors 18714 + 6905, one entry
  # short, and the larger remainder (0.66) takes it.
  counts = erk_keep_counts([(784, 300), (300, 100), (100, 10)], 0.9)
  assert counts == [18714, 6906, 1000]
  assert sum(counts) == num_keep(266200, 0.9)


@given(shapes_st, decimal_st)
def test_matches_rigl_loop_in_exact_arithmetic(shapes, sparsity):
  assert erk_keep_counts(shapes, float(sparsity)) == ref_erk(shapes, sparsity)


@given(shapes_st, decimal_st, st.floats(0.0, 3.0))
def test_counts_are_exact_bounded_and_proportional(shapes, sparsity, power):
  counts = erk_keep_counts(shapes, float(sparsity), power_scale=power)
  sizes = [math.prod(s) for s in shapes]
  assert sum(counts) == num_keep(sum(sizes), float(sparsity))
  assert all(0 <= c <= n for c, n in zip(counts, sizes))
  # Each count is its real-valued share from RigL's loop, rounded up or down.
  _, real = ref_erk_real(shapes, sparsity, power)
  for count, x in zip(counts, real):
    assert math.floor(x) - 1e-9 * x <= count <= math.ceil(x) + 1e-9 * x


def test_power_scale_zero_is_uniform():
  shapes = [(784, 300), (300, 100), (100, 10)]
  counts = erk_keep_counts(shapes, 0.9, power_scale=0.0)
  assert counts == [23520, 3000, 100]   # exactly 10 % of each leaf


def test_sparsity_zero_keeps_everything_and_near_one_keeps_one():
  shapes = [(5, 3), (2, 2, 4), (7,)]
  assert erk_keep_counts(shapes, 0.0) == [15, 16, 7]
  assert sum(erk_keep_counts(shapes, 0.9999)) == 1


def test_zero_size_and_empty():
  assert erk_keep_counts([], 0.9) == []
  assert erk_keep_counts([(0, 4), (4, 4)], 0.5) == [0, 8]


def test_odd_shapes_single_entry_and_scalar_like():
  assert erk_keep_counts([(1, 1)], 0.5) == [1]
  assert erk_keep_counts([(1, 1), (30, 30)], 0.5) == [1, 450]


@pytest.mark.slow
@given(shapes_st, st.integers(0, 999).map(lambda i: float(np.float32(i / 1000))))
def test_traced_sparsity_total_exact_and_within_one_of_eager(shapes, s):
  eager = erk_keep_counts(shapes, np.float32(s))
  traced = jax.jit(lambda x: jnp.stack(erk_keep_counts(shapes, x)))(jnp.float32(s))
  sizes = [math.prod(sh) for sh in shapes]
  assert int(traced.sum()) == int(num_keep(sum(sizes), jnp.float32(s)))
  assert sum(eager) == int(traced.sum())
  assert np.all(np.abs(np.asarray(traced) - np.array(eager)) <= 1)
  assert np.all((np.asarray(traced) >= 0) & (np.asarray(traced) <= np.array(sizes)))


VGG19_SHAPES = ([(3, 3, 3, 64), (3, 3, 64, 64), (3, 3, 64, 128), (3, 3, 128, 128),
                 (3, 3, 128, 256)] + [(3, 3, 256, 256)] * 3 + [(3, 3, 256, 512)]
                + [(3, 3, 512, 512)] * 7 + [(512, 10)])
LLM_SHAPES = ([(4096, 4096)] * 4 + [(4096, 11008)] * 2 + [(11008, 4096)]) * 4  # 808M entries


@pytest.mark.parametrize("shapes", [VGG19_SHAPES, LLM_SHAPES], ids=["vgg19", "llm"])
@pytest.mark.parametrize("s", [0.5, 0.9, 0.98, 0.995])
def test_traced_counts_of_large_models(shapes, s):
  """float32 under jit on 20M- and 808M-entry models: the total stays exact, each leaf
  within one entry of the float64 count (leaves of 45M entries included)."""
  eager = np.array(erk_keep_counts(shapes, np.float32(s)))
  traced = np.asarray(jax.jit(lambda x: jnp.stack(erk_keep_counts(shapes, x)))(jnp.float32(s)))
  total = int(num_keep(sum(math.prod(shape) for shape in shapes), jnp.float32(s)))
  assert int(eager.sum()) == int(traced.astype(np.int64).sum()) == total
  assert np.abs(eager - traced).max() <= 1


def test_bad_arguments_raise_naming_them():
  for bad in (-1.0, float("nan"), float("inf"), "1", True):
    with pytest.raises((ValueError, TypeError), match="power_scale"):
      ERK(bad)
  with pytest.raises(ValueError, match="sparsity"):
    erk_keep_counts([(3, 3)], 1.0)
  with pytest.raises(ValueError, match="shapes"):
    erk_keep_counts([(3, -1)], 0.5)


# --------------------------------------------------------------------------- #
# The projection and the transforms                                          #
# --------------------------------------------------------------------------- #

TREE = {"Dense_0": {"kernel": jax.random.normal(jax.random.PRNGKey(0), (32, 24)),
                    "bias": jnp.ones(24)},
        "Dense_1": {"kernel": jax.random.normal(jax.random.PRNGKey(1), (24, 10)) * 3},
        "Conv_0": {"kernel": jax.random.normal(jax.random.PRNGKey(2), (3, 3, 2, 4))}}


def _per_leaf_reference(tree, counts):
  """Keep the counts[i] largest |w| of prunable leaf i (ties: the earlier entry)."""
  out = {}
  leaves = [x for x in jax.tree.leaves(tree) if x.ndim >= 2]
  for leaf, k in zip(leaves, counts):
    flat = np.abs(np.asarray(leaf, np.float64)).ravel()
    keep = np.zeros(flat.size, bool)
    keep[np.lexsort((np.arange(flat.size), -flat))[:k]] = True
    out[id(leaf)] = keep.reshape(leaf.shape)
  return [out[id(x)] for x in leaves]


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
def test_project_topk_keeps_the_largest_of_each_leaf_at_its_erk_count(sparsity):
  leaves = [x for x in jax.tree.leaves(TREE) if x.ndim >= 2]
  counts = erk_keep_counts([x.shape for x in leaves], sparsity)
  projected, masks = project_topk(TREE, sparsity, structure=ERK())
  got = [np.asarray(m) for m, x in zip(jax.tree.leaves(masks), jax.tree.leaves(TREE))
         if x.ndim >= 2]
  for g, ref, k in zip(got, _per_leaf_reference(TREE, counts), counts):
    np.testing.assert_array_equal(g, ref)
    assert g.sum() == k
  np.testing.assert_array_equal(projected["Dense_0"]["bias"], TREE["Dense_0"]["bias"])
  # Under jit with a traced sparsity: the same masks here (counts within one, equal on this tree).
  traced = jax.jit(lambda t, s: project_topk(t, s, structure=ERK())[1])(TREE, jnp.float32(sparsity))
  for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(masks)):
    assert abs(int(np.sum(a)) - int(np.sum(b))) <= 1


def test_erk_differs_from_global_and_per_leaf_and_spares_the_small_layer():
  erk = project_topk(TREE, 0.9, structure=ERK())[1]
  glob = project_topk(TREE, 0.9, structure=Global())[1]
  per_leaf = project_topk(TREE, 0.9, structure=PerLeaf())[1]
  dens = lambda m, k: float(np.mean(m[k]["kernel"]))
  # ERK: the 240-entry output layer is denser than the 768-entry input layer.
  assert dens(erk, "Dense_1") > dens(erk, "Dense_0")
  assert dens(per_leaf, "Dense_1") == pytest.approx(0.1, abs=0.01)
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(erk), jax.tree.leaves(glob)))


def test_structure_is_hashable_static_and_distinct():
  assert ERK() == ERK(1.0) and ERK() != ERK(0.5)
  assert ERK() != PerLeaf() and ERK() != Global()
  assert hash(ERK()) == hash(ERK(1.0))
  assert ERK(0) == ERK(0.0)


@pytest.mark.slow
def test_transforms_accept_erk_and_schedules_do_not_recompile():
  """GMP with a traced polynomial schedule under ERK: exact ERK counts, one compilation."""
  schedule = safe_optax.polynomial_sparsity(0.9, begin_step=0, end_step=4)
  tx = optax.chain(optax.sgd(0.1), safe_optax.magnitude_pruning(schedule, structure=ERK()))
  params = {k: v for k, v in TREE.items()}
  state = tx.init(params)
  compiles = []

  @jax.jit
  def step(params, state, batch):
    compiles.append(1)
    grads = jax.tree.map(lambda p: batch * p, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(6):
    params, state = step(params, state, jnp.float32(0.01 * (i + 1)))
  assert len(compiles) == 1
  leaves = [x for x in jax.tree.leaves(params) if x.ndim >= 2]
  counts = erk_keep_counts([x.shape for x in leaves], 0.9)
  assert [int(np.count_nonzero(x)) for x in leaves] == counts


@pytest.mark.slow
def test_safe_reaches_the_erk_allocation_after_finalize():
  tx = safe_optax.safe(0.05, 0.9, structure=ERK(), penalty=1.0, total_steps=20)
  params = TREE
  state = tx.init(params)
  grad_fn = lambda p, _: jax.tree.map(lambda x: 0.1 * x, p)
  step = jax.jit(lambda p, s: tx.update(grad_fn(p, 0), s, p, grad_fn=grad_fn))
  for _ in range(5):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  sparse, masks = safe_optax.finalize(params, 0.9, structure=ERK())
  leaves = [x for x in jax.tree.leaves(TREE) if x.ndim >= 2]
  counts = erk_keep_counts([x.shape for x in leaves], 0.9)
  assert [int(np.sum(m)) for m, x in zip(jax.tree.leaves(masks), jax.tree.leaves(TREE))
          if x.ndim >= 2] == counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_at_init_global_empties_the_mlp_input_layer_and_erk_does_not(seed):
  """The mechanism of CrAM's collapse at 99.5 % (results/erk_cram): at initialisation the
  input layer's weights are the smallest (fan-in 784), so one global top-k keeps
  none of them and the compressed model CrAM differentiates is constant. ERK's
  counts depend on the shapes only: every layer keeps weights, whatever the seed."""
  from safe_optax.vision import configs, models  # pylint: disable=import-outside-toplevel
  model = models.create_model(configs.get_config("mlp-fashion-mnist"), 10)
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 28, 28, 1)))["params"]
  kept = lambda structure: [int(m.sum()) for m in jax.tree.leaves(
      project_topk(params, 0.995, structure=structure)[1]) if m.ndim >= 2]
  assert kept(Global())[0] == 0
  assert kept(ERK()) == erk_keep_counts([(784, 300), (300, 100), (100, 10)], 0.995)
  assert min(kept(ERK())) > 0 and sum(kept(ERK())) == sum(kept(Global()))
