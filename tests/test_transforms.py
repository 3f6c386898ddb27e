"""SAFE / ADMM transforms against a plain reference implementation of SPEC §1.

The reference below is written from the update rule, with numpy for the
optimizer arithmetic and a full sort for the projection, and the official
dual timing (after the x-step of step t when (t + 1) % K == 0).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax

IN, HIDDEN, OUT, BATCH = 6, 10, 3, 16
PRUNABLE = ("w1", "w2")


def init_params(seed):
  rng = np.random.default_rng(seed)
  return {
      "w1": jnp.asarray(rng.normal(0, 0.5, (IN, HIDDEN)), jnp.float32),
      "b1": jnp.asarray(rng.normal(0, 0.1, (HIDDEN,)), jnp.float32),
      "w2": jnp.asarray(rng.normal(0, 0.5, (HIDDEN, OUT)), jnp.float32),
      "b2": jnp.zeros((OUT,), jnp.float32),
  }


def make_batches(seed, steps):
  rng = np.random.default_rng(seed + 1000)
  xs = rng.normal(size=(steps, BATCH, IN)).astype(np.float32)
  ys = rng.integers(0, OUT, size=(steps, BATCH))
  return xs, ys


def loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


grad = jax.jit(jax.grad(loss))


def reference_projection(tree, sparsity, scores=None):
  """Global top-k by a full sort of the concatenated prunable scores."""
  flat = np.concatenate([np.abs(tree[k]).ravel() if scores is None else scores[k].ravel()
                         for k in PRUNABLE])
  keep = flat.size - math.floor(round(sparsity * flat.size, 9))
  order = np.argsort(-flat, kind="stable")
  mask = np.zeros(flat.size, bool)
  mask[order[:keep]] = True
  out, start = {}, 0
  for k in PRUNABLE:
    size = tree[k].size
    out[k] = np.where(mask[start:start + size].reshape(tree[k].shape), tree[k], 0.0)
    start += size
  return out


def reference_safe(params, batches, *, lr, sparsity, penalty, total_steps, rho, dual_every,
                   momentum, weight_decay, decoupled=False, snip=False):
  """SPEC §1 written out: SAM gradient, penalty, weight decay, SGD momentum, dual step."""
  x = {k: np.asarray(v, np.float64) for k, v in params.items()}
  trace = {k: np.zeros_like(v) for k, v in x.items()}
  z = reference_projection(x, sparsity)
  u = {k: np.zeros_like(x[k]) for k in PRUNABLE}
  history = []
  xs, ys = batches
  for t in range(len(xs)):
    as32 = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    g = {k: np.asarray(v, np.float64) for k, v in grad(as32, xs[t], ys[t]).items()}
    if rho is not None:
      norm = math.sqrt(sum(np.sum(v ** 2) for v in g.values()))
      perturbed = {k: jnp.asarray(x[k] + rho * g[k] / (norm + 1e-12), jnp.float32) for k in x}
      g = {k: np.asarray(v, np.float64) for k, v in grad(perturbed, xs[t], ys[t]).items()}
    if snip and t % dual_every == 0:
      # SAFE+ (SNIP) scores with this step's (SAM) gradient, so it projects at
      # the start of the step; z0 = Proj^P(x0) and u stays 0 at t = 0.
      v = {k: x[k] + u[k] for k in PRUNABLE}
      z = reference_projection(v, sparsity, {k: np.abs(g[k] * v[k]) for k in PRUNABLE})
      if t > 0:
        u = {k: u[k] + x[k] - z[k] for k in PRUNABLE}
    lam = penalty * 0.5 * (1 - math.cos(math.pi * min(t / total_steps, 1.0)))
    pen = {k: lam * (x[k] - z[k] + u[k]) for k in PRUNABLE}
    step = {}
    for k in x:
      d = g[k] + (pen[k] if (k in PRUNABLE and not decoupled) else 0.0) + weight_decay * x[k]
      trace[k] = d + momentum * trace[k]
      step[k] = -lr * trace[k] - (lr * pen[k] if (k in PRUNABLE and decoupled) else 0.0)
    x = {k: x[k] + step[k] for k in x}
    if not snip and (t + 1) % dual_every == 0:
      v = {k: x[k] + u[k] for k in PRUNABLE}
      z = reference_projection(v, sparsity)
      u = {k: u[k] + x[k] - z[k] for k in PRUNABLE}
    history.append(({k: v.copy() for k, v in x.items()}, {k: v.copy() for k, v in z.items()}))
  return history


def run_library(tx, params, batches):
  @jax.jit
  def step(params, state, x, y):
    grad_fn = lambda p, _: jax.grad(loss)(p, x, y)
    g = grad_fn(params, 0)
    updates, state = tx.update(g, state, params, grad_fn=grad_fn)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  history = []
  for x, y in zip(*batches):
    params, state = step(params, state, x, y)
    history.append((params, safe_optax.find_admm_state(state).z))
  return history


CONFIG = dict(lr=0.05, sparsity=0.7, penalty=0.5, total_steps=100, rho=0.05, dual_every=8,
              momentum=0.9, weight_decay=1e-3)


@pytest.mark.parametrize("variant", ["safe", "decoupled", "admm", "safe_plus_snip",
                                     "decoupled_snip"])
def test_matches_reference_for_120_steps(variant):
  steps = 120
  params, batches = init_params(0), make_batches(0, steps)
  cfg = dict(CONFIG)
  if variant == "admm":
    cfg["rho"] = None
  common = dict(penalty=cfg["penalty"], penalty_schedule="cosine", total_steps=cfg["total_steps"],
                dual_every=cfg["dual_every"], momentum=cfg["momentum"],
                weight_decay=cfg["weight_decay"])
  if variant == "admm":
    tx = safe_optax.admm(cfg["lr"], cfg["sparsity"], **common)
  elif variant in ("safe_plus_snip", "decoupled_snip"):
    tx = safe_optax.safe_plus(cfg["lr"], cfg["sparsity"], rho=cfg["rho"],
                              decoupled_penalty=variant == "decoupled_snip", **common)
  else:
    tx = safe_optax.safe(cfg["lr"], cfg["sparsity"], rho=cfg["rho"],
                         decoupled_penalty=variant == "decoupled", **common)
  ours = run_library(tx, params, batches)
  snip = variant in ("safe_plus_snip", "decoupled_snip")
  ref = reference_safe(params, batches, decoupled=variant in ("decoupled", "decoupled_snip"),
                       snip=snip, **cfg)
  for t, ((p, z), (p_ref, z_ref)) in enumerate(zip(ours, ref)):
    for k in p:
      np.testing.assert_allclose(p[k], p_ref[k], rtol=2e-4, atol=2e-5, err_msg=f"step {t} {k}")
    for k in PRUNABLE:
      # z is refreshed lazily (at the start of the next step) in the library.
      if (t + 1) % cfg["dual_every"] or snip:
        np.testing.assert_array_equal(np.asarray(z[k]) != 0, z_ref[k] != 0, err_msg=f"step {t}")
  # The penalty actually pulled the weights: they differ from a plain SAM run.
  assert not np.allclose(ours[-1][0]["w1"], run_library(
      optax.chain(*(([safe_optax.sam_perturb(cfg["rho"])] if cfg["rho"] else [])
                    + [optax.add_decayed_weights(cfg["weight_decay"]),
                       optax.sgd(cfg["lr"], cfg["momentum"]),
                       safe_optax.admm_penalty(0.7, 0.0)])),
      params, batches)[-1][0]["w1"], atol=1e-3)


def compressed_sensing(seed, n=120, m=60, k=6):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(m, n)).astype(np.float32) / np.sqrt(m)
  x_true = np.zeros(n, np.float32)
  support = rng.choice(n, k, replace=False)
  x_true[support] = rng.choice([-1.0, 1.0], k) * rng.uniform(1.0, 2.0, k)
  return jnp.asarray(a), jnp.asarray(x_true), set(support.tolist())


@pytest.mark.parametrize("method", ["safe", "admm"])
def test_recovers_sparse_support(method):
  n, k = 120, 6
  a, x_true, support = compressed_sensing(0, n=n, k=k)
  y = a @ x_true
  objective = lambda p: 0.5 * jnp.sum((a @ p["x"][:, 0] - y) ** 2)
  grad_fn = lambda p, _: jax.grad(objective)(p)
  sparsity = 1 - k / n
  kwargs = dict(penalty=0.5, dual_every=10, momentum=0.9)
  if method == "safe":
    tx = safe_optax.safe(0.05, sparsity, rho=0.01, penalty_schedule="constant", **kwargs)
  else:
    tx = safe_optax.admm(0.05, sparsity, **kwargs)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
    params = optax.apply_updates(params, updates)
    return params, state, safe_optax.constraint_distance(params, state)

  params = {"x": jnp.zeros((n, 1))}
  state = tx.init(params)
  distances = []
  for _ in range(1500):
    params, state, distance = step(params, state)
    distances.append(float(distance))
  sparse, masks = safe_optax.finalize(params, sparsity)
  assert set(np.flatnonzero(np.asarray(masks["x"][:, 0])).tolist()) == support
  np.testing.assert_allclose(sparse["x"][:, 0], x_true, atol=2e-2)
  # The iterate approaches the constraint set: ||x - z|| shrinks by orders of magnitude.
  assert np.mean(distances[-50:]) < 1e-2 * max(distances[:100])


def test_dual_update_initialises_z_and_keeps_u_zero():
  params = init_params(3)
  tx = safe_optax.admm_penalty(0.5, 1.0, dual_every=4)
  state = tx.init(params)
  g = jax.tree.map(jnp.zeros_like, params)
  _, state = jax.jit(tx.update)(g, state, params)
  ref = reference_projection({k: np.asarray(v) for k, v in params.items()}, 0.5)
  for k in PRUNABLE:
    np.testing.assert_array_equal(state.z[k], ref[k])
    np.testing.assert_array_equal(state.u[k], np.zeros_like(ref[k]))
  assert isinstance(state.z["b1"], optax.MaskedNode)


def test_safe_multi_draws_sparsity_from_choices():
  params = init_params(4)
  choices = (0.5, 0.8)
  tx = safe_optax.admm_penalty(choices, 0.1, dual_every=1, seed=3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  seen = set()
  n = sum(params[k].size for k in PRUNABLE)
  for _ in range(12):
    g = jax.tree.map(jnp.zeros_like, params)
    _, state = update(g, state, params)
    kept = sum(int(jnp.count_nonzero(state.z[k])) for k in PRUNABLE)
    seen.add(kept)
  assert seen == {safe_optax.num_keep(n, s) for s in choices}


@pytest.mark.slow
def test_hutchinson_is_exact_for_diagonal_hessian_and_unbiased_otherwise():
  h = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  quad = lambda p, _: jax.grad(lambda q: 0.5 * jnp.sum(h * q["w"] ** 2))(p)
  params = {"w": jnp.ones((2, 2))}
  diag = safe_optax.hutchinson_diagonal(quad, params, jax.random.PRNGKey(0), num_probes=1)
  np.testing.assert_allclose(diag["w"], h)
  full = jnp.array([[2.0, 0.5, 0.1], [0.5, 1.0, 0.3], [0.1, 0.3, 3.0]])
  grad_fn = lambda p, _: full @ p
  est = safe_optax.hutchinson_diagonal(grad_fn, jnp.zeros(3), jax.random.PRNGKey(1), 2000)
  np.testing.assert_allclose(est, jnp.diag(full), atol=0.05)


def test_obd_and_snip_scores_follow_their_metric():
  v = jnp.array([[1.0, -2.0], [3.0, 0.5]])
  g = jnp.array([[4.0, 0.1], [0.0, 2.0]])
  np.testing.assert_allclose(safe_optax.snip_scores(v, g), np.abs(np.asarray(v * g)))
  hess = jnp.array([[4.0, -9.0], [1.0, 0.0]])
  np.testing.assert_allclose(safe_optax.obd_scores(v, hess), [[2.0, 6.0], [3.0, 0.0]])


def test_wanda_saliency_in_transform_uses_input_norms_per_output():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.zeros(4)}
  norms = {"w": jnp.asarray(rng.uniform(0.1, 5.0, size=8), jnp.float32), "b": None}
  tx = safe_optax.admm_penalty(0.5, 1.0, structure=safe_optax.PerOutput(),
                               scores=safe_optax.wanda_saliency(norms))
  state = tx.init(params)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), state, params)
  score = np.abs(np.asarray(params["w"])) * np.asarray(norms["w"])[:, None]
  for col in range(4):
    expected = np.zeros(8, bool)
    expected[np.argsort(-score[:, col], kind="stable")[:4]] = True
    np.testing.assert_array_equal(np.asarray(state.z["w"][:, col]) != 0, expected)


def test_obd_saliency_needs_grad_fn():
  params = init_params(5)
  tx = safe_optax.admm_penalty(0.5, 1.0, scores=safe_optax.obd_saliency())
  state = tx.init(params)
  with pytest.raises(ValueError, match="grad_fn"):
    tx.update(jax.tree.map(jnp.zeros_like, params), state, params)


@pytest.mark.slow
def test_projected_gradient_adds_gradient_at_sparse_point():
  params, (xs, ys) = init_params(6), make_batches(6, 1)
  grad_fn = lambda p, _: jax.grad(loss)(p, xs[0], ys[0])
  tx = safe_optax.add_projected_gradient(0.6)
  g = grad_fn(params, 0)
  out, _ = jax.jit(functools.partial(tx.update, grad_fn=grad_fn))(g, tx.init(params), params)
  sparse, _ = safe_optax.project_topk(params, 0.6)
  expected = jax.tree.map(jnp.add, g, grad_fn(sparse, 1))
  for k in params:
    np.testing.assert_allclose(out[k], expected[k], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- fixed bugs


def test_decoupled_safe_plus_scores_with_the_gradient_under_warmup():
  """SNIP needs the gradient, not SGD's update (which is 0 at step 0 under warm-up)."""
  x0 = {"w": jnp.array([[1., 2.], [3., 4.]])}
  g = {"w": jnp.array([[4., 0.1], [0.1, 3.]])}  # |g x| = [[4, 0.2], [0.3, 12]]
  warmup = optax.linear_schedule(0.0, 0.1, 10)
  tx = safe_optax.safe_plus(warmup, 0.5, penalty=1.0, rho=None, decoupled_penalty=True,
                            total_steps=10, dual_every=4)
  _, state = tx.update(g, tx.init(x0), x0)
  z = safe_optax.find_admm_state(state).z["w"]
  expected, _ = safe_optax.project_topk(x0, 0.5, scores=safe_optax.snip_scores(x0, g))
  np.testing.assert_array_equal(z, expected["w"])
  np.testing.assert_array_equal(z, [[1., 0.], [0., 4.]])  # neither magnitude nor first-2


@pytest.mark.slow
def test_decoupled_penalty_matches_the_chain_with_the_penalty_after_sgd():
  """With magnitude scores the wrapper is the chain ``sgd -> admm_penalty(learning_rate)``."""
  params, batches = init_params(7), make_batches(7, 20)
  kwargs = dict(dual_every=4, penalty_schedule="cosine", total_steps=20)
  tx = safe_optax.safe(0.05, 0.7, penalty=0.5, rho=0.05, weight_decay=1e-3,
                       decoupled_penalty=True, **kwargs)
  chain = optax.chain(safe_optax.sam_perturb(0.05), optax.add_decayed_weights(1e-3),
                      optax.sgd(0.05, momentum=0.9),
                      safe_optax.admm_penalty(0.7, 0.5, learning_rate=0.05, **kwargs))
  for (p, z), (p_ref, z_ref) in zip(run_library(tx, params, batches),
                                    run_library(chain, params, batches)):
    for k in p:
      np.testing.assert_array_equal(p[k], p_ref[k])
    for k in PRUNABLE:
      np.testing.assert_array_equal(z[k], z_ref[k])


def test_safe_multi_draw_and_saliency_key_are_independent():
  """One key used to drive both SAFE-Multi's draw and the saliency (OBD's probes)."""
  params = init_params(8)
  choices = (0.25, 0.5, 0.75)
  keys = []

  def recording_magnitude(inputs):
    # The dual update runs in a lax.cond, eager calls too: record the key on the host.
    jax.debug.callback(lambda key: keys.append(np.asarray(key)), inputs.key)
    return [jnp.abs(v) for v in inputs.values]

  tx = safe_optax.admm_penalty(choices, 0.1, dual_every=1,
                               scores=safe_optax.Saliency(recording_magnitude), seed=2)
  state = tx.init(params)
  update = jax.jit(tx.update)  # compiled once: the key is state, not a constant
  n = sum(params[k].size for k in PRUNABLE)
  drawn = []
  for _ in range(20):
    _, state = update(jax.tree.map(jnp.zeros_like, params), state, params)
    kept = sum(int(jnp.count_nonzero(state.z[k])) for k in PRUNABLE)
    drawn.append(next(c for c in choices if safe_optax.num_keep(n, c) == kept))
  assert len(set(drawn)) > 1
  # Had the draw used the saliency's key, it would be choice(key) at every step.
  same = [float(jax.random.choice(key, jnp.asarray(choices))) == d for key, d in zip(keys, drawn)]
  assert not all(same)
  assert len(keys) == 20 and len({tuple(k.tolist()) for k in keys}) == len(keys)


def test_dual_update_takes_params_u_sparsity_and_keywords_only():
  params = {"b": jnp.ones(2), "w": jnp.array([[4., -3.], [0.2, 0.1]])}
  u = [jnp.array([[0., 0.], [1., 0.]])]
  new = safe_optax.dual_update(params, u, 0.5, flags=(False, True), first=jnp.array(False))
  np.testing.assert_array_equal(new[0][0], [[4., -3.], [0., 0.]])  # top 2 of |x + u|
  np.testing.assert_allclose(new[1][0], [[0., 0.], [1.2, 0.1]])  # u + x - z
  with pytest.raises(TypeError, match="positional"):  # the removed (params, z, u, sparsity)
    safe_optax.dual_update(params, u, u, 0.5, flags=(False, True), first=True)
  with pytest.raises(TypeError, match="'z'"):
    safe_optax.dual_update(params, u, 0.5, z=u, flags=(False, True), first=True)


# ---------------------------------------------------------------------------- aliases


def test_safe_is_the_documented_chain():
  params, batches = init_params(9), make_batches(9, 12)
  kwargs = dict(dual_every=4, penalty_schedule="cosine", total_steps=12)
  tx = safe_optax.safe(0.05, 0.7, penalty=0.5, rho=0.05, weight_decay=1e-3, max_grad_norm=1.0,
                       **kwargs)
  chain = optax.chain(safe_optax.sam_perturb(0.05), optax.clip_by_global_norm(1.0),
                      safe_optax.admm_penalty(0.7, 0.5, **kwargs), optax.add_decayed_weights(1e-3),
                      optax.sgd(0.05, momentum=0.9))
  for (p, _), (p_ref, _) in zip(run_library(tx, params, batches),
                                run_library(chain, params, batches)):
    for k in p:
      np.testing.assert_array_equal(p[k], p_ref[k])


@pytest.mark.slow
@pytest.mark.parametrize("variant, same_as", [
    (lambda **kw: safe_optax.safe_plus(0.05, 0.7, **kw),
     lambda **kw: safe_optax.safe(0.05, 0.7, scores=safe_optax.snip_saliency(), **kw)),
    (lambda **kw: safe_optax.safe_sg(0.05, 0.7, **kw),
     lambda **kw: safe_optax.safe(0.05, 0.7, sparse_gradient=True, **kw)),
    (lambda **kw: safe_optax.admm(0.05, 0.7, **kw),
     lambda **kw: safe_optax.safe(0.05, 0.7, rho=None, penalty_schedule="constant", **kw)),
    (lambda **kw: safe_optax.safe(0.05, [0.5, 0.7], **kw),  # SAFE-Multi: a list or a tuple
     lambda **kw: safe_optax.safe(0.05, (0.5, 0.7), **kw)),
], ids=["safe_plus", "safe_sg", "admm", "safe_multi"])
def test_variants_are_safe_with_their_own_arguments(variant, same_as):
  params, batches = init_params(10), make_batches(10, 9)
  kwargs = dict(penalty=0.5, dual_every=4, total_steps=9, seed=1)
  for (p, z), (p_ref, z_ref) in zip(run_library(variant(**kwargs), params, batches),
                                    run_library(same_as(**kwargs), params, batches)):
    for k in p:
      np.testing.assert_array_equal(p[k], p_ref[k])
    for k in PRUNABLE:
      np.testing.assert_array_equal(z[k], z_ref[k])


def test_variant_signatures_are_safes_with_their_defaults():
  """Explicit signatures (no __signature__ rewriting): safe's keywords, own defaults."""
  import inspect  # pylint: disable=import-outside-toplevel

  safe_params = inspect.signature(safe_optax.safe).parameters
  for variant in (safe_optax.safe_plus, safe_optax.safe_sg, safe_optax.admm):
    assert "__signature__" not in vars(variant)
    params = inspect.signature(variant).parameters
    assert set(params) <= set(safe_params)
    for name, param in params.items():
      assert param.kind == safe_params[name].kind
  plus = inspect.signature(safe_optax.safe_plus).parameters
  assert list(plus) == list(safe_params)
  assert isinstance(plus["scores"].default, safe_optax.Saliency)
  assert "sparse_gradient" not in inspect.signature(safe_optax.safe_sg).parameters
  admm = inspect.signature(safe_optax.admm).parameters
  assert admm["penalty_schedule"].default == "constant"
  assert not {"rho", "adaptive", "max_grad_norm", "sparse_gradient"} & set(admm)
  assert not hasattr(safe_optax, "safe_multi")  # safe(sparsity=(...)) is SAFE-Multi


def test_alias_argument_errors():
  with pytest.raises(TypeError, match="rho"):
    safe_optax.admm(0.1, 0.5, penalty=1.0, rho=0.1)
  with pytest.raises(ValueError, match="`adaptive=True` .* needs a SAM radius `rho`"):
    safe_optax.safe(0.1, 0.5, penalty=1.0, total_steps=5, rho=None, adaptive=True)
  with pytest.raises(ValueError, match="`sparsity`.*must not be empty"):
    safe_optax.safe(0.1, (), penalty=1.0, total_steps=5)


def test_inject_hyperparams_sees_the_variants_keywords():
  for factory, kwargs in [
      (safe_optax.safe_plus, dict(sparsity=0.5)),
      (safe_optax.admm, dict(sparsity=0.5)),
      (safe_optax.safe, dict(sparsity=(0.5, 0.7))),
  ]:
    tx = optax.inject_hyperparams(factory)(learning_rate=0.1, penalty=1e-2, dual_every=4,
                                           total_steps=10, **kwargs)
    state = tx.init(init_params(0))
    assert {"learning_rate", "penalty", "dual_every"} <= set(state.hyperparams)


@pytest.mark.parametrize("make, state_type", [
    (lambda: safe_optax.add_projected_gradient(0.5), safe_optax.AddProjectedGradientState),
    (lambda: safe_optax.cram(0.1, 0.5), safe_optax.CramState),
])
def test_counter_states_are_named_int32(make, state_type):
  params, (xs, ys) = init_params(11), make_batches(11, 1)
  grad_fn = lambda p, _: jax.grad(loss)(p, xs[0], ys[0])
  tx = make()
  state = tx.init(params)
  assert type(state) is state_type and state.count.dtype == jnp.int32
  _, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
  assert type(state) is state_type and int(state.count) == 1
