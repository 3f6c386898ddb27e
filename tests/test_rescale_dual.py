"""``rescale_dual``: ADMM's dual kept unscaled while the penalty changes (Boyd et al. 2011, §3.4.1).

The reference below is written in the *unscaled* form, independently of the
library's scaled ``u``: ``y`` is the Lagrange multiplier, the penalty's gradient
is ``lambda_t (x - z) + y``, and every ``K`` steps ``z = Proj(x + y / lambda_t)``,
``y += lambda_t (x - z)``; a zero penalty at a dual update resets ``y`` to 0 (the scaled
``u = y / lambda`` cannot carry it, and there is no augmented Lagrangian to keep it for).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safe_optax
from safe_optax import methods
from safe_optax.vision import cli, configs, sweeps

TARGET = np.array([[3.0, -0.2, 0.05, 1.5], [-2.0, 0.3, 0.0, -0.7], [0.9, -1.1, 0.4, 2.2]],
                  np.float32)


def _grad(x):
  """Gradient of ``0.5 * ||x - TARGET||^2 * (1 + |x|)`` -ish: a non-quadratic loss, elementwise."""
  return (x - TARGET) * (1.0 + 0.1 * x * x)


def _proj(v, sparsity):
  """Global top-k by |v| with numpy; ties are absent in these tests."""
  k = v.size - int(np.floor(sparsity * v.size))
  keep = np.zeros(v.size, bool)
  if k:
    keep[np.argsort(-np.abs(v).ravel(), kind="stable")[:k]] = True
  return np.where(keep.reshape(v.shape), v, 0.0)


def _reference(lams, *, steps, dual_every, sparsity, lr, momentum, decoupled=False):
  """Unscaled-dual ADMM with SGD (+ momentum); ``lams[t]`` is the penalty at step t."""
  x = np.zeros_like(TARGET) + 0.5
  m = np.zeros_like(x)
  y = np.zeros_like(x)
  z = None
  for t in range(steps):
    lam = lams[t]
    if t % dual_every == 0:
      if t == 0:
        z = _proj(x, sparsity)
      elif lam > 0:
        z = _proj(x + y / lam, sparsity)
        y = y + lam * (x - z)
      else:  # no augmented Lagrangian at lambda = 0: the dual is reset
        z = _proj(x, sparsity)
        y = np.zeros_like(y)
    g = _grad(x)
    penalty = lam * (x - z) + y
    if decoupled:
      m = momentum * m + g
      x = x - lr * m - lr * penalty
    else:
      m = momentum * m + g + penalty
      x = x - lr * m
  return x


def _run(tx, steps):
  params = {"w": jnp.zeros_like(TARGET) + 0.5}
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update({"w": _grad(params["w"])}, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return np.asarray(params["w"]), state


def _schedule(values):
  table = jnp.asarray(values, jnp.float32)
  return lambda count: table[jnp.minimum(count, len(values) - 1)]


@pytest.mark.parametrize("decoupled", [False, True])
def test_rescaled_admm_matches_the_unscaled_dual_reference_under_a_cosine_ramp(decoupled):
  steps, k, s, lr = 60, 4, 0.5, 0.05
  lam_fn = safe_optax.penalty_schedule(2.0, "cosine", total_steps=steps)
  lams = [float(lam_fn(t)) for t in range(steps)]
  assert lams[0] == 0.0 and lams[-1] > 1.9  # a real ramp from 0
  if decoupled:
    tx = safe_optax.decoupled_admm_penalty(optax.sgd(lr, momentum=0.9), s, 2.0,
                                           learning_rate=lr, dual_every=k,
                                           penalty_schedule="cosine", total_steps=steps,
                                           rescale_dual=True)
  else:
    tx = optax.chain(safe_optax.admm_penalty(s, 2.0, dual_every=k, penalty_schedule="cosine",
                                             total_steps=steps, rescale_dual=True),
                     optax.sgd(lr, momentum=0.9))
  got, _ = _run(tx, steps)
  want = _reference(lams, steps=steps, dual_every=k, sparsity=s, lr=lr, momentum=0.9,
                    decoupled=decoupled)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  # The paper's update (no rescaling) is a different iteration under the same ramp.
  plain = optax.chain(safe_optax.admm_penalty(s, 2.0, dual_every=k, penalty_schedule="cosine",
                                              total_steps=steps), optax.sgd(lr, momentum=0.9))
  assert np.abs(_run(plain, steps)[0] - want).max() > 1e-3


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lams=st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0, 4.0]), min_size=5, max_size=5),
       dual_every=st.integers(1, 5), kept=st.integers(0, 12))
def test_rescaled_dual_matches_the_reference_for_any_piecewise_penalty(lams, dual_every, kept):
  # Penalties that jump up, down and to 0 (a zero penalty has no dual force), every K, and
  # every number of kept weights from 1 to all 12 (sparsity 0). The 1e-6 keeps the count clear
  # of the float rounding of (12 - kept) / 12, which the projection tests cover.
  steps = 25
  per_step = [lams[min(t // 5, 4)] for t in range(steps)]
  sparsity = (TARGET.size - max(kept, 1)) / TARGET.size + 1e-6
  tx = optax.chain(safe_optax.admm_penalty(sparsity, _schedule(per_step), dual_every=dual_every,
                                           penalty_schedule=None, rescale_dual=True),
                   optax.sgd(0.05, momentum=0.5))
  got, _ = _run(tx, steps)
  want = _reference(per_step, steps=steps, dual_every=dual_every, sparsity=sparsity, lr=0.05,
                    momentum=0.5)
  np.testing.assert_allclose(got, want, rtol=5e-5, atol=5e-6)


@pytest.mark.slow
def test_a_constant_penalty_makes_rescaling_a_no_op():
  # SAFE (SAM, momentum, weight decay) on a small pytree, 48 steps with 12 dual updates.
  key = jax.random.PRNGKey(0)
  params = {"a": jax.random.normal(key, (6, 5)), "b": {"c": jnp.linspace(-1, 1, 7)}}
  loss = lambda p: jnp.sum((p["a"] - 0.3) ** 2 * jnp.arange(5)) + jnp.sum(jnp.sin(p["b"]["c"]))
  grad_fn = lambda p, _: jax.grad(loss)(p)

  def run(rescale):
    tx = safe_optax.safe(0.05, 0.6, penalty=0.5, penalty_schedule="constant", dual_every=4,
                         weight_decay=1e-3, rescale_dual=rescale)
    state, p = tx.init(params), params
    step = jax.jit(lambda p, s: tx.update(grad_fn(p, 0), s, p, grad_fn=grad_fn))
    for _ in range(48):
      updates, state = step(p, state)
      p = optax.apply_updates(p, updates)
    return p

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               run(True), run(False))


def test_rescaling_keeps_the_step_from_recompiling_and_works_under_inject_hyperparams():
  tx = optax.inject_hyperparams(safe_optax.admm_penalty, static_args=("dual_every",))(
      0.5, penalty=1.0, dual_every=3, penalty_schedule=None, rescale_dual=True)
  params = {"w": jnp.asarray(TARGET)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, lam):
    state.hyperparams["penalty"] = lam
    updates, state = tx.update({"w": _grad(params["w"])}, state, params)
    return optax.apply_updates(params, updates), state

  for t, lam in enumerate([0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 0.0, 1.0]):
    params, state = step(params, state, jnp.float32(lam))
  assert step._cache_size() == 1  # pylint: disable=protected-access
  assert np.isfinite(np.asarray(params["w"])).all()


@pytest.mark.parametrize("factory", [
    lambda v: safe_optax.admm_penalty(0.5, 1.0, rescale_dual=v),
    lambda v: safe_optax.decoupled_admm_penalty(optax.sgd(0.1), 0.5, 1.0, learning_rate=0.1,
                                                rescale_dual=v),
    lambda v: safe_optax.safe(0.1, 0.5, penalty=1.0, total_steps=10, rescale_dual=v),
    lambda v: safe_optax.safe_plus(0.1, 0.5, penalty=1.0, total_steps=10, rescale_dual=v),
])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_rescale_dual_must_be_a_bool_at_construction(factory, value):
  with pytest.raises(TypeError, match=r"`rescale_dual` must be True or False"):
    factory(value)


def test_vision_config_cli_and_sweep_folders_carry_the_switch(tmp_path):
  config = configs.get_config("mlp-mnist", method="safe", sparsity=0.9)
  assert config.rescale_dual is False
  with pytest.raises(ValueError, match="`rescale_dual` must be True or False"):
    configs.get_config("mlp-mnist", rescale_dual="yes")
  args = cli.build_parser().parse_args(
      ["train", "--preset", "mlp-mnist", "--data-dir", "d", "--workdir", "w", "--rescale-dual"])
  assert cli._overrides(args)["rescale_dual"] is True  # pylint: disable=protected-access
  args = cli.build_parser().parse_args(
      ["train", "--preset", "mlp-mnist", "--data-dir", "d", "--workdir", "w"])
  assert cli._overrides(args)["rescale_dual"] is None  # pylint: disable=protected-access
  # The optimizer the vision module builds is the rescaled one: its ADMM state differs after a
  # ramp (checked through the transform, not a flag).
  on, off = config.replace(rescale_dual=True), config
  assert methods.Recipe(on, 10).admm["rescale_dual"] is True
  assert methods.Recipe(off, 10).admm["rescale_dual"] is False
  # A rescaled SAFE run has its own folder; ADMM's constant penalty is not affected by it.
  assert sweeps.run_dir(tmp_path, on).name == "safe-s0.9-lam0.1-rescaled-seed0"
  assert sweeps.run_dir(tmp_path, off).name == "safe-s0.9-lam0.1-seed0"
  admm = on.replace(method="admm", admm_penalty=0.01)
  assert "rescaled" not in sweeps.run_dir(tmp_path, admm).name
