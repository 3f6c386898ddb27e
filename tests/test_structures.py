"""The typed sparsity structures, ``Projection``, and the deprecated ``scope=`` / ``structure=None``.

Every public function that takes a sparsity set takes ``structure=`` with the
same default, ``Global()``; the old keywords still work for one release, with a
``DeprecationWarning`` that names the replacement, and give the same result.
"""

import inspect
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import safe_optax
from safe_optax import ERK, NM, Global, PerLeaf, PerOutput, Projection
from safe_optax import _structures

PARAMS = {"b": jnp.ones(3), "w1": jnp.array([[4., -3., 0.5], [0.2, 0.1, -2.]]),
          "w2": jnp.array([[0.01, -0.3], [0.7, 5.], [-0.05, 0.25]])}
ZERO = jax.tree.map(jnp.zeros_like, PARAMS)
GRAD_FN = lambda p, _: jax.tree.map(lambda x: 0.1 * x, p)

# Every public function with a sparsity set, built with the given keywords.
BUILDERS = {
    "project_topk": lambda **kw: safe_optax.project_topk(PARAMS, 0.5, **kw)[1],
    "finalize": lambda **kw: safe_optax.finalize(PARAMS, 0.5, **kw)[1],
    "admm_penalty": lambda **kw: safe_optax.admm_penalty(0.5, 1.0, **kw),
    "add_projected_gradient": lambda **kw: safe_optax.add_projected_gradient(0.5, **kw),
    "magnitude_pruning": lambda **kw: safe_optax.magnitude_pruning(0.5, **kw),
    "cram": lambda **kw: safe_optax.cram(0.1, 0.5, **kw),
    "safe": lambda **kw: safe_optax.safe(0.1, 0.5, penalty=1.0, total_steps=10, **kw),
    "safe_plus": lambda **kw: safe_optax.safe_plus(0.1, 0.5, penalty=1.0, total_steps=10, **kw),
    "admm": lambda **kw: safe_optax.admm(0.1, 0.5, penalty=1.0, **kw),
    "safe_sg": lambda **kw: safe_optax.safe_sg(0.1, 0.5, penalty=1.0, total_steps=10, **kw),
}
PUBLIC = {name: getattr(safe_optax, name) for name in BUILDERS}


def _masks(result):
  """Keep masks of a builder's result: the masks themselves, or z != 0 after one step."""
  if not isinstance(result, optax.GradientTransformation):
    return jax.tree.map(np.asarray, result)
  state = result.init(PARAMS)
  _, state = result.update(ZERO, state, PARAMS, grad_fn=GRAD_FN)
  for found in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
      s, (safe_optax.ADMMState, safe_optax.MagnitudePruningState))):
    if isinstance(found, safe_optax.ADMMState):
      return {k: np.asarray(v) != 0 for k, v in found.z.items() if k != "b"}
    if isinstance(found, safe_optax.MagnitudePruningState):
      return {k: np.asarray(v) for k, v in found.masks.items() if k != "b"}
  return None  # add_projected_gradient, cram: no mask in their state


# ---------------------------------------------------------------------------- the types


def test_structures_compare_by_type_and_fields():
  assert Global() != PerLeaf() and hash(Global()) != hash(PerLeaf())
  assert Global() == Global() and hash(Global()) == hash(Global())
  assert PerOutput(-1) != (-1,) and NM(2, 4) != (2, 4, -2)
  assert NM(2, 4) == NM(2, 4, -2) and NM(2, 4) != NM(2, 4, 0)
  assert len({Global(), PerLeaf(), PerOutput(), NM(2, 4), ERK(), Global()}) == 5
  assert ERK() == ERK(1) and ERK() != ERK(0.5) and ERK(0.0) != (0.0,)


KINDS = ["g", "l", "o", "nm", "erk"]


@given(st.sampled_from(KINDS), st.sampled_from(KINDS), st.integers(-3, 2), st.integers(-3, 2))
def test_equality_is_type_and_fields_property(kind_a, kind_b, axis_a, axis_b):
  make = {"g": lambda a: Global(), "l": lambda a: PerLeaf(), "o": PerOutput,
          "nm": lambda a: NM(1, 2, a), "erk": lambda a: ERK(abs(a) % 2)}
  a, b = make[kind_a](axis_a), make[kind_b](axis_b)
  same = type(a) is type(b) and tuple(a) == tuple(b)
  assert (a == b) is same and (a != b) is (not same)
  if same:
    assert hash(a) == hash(b)


@pytest.mark.slow
def test_structures_are_distinct_static_jit_arguments():
  """Equal-looking empty tuples must not share a compilation (Global vs PerLeaf)."""
  tree = {"a": jnp.array([[1., 2.]]), "b": jnp.array([[3., 4.]])}
  project = jax.jit(lambda t, structure: safe_optax.project_topk(t, 0.5, structure=structure)[0],
                    static_argnames="structure")
  assert project(tree, Global())["a"].tolist() == [[0., 0.]]
  assert project(tree, PerLeaf())["a"].tolist() == [[0., 2.]]


def test_structures_pickle_and_keep_their_checks():
  for structure in (Global(), PerLeaf(), PerOutput(0), NM(2, 4, -1), ERK(0.5)):
    assert pickle.loads(pickle.dumps(structure)) == structure
  with pytest.raises(ValueError, match="PerOutput `axis` must be an int"):
    PerOutput(1.5)
  with pytest.raises(ValueError, match="PerOutput `axis`"):  # _replace bypasses __new__
    safe_optax.project_topk(PARAMS, 0.5, structure=PerOutput()._replace(axis="x"))
  with pytest.raises(ValueError, match="ERK `power_scale`"):
    safe_optax.project_topk(PARAMS, 0.5, structure=ERK()._replace(power_scale=-2.0))


def test_check_config_returns_the_typed_structure():
  for structure in (Global(), PerLeaf(), PerOutput(), ERK()):
    assert _structures.check_config(0.5, structure) is structure
  assert _structures.check_config(None, NM(2, 4)) == NM(2, 4)
  with pytest.raises(ValueError, match="`sparsity` is required"):
    _structures.check_config(None, ERK())
  with pytest.raises(TypeError, match=r"`structure` must be one of Global\(\), PerLeaf\(\), "
                                      r"PerOutput\(axis\), NM\(n, m, axis\) or "
                                      r"ERK\(power_scale\), got 'global'"):
    _structures.check_config(0.5, "global")


@pytest.mark.parametrize("name", PUBLIC)
def test_one_default_everywhere(name):
  params = inspect.signature(PUBLIC[name]).parameters
  assert params["structure"].default == Global()
  assert type(params["structure"].default) is Global
  assert "scope" not in params  # removed before 0.1.0: one way to name a structure


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("bad, error, match", [
    ("per_leaf", TypeError, r"`structure` must be one of Global\(\), PerLeaf\(\)"),
    ((2, 4), TypeError, r"`structure` must be one of"),
])
def test_bad_structure_raises_at_construction_naming_allowed_values(name, bad, error, match):
  with pytest.raises(error, match=match):
    BUILDERS[name](structure=bad)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("bad", [None, "global", "per_leaf"])
def test_the_removed_forms_of_structure_are_refused(name, bad):
  """``structure=None`` and the strings of the removed ``scope=`` are not structures."""
  with pytest.raises(TypeError, match=r"`structure` must be one of Global\(\), PerLeaf\(\)"):
    BUILDERS[name](structure=bad)


@pytest.mark.parametrize("name", BUILDERS)
def test_scope_keyword_is_gone(name):
  with pytest.raises(TypeError, match="scope"):
    BUILDERS[name](scope="global")


@pytest.mark.slow
def test_per_leaf_and_global_differ_on_this_tree():
  """So the equivalence tests above compare two different answers, not one."""
  global_masks = _masks(BUILDERS["project_topk"](structure=Global()))
  per_leaf_masks = _masks(BUILDERS["project_topk"](structure=PerLeaf()))
  assert not np.array_equal(global_masks["w1"], per_leaf_masks["w1"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in BUILDERS if n not in ("add_projected_gradient", "cram")])
def test_every_builder_takes_erk_and_keeps_its_counts(name):
  """Each function with a sparsity set keeps exactly the ERK count in every leaf."""
  counts = safe_optax.erk_keep_counts([PARAMS["w1"].shape, PARAMS["w2"].shape], 0.5)
  masks = _masks(BUILDERS[name](structure=ERK()))
  assert [int(np.sum(masks["w1"])), int(np.sum(masks["w2"]))] == counts
  # ERK's allocation (3 and 3: equal shapes sums and sizes) is not Global's (4 and 2)
  # on this tree, so a builder that dropped the structure would fail.
  global_masks = _masks(BUILDERS["project_topk"](structure=Global()))
  assert [int(np.sum(global_masks["w1"])), int(np.sum(global_masks["w2"]))] != counts


@pytest.mark.slow
def test_no_deprecation_warning_anywhere():
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    for build in BUILDERS.values():
      _masks(build())
      _masks(build(structure=PerLeaf()))


# ---------------------------------------------------------------------------- Projection


@pytest.mark.slow
def test_projection_feeds_project_topk_finalize_and_the_transforms():
  projection = Projection(0.5, PerLeaf(), prunable=lambda path, leaf: path[0].key == "w1")
  masks = safe_optax.project_topk(PARAMS, **projection._asdict())[1]
  assert masks["w2"].all() and int(masks["w1"].sum()) == 3
  final = safe_optax.finalize(PARAMS, **projection._asdict())[1]
  assert jax.tree.all(jax.tree.map(np.array_equal, masks, final))
  tx = safe_optax.admm_penalty(projection.sparsity, 1.0, structure=projection.structure,
                               prunable=projection.prunable)
  _, state = tx.update(ZERO, tx.init(PARAMS), PARAMS)
  np.testing.assert_array_equal(np.asarray(state.z["w1"]) != 0, masks["w1"])
  assert isinstance(state.z["w2"], optax.MaskedNode)


@pytest.mark.parametrize("args, error, match", [
    ((None,), ValueError, "`sparsity` is required"),
    ((1.0,), ValueError, r"`sparsity` must be in \[0, 1\)"),
    ((0.3, NM(2, 4)), ValueError, r"contradicts NM\(2, 4\)"),
    ((0.5, "per_leaf"), TypeError, "`structure` must be one of"),
])
def test_projection_is_checked_when_built(args, error, match):
  with pytest.raises(error, match=match):
    Projection(*args)


def test_projection_defaults():
  assert Projection(0.9) == Projection(0.9, Global(), None)
  assert Projection(None, NM(2, 4)).sparsity is None
