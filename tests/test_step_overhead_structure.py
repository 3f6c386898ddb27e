"""What a SAFE step without a dual update traces to (structure only, no timings).

The dual update (the projection: sorts, histograms, scatters) must sit inside
the one ``lax.cond`` of the step, so steps between dual updates skip it; the
SAM pass must call ``grad_fn`` once; the penalty must not change dtypes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax

# Primitives of a projection: none may run outside the dual update's branch.
PROJECTION_PRIMITIVES = {"sort", "top_k", "scatter-add", "scatter_add", "scatter", "cumsum",
                         "argsort"}


def _params(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {"w1": jnp.asarray(rng.normal(size=(8, 6)), dtype), "b1": jnp.zeros(6, dtype),
          "w2": jnp.asarray(rng.normal(size=(6, 3)), dtype)}


def _loss(params):
  h = jnp.tanh(jnp.ones((4, 8), params["w1"].dtype) @ params["w1"] + params["b1"])
  return jnp.sum(jnp.square(h @ params["w2"]))


def _top_level_primitives(jaxpr):
  """Primitive names of a jaxpr's equations, entering calls (pjit) but not cond branches."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    if eqn.primitive.name != "cond":
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns"):
            names.extend(_top_level_primitives(sub))
  return names


@pytest.mark.parametrize("method", ["safe", "admm", "safe_plus"])
def test_projection_only_inside_the_dual_cond(method):
  params = _params()
  if method == "safe":
    tx = safe_optax.safe(0.1, 0.5, penalty=1e-3, total_steps=100, dual_every=4)
  elif method == "admm":
    tx = safe_optax.admm(0.1, 0.5, penalty=1e-3, total_steps=100, dual_every=4)
  else:
    tx = safe_optax.safe_plus(0.1, 0.5, penalty=1e-3, total_steps=100, dual_every=4)
  state = tx.init(params)
  grad_fn = lambda p, _: jax.grad(_loss)(p)

  def update(params, state):
    return tx.update(jax.grad(_loss)(params), state, params, grad_fn=grad_fn)

  jaxpr = jax.make_jaxpr(update)(params, state).jaxpr
  names = _top_level_primitives(jaxpr)
  assert names.count("cond") == 1
  assert not PROJECTION_PRIMITIVES & set(names), sorted(PROJECTION_PRIMITIVES & set(names))


def test_sam_pass_traces_grad_fn_once():
  params = _params()
  tx = safe_optax.safe(0.1, 0.5, penalty=1e-3, total_steps=100, dual_every=4)
  state = tx.init(params)
  calls = []

  def grad_fn(p, step):
    calls.append(step)
    return jax.grad(_loss)(p)

  jax.make_jaxpr(lambda p, s: tx.update(jax.grad(_loss)(p), s, p, grad_fn=grad_fn))(
      params, state)
  assert calls == [0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_penalty_keeps_dtypes(dtype):
  params = _params(dtype)
  tx = safe_optax.safe(0.1, 0.5, penalty=1e-3, total_steps=100, dual_every=4)
  state = tx.init(params)
  grad_fn = lambda p, _: jax.grad(_loss)(p)
  updates, state = jax.jit(lambda p, s: tx.update(jax.grad(_loss)(p), s, p, grad_fn=grad_fn))(
      params, state)
  assert jax.tree.map(lambda a: a.dtype, updates) == jax.tree.map(lambda a: a.dtype, params)
  admm = safe_optax.find_admm_state(state)
  for leaf in jax.tree.leaves(admm.z, is_leaf=lambda x: isinstance(x, optax.MaskedNode)):
    if not isinstance(leaf, optax.MaskedNode):
      assert leaf.dtype == dtype
