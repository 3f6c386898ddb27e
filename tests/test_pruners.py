"""Tests for the baseline pruners: `polynomial_sparsity`, `magnitude_pruning`, `cram`.

Each numerical claim is checked against a plain numpy reference written here:

* the schedule, against Zhu & Gupta's formula in float64 (fixed cases and
  hypothesis properties on edge cases: clamping, grid steps, exact end value);
* GMP (cubic schedule, SGD with momentum, mask every 5 steps) over 50 steps on
  a linear-regression problem, step by step: parameters, masks, exact zeros,
  exact final sparsity, masks held between updates, biases untouched;
* CrAM / CrAM+ (normalised and the paper's plain ascent step, sparse gradient,
  Multi draws), step by step inside a chain with SGD.

Plus: one compile for many steps (mask updates and plain steps),
``inject_hyperparams`` with traced sparsity, bfloat16, N:M masks, saliency
scores, ``update_until``, and every construction-time error.

Cost: every jitted program compiles the projection kernel (1-3 s on a 2-core
CPU), so the module jits a handful of programs and reuses them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import safe_optax
from safe_optax import NM

# --------------------------------------------------------------------------
# polynomial_sparsity
# --------------------------------------------------------------------------


def reference_sparsity(t, final, begin, end, initial=0.0, power=3, every=1):
  """Zhu & Gupta, Eq. (1), with the value held between grid steps (float64)."""
  if t <= begin:
    return initial
  if t >= end:
    return final
  tau = begin + every * ((t - begin) // every)
  return final + (initial - final) * (1.0 - (tau - begin) / (end - begin)) ** power


@pytest.mark.parametrize("kwargs", [
    dict(final_sparsity=0.9, begin_step=0, end_step=100),
    dict(final_sparsity=0.95, begin_step=20, end_step=120, initial_sparsity=0.5, power=1),
    dict(final_sparsity=0.98, begin_step=7, end_step=50, power=2.5, update_every=6),
    dict(final_sparsity=0.8, begin_step=0, end_step=391 * 30, power=1, update_every=391 * 10),
])
def test_schedule_matches_reference(kwargs):
  schedule = safe_optax.polynomial_sparsity(**kwargs)
  end = kwargs["end_step"]
  # 128 steps (one shape: the eager ops compile once for every schedule test).
  steps = np.unique(np.concatenate([np.arange(0, 64), np.linspace(0, end + 10, 64).astype(int)]))
  steps = np.concatenate([steps, np.full(128 - steps.size, end + 10)])
  got = np.asarray(schedule(jnp.asarray(steps)))
  want = [reference_sparsity(int(t), kwargs["final_sparsity"], kwargs["begin_step"], end,
                             kwargs.get("initial_sparsity", 0.0), kwargs.get("power", 3),
                             kwargs.get("update_every", 1)) for t in steps]
  np.testing.assert_allclose(got, want, atol=2e-7, rtol=0)
  assert got.dtype == np.float32


def test_schedule_cubic_values_and_jit():
  schedule = safe_optax.polynomial_sparsity(0.9, begin_step=0, end_step=100)
  steps = jnp.arange(128)
  # s(50) = 0.9 (1 - 0.5^3) = 0.7875; traced steps give the same values.
  assert float(schedule(steps)[50]) == pytest.approx(0.7875, abs=1e-7)
  np.testing.assert_allclose(jax.jit(schedule)(steps), schedule(steps), rtol=0, atol=1.2e-7)


@given(
    final=st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.99, 0.995]),
    initial_frac=st.sampled_from([0.0, 0.3, 1.0]),
    begin=st.integers(0, 50),
    length=st.integers(1, 60),
    power=st.sampled_from([0.5, 1, 2, 3, 7.5]),
    every=st.integers(1, 70),
)
def test_schedule_properties(final, initial_frac, begin, length, power, every):
  initial = final * initial_frac
  end = begin + length
  schedule = safe_optax.polynomial_sparsity(final, begin_step=begin, end_step=end,
                                            initial_sparsity=initial, power=power,
                                            update_every=every)
  # One fixed shape (end <= 110), so the eager ops compile once for all examples.
  steps = np.arange(128)
  values = np.asarray(schedule(jnp.asarray(steps)))
  want = [reference_sparsity(int(t), final, begin, end, initial, power, every) for t in steps]
  np.testing.assert_allclose(values, want, atol=2e-7, rtol=0)
  # Bounded, non-decreasing, initial before the ramp, bit-exact final value at the end.
  assert np.all(values >= np.float32(initial) - 1e-7) and np.all(values <= np.float32(final))
  assert np.all(np.diff(values) >= 0)
  assert np.all(values[:begin + 1] == np.float32(initial))
  assert np.all(values[end:] == np.float32(final))
  # Piecewise constant: it only changes on the grid begin + k * every, or at end.
  changes = steps[1:][np.diff(values) != 0]
  assert all((t - begin) % every == 0 or t == end for t in changes)


# --------------------------------------------------------------------------
# magnitude_pruning: GMP on linear regression against numpy, step by step
# --------------------------------------------------------------------------

LR, MOMENTUM, STEPS, EVERY = 0.05, 0.9, 50, 5
FINAL = 0.75  # 48 prunable weights -> exactly 12 kept


def regression_problem(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(32, 6)).astype(np.float32)
  true_w = rng.normal(size=(6, 4)).astype(np.float32)
  y = (x @ true_w).astype(np.float32)
  target_k = rng.normal(size=(4, 6)).astype(np.float32)
  params = {"W": (0.1 * rng.normal(size=(6, 4))).astype(np.float32),
            "K": (0.1 * rng.normal(size=(4, 6))).astype(np.float32),
            "b": np.full((4,), 0.3, np.float32)}
  return x, y, target_k, params


def np_grads(params, x, y, target_k):
  """Gradient of 0.5 mean_i ||x_i W + b - y_i||^2 + 0.5 ||K - T||^2."""
  residual = x @ params["W"] + params["b"] - y
  return {"W": x.T @ residual / len(x), "b": residual.mean(0),
          "K": params["K"] - target_k}


def jax_loss(params, x, y, target_k):
  residual = x @ params["W"] + params["b"] - y
  return (0.5 * jnp.mean(jnp.sum(residual ** 2, axis=1))
          + 0.5 * jnp.sum((params["K"] - target_k) ** 2))


def np_topk_masks(values: dict, sparsity: float, names=("K", "W")) -> dict:
  """Global top-k of |v| over the named leaves, flatten order, ties to the earlier entry."""
  flat = np.concatenate([np.abs(values[n]).ravel() for n in names])
  keep = flat.size - math.floor(float(np.float32(sparsity)) * flat.size)
  order = np.argsort(-flat, kind="stable")
  mask = np.zeros(flat.size, bool)
  mask[order[:keep]] = True
  out, start = {}, 0
  for n in names:
    out[n] = mask[start:start + values[n].size].reshape(values[n].shape)
    start += values[n].size
  return out


def np_gmp(params, x, y, target_k, schedule):
  """SGD with momentum, then every EVERY steps a new global magnitude mask of x + u."""
  params = {k: v.astype(np.float64) for k, v in params.items()}
  momentum = {k: np.zeros_like(v) for k, v in params.items()}
  masks = {n: np.ones(params[n].shape, bool) for n in ("K", "W")}
  history = []
  for t in range(STEPS):
    grads = np_grads(params, x, y, target_k)
    momentum = {k: grads[k] + MOMENTUM * momentum[k] for k in params}
    new = {k: params[k] - LR * momentum[k] for k in params}
    if t % EVERY == 0:
      masks = np_topk_masks(new, reference_sparsity(t, FINAL, 0, 30, power=3, every=EVERY))
    params = {k: np.where(masks[k], new[k], 0.0) if k in masks else new[k] for k in new}
    history.append(({k: v.copy() for k, v in params.items()},
                    {k: v.copy() for k, v in masks.items()}))
  return history


@pytest.fixture(scope="module")
def gmp_run():
  x, y, target_k, params0 = regression_problem()
  schedule = safe_optax.polynomial_sparsity(FINAL, begin_step=0, end_step=30,
                                            update_every=EVERY)
  tx = optax.chain(optax.sgd(LR, momentum=MOMENTUM),
                   safe_optax.magnitude_pruning(schedule, update_every=EVERY))

  @jax.jit
  def step(params, state):
    grads = jax.grad(jax_loss)(params, x, y, target_k)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.tree.map(jnp.asarray, params0)
  state = tx.init(params)
  history = []
  for _ in range(STEPS):
    params, state = step(params, state)
    history.append((jax.device_get(params), jax.device_get(state[1].masks)))
  return history, np_gmp(params0, x, y, target_k, schedule), step


def test_gmp_matches_numpy_reference_step_by_step(gmp_run):
  history, reference, _ = gmp_run
  for t, ((params, masks), (want_params, want_masks)) in enumerate(zip(history, reference)):
    for name in ("K", "W"):
      np.testing.assert_array_equal(masks[name], want_masks[name], err_msg=f"mask {name} t={t}")
    for name in ("K", "W", "b"):
      np.testing.assert_allclose(params[name], want_params[name], rtol=2e-5, atol=2e-6,
                                 err_msg=f"{name} at step {t}")


def test_gmp_exact_zeros_persistent_masks_and_final_sparsity(gmp_run):
  history, _, step = gmp_run
  for t, (params, masks) in enumerate(history):
    for name in ("K", "W"):
      # Pruned weights are exactly 0 after every step, kept ones are not.
      assert np.all(params[name][~masks[name]] == 0.0)
      assert np.all(params[name][masks[name]] != 0.0)
      if t % EVERY:  # no mask update: the mask of the previous step is held
        np.testing.assert_array_equal(masks[name], history[t - 1][1][name])
    assert isinstance(masks["b"], optax.MaskedNode)
  final, _ = history[-1]
  kept = sum(int(np.count_nonzero(final[n])) for n in ("K", "W"))
  assert kept == 48 - 36  # exactly 75% of the 48 prunable weights are 0
  assert np.all(final["b"] != 0.0)
  # Sparsity went up on the cubic schedule, and masks did change along the way.
  nonzero = [sum(int(np.count_nonzero(p[n])) for n in ("K", "W")) for p, _ in history]
  assert nonzero[0] == 48 and nonzero[29] > 12 and nonzero[30] == 12
  assert step._cache_size() == 1  # 50 steps, 10 mask updates, one compile


def test_mask_is_held_until_the_next_update():
  # A pruned weight pushed above a kept one stays 0 until the next mask update regrows it.
  params = {"w": jnp.array([[1.0, 0.5, 0.1, 0.05]])}
  push = {"w": jnp.array([[0.0, 0.0, -3.0, 0.0]])}
  zero = {"w": jnp.zeros((1, 4))}
  tx = optax.chain(optax.sgd(1.0), safe_optax.magnitude_pruning(0.5, update_every=3))
  state = tx.init(params)
  seen = []
  for grads in (zero, push, push, push):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    seen.append(np.asarray(params["w"][0]))
  np.testing.assert_array_equal(seen[0], [1.0, 0.5, 0.0, 0.0])
  np.testing.assert_array_equal(seen[1], [1.0, 0.5, 0.0, 0.0])
  np.testing.assert_array_equal(seen[2], [1.0, 0.5, 0.0, 0.0])
  np.testing.assert_array_equal(seen[3], [1.0, 0.0, 3.0, 0.0])  # update at step 3


def test_update_until_freezes_the_mask():
  params = {"w": jnp.array([[1.0, 0.5, 0.1, 0.05]])}
  push = {"w": jnp.array([[0.0, 0.0, -3.0, 0.0]])}
  tx = optax.chain(optax.sgd(1.0),
                   safe_optax.magnitude_pruning(0.5, update_every=1, update_until=0))
  state = tx.init(params)
  for grads in ({"w": jnp.zeros((1, 4))}, push, push):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["w"][0], [1.0, 0.5, 0.0, 0.0])


def test_inject_hyperparams_traced_sparsity_bf16_no_recompile():
  # float32 hyperparameters: by default optax would store the sparsity in the params' bf16.
  tx = optax.inject_hyperparams(safe_optax.magnitude_pruning, hyperparam_dtype=jnp.float32)(
      sparsity=0.5, update_every=2)
  rng = np.random.default_rng(3)
  params = {"a": jnp.asarray(rng.normal(size=(8, 8)), jnp.bfloat16),
            "bias": jnp.ones((8,), jnp.bfloat16)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.01, p.dtype), params)
  chain = optax.chain(optax.sgd(0.1), tx)

  @jax.jit
  def step(params, state):
    updates, state = chain.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = chain.init(params)
  counts = []
  for t in range(6):
    if t == 2:  # a new traced value, picked up at the next mask update
      state[1].hyperparams["sparsity"] = jnp.asarray(0.875, jnp.float32)
    params, state = step(params, state)
    counts.append(int(jnp.count_nonzero(params["a"])))
    assert params["a"].dtype == jnp.bfloat16 and params["bias"].dtype == jnp.bfloat16
  assert counts == [32, 32, 8, 8, 8, 8]
  assert bool(jnp.all(params["bias"] != 0))
  assert step._cache_size() == 1


def test_nm_structure_and_custom_scores():
  rng = np.random.default_rng(4)
  params = {"k": jnp.asarray(rng.normal(size=(3, 3, 8, 4)), jnp.float32)}
  zero = jax.tree.map(jnp.zeros_like, params)
  tx = safe_optax.magnitude_pruning(None, structure=NM(2, 4))
  updates, state = tx.update(zero, tx.init(params), params)
  pruned = np.asarray(optax.apply_updates(params, updates)["k"])
  groups = np.moveaxis(pruned, 2, -1).reshape(-1, 4)  # groups of 4 along the input axis
  assert np.all(np.count_nonzero(groups, axis=1) == 2)
  # A saliency that prefers small magnitudes keeps exactly the smallest half.
  smallest = safe_optax.magnitude_pruning(
      0.5, scores=safe_optax.Saliency(lambda inputs: [-jnp.abs(v) for v in inputs.values]))
  updates, _ = smallest.update(zero, smallest.init(params), params)
  kept = np.asarray(optax.apply_updates(params, updates)["k"]) != 0
  magnitudes = np.abs(np.asarray(params["k"]))
  assert kept.sum() == magnitudes.size // 2
  assert magnitudes[kept].max() < magnitudes[~kept].min()


# --------------------------------------------------------------------------
# cram against numpy, step by step
# --------------------------------------------------------------------------


def np_cram_grad(params, x, y, target_k, rho, sparsity, *, plus, normalize, sparse_grad,
                 eps=1e-12):
  """grad f(C(x + e)) (+ grad f(x)), e = rho g / (||g|| + eps) or rho g; C on K and W."""
  g = np_grads(params, x, y, target_k)
  norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values()))
  scale = rho / (norm + eps) if normalize else rho
  perturbed = {k: params[k] + scale * g[k] for k in params}
  masks = np_topk_masks(perturbed, sparsity)
  compressed = {k: np.where(masks[k], v, 0.0) if k in masks else v for k, v in perturbed.items()}
  out = np_grads(compressed, x, y, target_k)
  if sparse_grad:
    out = {k: np.where(masks[k], v, 0.0) if k in masks else v for k, v in out.items()}
  if plus:
    out = {k: out[k] + g[k] for k in out}
  return out, compressed


CRAM_CASES = [
    dict(rho=0.1, plus=False, normalize=True, sparse_grad=False),
    dict(rho=0.1, plus=True, normalize=True, sparse_grad=False),
    dict(rho=0.05, plus=True, normalize=False, sparse_grad=True),
]


@pytest.mark.parametrize("case", CRAM_CASES, ids=["cram", "cram_plus", "plain_step_sparse_grad"])
def test_cram_matches_numpy_reference_in_a_chain(case):
  x, y, target_k, params0 = regression_problem(seed=1)
  sparsity = 0.75
  grad_fn = lambda p, _: jax.grad(jax_loss)(p, x, y, target_k)
  tx = optax.chain(safe_optax.cram(case["rho"], sparsity, plus=case["plus"],
                                   normalize=case["normalize"],
                                   sparse_grad=case["sparse_grad"]),
                   optax.sgd(LR))

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
    return optax.apply_updates(params, updates), state

  params, state = jax.tree.map(jnp.asarray, params0), tx.init(params0)
  ref = {k: v.astype(np.float64) for k, v in params0.items()}
  for t in range(8):
    params, state = step(params, state)
    g, _ = np_cram_grad(ref, x, y, target_k, case["rho"], sparsity, plus=case["plus"],
                        normalize=case["normalize"], sparse_grad=case["sparse_grad"])
    ref = {k: ref[k] - LR * g[k] for k in ref}
    for name in ref:
      np.testing.assert_allclose(params[name], ref[name], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name} at step {t}")
  # The iterate stays dense: CrAM only evaluates gradients at the compressed point.
  assert int(jnp.count_nonzero(params["W"])) == params["W"].size
  assert step._cache_size() == 1


def test_cram_multi_draws_each_sparsity_exactly():
  x, y, target_k, params = regression_problem(seed=2)
  params = jax.tree.map(jnp.asarray, params)
  seen = []

  def grad_fn(p, step):
    assert step == 0
    # What the gradient sees: the compressed point's nonzero count.
    nonzero = sum(jnp.count_nonzero(p[n]) for n in ("K", "W"))
    jax.debug.callback(lambda n: seen.append(int(n)), nonzero)
    return jax.grad(jax_loss)(p, x, y, target_k)

  g = jax.grad(jax_loss)(params, x, y, target_k)
  multi = safe_optax.cram(0.1, (0.5, 0.75), seed=0)
  step = jax.jit(lambda state: multi.update(g, state, params, grad_fn=grad_fn)[1])
  state = multi.init(params)
  for _ in range(12):
    state = step(state)
  jax.effects_barrier()
  assert len(seen) == 12 and set(seen) == {24, 12}  # both drawn, each exact
  assert int(state.count) == 12


# --------------------------------------------------------------------------
# Errors, raised at construction (or at update for a missing argument)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(final_sparsity=1.0), "final_sparsity"),
    (dict(final_sparsity=-0.1), "final_sparsity"),
    (dict(final_sparsity="0.9"), "final_sparsity"),
    (dict(initial_sparsity=1.5), "initial_sparsity"),
    (dict(initial_sparsity=0.95), "must not exceed"),
    (dict(begin_step=-1), "begin_step"),
    (dict(begin_step=1.5), "begin_step"),
    (dict(end_step=10), "greater than"),
    (dict(power=0), "power"),
    (dict(power=float("nan")), "power"),
    (dict(power=True), "power"),
    (dict(update_every=0), "update_every"),
    (dict(update_every=2.0), "update_every"),
])
def test_schedule_errors(kwargs, match):
  args = dict(final_sparsity=0.9, begin_step=10, end_step=20)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    safe_optax.polynomial_sparsity(**args)


@pytest.mark.parametrize("make, error, match", [
    (lambda: safe_optax.magnitude_pruning(1.0), ValueError, r"\[0, 1\)"),
    (lambda: safe_optax.magnitude_pruning("high"), TypeError, "sparsity"),
    (lambda: safe_optax.magnitude_pruning((0.5, 0.9)), TypeError, "schedule"),
    (lambda: safe_optax.magnitude_pruning(None), ValueError, "required"),
    (lambda: safe_optax.magnitude_pruning(0.5, update_every=0), ValueError, "update_every"),
    (lambda: safe_optax.magnitude_pruning(0.5, scope="layer"), TypeError, "scope"),
    (lambda: safe_optax.magnitude_pruning(0.5, structure="2:4"), TypeError, "structure"),
    (lambda: safe_optax.magnitude_pruning(0.9, structure=NM(2, 4)), ValueError, "contradicts"),
    (lambda: safe_optax.magnitude_pruning(0.5, scores="wanda"), TypeError, "scores"),
    (lambda: safe_optax.magnitude_pruning(0.5, update_until=-1), ValueError, "update_until"),
    (lambda: safe_optax.cram(-0.1, 0.5), ValueError, "rho"),
    (lambda: safe_optax.cram(0.1, 0.5, eps=-1.0), ValueError, "eps"),
    (lambda: safe_optax.cram(0.1, 1.2), ValueError, r"\[0, 1\)"),
    (lambda: safe_optax.cram(0.1, ()), ValueError, "empty"),
    (lambda: safe_optax.cram(0.1, 0.5, scope="layer"), TypeError, "scope"),
])
def test_construction_errors(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_update_errors():
  params = {"w": jnp.ones((2, 2))}
  tx = safe_optax.magnitude_pruning(0.5)
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update(params, tx.init(params))
  tx = safe_optax.cram(0.1, 0.5)
  with pytest.raises(ValueError, match="grad_fn"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update(params, tx.init(params), grad_fn=lambda p, s: p)
  with pytest.raises(ValueError, match="no prunable leaves"):
    safe_optax.magnitude_pruning(0.5).init({"b": jnp.ones(3)})


def test_magnitude_pruning_seed_drives_the_saliency_key():
  """The saliency key came from PRNGKey(0) whatever the run's seed."""
  params = {"w": jnp.ones((8, 8))}
  random_scores = safe_optax.Saliency(
      lambda inputs: [jax.random.uniform(inputs.key, v.shape) for v in inputs.values])

  def masks(**kwargs):
    tx = safe_optax.magnitude_pruning(0.5, scores=random_scores, **kwargs)
    _, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    assert int(state.masks["w"].sum()) == 32
    return np.asarray(state.masks["w"])

  np.testing.assert_array_equal(masks(), masks(seed=0))
  assert not np.array_equal(masks(seed=0), masks(seed=1))
  assert not np.array_equal(masks(seed=1), masks(seed=2))
