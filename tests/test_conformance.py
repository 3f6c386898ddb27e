"""Conformance of the safe_optax optimizers with the optax / JAX ecosystem.

Every optimizer construction in ``SPECS`` (the aliases, a hand-written chain
and the decoupled-penalty form) is checked against the optax wrappers
(``chain``, ``apply_if_finite``, ``MultiSteps``, ``inject_hyperparams``,
``tree.map_params``), dtypes, recompilation, the ADMM invariants (exact
sparsity of ``z``, the dual update, ``constraint_distance``), Flax Linen / NNX
parameter trees and data-parallel sharding.

Cost: every step runs under ``jax.jit``, and each distinct jitted program
compiles the radix-select projection (2-3 CPU-seconds), which dominates the
module's run time. So one 70-step training run per construction
(``_main_run``: ``sam(apply_if_finite(chain(clip, optimizer without SAM)),
rho)`` with one NaN step, the documented recipe)
is shared by the tests that read its trajectory, these runs and the 8-device
subprocess are started in the background when the module starts, and the
wrapper tests run on the constructions whose code paths differ for that
property (see ``INJECT_NAMES`` etc.).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax
import process_launcher  # tests/process_launcher.py: forced-device XLA flags

# --------------------------------------------------------------------------
# A small MLP in plain JAX: dict params with 2-D kernels and 1-D biases.
# --------------------------------------------------------------------------

LR = 0.05
TOTAL = 70
SHAPES = {"dense0": (8, 16), "dense1": (16, 4)}
N_PRUNABLE = sum(a * b for a, b in SHAPES.values())  # 192 kernel entries


def init_mlp(seed: int = 0, dtype=jnp.float32) -> dict:
  keys = jax.random.split(jax.random.PRNGKey(seed), len(SHAPES))
  params = {}
  for key, (name, (fan_in, fan_out)) in zip(keys, SHAPES.items()):
    params[name] = {
        "kernel": (jax.random.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in)).astype(dtype),
        # Non-zero biases, so a penalty or decay wrongly applied to them shows.
        "bias": jnp.full((fan_out,), 0.1, dtype),
    }
  return params


def make_batch(seed: int = 1, n: int = 32, step=None):
  """A regression batch; ``step`` draws a different batch of the same teacher."""
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  if step is not None:
    kx = jax.random.fold_in(kx, step)
  x = jax.random.normal(kx, (n, 8))
  y = jnp.tanh(x @ jax.random.normal(kw, (8, 4)))
  return x, y


def mlp_apply(params, x):
  x = x.astype(params["dense0"]["kernel"].dtype)
  h = jnp.tanh(x @ params["dense0"]["kernel"] + params["dense0"]["bias"])
  return h @ params["dense1"]["kernel"] + params["dense1"]["bias"]


def mlp_loss(params, x, y):
  return jnp.mean((mlp_apply(params, x).astype(jnp.float32) - y) ** 2)


# --------------------------------------------------------------------------
# The optimizer constructions under test.
# --------------------------------------------------------------------------


class Spec(NamedTuple):
  make: Callable[..., Any]
  """``make(penalty=, penalty_schedule=, momentum=, dual_every=, wrap=)`` -> transform.

  With ``wrap`` (an optax wrapper ``body -> transform``), the supported form
  ``chain(<gradient passes>, wrap(<the rest>))``: the wrapper sees SAM's gradient.
  """
  sparsities: tuple[float, ...]
  """Sparsities the ADMM target ``z`` may have."""
  dual_every: int
  magnitude: bool
  """z is the magnitude projection of ``x + u`` (not a saliency)."""
  inject_factory: Callable[..., Any]
  """``optax.inject_hyperparams(inject_factory)(**inject_kwargs)`` (no static_args)."""
  inject_kwargs: dict
  inject_dual_every: int


def _alias(fn, sparsity, **fixed):
  def make(*, penalty=1e-2, penalty_schedule=None, momentum=0.9, dual_every=8, wrap=None):
    kwargs = dict(penalty=penalty, total_steps=TOTAL, dual_every=dual_every,
                  momentum=momentum, **fixed)
    if penalty_schedule is not None:
      kwargs["penalty_schedule"] = penalty_schedule
    if wrap is None:
      return fn(LR, sparsity, **kwargs)
    # The documented recipe: safe_optax.sam around the wrapper around the rest.
    rho = kwargs.pop("rho", None)
    head, body_fn = [], fn
    if fn is safe_optax.safe_sg:  # safe_sg = safe + add_projected_gradient after SAM
      head.append(safe_optax.add_projected_gradient(sparsity))
      body_fn = safe_optax.safe
    if rho is None:
      return optax.chain(*head, wrap(body_fn(LR, sparsity, **kwargs)))
    return safe_optax.sam(optax.chain(*head, wrap(body_fn(LR, sparsity, rho=None, **kwargs))),
                          rho)
  return make


def _custom_chain(*, penalty=1e-2, penalty_schedule=None, momentum=None, dual_every=4,
                  wrap=None):
  del momentum  # Adam
  wrap = wrap or (lambda body: body)
  return safe_optax.sam(
      wrap(optax.chain(
          safe_optax.admm_penalty(0.8, penalty, dual_every=dual_every,
                                  penalty_schedule=penalty_schedule or "constant",
                                  total_steps=TOTAL),
          optax.adam(1e-2),
      )),
      0.05,
  )


def custom_chain_factory(sparsity, penalty):
  """The custom chain as a hyperparameter factory for ``inject_hyperparams``."""
  return optax.chain(
      safe_optax.sam_perturb(0.05),
      safe_optax.admm_penalty(sparsity, penalty, dual_every=4),
      optax.adam(1e-2),
  )


# The call from the docs: every numeric argument, including the integer defaults
# dual_every=32 and seed=0, becomes an injected (traced) hyperparameter.
_SAFE_INJECT = dict(learning_rate=0.1, sparsity=0.8, penalty=1e-2, total_steps=100)
_ALIAS_INJECT = dict(learning_rate=LR, sparsity=0.8, penalty=1e-2, total_steps=TOTAL,
                     dual_every=4, rho=0.05)

SPECS = {
    "safe": Spec(_alias(safe_optax.safe, 0.8, rho=0.05), (0.8,), 8, True,
                 safe_optax.safe, _SAFE_INJECT, 32),
    "safe_plus_snip": Spec(
        _alias(safe_optax.safe_plus, 0.8, rho=0.05, scores=safe_optax.snip_saliency()), (0.8,),
        8, False, safe_optax.safe_plus, _ALIAS_INJECT, 4),
    "admm": Spec(_alias(safe_optax.admm, 0.8), (0.8,), 8, True, safe_optax.admm,
                 dict(learning_rate=LR, sparsity=0.8, penalty=1e-2, dual_every=4), 4),
    "safe_sg": Spec(_alias(safe_optax.safe_sg, 0.8, rho=0.05), (0.8,), 8, True,
                    safe_optax.safe_sg, _ALIAS_INJECT, 4),
    "safe_multi": Spec(  # SAFE-Multi: safe with a sequence of sparsities
        _alias(safe_optax.safe, (0.5, 0.8), rho=0.05), (0.5, 0.8), 8, True,
        safe_optax.safe,
        dict(learning_rate=LR, sparsity=(0.5, 0.8), penalty=1e-2,
             total_steps=TOTAL, dual_every=4, rho=0.05), 4),
    "custom_chain": Spec(_custom_chain, (0.8,), 4, True, custom_chain_factory,
                         dict(sparsity=0.8, penalty=1e-2), 4),
    "safe_decoupled": Spec(
        _alias(safe_optax.safe, 0.8, rho=0.05, decoupled_penalty=True), (0.8,), 8, True,
        functools.partial(safe_optax.safe, decoupled_penalty=True), _ALIAS_INJECT, 4),
}
NAMES = list(SPECS)
# Every further jitted program costs 2-3 CPU-seconds of XLA compilation (the
# radix-select projection), so each wrapper test below runs on the constructions
# whose code paths differ for that property; every construction goes through the
# shared main run (chain, apply_if_finite, ADMM invariants, finalize).
INJECT_NAMES = ["safe", "safe_sg", "safe_multi", "custom_chain"]
MULTISTEPS_NAMES = ["safe"]  # SAM: grad_fn must reach the inner optimizer
BF16_NAMES = ["safe_sg"]  # every safe_optax cast: SAM, projected gradient, penalty
ZERO_GRAD_NAMES = ["safe", "safe_decoupled"]  # penalty before / after SGD

# --------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------


def host(tree):
  return jax.device_get(tree)


def guard_state(state) -> optax.ApplyIfFiniteState:
  """The (single) ``optax.apply_if_finite`` state inside a nested optimizer state."""
  is_guard = lambda s: isinstance(s, optax.ApplyIfFiniteState)
  found = [s for s in jax.tree.leaves(state, is_leaf=is_guard) if is_guard(s)]
  assert len(found) == 1
  return found[0]


def kernels(params) -> list[np.ndarray]:
  """The prunable (2-D) leaves of a params tree, in flatten order, as float32."""
  return [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(params) if np.ndim(leaf) >= 2]


def biases(params) -> list[np.ndarray]:
  return [np.asarray(leaf) for leaf in jax.tree.leaves(params) if np.ndim(leaf) < 2]


def masked_leaves(tree) -> list[np.ndarray]:
  """Arrays of an ADMM ``z``/``u`` tree (MaskedNode leaves have no arrays)."""
  return [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(tree)]


def nnz(arrays) -> int:
  return int(sum(np.count_nonzero(a) for a in arrays))


def keep_counts(sparsities) -> set[int]:
  return {safe_optax.num_keep(N_PRUNABLE, s) for s in sparsities}


def reference_projection(values: list[np.ndarray], sparsity: float) -> list[np.ndarray]:
  """Global magnitude top-k in numpy; ties keep the earlier entry (flatten order)."""
  flat = np.concatenate([v.reshape(-1) for v in values])
  k = safe_optax.num_keep(flat.size, sparsity)
  order = np.argsort(-np.abs(flat), kind="stable")
  keep = np.zeros(flat.size, bool)
  keep[order[:k]] = True
  out, start = [], 0
  for v in values:
    out.append(np.where(keep[start:start + v.size].reshape(v.shape), v, 0).astype(v.dtype))
    start += v.size
  return out


def make_step(tx, loss=mlp_loss, traces=None):
  """A jitted SAFE step -> ``(params, updates, state, loss at the input params)``.

  ``poison`` is added to the gradient (0. or NaN); ``traces`` counts traces.
  """

  @jax.jit
  def step(params, state, x, y, poison=jnp.float32(0.0)):
    if traces is not None:
      traces.append(1)
    grad_fn = lambda p, _: jax.grad(loss)(p, x, y)
    value, grads = jax.value_and_grad(loss)(params, x, y)
    grads = jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)
    updates, state = tx.update(grads, state, params, grad_fn=grad_fn)
    return optax.apply_updates(params, updates), updates, state, value

  return step


# --------------------------------------------------------------------------
# Background work. XLA compilation dominates this module's cost, so the seven
# main runs (in two worker threads) and the 8-device subprocess start when the
# module starts and overlap with the other tests, which run first.
# --------------------------------------------------------------------------

_MAIN_RUN_TESTS = frozenset({
    "test_chain_traces_once_across_many_dual_updates",
    "test_apply_if_finite_skips_nan_gradient_step",
    "test_z_exactly_sparse_after_each_dual_update",
    "test_constraint_distance_matches_direct_computation",
    "test_finalize_gives_exact_counts",
})
_BACKGROUND: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _background_work(request):
  items = [item for item in request.session.items
           if getattr(item, "module", None) is sys.modules[__name__]]
  if any(item.originalname == "test_data_parallel_on_8_devices_matches_single_device"
         for item in items):
    _BACKGROUND["sharded"] = _launch_sharded_run()
  names = []
  for item in items:
    if item.originalname in _MAIN_RUN_TESTS and item.callspec.params["name"] not in names:
      names.append(item.callspec.params["name"])
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
  for name in names:
    _BACKGROUND[name] = pool.submit(_compute_main_run, name)
  yield
  pool.shutdown(wait=True, cancel_futures=True)
  proc = _BACKGROUND.pop("sharded", None)
  if proc is not None and proc.poll() is None:
    proc.kill()
    proc.wait()
  _BACKGROUND.clear()


# --------------------------------------------------------------------------
# optax wrappers.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_constructible_under_jit(name):
  """Building and initialising inside a trace (as inject_hyperparams does in update)."""
  spec = SPECS[name]

  @jax.jit
  def build_and_init(params):
    tx = spec.make()
    return safe_optax.find_admm_state(tx.init(params)).count

  assert int(build_and_init(init_mlp())) == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", INJECT_NAMES)
def test_inject_hyperparams_traced_sparsity_without_recompiling(name):
  spec = SPECS[name]
  tx = optax.inject_hyperparams(spec.inject_factory)(**spec.inject_kwargs)
  params = init_mlp()
  state = tx.init(params)
  assert "penalty" in state.hyperparams
  traces: list[int] = []
  step = make_step(tx, traces=traces)
  x, y = make_batch()
  has_sparsity = "sparsity" in state.hyperparams
  k = spec.inject_dual_every
  # Dual updates at counts 0 and k; the sparsity changes just before the second.
  for t in range(k + 1):
    if t == k and has_sparsity:
      old = state.hyperparams["sparsity"]
      state.hyperparams["sparsity"] = jnp.asarray(0.5, old.dtype)
    params, _, state, _ = step(params, state, x, y)
    z = masked_leaves(safe_optax.find_admm_state(state).z)
    if has_sparsity:
      expected = safe_optax.num_keep(N_PRUNABLE, 0.8 if t < k else 0.5)
      assert nnz(z) == expected, (t, nnz(z), expected)
    else:
      assert nnz(z) in keep_counts(spec.sparsities)
  # The penalty is traced too: from the same state, penalty 0 changes the kernels'
  # updates (the penalty term vanishes) but not the biases'.
  zero = dict(state.hyperparams, penalty=jnp.zeros_like(state.hyperparams["penalty"]))
  _, with_penalty, _, _ = step(params, state, x, y)
  _, without, _, _ = step(params, state._replace(hyperparams=zero), x, y)
  assert all(not np.array_equal(a, b) for a, b in zip(kernels(with_penalty), kernels(without)))
  for a, b in zip(biases(with_penalty), biases(without)):
    np.testing.assert_array_equal(a, b)
  assert len(traces) == 1
  assert step._cache_size() == 1
  final = 0.5 if has_sparsity else 0.8
  sparse, _ = safe_optax.finalize(params, final)
  assert nnz(kernels(sparse)) == safe_optax.num_keep(N_PRUNABLE, final)


@pytest.mark.slow
@pytest.mark.parametrize("name", MULTISTEPS_NAMES)
def test_multisteps_advances_admm_every_k_micro_steps(name):
  """sam(MultiSteps(rest, k), rho): ADMM counts emitted steps, not micro-batches.

  (tests/test_composition.py checks the emitted update against the mean of
  per-micro-batch SAM gradients.)
  """
  spec = SPECS[name]
  k = 2
  tx = spec.make(dual_every=4, wrap=lambda body: optax.MultiSteps(body, every_k_schedule=k))
  step = make_step(tx)
  params = init_mlp()
  state = tx.init(params)
  z_prev = masked_leaves(safe_optax.find_admm_state(state).z)
  for micro in range(2 * 6):
    x, y = make_batch(step=micro)  # a different micro-batch at every call
    new_params, _, state, _ = step(params, state, x, y)
    admm = safe_optax.find_admm_state(state)
    assert int(admm.count) == (micro + 1) // k
    changed = [not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(host(params)), jax.tree.leaves(host(new_params)))]
    emitted = (micro + 1) % k == 0
    assert any(changed) == emitted, (micro, changed)
    z = masked_leaves(admm.z)
    z_changed = any(not np.array_equal(a, b) for a, b in zip(z, z_prev))
    # Inner dual updates run at inner counts 0 and 4 (micro steps 1 and 9) and
    # are committed only when MultiSteps emits.
    if emitted and ((micro + 1) // k - 1) % 4 == 0:
      assert z_changed, micro
      assert nnz(z) in keep_counts(spec.sparsities)
    else:
      assert not z_changed, micro
    z_prev = z
    params = new_params


@pytest.mark.parametrize("name", NAMES)
def test_map_params_over_state(name):
  spec = SPECS[name]
  tx = spec.make()
  params = init_mlp()
  state = tx.init(params)

  class Leaf:  # a plain object is a pytree leaf
    def __init__(self, shape):
      self.shape = shape

  def to_shape(v):
    return v if isinstance(v, optax.MaskedNode) else Leaf(tuple(v.shape))

  mapped = optax.tree.map_params(
      tx, to_shape, state, transform_non_params=lambda v: "non-param",
      is_leaf=lambda v: isinstance(v, optax.MaskedNode))
  assert jax.tree.structure(mapped) == jax.tree.structure(state)
  n_mapped = 0
  for got, orig in zip(jax.tree.leaves(mapped), jax.tree.leaves(state)):
    if isinstance(got, Leaf):
      assert got.shape == orig.shape
      n_mapped += 1
    else:
      assert got == "non-param"
      # Only scalars (counts) are not parameter-shaped in these states.
      assert np.ndim(orig) == 0
  admm = safe_optax.find_admm_state(mapped)
  assert admm.count == "non-param"
  for tree in (admm.z, admm.u):
    for layer, shape in SHAPES.items():
      assert isinstance(tree[layer]["kernel"], Leaf) and tree[layer]["kernel"].shape == shape
      assert isinstance(tree[layer]["bias"], optax.MaskedNode)
  assert n_mapped >= 4  # z and u kernels at least


@pytest.mark.slow
@pytest.mark.parametrize("name", BF16_NAMES)
def test_bfloat16_params_stay_bfloat16(name):
  spec = SPECS[name]
  tx = spec.make(dual_every=4)
  step = make_step(tx)
  params = init_mlp(dtype=jnp.bfloat16)
  state = tx.init(params)
  x, y = make_batch()
  for _ in range(6):  # dual updates at counts 0 and 4
    params, updates, state, _ = step(params, state, x, y)
    for tree in (params, updates):
      assert {leaf.dtype for leaf in jax.tree.leaves(tree)} == {jnp.dtype(jnp.bfloat16)}
    admm = safe_optax.find_admm_state(state)
    for tree in (admm.z, admm.u):
      leaves = jax.tree.leaves(tree)
      assert len(leaves) == 2
      assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
  # No floating array of the optimizer state was promoted.
  float_dtypes = {leaf.dtype for leaf in jax.tree.leaves(state)
                  if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim > 0}
  assert float_dtypes == {jnp.dtype(jnp.bfloat16)}
  assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in jax.tree.leaves(params))
  assert nnz(masked_leaves(safe_optax.find_admm_state(state).z)) in keep_counts(spec.sparsities)


@pytest.mark.parametrize("name", ZERO_GRAD_NAMES)
def test_penalty_only_touches_prunable_leaves(name):
  """Zero gradients, momentum 0, no weight decay: only the ADMM penalty moves params."""
  spec = SPECS[name]
  dual_every, penalty = 4, 1.0
  tx = spec.make(penalty=penalty, penalty_schedule="constant", momentum=0.0,
                 dual_every=dual_every)
  zero_loss = lambda p, x, y: 0.0 * mlp_loss(p, x, y)
  step = make_step(tx, loss=zero_loss)
  params0 = init_mlp()
  params, state = params0, tx.init(params0)
  x, y = make_batch()
  distances = []
  for t in range(3 * dual_every):
    prev = params
    params, updates, state, _ = step(params, state, x, y)
    distances.append(float(safe_optax.constraint_distance(params, state)))
    for b_new, b_old in zip(biases(params), biases(params0)):
      np.testing.assert_array_equal(b_new, b_old)
    for u in biases(updates):
      assert not u.any()
    if t < dual_every:  # first interval: u = 0 and z = Proj(x0) is fixed
      z = masked_leaves(safe_optax.find_admm_state(state).z)
      for ui, xi, x0, zi in zip(kernels(updates), kernels(prev), kernels(params0), z):
        kept = zi != 0
        np.testing.assert_array_equal(xi[kept], x0[kept])  # already at z: never moves
        assert not ui[kept].any()
        assert np.all(ui[~kept] * xi[~kept] < 0)  # every pruned entry moves toward 0
  first = distances[:dual_every]
  # x - z contracts by exactly (1 - lr * lambda) per step while z and u are fixed.
  np.testing.assert_allclose(np.array(first[1:]) / np.array(first[:-1]),
                             1 - LR * penalty, rtol=1e-4)
  assert distances[-1] < 0.6 * distances[0], distances


# --------------------------------------------------------------------------
# Flax.
# --------------------------------------------------------------------------


def _flax_train(params, loss, steps=9):
  """``safe`` for ``steps`` jitted steps -> (params, opt state, losses)."""
  tx = safe_optax.safe(LR, 0.8, penalty=1e-2, total_steps=steps, dual_every=4, rho=0.05)
  traces: list[int] = []
  step = make_step(tx, loss=loss, traces=traces)
  state = tx.init(params)
  x, y = make_batch()
  losses = []
  for _ in range(steps):
    params, _, state, value = step(params, state, x, y)
    losses.append(float(value))
  assert len(traces) == 1
  return params, state, losses


def test_flax_linen_params():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, name="Dense_1")(jnp.tanh(nn.Dense(16, name="Dense_0")(x)))

  model = MLP()
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8)))
  assert set(variables) == {"params"}
  loss = lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2)
  params, state, losses = _flax_train(variables, loss)
  assert losses[-1] < losses[0]
  admm = safe_optax.find_admm_state(state)
  assert isinstance(admm.z["params"]["Dense_0"]["bias"], optax.MaskedNode)
  assert admm.z["params"]["Dense_0"]["kernel"].shape == (8, 16)
  assert nnz(masked_leaves(admm.z)) == safe_optax.num_keep(N_PRUNABLE, 0.8)
  sparse, masks = safe_optax.finalize(params, 0.8)
  assert jax.tree.structure(sparse) == jax.tree.structure(variables)
  assert nnz(kernels(sparse)) == safe_optax.num_keep(N_PRUNABLE, 0.8)
  assert bool(jnp.all(masks["params"]["Dense_1"]["bias"]))
  np.testing.assert_array_equal(sparse["params"]["Dense_1"]["bias"],
                                params["params"]["Dense_1"]["bias"])


def test_flax_nnx_state_params():
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(8, 16, rngs=rngs)
      self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  model = MLP(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, x, y):
    m = nnx.merge(graphdef, p, rest)
    return jnp.mean((m(x) - y) ** 2)

  trained, state, losses = _flax_train(params, loss)
  assert losses[-1] < losses[0]
  assert type(trained) is type(params)
  admm = safe_optax.find_admm_state(state)
  assert nnz(masked_leaves(admm.z)) == safe_optax.num_keep(N_PRUNABLE, 0.8)
  sparse, masks = safe_optax.finalize(trained, 0.8)
  assert type(sparse) is type(params)
  nnx.update(model, sparse)
  kept = int(np.count_nonzero(np.asarray(model.l1.kernel[...]))) + int(
      np.count_nonzero(np.asarray(model.l2.kernel[...])))
  assert kept == safe_optax.num_keep(N_PRUNABLE, 0.8)
  np.testing.assert_array_equal(np.asarray(model.l1.bias[...]),
                                np.asarray(trained["l1"]["bias"][...]))
  assert bool(np.all(np.asarray(masks["l2"]["bias"][...])))


# --------------------------------------------------------------------------
# One shared training run per optimizer:
#   sam(apply_if_finite(chain(clip_by_global_norm, <the rest>)), rho), 70 jitted steps,
#   a NaN gradient injected at NAN_STEP.
# --------------------------------------------------------------------------

MAIN_STEPS = 70
NAN_STEP = 13
_RUNS: dict[str, dict] = {}


def _main_run(name: str) -> dict:
  if name not in _RUNS:
    future = _BACKGROUND.get(name)
    _RUNS[name] = future.result() if future is not None else _compute_main_run(name)
  return _RUNS[name]


def _compute_main_run(name: str) -> dict:
  spec = SPECS[name]
  tx = spec.make(wrap=lambda body: optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(10.0), body), max_consecutive_errors=3))
  traces: list[int] = []
  step = make_step(tx, traces=traces)
  params = init_mlp()
  state = tx.init(params)
  records, losses = [], []
  for t in range(MAIN_STEPS):
    x, y = make_batch(step=t)  # different data at every call
    poison = jnp.float32(jnp.nan if t == NAN_STEP else 0.0)
    new_params, updates, new_state, loss = step(params, state, x, y, poison)
    losses.append(float(loss))
    records.append(dict(params_in=host(params), state_in=host(state),
                        params_out=host(new_params), updates=host(updates),
                        state_out=host(new_state)))
    params, state = new_params, new_state
  run = dict(records=records, traces=len(traces), cache_size=step._cache_size(),
             params=host(params), state=host(state), losses=losses)
  return run


@pytest.mark.parametrize("name", NAMES)
def test_chain_traces_once_across_many_dual_updates(name):
  run = _main_run(name)
  spec = SPECS[name]
  assert run["traces"] == 1
  assert run["cache_size"] == 1
  admm = safe_optax.find_admm_state(run["state"])
  # 70 steps minus the skipped NaN step, spanning several dual updates.
  assert int(admm.count) == MAIN_STEPS - 1
  z_changes = sum(
      not all(np.array_equal(a, b) for a, b in zip(
          masked_leaves(safe_optax.find_admm_state(r["state_in"]).z),
          masked_leaves(safe_optax.find_admm_state(r["state_out"]).z)))
      for r in run["records"])
  assert z_changes >= 3
  # Training made progress and stayed finite.
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(run["params"]))
  assert run["losses"][-1] < 0.9 * run["losses"][0]


@pytest.mark.parametrize("name", NAMES)
def test_apply_if_finite_skips_nan_gradient_step(name):
  run = _main_run(name)
  rec = run["records"][NAN_STEP]
  for a, b in zip(jax.tree.leaves(rec["params_in"]), jax.tree.leaves(rec["params_out"])):
    np.testing.assert_array_equal(a, b)
  admm_in = safe_optax.find_admm_state(rec["state_in"])
  admm_out = safe_optax.find_admm_state(rec["state_out"])
  assert int(admm_out.count) == int(admm_in.count) == NAN_STEP
  for a, b in zip(jax.tree.leaves(admm_in), jax.tree.leaves(admm_out)):
    np.testing.assert_array_equal(a, b)
  assert int(guard_state(rec["state_out"]).notfinite_count) == 1
  assert int(guard_state(rec["state_out"]).total_notfinite) == 1
  # The next (finite) step is taken again.
  nxt = run["records"][NAN_STEP + 1]
  assert int(safe_optax.find_admm_state(nxt["state_out"]).count) == NAN_STEP + 1
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(nxt["params_in"]), jax.tree.leaves(nxt["params_out"])))


@pytest.mark.parametrize("name", NAMES)
def test_z_exactly_sparse_after_each_dual_update(name):
  run = _main_run(name)
  spec = SPECS[name]
  allowed = keep_counts(spec.sparsities)
  n_dual = 0
  for t, rec in enumerate(run["records"]):
    if t == NAN_STEP:
      continue
    s_in = safe_optax.find_admm_state(rec["state_in"])
    s_out = safe_optax.find_admm_state(rec["state_out"])
    # Non-prunable leaves hold MaskedNode placeholders.
    for tree in (s_out.z, s_out.u):
      for layer in SHAPES:
        assert isinstance(tree[layer]["bias"], optax.MaskedNode)
    x = kernels(rec["params_in"])
    z_in, u_in = masked_leaves(s_in.z), masked_leaves(s_in.u)
    z_out, u_out = masked_leaves(s_out.z), masked_leaves(s_out.u)
    count = int(s_in.count)
    if count % spec.dual_every:
      for a, b in zip(z_in + u_in, z_out + u_out):
        np.testing.assert_array_equal(a, b)
      continue
    n_dual += 1
    v = [xi + ui for xi, ui in zip(x, u_in)]
    assert nnz(z_out) in allowed, (t, nnz(z_out), allowed)
    # z keeps entries of x + u unchanged and zeroes the rest.
    for zi, vi in zip(z_out, v):
      np.testing.assert_array_equal(zi, np.where(zi != 0, vi, 0))
    if spec.magnitude:
      matches = [all(np.array_equal(a, b) for a, b in zip(z_out, reference_projection(v, s)))
                 for s in spec.sparsities]
      assert any(matches), f"step {t}: z is not the magnitude projection of x + u"
    if count == 0:
      assert all(not ui.any() for ui in u_out)
    else:
      for uo, ui, xi, zi in zip(u_out, u_in, x, z_out):
        np.testing.assert_allclose(uo, ui + xi - zi, rtol=1e-6, atol=1e-7)
  assert n_dual == len(range(0, MAIN_STEPS - 1, spec.dual_every))


@pytest.mark.parametrize("name", NAMES)
def test_constraint_distance_matches_direct_computation(name):
  run = _main_run(name)
  for t in (0, 1, 8, 30, MAIN_STEPS - 1):
    rec = run["records"][t]
    z = masked_leaves(safe_optax.find_admm_state(rec["state_out"]).z)
    x = kernels(rec["params_out"])
    direct = math.sqrt(sum(float(np.sum((xi.astype(np.float64) - zi) ** 2))
                           for xi, zi in zip(x, z)))
    got = float(safe_optax.constraint_distance(rec["params_out"], rec["state_out"]))
    assert got == pytest.approx(direct, rel=1e-5, abs=1e-7)
    if t > 0:
      assert direct > 0  # Not trivially zero: the iterate is dense.


@pytest.mark.parametrize("name", NAMES)
def test_finalize_gives_exact_counts(name):
  run = _main_run(name)
  params = run["params"]
  for sparsity in (0.8,):  # (0.5 is finalized in the inject_hyperparams test)
    sparse, masks = safe_optax.finalize(params, sparsity)
    keep = safe_optax.num_keep(N_PRUNABLE, sparsity)
    assert nnz(kernels(sparse)) == keep
    assert sum(int(np.sum(m)) for m in kernels(masks)) == keep
    for b_new, b_old in zip(biases(sparse), biases(params)):
      np.testing.assert_array_equal(b_new, b_old)
    assert all(np.all(m) for m in biases(masks))
    report = safe_optax.sparsity_report(sparse)
    assert report.prunable_nonzero == keep


# --------------------------------------------------------------------------
# Data parallelism on 8 (host) devices versus 1.
# --------------------------------------------------------------------------

_SHARDED_SCRIPT = textwrap.dedent("""
    import json, math
    import jax, jax.numpy as jnp, numpy as np, optax, safe_optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def init_mlp():
      keys = jax.random.split(jax.random.PRNGKey(0), 2)
      shapes = {"dense0": (8, 16), "dense1": (16, 4)}
      return {name: {"kernel": jax.random.normal(k, s) / math.sqrt(s[0]),
                     "bias": jnp.full((s[1],), 0.1)}
              for k, (name, s) in zip(keys, shapes.items())}

    def loss(p, x, y):
      h = jnp.tanh(x @ p["dense0"]["kernel"] + p["dense0"]["bias"])
      return jnp.mean((h @ p["dense1"]["kernel"] + p["dense1"]["bias"] - y) ** 2)

    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (64, 8))
    y = jnp.tanh(x @ jax.random.normal(kw, (8, 4)))
    tx = safe_optax.safe(0.05, 0.8, penalty=1e-2, total_steps=40, dual_every=8, rho=0.05)

    def train(params, x, y):
      @jax.jit
      def step(p, s, x, y):
        grad_fn = lambda q, _: jax.grad(loss)(q, x, y)
        u, s = tx.update(grad_fn(p, 0), s, p, grad_fn=grad_fn)
        return optax.apply_updates(p, u), s
      s = tx.init(params)
      for _ in range(40):
        params, s = step(params, s, x, y)
      return params, s

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    p1, s1 = train(init_mlp(), x, y)
    xs, ys = jax.device_put(x, dat), jax.device_put(y, dat)
    p8, s8 = train(jax.device_put(init_mlp(), rep), xs, ys)
    z1 = safe_optax.find_admm_state(s1).z
    z8 = safe_optax.find_admm_state(s8).z
    print(json.dumps({
        "devices": jax.device_count(),
        "x_devices": len(xs.sharding.device_set),
        "x_shard_rows": [s.data.shape[0] for s in xs.addressable_shards],
        "param_devices": len(jax.tree.leaves(p8)[0].sharding.device_set),
        "z_masks_equal": all(bool(jnp.array_equal(a != 0, b != 0))
                             for a, b in zip(jax.tree.leaves(z1), jax.tree.leaves(z8))),
        "z_nnz": [sum(int(jnp.count_nonzero(a)) for a in jax.tree.leaves(z)) for z in (z1, z8)],
        # Leaves in flatten order; the parent finalizes them (its projection is compiled).
        "p1": [np.asarray(a).tolist() for a in jax.tree.leaves(p1)],
        "p8": [np.asarray(a).tolist() for a in jax.tree.leaves(p8)],
    }))
""")


def _launch_sharded_run() -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": process_launcher.forced_devices_flags(8),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen([sys.executable, "-c", _SHARDED_SCRIPT], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_data_parallel_on_8_devices_matches_single_device():
  proc = _BACKGROUND["sharded"] if "sharded" in _BACKGROUND else _launch_sharded_run()
  stdout, stderr = proc.communicate(timeout=600)
  if proc.returncode != 0 and "rendezvous" in stderr:
    # XLA's in-process CPU collectives can deadlock when 8 forced devices share 2 busy
    # cores (a device thread never reaches the all-reduce; XLA aborts after the timeout of
    # forced_devices_flags). That is the runtime, not the result: run once more, alone.
    proc = _launch_sharded_run()
    stdout, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 0, stderr[-4000:]
  result = json.loads(stdout.strip().splitlines()[-1])
  assert result["devices"] == 8
  assert result["x_devices"] == 8 and result["x_shard_rows"] == [8] * 8
  assert result["param_devices"] == 8  # replicated params stay replicated
  keep = safe_optax.num_keep(N_PRUNABLE, 0.8)
  assert result["z_masks_equal"] and result["z_nnz"] == [keep, keep]
  treedef = jax.tree.structure(init_mlp())
  p1, p8 = (jax.tree.unflatten(treedef, [np.asarray(a, np.float32) for a in result[k]])
            for k in ("p1", "p8"))
  for a, b, a0 in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), jax.tree.leaves(init_mlp())):
    assert not np.allclose(a, a0, atol=1e-3)  # both trained
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
  (f1, m1), (f8, m8) = safe_optax.finalize(p1, 0.8), safe_optax.finalize(p8, 0.8)
  for a, b in zip(jax.tree.leaves(m1), jax.tree.leaves(m8)):
    np.testing.assert_array_equal(a, b)
  assert nnz(kernels(f1)) == nnz(kernels(f8)) == keep
