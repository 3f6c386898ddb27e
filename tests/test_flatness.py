"""Tests for safe_optax.flatness against exact Hessians and plain references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.flatten_util import ravel_pytree

from safe_optax import flatness

KEY = jax.random.PRNGKey(0)
direction = jax.jit(flatness.filter_normalized_direction, static_argnames="vectors")


def magnitude_prune(params, sparsity):
  """Per-leaf magnitude pruning of ndim >= 2 leaves, in numpy (a plain stand-in for finalize)."""
  sparse, keep = {}, {}
  for name, leaf in params.items():
    leaf = np.asarray(leaf)
    if leaf.ndim < 2:
      sparse[name], keep[name] = jnp.asarray(leaf), None
      continue
    k = int(round(leaf.size * (1 - sparsity)))
    mask = np.zeros(leaf.size, bool)
    mask[np.argsort(-np.abs(leaf).ravel(), kind="stable")[:k]] = True
    keep[name] = jnp.asarray(mask.reshape(leaf.shape))
    sparse[name] = jnp.asarray(np.where(keep[name], leaf, 0.0))
  return sparse, keep


def quadratic_loss(p, batch):
  """0.5 p^T A_b p on a dict tree; the batch is the matrix A_b."""
  flat = jnp.concatenate([p["a"].ravel(), p["b"]])
  return 0.5 * flat @ batch @ flat


def quadratic_params():
  return {"a": jnp.ones((2, 2)), "b": jnp.ones(2)}


def spd_matrix(seed, eigenvalues):
  q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(len(eigenvalues),) * 2))
  return (q * np.asarray(eigenvalues)) @ q.T


@functools.partial(jax.jit, static_argnames=("loss_fn", "tol", "max_iterations"))
def power(loss_fn, params, batches, key, support=None, tol=1e-6, max_iterations=500):
  return flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=key, tol=tol,
                                         max_iterations=max_iterations, support=support)


def test_quadratic_averaged_over_batches():
  a1 = spd_matrix(0, [9.0, 4.0, 3.0, 2.0, 1.0, 0.5])
  a2 = spd_matrix(1, [5.0, 2.0, 2.0, 1.0, 1.0, 0.1])
  expected = np.linalg.eigvalsh((a1 + a2) / 2).max()
  batches = [jnp.asarray(a1, jnp.float32), jnp.asarray(a2, jnp.float32)]
  result = power(quadratic_loss, quadratic_params(), batches, KEY)
  assert bool(result.converged)
  assert int(result.num_iterations) < 500
  np.testing.assert_allclose(float(result.eigenvalue), expected, rtol=1e-4)
  # The eigenvector is a unit eigenvector of the averaged matrix.
  v = ravel_pytree(result.eigenvector)[0]
  np.testing.assert_allclose(float(jnp.linalg.norm(v)), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.asarray((a1 + a2) / 2 @ v), expected * np.asarray(v), atol=2e-2)


def test_iteration_cap_and_tolerance():
  a = jnp.asarray(spd_matrix(2, [1.0, 0.99, 0.98, 0.5, 0.2, 0.1]), jnp.float32)
  capped = power(quadratic_loss, quadratic_params(), [a], KEY, tol=0.0, max_iterations=7)
  assert int(capped.num_iterations) == 7 and not bool(capped.converged)
  loose = power(quadratic_loss, quadratic_params(), [a], KEY, tol=1e-1)
  assert bool(loose.converged) and int(loose.num_iterations) == 2


def mlp_loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])


def tiny_mlp():
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(3), 4)
  params = {"w1": jax.random.normal(k1, (4, 5)), "b1": jnp.zeros(5),
            "w2": jax.random.normal(k2, (5, 3)), "b2": jnp.zeros(3)}
  x = jax.random.normal(k3, (2, 16, 4))
  y = jax.random.randint(k4, (2, 16), 0, 3)
  return params, [(x[0], y[0]), (x[1], y[1])]


def exact_hessian(loss_fn, params, batches):
  flat, unravel = ravel_pytree(params)
  mean = lambda f: sum(loss_fn(unravel(f), b) for b in batches) / len(batches)
  return np.asarray(jax.jit(jax.hessian(mean))(flat), np.float64)


def dominant(eigenvalues):
  return eigenvalues[np.argmax(np.abs(eigenvalues))]


@pytest.mark.slow
def test_tiny_mlp_matches_full_hessian():
  params, batches = tiny_mlp()
  eig = np.linalg.eigvalsh(exact_hessian(mlp_loss, params, batches))
  result = power(mlp_loss, params, batches, KEY)
  assert bool(result.converged)
  np.testing.assert_allclose(float(result.eigenvalue), dominant(eig), rtol=1e-3)


@pytest.mark.slow
def test_tiny_mlp_support_matches_restricted_hessian():
  params, batches = tiny_mlp()
  sparse, keep = magnitude_prune(params, 0.5)
  support = flatness.support_mask(sparse, keep)
  hessian = exact_hessian(mlp_loss, sparse, batches)
  kept = np.asarray(ravel_pytree(support)[0])
  eig = np.linalg.eigvalsh(hessian[np.ix_(kept, kept)])
  result = power(mlp_loss, sparse, batches, KEY, support=support)
  np.testing.assert_allclose(float(result.eigenvalue), dominant(eig), rtol=1e-3)
  # The eigenvector lives on the support.
  v = np.asarray(ravel_pytree(result.eigenvector)[0])
  assert np.all(v[~kept] == 0)
  # Hessian-vector products agree with the restricted full matrix.
  probe = jax.tree.map(jnp.ones_like, sparse)
  hvp = flatness.hessian_vector_product(mlp_loss, sparse, batches, probe, support=support)
  p = np.where(kept, 1.0, 0.0)
  np.testing.assert_allclose(np.asarray(ravel_pytree(hvp)[0]), p * (hessian @ p), rtol=1e-4,
                             atol=1e-5)


@pytest.mark.slow
def test_hutchinson_trace():
  diag = jnp.array([4.0, -1.0, 2.5, 0.5, 3.0, 1.0])
  loss = lambda p, _: 0.5 * jnp.sum(diag * ravel_pytree(p)[0] ** 2)
  trace = jax.jit(lambda p: flatness.hessian_trace(loss, p, [None], key=KEY, num_probes=2))
  # Rademacher probes are exact for a diagonal Hessian.
  np.testing.assert_allclose(float(trace(quadratic_params())), float(diag.sum()), rtol=1e-6)
  support = {"a": jnp.array([[True, False], [False, True]]), "b": jnp.array([True, False])}
  restricted = flatness.hessian_trace(loss, quadratic_params(), [None], key=KEY, num_probes=1,
                                      support=support)
  np.testing.assert_allclose(float(restricted), 4.0 + 0.5 + 3.0, rtol=1e-6)
  # A dense Hessian: the estimate converges to the exact trace.
  params, batches = tiny_mlp()
  exact = np.trace(exact_hessian(mlp_loss, params, batches))
  estimate = jax.jit(lambda p: flatness.hessian_trace(mlp_loss, p, batches, key=KEY,
                                                      num_probes=400))(params)
  np.testing.assert_allclose(float(estimate), exact, rtol=0.1)


def reference_filter_norm(key, params, support, vectors):
  """Plain loops over filters (last axis) as in Li et al.'s code, on numpy arrays."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  masks = treedef.flatten_up_to(support) if support is not None else [None] * len(leaves)
  out = []
  for k, theta, mask in zip(keys, leaves, masks):
    theta = np.asarray(theta, np.float64)
    m = np.ones(theta.shape, bool) if mask is None else np.asarray(mask)
    if theta.ndim <= 1:
      out.append(np.where(m, theta, 0.0) if vectors == "weights" else np.zeros_like(theta))
      continue
    d = np.where(m, np.asarray(jax.random.normal(k, theta.shape), np.float64), 0.0)
    for f in range(theta.shape[-1]):
      dn = np.linalg.norm(d[..., f])
      tn = np.linalg.norm(np.where(m[..., f], theta[..., f], 0.0))
      d[..., f] = d[..., f] / dn * tn if dn > 0 else 0.0
    out.append(d)
  return out


@pytest.mark.parametrize("vectors", ["zero", "weights"])
def test_filter_normalization_matches_reference(vectors):
  k1, k2 = jax.random.split(jax.random.PRNGKey(5))
  params = {"conv": jax.random.normal(k1, (3, 3, 2, 4)), "dense": jax.random.normal(k2, (6, 5)),
            "bias": jnp.arange(5.0)}
  params["conv"] = params["conv"].at[..., 1].set(0.0)  # a dead filter gets a zero direction
  sparse, keep = magnitude_prune(params, 0.7)
  for tree, support in ((params, None), (sparse, flatness.support_mask(sparse, keep))):
    got = direction(KEY, tree, support=support, vectors=vectors)
    want = reference_filter_norm(KEY, tree, support, vectors)
    for g, w in zip(jax.tree.leaves(got), want):
      np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@settings(max_examples=15)
@given(shape=st.sampled_from([(1, 1), (3, 1), (1, 4), (2, 3, 2), (5, 3)]),
       scale=st.floats(0.0, 1e3), keep=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16))
def test_filter_normalization_properties(shape, scale, keep, seed):
  rng = np.random.default_rng(seed)
  theta = jnp.asarray(scale * rng.normal(size=shape), jnp.float32)
  support = {"w": jnp.asarray(rng.uniform(size=shape) < keep)}
  d = direction(jax.random.PRNGKey(seed), {"w": theta}, support=support)["w"]
  assert np.all(np.isfinite(np.asarray(d)))
  assert np.all(np.asarray(d)[~np.asarray(support["w"])] == 0)
  axes = tuple(range(len(shape) - 1))
  d_norm = np.linalg.norm(np.asarray(d, np.float64), axis=axes)
  t_norm = np.linalg.norm(np.where(support["w"], np.asarray(theta, np.float64), 0.0), axis=axes)
  has_direction = np.asarray(jnp.any(support["w"], axis=axes))
  np.testing.assert_allclose(d_norm, np.where(has_direction, t_norm, 0.0), rtol=1e-4, atol=1e-6)


@settings(max_examples=10)
@given(eigenvalues=st.lists(st.floats(-5.0, 20.0), min_size=6, max_size=6), seed=st.integers(0, 99))
def test_power_iteration_on_random_quadratics(eigenvalues, seed):
  eig = np.asarray(eigenvalues)
  order = np.sort(np.abs(eig))
  if order[-1] == 0:
    a = np.zeros((6, 6))
  else:
    # Keep a spectral gap so 500 iterations suffice (power iteration needs one).
    eig[np.argmax(np.abs(eig))] = np.sign(dominant(eig)) * max(order[-1], 1.5 * order[-2] + 0.1)
    a = spd_matrix(seed, eig)
  result = power(quadratic_loss, quadratic_params(), [jnp.asarray(a, jnp.float32)],
                 jax.random.PRNGKey(seed))
  want = 0.0 if order[-1] == 0 else dominant(eig)
  assert np.isfinite(float(result.eigenvalue))
  np.testing.assert_allclose(float(result.eigenvalue), want, rtol=1e-3, atol=1e-5)


@pytest.mark.slow
def test_landscapes_match_plain_evaluation():
  params, batches = tiny_mlp()
  d1 = direction(jax.random.PRNGKey(1), params)
  d2 = direction(jax.random.PRNGKey(2), params)
  xs, ys = jnp.array([-0.5, 0.0, 1.0]), jnp.array([0.0, 0.25])

  @jax.jit
  def landscapes(params):
    return (flatness.loss_line(mlp_loss, params, batches, d1, xs),
            flatness.loss_surface(mlp_loss, params, batches, (d1, d2), xs, ys))

  line, surface = landscapes(params)
  assert surface.shape == (2, 3)

  def plain(a, b):
    p = jax.tree.map(lambda t, u, v: t + a * u + b * v, params, d1, d2)
    return np.mean([float(mlp_loss(p, batch)) for batch in batches])

  np.testing.assert_allclose(np.asarray(line), [plain(a, 0.0) for a in xs], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(surface), [[plain(a, b) for a in xs] for b in ys],
                             rtol=1e-5)
  # The biases do not move under the default ('zero') direction convention.
  assert float(jnp.abs(d1["b1"]).max()) == 0.0


def test_weight_histograms_png(tmp_path):
  dense = {"w": jax.random.normal(KEY, (20, 10)), "b": jnp.ones(10)}
  sparse, _ = magnitude_prune(dense, 0.9)
  path = tmp_path / "hist.png"
  flatness.save_weight_histograms({"dense": dense, "SAFE": sparse}, path, bins=20)
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots()
  flatness.plot_weight_histograms(ax, {"dense": dense, "SAFE": sparse}, bins=20)
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  plt.close(fig)
  assert labels == ["dense (0% zeros)", "SAFE (90% zeros)"]


@pytest.mark.parametrize("kwargs, match", [
    ({"tol": -1.0}, "tol"),
    ({"max_iterations": 0}, "max_iterations"),
    ({"max_iterations": 2.5}, "max_iterations"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    flatness.max_hessian_eigenvalue(quadratic_loss, quadratic_params(), [jnp.eye(6)], key=KEY,
                                    **kwargs)


def test_bad_batches_and_options():
  with pytest.raises(ValueError, match="batches"):
    flatness.max_hessian_eigenvalue(quadratic_loss, quadratic_params(), [], key=KEY)
  with pytest.raises(ValueError, match="same structure"):
    flatness.mean_loss(quadratic_loss, quadratic_params(), [jnp.eye(6), jnp.eye(5)])
  with pytest.raises(ValueError, match="num_probes"):
    flatness.hessian_trace(quadratic_loss, quadratic_params(), [jnp.eye(6)], key=KEY,
                           num_probes=0)
  with pytest.raises(ValueError, match="vectors"):
    flatness.filter_normalized_direction(KEY, quadratic_params(), vectors="copy")
  with pytest.raises(ValueError, match="alphas"):
    flatness.loss_line(quadratic_loss, quadratic_params(), [jnp.eye(6)],
                       quadratic_params(), jnp.zeros((2, 2)))


def test_saving_figures_leaves_the_callers_matplotlib_backend_and_figures_alone(tmp_path):
  """A notebook's inline backend must survive the library's PNG writers (they used to
  switch matplotlib to Agg, after which a notebook's figures no longer showed)."""
  import matplotlib
  import matplotlib.pyplot as plt
  from safe_optax.vision import plots

  before = matplotlib.get_backend()
  matplotlib.use("svg")
  try:
    open_figures = plt.get_fignums()
    dense = {"w": jax.random.normal(KEY, (20, 10))}
    flatness.save_weight_histograms({"dense": dense}, tmp_path / "hist.png", bins=10)
    history = [{"epoch": e, "train_accuracy": 0.5, "distance_to_projection": 1.0 / (e + 1)}
               for e in range(3)]
    paths = plots.plot_history(history, tmp_path, title="t")
    assert matplotlib.get_backend() == "svg"
    assert plt.get_fignums() == open_figures
    for path in [tmp_path / "hist.png", *paths]:
      with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  finally:
    matplotlib.use(before)
