"""Bad inputs raise early, with a message that names the offending argument.

Construction-time checks run without any array work; the update- and
init-time checks use tiny trees and never reach a projection kernel, so this
file compiles almost nothing.
"""

from __future__ import annotations


import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax
from safe_optax import NM, PerOutput

PARAMS = {"w": jnp.arange(12.0).reshape(3, 4) - 5.0, "b": jnp.ones(4)}
GRADS = jax.tree.map(jnp.ones_like, PARAMS)


def grad_fn(params, step):
  del step
  return jax.tree.map(lambda p: 2.0 * p, params)


# Every constructor that takes a target sparsity; the others are set to valid values
# (total_steps is given so the cosine default of the SAFE aliases is valid).
SPARSITY_CONSTRUCTORS = {
    "admm_penalty": lambda s, **kw: safe_optax.admm_penalty(s, 1e-2, **kw),
    "add_projected_gradient": lambda s, **kw: safe_optax.add_projected_gradient(s, **kw),
    "safe": lambda s, **kw: safe_optax.safe(0.1, s, penalty=1e-2, total_steps=10, **kw),
    "safe_plus": lambda s, **kw: safe_optax.safe_plus(0.1, s, penalty=1e-2, total_steps=10, **kw),
    "admm": lambda s, **kw: safe_optax.admm(0.1, s, penalty=1e-2, **kw),
    "safe_sg": lambda s, **kw: safe_optax.safe_sg(0.1, s, penalty=1e-2, total_steps=10, **kw),
    "safe_multi": lambda s, **kw: safe_optax.safe(
        0.1, (0.5, s), penalty=1e-2, total_steps=10, **kw),
}
# Every constructor that takes penalty / dual_every / penalty_schedule.
PENALTY_CONSTRUCTORS = {
    "admm_penalty": lambda **kw: safe_optax.admm_penalty(0.5, **kw),
    "safe": lambda **kw: safe_optax.safe(0.1, 0.5, **kw),
    "safe_plus": lambda **kw: safe_optax.safe_plus(0.1, 0.5, **kw),
    "admm": lambda **kw: safe_optax.admm(0.1, 0.5, **kw),
    "safe_sg": lambda **kw: safe_optax.safe_sg(0.1, 0.5, **kw),
    "safe_multi": lambda **kw: safe_optax.safe(0.1, (0.5, 0.7), **kw),
}
VALID_PENALTY = dict(penalty=1e-2, total_steps=10)


# --------------------------------------------------------------------------
# Valid inputs construct: the error tests below are not vacuous.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPARSITY_CONSTRUCTORS)
def test_valid_sparsity_constructs(name):
  for s in (0.0, 0.5, 0.999):
    tx = SPARSITY_CONSTRUCTORS[name](s)
    assert callable(tx.init) and callable(tx.update)


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
def test_valid_penalty_arguments_construct(name):
  make = PENALTY_CONSTRUCTORS[name]
  for kw in (dict(penalty=0.0, total_steps=10), dict(penalty=1e-2, total_steps=10, dual_every=1),
             dict(penalty=2.0, penalty_schedule="linear", total_steps=3),
             dict(penalty=1.0, penalty_schedule="constant"),
             dict(penalty=optax.constant_schedule(1.0), penalty_schedule=None)):
    make(**kw)


# --------------------------------------------------------------------------
# Sparsity.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPARSITY_CONSTRUCTORS)
@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_sparsity_outside_unit_interval(name, sparsity):
  with pytest.raises(ValueError, match=r"`sparsity` must be in \[0, 1\)"):
    SPARSITY_CONSTRUCTORS[name](sparsity)


@pytest.mark.parametrize("name", SPARSITY_CONSTRUCTORS)
@pytest.mark.parametrize("sparsity", ["0.5", object(), {"a": 0.5}, 1j])
def test_sparsity_not_a_number(name, sparsity):
  with pytest.raises(TypeError, match="`sparsity`"):
    SPARSITY_CONSTRUCTORS[name](sparsity)


@pytest.mark.parametrize("name", ["admm_penalty", "add_projected_gradient", "safe", "admm"])
def test_sparsity_none_without_nm(name):
  with pytest.raises(ValueError, match="`sparsity` is required"):
    SPARSITY_CONSTRUCTORS[name](None)


def test_sparsity_choices_checked_one_by_one():
  with pytest.raises(ValueError, match=r"`sparsity` must be in \[0, 1\), got 1.0"):
    safe_optax.admm_penalty([0.5, 1.0], 1e-2)
  with pytest.raises(ValueError, match=r"`sparsity` must be in \[0, 1\), got -0.5"):
    safe_optax.add_projected_gradient((-0.5, 0.5))


@pytest.mark.parametrize("choices", [(), []])
def test_empty_sparsity_choices(choices):
  with pytest.raises(ValueError, match="`sparsity`.*must not be empty"):
    safe_optax.safe(0.1, choices, penalty=1e-2, total_steps=10)
  with pytest.raises(ValueError, match="`sparsity`.*must not be empty"):
    safe_optax.admm_penalty(choices, 1e-2)


# --------------------------------------------------------------------------
# dual_every, rho, penalty, penalty_schedule.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
@pytest.mark.parametrize("dual_every", [0, -1, 2.5, 8.0, "8", None, True])
def test_dual_every_must_be_positive_int(name, dual_every):
  with pytest.raises(ValueError, match="`dual_every` must be a positive int"):
    PENALTY_CONSTRUCTORS[name](dual_every=dual_every, **VALID_PENALTY)


@pytest.mark.parametrize("dual_every", [
    np.int64(0), jnp.asarray(-3), jnp.asarray(4.0), np.ones(2, np.int32), jnp.asarray([4])])
def test_dual_every_arrays_must_be_positive_integer_scalars(dual_every):
  with pytest.raises(ValueError, match="`dual_every` must be a positive int"):
    safe_optax.admm_penalty(0.5, 1e-2, dual_every=dual_every)


def test_integer_scalar_arrays_are_accepted_for_counts():
  """As optax.inject_hyperparams passes them (the error tests above are not over-eager)."""
  for value in (np.int64(8), np.int32(8), jnp.asarray(8), jnp.asarray(8, jnp.int16)):
    safe_optax.admm_penalty(0.5, 1e-2, dual_every=value, penalty_schedule="cosine",
                            total_steps=value)
  with pytest.raises(ValueError, match="`total_steps`"):
    safe_optax.admm_penalty(0.5, 1e-2, penalty_schedule="linear", total_steps=jnp.asarray(0))
  with pytest.raises(ValueError, match="`total_steps`"):
    safe_optax.admm_penalty(0.5, 1e-2, penalty_schedule="linear", total_steps=jnp.asarray(9.0))


@pytest.mark.parametrize("make", [
    lambda rho: safe_optax.sam_perturb(rho),
    lambda rho: safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=10, rho=rho),
    lambda rho: safe_optax.safe_plus(0.1, 0.5, penalty=1e-2, total_steps=10, rho=rho),
    lambda rho: safe_optax.safe_sg(0.1, 0.5, penalty=1e-2, total_steps=10, rho=rho),
    lambda rho: safe_optax.safe(0.1, (0.5,), penalty=1e-2, total_steps=10, rho=rho),
], ids=["sam_perturb", "safe", "safe_plus", "safe_sg", "safe_multi"])
def test_negative_rho(make):
  for rho in (-0.05, -1e-9, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="`rho` must be a finite number >= 0"):
      make(rho)
  with pytest.raises(TypeError, match="`rho`"):
    make("0.05")


def test_negative_eps():
  with pytest.raises(ValueError, match="`eps`"):
    safe_optax.sam_perturb(0.05, eps=-1e-12)


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
@pytest.mark.parametrize("penalty", [-1e-3, -1.0, float("nan"), float("inf"), -float("inf")])
def test_negative_or_non_finite_penalty(name, penalty):
  with pytest.raises(ValueError, match="`penalty` must be a finite number >= 0"):
    PENALTY_CONSTRUCTORS[name](penalty=penalty, total_steps=10)


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
def test_penalty_not_a_number(name):
  with pytest.raises(TypeError, match="`penalty`"):
    PENALTY_CONSTRUCTORS[name](penalty="1e-2", total_steps=10)
  with pytest.raises(TypeError, match="`penalty`"):
    PENALTY_CONSTRUCTORS[name](penalty=jnp.ones(2), total_steps=10)


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("total_steps", [None, 0, -5, 10.0, True])
def test_ramp_needs_positive_int_total_steps(name, schedule, total_steps):
  with pytest.raises(ValueError, match="`total_steps`"):
    PENALTY_CONSTRUCTORS[name](penalty=1e-2, penalty_schedule=schedule, total_steps=total_steps)


@pytest.mark.parametrize("name", ["safe", "safe_plus", "safe_sg", "safe_multi"])
def test_cosine_default_of_safe_aliases_needs_total_steps(name):
  with pytest.raises(ValueError, match="penalty_schedule='cosine' needs `total_steps`"):
    PENALTY_CONSTRUCTORS[name](penalty=1e-2)


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
@pytest.mark.parametrize("schedule", ["cos", "exponential", "Cosine", ""])
def test_unknown_penalty_schedule(name, schedule):
  with pytest.raises(ValueError, match="`penalty_schedule` must be one of"):
    PENALTY_CONSTRUCTORS[name](penalty=1e-2, penalty_schedule=schedule, total_steps=10)


@pytest.mark.parametrize("name", PENALTY_CONSTRUCTORS)
@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_penalty_schedule_with_ramp(name, schedule):
  with pytest.raises(ValueError, match="`penalty` is already a schedule.*`penalty_schedule`"):
    PENALTY_CONSTRUCTORS[name](penalty=optax.linear_schedule(0.0, 1.0, 10),
                               penalty_schedule=schedule, total_steps=10)


def test_negative_decoupled_learning_rate():
  with pytest.raises(ValueError, match="`learning_rate`"):
    safe_optax.admm_penalty(0.5, 1e-2, learning_rate=-0.1)
  with pytest.raises(ValueError, match="`learning_rate`"):
    safe_optax.safe(-0.1, 0.5, penalty=1e-2, total_steps=10, decoupled_penalty=True)


# --------------------------------------------------------------------------
# The penalty_schedule helper.
# --------------------------------------------------------------------------


def test_penalty_schedule_helper_values():
  lam = safe_optax.penalty_schedule(2.0, "linear", total_steps=4)
  assert [float(lam(t)) for t in (0, 2, 4, 8)] == [0.0, 1.0, 2.0, 2.0]
  lam = safe_optax.penalty_schedule(1.0, "cosine", total_steps=10)
  assert float(lam(5)) == pytest.approx(0.5)
  assert float(safe_optax.penalty_schedule(3.0)(100)) == 3.0
  sched = optax.constant_schedule(0.25)
  assert safe_optax.penalty_schedule(sched, None) is sched


@pytest.mark.parametrize("args, kwargs, error, pattern", [
    ((-1.0,), {}, ValueError, "`penalty` must be a finite number >= 0"),
    ((float("nan"), "linear", 10), {}, ValueError, "`penalty`"),
    (("0.1",), {}, TypeError, "`penalty`"),
    ((None,), {}, TypeError, "`penalty`"),
    ((1.0, "cosine"), {}, ValueError, "`total_steps`"),
    ((1.0, "linear"), {"total_steps": 0}, ValueError, "`total_steps`"),
    ((1.0, "linear"), {"total_steps": 2.5}, ValueError, "`total_steps`"),
    ((1.0, "cosine"), {"total_steps": "10"}, ValueError, "`total_steps`"),
    ((1.0, "step"), {"total_steps": 10}, ValueError, "`penalty_schedule` must be one of"),
    ((1.0, 3), {"total_steps": 10}, ValueError, "`penalty_schedule` must be one of"),
    ((optax.constant_schedule(1.0), "cosine"), {"total_steps": 10}, ValueError,
     "`penalty` is already a schedule"),
    ((lambda t: 1.0, "linear"), {"total_steps": 10}, ValueError, "`penalty_schedule`"),
])
def test_penalty_schedule_helper_errors(args, kwargs, error, pattern):
  with pytest.raises(error, match=pattern):
    safe_optax.penalty_schedule(*args, **kwargs)


# --------------------------------------------------------------------------
# Projection configuration: N:M, scope, structure, scores.
# --------------------------------------------------------------------------

STRUCTURED = {
    "admm_penalty": lambda s, **kw: safe_optax.admm_penalty(s, 1e-2, **kw),
    "add_projected_gradient": lambda s, **kw: safe_optax.add_projected_gradient(s, **kw),
    "safe": lambda s, **kw: safe_optax.safe(0.1, s, penalty=1e-2, total_steps=10, **kw),
    "admm": lambda s, **kw: safe_optax.admm(0.1, s, penalty=1e-2, **kw),
    "finalize": lambda s, **kw: safe_optax.finalize(PARAMS, s, **kw),
}


@pytest.mark.parametrize("name", STRUCTURED)
@pytest.mark.parametrize("n, m", [(3, 2), (5, 4), (0, 4), (-1, 4), (2.0, 4)])
def test_nm_needs_1_le_n_le_m(name, n, m):
  with pytest.raises(ValueError, match=r"NM\(n, m\) needs integers with 1 <= n <= m"):
    STRUCTURED[name](None, structure=NM(n, m))


@pytest.mark.parametrize("n, m, axis", [(3, 2, -2), (0, 4, -2), (2, 4.0, -2), (2, 4, 1.5),
                                         (True, 4, -2)])
def test_nm_is_checked_when_built(n, m, axis):
  """Before any transform or tree sees it."""
  with pytest.raises(ValueError, match=r"NM"):
    NM(n, m, axis)


NM_INIT = {
    "admm_penalty": lambda **kw: safe_optax.admm_penalty(None, 1e-2, **kw),
    "admm": lambda **kw: safe_optax.admm(0.1, None, penalty=1e-2, **kw),
    "safe": lambda **kw: safe_optax.safe(0.1, None, penalty=1e-2, total_steps=10, **kw),
    "add_projected_gradient": lambda **kw: safe_optax.add_projected_gradient(None, **kw),
    "safe_sg": lambda **kw: safe_optax.safe_sg(0.1, None, penalty=1e-2, total_steps=10, **kw),
}


@pytest.mark.parametrize("name", NM_INIT)
def test_nm_axis_not_divisible_raises_at_init_naming_the_path(name):
  params = {"params": {"Dense_0": {"kernel": jnp.ones((8, 3)), "bias": jnp.ones(3)},
                       "Dense_1": {"kernel": jnp.ones((6, 2)), "bias": jnp.ones(2)}}}
  tx = NM_INIT[name](structure=NM(2, 4))
  with pytest.raises(ValueError, match=r"leaf 'params/Dense_1/kernel' has 6 entries along "
                                       r"axis -2, not divisible by m=4"):
    tx.init(params)
  # Excluding that leaf through `prunable` is the way out the message gives.
  tx = NM_INIT[name](structure=NM(2, 4),
                     prunable=lambda path, leaf: jnp.ndim(leaf) == 2 and leaf.shape[0] % 4 == 0)
  tx.init(params)


def test_sparsity_report_of_a_tree_without_prunable_leaves():
  report = safe_optax.sparsity_report({"b": jnp.array([1.0, 0.0]), "scale": jnp.ones(3)})
  assert report.sparsity == 0.0 and report.prunable_size == 0
  assert report.overall_sparsity == pytest.approx(0.2)
  assert not any(leaf.prunable for leaf in report.leaves)
  assert "(dense)" in str(report)
  assert safe_optax.sparsity_report({}).sparsity == 0.0
  str(safe_optax.sparsity_report({}))


@pytest.mark.parametrize("name", STRUCTURED)
def test_nm_sparsity_mismatch(name):
  with pytest.raises(ValueError, match=r"`sparsity`=0.3 contradicts NM\(2, 4\)"):
    STRUCTURED[name](0.3, structure=NM(2, 4))
  if name != "finalize":  # (PARAMS has no axis divisible by 4 to actually project)
    STRUCTURED[name](0.5, structure=NM(2, 4))  # the consistent value is accepted


@pytest.mark.parametrize("name", STRUCTURED)
def test_unknown_structure_type(name):
  with pytest.raises(TypeError, match="`structure`"):
    STRUCTURED[name](0.5, structure=(2, 4))


@pytest.mark.parametrize("make", [
    lambda scores: safe_optax.admm_penalty(0.5, 1e-2, scores=scores),
    lambda scores: safe_optax.safe_plus(0.1, 0.5, penalty=1e-2, total_steps=10, scores=scores),
    lambda scores: safe_optax.admm(0.1, 0.5, penalty=1e-2, scores=scores),
], ids=["admm_penalty", "safe_plus", "admm"])
@pytest.mark.parametrize("scores", ["snip", "obd", "magnitude", "wanda", "", 0.5,
                                    lambda inputs: inputs.values])
def test_scores_that_are_not_saliencies(make, scores):
  with pytest.raises(TypeError, match=r"`scores` must be None \(magnitude\) or a "
                                      r"safe_optax.Saliency.*snip_saliency\(\)"):
    make(scores)


def test_obd_probes_must_be_positive_int():
  for bad in (0, -1, 1.5):
    with pytest.raises(ValueError, match="`num_probes`"):
      safe_optax.obd_saliency(bad)


def test_variant_aliases_reject_unknown_or_missing_keywords():
  with pytest.raises(TypeError, match="dual_evry"):
    safe_optax.safe_sg(0.1, 0.5, penalty=1e-2, total_steps=10, dual_evry=4)
  with pytest.raises(TypeError, match="penalty"):
    safe_optax.safe_plus(0.1, (0.5,), total_steps=10)
  for sam_keyword in ("rho", "adaptive", "max_grad_norm", "sparse_gradient"):
    with pytest.raises(TypeError, match=sam_keyword):
      safe_optax.admm(0.1, 0.5, penalty=1e-2, **{sam_keyword: None})


def test_magnitude_pruning_scores_is_a_saliency_callable_or_none():
  with pytest.raises(TypeError, match="`scores`"):
    safe_optax.magnitude_pruning(0.5, scores="snip")


# --------------------------------------------------------------------------
# update-time errors: missing grad_fn / params; extra args are ignored.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [
    (lambda: safe_optax.sam_perturb(0.05), "sam"),
    (lambda: safe_optax.add_projected_gradient(0.5), "add_projected_gradient"),
    (lambda: safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=10), "sam"),
    (lambda: safe_optax.safe_sg(0.1, 0.5, penalty=1e-2, total_steps=10), "sam"),
    (lambda: safe_optax.safe_sg(0.1, 0.5, penalty=1e-2, total_steps=10, rho=None),
     "add_projected_gradient"),
], ids=["sam_perturb", "add_projected_gradient", "safe", "safe_sg", "sg_without_sam"])
def test_missing_grad_fn_at_update(make, name):
  tx = make()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=rf"{name} needs `grad_fn`.*grad_fn\(params, step\)"):
    tx.update(GRADS, state, PARAMS)
  with pytest.raises(ValueError, match=rf"{name} needs `grad_fn`"):
    tx.update(GRADS, state, PARAMS, grad_fn=None, foo=1)


def test_obd_scores_need_grad_fn_at_update():
  tx = safe_optax.admm(0.1, 0.5, penalty=1e-2, scores=safe_optax.obd_saliency())
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="OBD scores need `grad_fn`"):
    jax.jit(lambda p, s: tx.update(GRADS, s, p))(PARAMS, state)


@pytest.mark.parametrize("make, name", [
    (lambda: safe_optax.admm_penalty(0.5, 1e-2), "admm_penalty"),
    (lambda: safe_optax.admm(0.1, 0.5, penalty=1e-2), "admm_penalty"),
    (lambda: safe_optax.sam_perturb(0.05), "sam"),
    (lambda: safe_optax.add_projected_gradient(0.5), "add_projected_gradient"),
], ids=["admm_penalty", "admm", "sam_perturb", "add_projected_gradient"])
def test_missing_params_at_update(make, name):
  tx = make()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=rf"{name} needs `params`"):
    tx.update(GRADS, state, grad_fn=grad_fn)
  with pytest.raises(ValueError, match=rf"{name} needs `params`"):
    tx.update(GRADS, state, None, grad_fn=grad_fn)


@pytest.mark.slow
def test_sam_perturb_ignores_unrelated_extra_args():
  tx = safe_optax.sam_perturb(0.5)
  state = tx.init(PARAMS)
  plain, s1 = tx.update(GRADS, state, PARAMS, grad_fn=grad_fn)
  extra, s2 = tx.update(GRADS, state, PARAMS, grad_fn=grad_fn, foo=1, bar="x")
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(extra)):
    np.testing.assert_array_equal(a, b)
  for s in (s1, s2):
    assert s.inner == optax.EmptyState() and int(s.invalid_hyperparams) == 0
  # And the result is really the gradient at the ascent point x + rho * g / ||g||.
  norm = float(optax.tree.norm(GRADS))
  expected = jax.tree.map(lambda p, g: 2.0 * (p + 0.5 * g / norm), PARAMS, GRADS)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


# --------------------------------------------------------------------------
# init-time errors: the prunable selection.
# --------------------------------------------------------------------------

INIT_TRANSFORMS = {
    "admm_penalty": lambda **kw: safe_optax.admm_penalty(0.5, 1e-2, **kw),
    "safe": lambda **kw: safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=10, **kw),
    "admm": lambda **kw: safe_optax.admm(0.1, 0.5, penalty=1e-2, **kw),
    "safe_multi": lambda **kw: safe_optax.safe(0.1, (0.5,), penalty=1e-2,
                                               total_steps=10, **kw),
}


@pytest.mark.parametrize("name", INIT_TRANSFORMS)
def test_no_prunable_leaves_at_init(name):
  tx = INIT_TRANSFORMS[name]()
  only_vectors = {"b1": jnp.ones(4), "b2": jnp.ones(3), "scale": jnp.float32(1.0)}
  with pytest.raises(ValueError, match="no prunable leaves among 3 leaves"):
    tx.init(only_vectors)
  ints_only = {"ids": jnp.zeros((3, 4), jnp.int32)}
  with pytest.raises(ValueError, match="no prunable leaves"):
    tx.init(ints_only)
  # An explicit selection of nothing is an error too.
  tx = INIT_TRANSFORMS[name](prunable=lambda path, leaf: False)
  with pytest.raises(ValueError, match="no prunable leaves"):
    tx.init(PARAMS)


@pytest.mark.parametrize("name", INIT_TRANSFORMS)
def test_integer_leaf_marked_prunable_at_init(name):
  params = {"emb": {"ids": jnp.zeros((3, 4), jnp.int32), "table": jnp.ones((4, 2))},
            "w": jnp.ones((2, 2))}
  mask = {"emb": {"ids": True, "table": True}, "w": False}
  tx = INIT_TRANSFORMS[name](prunable=mask)
  with pytest.raises(TypeError, match=r"leaf 'emb/ids' is selected as prunable but has dtype int32"):
    tx.init(params)
  # A prefix mask reaching the integer leaf names it as well.
  tx = INIT_TRANSFORMS[name](prunable={"emb": True, "w": True})
  with pytest.raises(TypeError, match=r"'emb/ids'"):
    tx.init(params)
  # Excluding it works: the state holds z for the selected float leaves only.
  tx = INIT_TRANSFORMS[name](prunable={"emb": {"ids": False, "table": True}, "w": True})
  admm = safe_optax.find_admm_state(tx.init(params))
  assert isinstance(admm.z["emb"]["ids"], optax.MaskedNode)
  assert admm.z["emb"]["table"].shape == (4, 2)


def test_integer_variable_of_nnx_state_is_named_without_value_suffix():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((3, 4)))
      self.steps = nnx.Variable(jnp.zeros((2, 2), jnp.int32))

  _, state = nnx.split(Model())
  tx = safe_optax.admm_penalty(0.5, 1e-2, prunable=lambda path, leaf: jnp.ndim(leaf) == 2)
  with pytest.raises(TypeError, match=r"leaf 'steps' is selected as prunable but has dtype int32"):
    tx.init(state)


def test_prunable_mask_of_wrong_structure_at_init():
  tx = safe_optax.admm_penalty(0.5, 1e-2, prunable={"w": True, "c": False})
  with pytest.raises(ValueError, match="`prunable` must be"):
    tx.init(PARAMS)


def test_find_admm_state_errors():
  with pytest.raises(ValueError, match="exactly one ADMMState.*found 0"):
    safe_optax.find_admm_state(optax.sgd(0.1).init(PARAMS))
  tx = optax.chain(safe_optax.admm_penalty(0.5, 1.0), safe_optax.admm_penalty(0.5, 1.0))
  with pytest.raises(ValueError, match="found 2"):
    safe_optax.find_admm_state(tx.init(PARAMS))


def test_state_of_other_params_is_rejected():
  tx = safe_optax.admm_penalty(0.5, 1.0)
  state = tx.init(PARAMS)
  other = {"w": jnp.ones((3, 4)), "b": jnp.ones(4), "v": jnp.ones((2, 2))}
  with pytest.raises(ValueError, match="does not belong to these parameters"):
    tx.update(jax.tree.map(jnp.zeros_like, other), state, other)


# --------------------------------------------------------------------------
# prunable: None, a callable or a pytree of bools; nothing else.
# --------------------------------------------------------------------------

PRUNABLE_TAKERS = {
    "finalize": lambda p: safe_optax.finalize(PARAMS, 0.5, prunable=p),
    "project_topk": lambda p: safe_optax.project_topk(PARAMS, 0.5, prunable=p),
    "prunable_mask": lambda p: safe_optax.prunable_mask(PARAMS, p),
    "safe": lambda p: safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=64, prunable=p),
    "admm_penalty": lambda p: safe_optax.admm_penalty(0.5, 1e-2, prunable=p),
    "add_projected_gradient": lambda p: safe_optax.add_projected_gradient(0.5, prunable=p),
    "cram": lambda p: safe_optax.cram(0.1, 0.5, prunable=p),
    "magnitude_pruning": lambda p: safe_optax.magnitude_pruning(0.5, prunable=p),
}


@pytest.mark.parametrize("name", PRUNABLE_TAKERS)
@pytest.mark.parametrize("bad", ["kernel", 1, 0.5, {"w": "kernel", "b": False}])
def test_prunable_that_is_no_bool_tree_nor_callable_is_refused(name, bad):
  """Read as bool, 'kernel' and 1 meant "prune everything" (norm scales and biases too)."""
  with pytest.raises(TypeError, match=r"`prunable` must be None.*a callable \(key_path, leaf\) "
                                      r"-> bool, or a pytree of bools"):
    PRUNABLE_TAKERS[name](bad)


def test_prunable_bool_trees_and_callables_still_work():
  assert safe_optax.prunable_mask(PARAMS, True) == jax.tree.map(lambda _: True, PARAMS)
  mask = jax.tree.map(lambda x: x.ndim >= 2, PARAMS)
  assert safe_optax.prunable_mask(PARAMS, mask) == mask
  assert safe_optax.prunable_mask(PARAMS, lambda path, leaf: leaf.ndim >= 2) == mask


# --------------------------------------------------------------------------
# A run too short for any dual update after the first is warned about.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda **kw: safe_optax.safe(0.1, 0.5, penalty=1e-2, **kw),
    lambda **kw: safe_optax.admm(0.1, 0.5, penalty=1e-2, penalty_schedule="linear", **kw),
    lambda **kw: safe_optax.admm_penalty(0.5, 1e-2, penalty_schedule="cosine", **kw),
], ids=["safe", "admm", "admm_penalty"])
def test_total_steps_not_above_dual_every_warns(make):
  for total_steps, dual_every in [(5, 10), (10, 10)]:
    with pytest.warns(UserWarning, match=rf"total_steps={total_steps} with "
                                         rf"dual_every={dual_every}.*no dual update"):
      make(total_steps=total_steps, dual_every=dual_every)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    make(total_steps=11, dual_every=10)
