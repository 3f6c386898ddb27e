"""Composition with the optax wrappers, each call with a different minibatch.

Every recipe gives what a plain-JAX reference computes:

* ``masked`` / ``multi_transform`` around a transform with a gradient pass
  (``sam``, ``sam_perturb``, ``add_projected_gradient``, ``cram``) is refused
  at ``init`` (``MaskedNode`` in ``params``), naming the recipe;
* ``safe_optax.sam(wrapper(safe(..., rho=None)), rho)``: ``MultiSteps`` averages
  per-micro-batch SAM gradients, ``apply_if_finite`` counts a NaN from SAM's
  pass, any clip (named, nested, injected) clips the SAM gradient;
* ``masked`` / ``multi_transform`` around ``admm_penalty`` (prune a subset);
* ``inject_hyperparams`` values out of range: ignored and counted in the state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax

LR = 0.1
RHO = 0.2
SHAPES = {"enc": (6, 8), "dec": (8, 3)}
N_ENC = 6 * 8


def init_params(seed: int = 0) -> dict:
  keys = jax.random.split(jax.random.PRNGKey(seed), len(SHAPES))
  return {name: {"kernel": jax.random.normal(key, shape) / math.sqrt(shape[0]),
                 "bias": jnp.full((shape[1],), 0.1, jnp.float32)}
          for key, (name, shape) in zip(keys, SHAPES.items())}


def batch(t: int, n: int = 16):
  """Minibatch ``t``: different inputs and targets at every call."""
  kx, kw = jax.random.split(jax.random.PRNGKey(100 + t))
  x = jax.random.normal(kx, (n, 6))
  return x, jnp.tanh(x @ jax.random.normal(kw, (6, 3)))


def loss(params, x, y):
  h = jnp.tanh(x @ params["enc"]["kernel"] + params["enc"]["bias"])
  return jnp.mean((h @ params["dec"]["kernel"] + params["dec"]["bias"] - y) ** 2)


def grad_fn_of(x, y):
  return lambda p, _: jax.grad(loss)(p, x, y)


def ref_sam_grad(params, x, y, rho=RHO):
  """SAM's gradient in plain JAX: grad f(x + rho g / ||g||) on the same minibatch."""
  g = jax.grad(loss)(params, x, y)
  norm = jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(g)))
  return jax.grad(loss)(jax.tree.map(lambda p, d: p + rho * d / (norm + 1e-12), params, g),
                        x, y)


def make_step(tx):
  @jax.jit
  def step(params, state, x, y, grad_fn_scale=jnp.float32(1.0)):
    grads = jax.grad(loss)(params, x, y)
    # grad_fn_scale=NaN poisons only the transforms' own gradient passes.
    grad_fn = lambda p, _: jax.tree.map(lambda g: g * grad_fn_scale, jax.grad(loss)(p, x, y))
    updates, state = tx.update(grads, state, params, grad_fn=grad_fn)
    return optax.apply_updates(params, updates), state
  return step


def assert_trees_close(a, b, **kw):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def find(state, kind):
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, kind))
           if isinstance(s, kind)]
  assert len(found) == 1
  return found[0]


def body(**kw):
  """SAFE without SAM: what goes inside a wrapper, after ``sam_perturb``."""
  kw = dict(dict(penalty=0.5, penalty_schedule="constant", dual_every=2, momentum=0.9,
                 rho=None), **kw)
  return safe_optax.safe(LR, 0.5, **kw)


# --------------------------------------------------------------------------
# A gradient pass inside optax.masked / multi_transform (MaskedNode in params)
# is refused at init; the other wrappers go inside safe_optax.sam.
# --------------------------------------------------------------------------

GRAD_PASS = {
    "sam": (lambda: safe_optax.sam(optax.sgd(LR), RHO), "sam"),
    "sam_perturb": (lambda: safe_optax.sam_perturb(RHO), "sam"),
    "add_projected_gradient": (lambda: safe_optax.add_projected_gradient(0.5),
                               "add_projected_gradient"),
    "cram": (lambda: safe_optax.cram(RHO, 0.5), "cram"),
    "safe": (lambda: safe_optax.safe(LR, 0.5, penalty=1e-2, total_steps=10), "sam"),
    "safe_sg_without_sam": (
        lambda: safe_optax.safe_sg(LR, 0.5, penalty=1e-2, total_steps=10, rho=None),
        "add_projected_gradient"),
}
MASKS = {
    "optax.masked": lambda tx: optax.masked(tx, {"enc": True, "dec": False}),
    "optax.multi_transform": lambda tx: optax.multi_transform(
        {"a": tx, "b": optax.sgd(LR)}, {"enc": "a", "dec": "b"}),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", GRAD_PASS)
def test_a_gradient_pass_inside_a_mask_is_refused_at_init(name, mask):
  make, transform = GRAD_PASS[name]
  tx = MASKS[mask](make())
  pattern = (rf"{transform} inside optax.masked / optax.multi_transform.*"
             r"safe_optax\.sam\(optax\.masked\(safe_optax\.safe\(\.\.\., rho=None\)")
  with pytest.raises(ValueError, match=pattern):
    tx.init(init_params())
  with pytest.raises(ValueError, match=pattern):  # also when traced
    jax.jit(tx.init)(init_params())


def test_the_same_transforms_unwrapped_still_initialise():
  for make, _ in GRAD_PASS.values():
    make().init(init_params())


def test_sam_perturb_is_sam_around_identity():
  step_a = make_step(optax.chain(safe_optax.sam_perturb(RHO), body()))
  step_b = make_step(safe_optax.sam(body(), RHO))
  params_a = params_b = init_params()
  state_a, state_b = (tx.init(params_a) for tx in (optax.chain(safe_optax.sam_perturb(RHO),
                                                                 body()),
                                                     safe_optax.sam(body(), RHO)))
  for t in range(4):
    x, y = batch(t)
    params_a, state_a = step_a(params_a, state_a, x, y)
    params_b, state_b = step_b(params_b, state_b, x, y)
    assert_trees_close(params_a, params_b, rtol=0, atol=0)


# --------------------------------------------------------------------------
# MultiSteps inside sam: the mean of per-micro-batch SAM gradients.
# --------------------------------------------------------------------------


def test_multisteps_inside_sam_averages_per_micro_batch_sam_gradients():
  k, emits = 3, 3
  tx = safe_optax.sam(optax.MultiSteps(body(), every_k_schedule=k), RHO)
  step = make_step(tx)
  reference = body()
  params = ref_params = init_params()
  state, ref_state = tx.init(params), reference.init(params)
  t = 0
  for _ in range(emits):
    sam_grads = []
    for micro in range(k):
      x, y = batch(t)
      t += 1
      sam_grads.append(ref_sam_grad(ref_params, x, y))
      new_params, state = step(params, state, x, y)
      if micro < k - 1:  # accumulating: nothing applied yet
        assert_trees_close(new_params, params, rtol=0, atol=0)
      params = new_params
    mean = jax.tree.map(lambda *g: sum(g) / k, *sam_grads)
    updates, ref_state = reference.update(mean, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    assert_trees_close(params, ref_params, rtol=2e-5, atol=1e-6)
    assert int(safe_optax.find_admm_state(state).count) == int(
        safe_optax.find_admm_state(ref_state).count)
  # The last micro-batch alone would have given something else: the test can tell.
  last_only = optax.apply_updates(init_params(), reference.update(
      sam_grads[-1], reference.init(init_params()), init_params())[0])
  assert not np.allclose(np.asarray(last_only["enc"]["kernel"]),
                         np.asarray(ref_params["enc"]["kernel"]), atol=1e-3)


# --------------------------------------------------------------------------
# apply_if_finite inside sam: a NaN from SAM's own pass counts as non-finite.
# --------------------------------------------------------------------------


def test_apply_if_finite_inside_sam_counts_a_nan_from_the_sam_pass():
  tx = safe_optax.sam(optax.apply_if_finite(body(), 3), RHO)
  step = make_step(tx)
  params = init_params()
  state = tx.init(params)
  nan_step = 3
  for t in range(6):
    x, y = batch(t)
    scale = jnp.float32(jnp.nan if t == nan_step else 1.0)
    new_params, new_state = step(params, state, x, y, scale)
    guard = find(new_state, optax.ApplyIfFiniteState)
    admm_in, admm_out = (safe_optax.find_admm_state(s) for s in (state, new_state))
    if t == nan_step:
      # The clean gradient is finite; only the ascent-point gradient is NaN.
      assert all(np.isfinite(g).all() for g in jax.tree.leaves(jax.grad(loss)(params, x, y)))
      assert int(guard.notfinite_count) == 1 and int(guard.total_notfinite) == 1
      assert_trees_close(new_params, params, rtol=0, atol=0)
      assert_trees_close(admm_out, admm_in, rtol=0, atol=0)
    else:
      assert int(guard.notfinite_count) == 0
      assert int(admm_out.count) == int(admm_in.count) + 1
      assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(new_params))
    params, state = new_params, new_state
  assert int(find(state, optax.ApplyIfFiniteState).total_notfinite) == 1


# --------------------------------------------------------------------------
# Clipping: max_grad_norm, or any clip inside sam, clips the SAM gradient.
# --------------------------------------------------------------------------

MAX_NORM = 0.05
UNCLIPPED = dict(penalty=0.0, penalty_schedule="constant", momentum=0.0, dual_every=2)


def _inner_safe():
  return safe_optax.safe(LR, 0.5, rho=None, **UNCLIPPED)


CLIPPED = {
    "argument": lambda: safe_optax.safe(LR, 0.5, rho=RHO, max_grad_norm=MAX_NORM, **UNCLIPPED),
    "chain_after_sam_perturb": lambda: optax.chain(
        safe_optax.sam_perturb(RHO), optax.clip_by_global_norm(MAX_NORM), _inner_safe()),
    # The three forms a frame-reading check used to miss, now clipped by construction.
    "sam_named_chain": lambda: safe_optax.sam(optax.named_chain(
        ("clip", optax.clip_by_global_norm(MAX_NORM)), ("safe", _inner_safe())), RHO),
    "sam_nested_chain": lambda: safe_optax.sam(optax.chain(
        optax.chain(optax.clip_by_global_norm(MAX_NORM)), _inner_safe()), RHO),
    "sam_injected_clip": lambda: safe_optax.sam(optax.chain(
        optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=MAX_NORM),
        _inner_safe()), RHO),
}


@pytest.mark.parametrize("form", CLIPPED)
def test_clipping_clips_the_sam_gradient(form):
  tx = CLIPPED[form]()
  step = make_step(tx)
  params = init_params()
  state = tx.init(params)
  for t in range(4):
    x, y = batch(t)
    g = ref_sam_grad(params, x, y)
    norm = float(optax.tree.norm(g))
    assert norm > 2 * MAX_NORM  # clipping is active
    expected = jax.tree.map(lambda p, gi: p - LR * gi * (MAX_NORM / norm), params, g)
    new_params, state = step(params, state, x, y)
    assert_trees_close(new_params, expected, rtol=1e-5, atol=1e-7)
    assert float(optax.tree.norm(optax.tree.sub(new_params, params))) <= LR * MAX_NORM * 1.0001
    params = new_params


def test_a_clip_before_sam_perturb_only_moves_the_ascent_point():
  """Why the docs say clip inside sam: a clip before sam_perturb is not detected, and
  the update equals the unclipped one but for the ascent direction (norm-free)."""
  clipped_before = optax.chain(optax.clip_by_global_norm(MAX_NORM), safe_optax.sam_perturb(RHO),
                               _inner_safe())
  plain = optax.chain(safe_optax.sam_perturb(RHO), _inner_safe())
  step_a, step_b = make_step(clipped_before), make_step(plain)
  params = init_params()
  a, _ = step_a(params, clipped_before.init(params), *batch(0))
  b, _ = step_b(params, plain.init(params), *batch(0))
  assert_trees_close(a, b, rtol=1e-5, atol=1e-7)  # SAM normalises the direction
  assert float(optax.tree.norm(optax.tree.sub(a, params))) > 2 * LR * MAX_NORM


def test_max_grad_norm_is_checked_at_construction():
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="`max_grad_norm` must be a finite number >= 0"):
      safe_optax.safe(LR, 0.5, penalty=1e-2, total_steps=10, max_grad_norm=bad)


# --------------------------------------------------------------------------
# masked / multi_transform: prune only the encoder.
# --------------------------------------------------------------------------

ENC_KERNEL_ONLY = {"enc": {"kernel": True, "bias": False}, "dec": {"kernel": False, "bias": False}}


def test_masked_admm_prunes_only_the_masked_in_leaves():
  tx = optax.masked(safe_optax.admm(LR, 0.5, penalty=0.5, dual_every=2),
                    {"enc": True, "dec": False})
  step = make_step(tx)
  params = init_params()
  state = tx.init(params)
  for t in range(5):
    x, y = batch(t)
    grads = jax.grad(loss)(params, x, y)
    new_params, state = step(params, state, x, y)
    # optax.masked passes the masked-out updates through: the raw gradient.
    assert_trees_close(jax.tree.map(lambda a, b: a - b, new_params["dec"], params["dec"]),
                       grads["dec"], rtol=1e-5, atol=1e-7)
    params = new_params
  admm = safe_optax.find_admm_state(state)
  assert isinstance(admm.z["dec"], optax.MaskedNode)
  assert isinstance(admm.z["enc"]["bias"], optax.MaskedNode)
  z = np.asarray(admm.z["enc"]["kernel"])
  assert np.count_nonzero(z) == safe_optax.num_keep(N_ENC, 0.5)
  assert float(safe_optax.constraint_distance(params, state)) > 0


def test_multi_transform_recipe_equals_safe_with_a_prunable_subset():
  """sam(multi_transform({prune: safe(rho=None), dense: sgd})) == safe(prunable=...)."""
  kw = dict(penalty=0.5, total_steps=8, dual_every=2, momentum=0.9)
  tx = safe_optax.sam(
      optax.multi_transform(
          {"prune": safe_optax.safe(LR, 0.5, rho=None, **kw),
           "dense": optax.sgd(LR, momentum=0.9)},
          {"enc": "prune", "dec": "dense"}),
      RHO)
  reference = safe_optax.safe(LR, 0.5, rho=RHO, prunable=ENC_KERNEL_ONLY, **kw)
  step, ref_step = make_step(tx), make_step(reference)
  params = ref_params = init_params()
  state, ref_state = tx.init(params), reference.init(params)
  for t in range(6):
    x, y = batch(t)
    params, state = step(params, state, x, y)
    ref_params, ref_state = ref_step(ref_params, ref_state, x, y)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-7)
  z = safe_optax.find_admm_state(state).z
  z_ref = safe_optax.find_admm_state(ref_state).z
  np.testing.assert_array_equal(np.asarray(z["enc"]["kernel"]) != 0,
                                np.asarray(z_ref["enc"]["kernel"]) != 0)
  sparse, _ = safe_optax.finalize(params, 0.5, prunable=ENC_KERNEL_ONLY)
  assert np.count_nonzero(np.asarray(sparse["enc"]["kernel"])) == safe_optax.num_keep(N_ENC, 0.5)
  np.testing.assert_array_equal(sparse["dec"]["kernel"], params["dec"]["kernel"])


# --------------------------------------------------------------------------
# inject_hyperparams: traced values out of range are ignored and counted.
# --------------------------------------------------------------------------


def _inject_run(hyperparams_per_step):
  tx = optax.inject_hyperparams(safe_optax.admm)(
      learning_rate=LR, sparsity=0.5, penalty=0.5, dual_every=1)
  step = make_step(tx)
  params = init_params()
  state = tx.init(params)
  records = []
  for t, overrides in enumerate(hyperparams_per_step):
    for name, value in overrides.items():
      state.hyperparams[name] = jnp.full_like(state.hyperparams[name], value)  # keeps weak type
    x, y = batch(t)
    new_params, new_state = step(params, state, x, y)
    records.append((params, state, new_params, new_state))
    params, state = new_params, new_state
  assert step._cache_size() == 1
  return records


@pytest.mark.parametrize("bad", [1.5, 1.0, -0.1, float("nan"), float("inf")])
def test_inject_hyperparams_invalid_sparsity_skips_the_dual_update_and_is_counted(bad):
  records = _inject_run([{}, {"sparsity": bad}, {"sparsity": bad}, {"sparsity": 0.5}])
  keep = safe_optax.num_keep(N_ENC + 8 * 3, 0.5)
  for t, (_, state_in, params_out, state_out) in enumerate(records):
    admm_in, admm_out = (safe_optax.find_admm_state(s) for s in (state_in, state_out))
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params_out))
    z_out = [np.asarray(leaf) for leaf in jax.tree.leaves(admm_out.z)]
    assert sum(np.count_nonzero(z) for z in z_out) == keep  # never 1 weight, never dense
    if t in (1, 2):
      assert_trees_close(admm_out.z, admm_in.z, rtol=0, atol=0)  # z and u kept
      assert_trees_close(admm_out.u, admm_in.u, rtol=0, atol=0)
    assert int(admm_out.invalid_hyperparams) == min(t, 2)


@pytest.mark.parametrize("bad", [0, -3])
def test_inject_hyperparams_invalid_dual_every_skips_the_dual_update_and_is_counted(bad):
  records = _inject_run([{}, {"dual_every": bad}, {"dual_every": 1}])
  (_, state_in, params_out, state_out) = records[1]
  admm_in, admm_out = (safe_optax.find_admm_state(s) for s in (state_in, state_out))
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params_out))
  assert_trees_close(admm_out.z, admm_in.z, rtol=0, atol=0)
  assert_trees_close(admm_out.u, admm_in.u, rtol=0, atol=0)
  assert int(admm_out.invalid_hyperparams) == 1
  last_in, last_out = (safe_optax.find_admm_state(s) for s in records[2][1::2])
  assert int(last_out.invalid_hyperparams) == 1
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(last_in.u),
                                                      jax.tree.leaves(last_out.u)))


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_inject_hyperparams_invalid_penalty_counts_as_zero_and_is_counted(bad):
  records = _inject_run([{}, {"penalty": bad}])
  zero = _inject_run([{}, {"penalty": 0.0}])
  (_, _, params_bad, state_bad), (_, _, params_zero, state_zero) = records[1], zero[1]
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params_bad))
  assert_trees_close(params_bad, params_zero, rtol=0, atol=0)
  assert int(safe_optax.find_admm_state(state_bad).invalid_hyperparams) == 1
  assert int(safe_optax.find_admm_state(state_zero).invalid_hyperparams) == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_inject_hyperparams_invalid_rho_is_ignored_and_counted(bad):
  """A negative rho would step downhill, a NaN one poison the weights: rho = 0 is used."""
  make = lambda rho: optax.inject_hyperparams(safe_optax.safe)(
      learning_rate=LR, sparsity=0.5, penalty=0.5, rho=rho, dual_every=2, total_steps=8)
  txs = {"bad": make(RHO), "zero": make(0.0)}
  steps = {k: make_step(tx) for k, tx in txs.items()}
  params = {k: init_params() for k in txs}
  states = {k: tx.init(params[k]) for k, tx in txs.items()}
  for t in range(4):
    x, y = batch(t)
    if t == 2:
      states["bad"].hyperparams["rho"] = jnp.full_like(states["bad"].hyperparams["rho"], bad)
    for k in txs:
      if t == 2 or k == "bad":
        params[k], states[k] = steps[k](params[k], states[k], x, y)
    if t < 2:  # "zero" restarts from "bad"'s state, with rho = 0 (a fresh dict)
      params["zero"] = params["bad"]
      states["zero"] = states["bad"]._replace(hyperparams=dict(
          states["bad"].hyperparams, rho=jnp.zeros_like(states["bad"].hyperparams["rho"])))
    if t == 2:
      assert_trees_close(params["bad"], params["zero"], rtol=0, atol=0)
      assert float(states["zero"].hyperparams["rho"]) == 0.0
      states["bad"].hyperparams["rho"] = jnp.full_like(states["bad"].hyperparams["rho"], RHO)
  sam_state = find(states["bad"], safe_optax.SAMState)
  assert int(sam_state.invalid_hyperparams) == 1
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params["bad"]))
  assert steps["bad"]._cache_size() == 1
