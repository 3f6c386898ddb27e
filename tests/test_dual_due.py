"""``admm_penalty``'s ``dual_due`` hint: two programs, the same results.

A loop that passes ``dual_due=is_dual_step(t, K)`` compiles a step with the
projection (the dual steps) and one without it (the others). These tests check
that such a run equals the default run (one program, the dual update in a
``lax.cond``) bit for bit, that the program without the dual update holds no
projection (traced primitives, XLA's temporary buffer), and that a wrong hint
is counted rather than silently dropped. ``run_dual_update`` (the dual update
as a program of its own, then a ``dual_due=False`` step) equals them too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax

K = 3
STEPS = 8  # dual updates at 0, 3, 6
PROJECTION_PRIMITIVES = {"sort", "top_k", "scatter-add", "scatter_add", "scatter", "cumsum",
                         "argsort", "cond"}


def _params():
  rng = np.random.default_rng(0)
  return {"w1": jnp.asarray(rng.normal(size=(12, 10)), jnp.float32),
          "b1": jnp.zeros(10, jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(10, 4)), jnp.float32)}


def _loss(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean(jnp.square(h @ params["w2"] - 1.0))


def _batch(t):
  return jnp.asarray(np.random.default_rng(t).normal(size=(6, 12)), jnp.float32)


TRANSFORMS = {
    "safe": lambda: safe_optax.safe(0.05, 0.6, penalty=0.1, total_steps=STEPS, dual_every=K),
    "safe_plus": lambda: safe_optax.safe_plus(0.05, 0.6, penalty=0.1, total_steps=STEPS,
                                              dual_every=K),
    "admm_per_leaf": lambda: safe_optax.admm(0.05, 0.6, penalty=0.1, dual_every=K,
                                             structure=safe_optax.PerLeaf()),
    "decoupled": lambda: safe_optax.safe(0.05, 0.6, penalty=0.1, total_steps=STEPS,
                                         dual_every=K, decoupled_penalty=True),
    "multi_adam": lambda: optax.chain(
        safe_optax.sam_perturb(0.05),
        safe_optax.admm_penalty((0.5, 0.7), 0.1, dual_every=K, penalty_schedule="constant"),
        optax.adam(1e-2)),
}


def _step_fn(tx):
  def step(params, state, x, **hint):
    grad_fn = lambda p, _: jax.grad(_loss)(p, x)
    updates, state = tx.update(jax.grad(_loss)(params, x), state, params, grad_fn=grad_fn,
                               **hint)
    return optax.apply_updates(params, updates), state
  return step


def _run(tx, split: bool, separate: bool = False):
  step = jax.jit(_step_fn(tx), static_argnames="dual_due")
  dual = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx))
  params = _params()
  state = tx.init(params)
  for t in range(STEPS):
    hint = {"dual_due": safe_optax.experimental.is_dual_step(t, K)} if split else {}
    if separate:
      if safe_optax.experimental.is_dual_step(t, K):
        state = dual(state, params)
      hint = {"dual_due": False}
    params, state = step(params, state, _batch(t), **hint)
  return params, state


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_split_programs_equal_the_cond_program_bit_for_bit(name):
  tx = TRANSFORMS[name]()
  expected = _run(tx, split=False)
  got = _run(tx, split=True)
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  admm_state = safe_optax.find_admm_state(got[1])
  assert int(admm_state.invalid_hyperparams) == 0
  assert int(admm_state.count) == STEPS
  # The dual updates did run: z is sparse and differs from its initial Proj(x0).
  z = [l for l in jax.tree.leaves(admm_state.z) if l.ndim == 2]
  z0 = jax.tree.leaves(safe_optax.find_admm_state(tx.init(_params())).z)
  assert any(not np.array_equal(a, b) for a, b in zip(z, [l for l in z0 if l.ndim == 2]))


WRAPPED = {
    # Optax wrappers around SAFE: their own state must come through run_dual_update unchanged.
    "apply_if_finite": lambda: optax.chain(safe_optax.sam_perturb(0.05), optax.apply_if_finite(
        safe_optax.safe(0.05, 0.6, penalty=0.1, total_steps=STEPS, dual_every=K, rho=None),
        max_consecutive_errors=2)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(safe_optax.safe)(
        learning_rate=0.05, sparsity=0.6, penalty=0.1, total_steps=STEPS, dual_every=K),
    "clipped": lambda: safe_optax.safe(0.05, 0.6, penalty=0.1, total_steps=STEPS, dual_every=K,
                                       max_grad_norm=0.5),
}


@pytest.mark.xla_default_codegen  # bit for bit / HLO: XLA's own code generation
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(TRANSFORMS) - {"safe_plus"}) + sorted(WRAPPED))
def test_dual_update_as_its_own_program_equals_one_program_bit_for_bit(name):
  tx = {**TRANSFORMS, **WRAPPED}[name]()
  expected = _run(tx, split=False)
  got = _run(tx, split=False, separate=True)
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  admm_state = safe_optax.find_admm_state(got[1])
  assert int(admm_state.invalid_hyperparams) == 0  # no dual update counted as missed
  assert int(admm_state.count) == STEPS and int(admm_state.dual_count) == 6


@pytest.mark.slow
def test_run_dual_update_changes_only_z_u_and_runs_once_per_count():
  tx = TRANSFORMS["safe"]()
  params = _params()
  step = jax.jit(_step_fn(tx), static_argnames="dual_due")
  dual = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx))
  state = tx.init(params)
  for t in range(K):  # counts 0 .. K - 1; count K is due next
    params, state = step(params, state, _batch(t))
  ran = dual(state, params)
  before, after = safe_optax.find_admm_state(state), safe_optax.find_admm_state(ran)
  assert int(after.count) == int(before.count) == K and int(after.dual_count) == K
  assert int(after.invalid_hyperparams) == 0
  # By hand: z = Proj(x + u), u = u + x - z on the prunable (2-D) leaves.
  for name in ("w1", "w2"):
    x, u = np.asarray(params[name]), np.asarray(before.u[name])
    assert not np.array_equal(after.z[name], before.z[name])
    np.testing.assert_array_equal(after.u[name], u + x - np.asarray(after.z[name]))
  z_all = np.concatenate([np.asarray(after.z[n]).ravel() for n in ("w1", "w2")])
  assert np.count_nonzero(z_all) == safe_optax.num_keep(z_all.size, 0.6)
  # Every other leaf of the state (SAM's, momentum's) is the input's.
  is_admm = lambda s: isinstance(s, safe_optax.ADMMState)
  others = lambda s: jax.tree.leaves(jax.tree.map(lambda n: None if is_admm(n) else n, s,
                                                  is_leaf=is_admm))
  jax.tree.map(np.testing.assert_array_equal, others(ran), others(state))
  # A second call at the same count changes nothing (the dual update ran once).
  jax.tree.map(np.testing.assert_array_equal, dual(ran, params), ran)
  # At a count that is not a dual step it changes nothing either.
  params, stepped = step(params, ran, _batch(K), dual_due=False)
  jax.tree.map(np.testing.assert_array_equal, dual(stepped, params), stepped)


def test_run_dual_update_refuses_a_saliency_and_a_state_without_admm():
  params = _params()
  tx = TRANSFORMS["safe_plus"]()
  with pytest.raises(ValueError, match=r"saliency \(`scores` set\).*dual_due=True"):
    safe_optax.experimental.run_dual_update(tx, tx.init(params), params)
  sam = optax.chain(safe_optax.sam_perturb(0.05), optax.sgd(0.1))
  with pytest.raises(ValueError, match="ADMMState"):
    safe_optax.experimental.run_dual_update(sam, sam.init(params), params)


def test_dual_program_holds_no_gradient_pass():
  """The dual program computes only the projection: the SAM and momentum work is removed."""
  w = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(64, 64)), jnp.float32)}
  tx = safe_optax.safe(0.1, 0.9, penalty=1e-3, total_steps=100, dual_every=K)
  hlo = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx)).lower(
      tx.init(w), w).compile().as_text()
  assert "sort" in hlo or "scatter" in hlo or "reduce" in hlo  # the projection is there
  assert " dot(" not in hlo and "convolution" not in hlo


def _primitives(jaxpr):
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          names |= _primitives(sub)
  return names


def test_non_dual_program_holds_no_projection():
  tx = TRANSFORMS["safe"]()
  params = _params()
  state = tx.init(params)
  step = _step_fn(tx)
  traced = {hint: _primitives(jax.make_jaxpr(functools.partial(step, dual_due=hint))(
      params, state, _batch(0)).jaxpr) for hint in (None, False, True)}
  assert PROJECTION_PRIMITIVES & traced[None], "the cond program should hold the projection"
  assert PROJECTION_PRIMITIVES & traced[True]
  assert not PROJECTION_PRIMITIVES & traced[False], sorted(PROJECTION_PRIMITIVES & traced[False])


@pytest.mark.slow
def test_non_dual_program_temp_buffer_excludes_the_projection():
  # One large matrix and a one-row batch: the projection's temporaries (flat keys,
  # histograms) dwarf the forward and backward passes', as on a small MLP.
  w = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(256, 256)), jnp.float32)}
  x = jnp.ones((1, 256), jnp.float32)
  loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]))
  tx = safe_optax.safe(0.1, 0.9, penalty=1e-3, total_steps=100, dual_every=K)
  sam = optax.chain(safe_optax.sam_perturb(0.1), optax.sgd(0.1, momentum=0.9))

  def temp_bytes(tx, **hint):
    def step(p, s, x):
      grad_fn = lambda q, _: jax.grad(loss)(q, x)
      return tx.update(jax.grad(loss)(p, x), s, p, grad_fn=grad_fn, **hint)
    compiled = jax.jit(step).lower(w, tx.init(w), x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  cond, plain, base = temp_bytes(tx), temp_bytes(tx, dual_due=False), temp_bytes(sam)
  weight_bytes = w["w"].size * 4
  # The cond program's buffer holds the projection's temporaries (a flat copy at least);
  # the non-dual one only the penalty's few weight-sized values beyond SAM's.
  assert cond >= plain + weight_bytes, (cond, plain)
  assert plain <= base + 2 * weight_bytes, (plain, base)


def test_wrong_hint_skips_the_dual_update_and_is_counted():
  tx = TRANSFORMS["safe"]()
  params = _params()
  state = tx.init(params)
  step = jax.jit(_step_fn(tx), static_argnames="dual_due")
  params, state = step(params, state, _batch(0), dual_due=True)  # count 0: due
  for t in range(1, K):
    params, state = step(params, state, _batch(t), dual_due=False)
  before = safe_optax.find_admm_state(state)
  _, state = step(params, state, _batch(K), dual_due=False)  # count K: due, hint wrong
  after = safe_optax.find_admm_state(state)
  jax.tree.map(np.testing.assert_array_equal, (after.z, after.u), (before.z, before.u))
  assert int(after.invalid_hyperparams) == 1
  # A True hint on a step that is not due changes nothing: the cond still decides.
  _, state_true = step(params, tx.init(params), _batch(1), dual_due=True)
  _, state_none = jax.jit(_step_fn(tx))(params, tx.init(params), _batch(1))
  jax.tree.map(np.testing.assert_array_equal, state_true, state_none)


def test_wrong_hint_is_counted_when_called_eagerly():
  tx = safe_optax.admm_penalty(0.5, 1.0, dual_every=2)
  params = _params()
  state = tx.init(params)
  zero = jax.tree.map(jnp.zeros_like, params)
  _, state = tx.update(zero, state, params, dual_due=False)  # count 0 is due
  assert int(state.invalid_hyperparams) == 1
  _, state = tx.update(zero, state, params, dual_due=False)  # count 1 is not
  assert int(state.invalid_hyperparams) == 1


@pytest.mark.parametrize("bad", [1, "yes", jnp.array(True), np.int32(0)])
def test_dual_due_must_be_a_python_bool(bad):
  tx = safe_optax.admm_penalty(0.5, 1.0)
  params = _params()
  with pytest.raises(ValueError, match="dual_due"):
    tx.update(params, tx.init(params), params, dual_due=bad)


def test_is_dual_step():
  assert [safe_optax.experimental.is_dual_step(t, 3) for t in range(7)] == [
      True, False, False, True, False, False, True]
  assert all(safe_optax.experimental.is_dual_step(t, 1) for t in range(4))
  with pytest.raises(ValueError, match="dual_every"):
    safe_optax.experimental.is_dual_step(0, 0)
  with pytest.raises(ValueError, match="count"):
    safe_optax.experimental.is_dual_step(-1, 4)


@pytest.mark.xla_default_codegen  # bit for bit / HLO: XLA's own code generation
@pytest.mark.slow
def test_llm_block_step_split_equals_cond_program():
  from safe_optax.llm import block, model as model_lib
  from safe_optax.llm.prune_config import PruneConfig

  config = model_lib.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1)
  linears, norms = block.split_block(model_lib.init_params(config, 0)["layers_0"])
  cfg = PruneConfig("safe", dual_every=K, learning_rate=1e-2)
  step = block.safe_step(config, cfg, STEPS)
  rng = np.random.default_rng(0)
  data = [tuple(jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32) for _ in range(2))
          for _ in range(STEPS)]
  runs = []
  for split in (False, True):
    params = linears
    state = block.safe_transform(cfg, STEPS).init(params)
    for t, (x, y) in enumerate(data):
      due = safe_optax.experimental.is_dual_step(t, K) if split else None
      params, state, _ = step(params, norms, None, None, state, x, y, dual_due=due)
    runs.append((params, state))
  jax.tree.map(np.testing.assert_array_equal, runs[1], runs[0])
  assert int(safe_optax.find_admm_state(runs[1][1]).invalid_hyperparams) == 0


@pytest.mark.slow
def test_run_dual_update_under_multisteps_equals_the_plain_run():
  """Under optax.MultiSteps the ADMM count is the inner one (one per accumulated step): the
  dual program runs on the micro-steps that end an accumulation at a due inner count."""
  every_k = 2
  inner = lambda: safe_optax.admm(0.05, 0.6, penalty=0.1, dual_every=K)
  steps = 2 * every_k * K + 1

  def run(separate):
    tx = optax.MultiSteps(inner(), every_k_schedule=every_k)
    step = jax.jit(_step_fn(tx), static_argnames="dual_due")
    dual = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx))
    params = _params()
    state = tx.init(params)
    for t in range(steps):
      hint = {}
      if separate:
        if t % every_k == every_k - 1 and safe_optax.experimental.is_dual_step(t // every_k, K):
          state = dual(state, params)
        hint = {"dual_due": False}
      params, state = step(params, state, _batch(t), **hint)
    return params, state

  expected, got = run(False), run(True)
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  admm_state = safe_optax.find_admm_state(got[1])
  assert int(admm_state.invalid_hyperparams) == 0
  assert int(admm_state.count) == steps // every_k and int(admm_state.dual_count) == K
