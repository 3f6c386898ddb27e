"""Block-wise pruning: Wanda rows, SparseGPT vs a numpy OBS reference, SAFE, N:M, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import safe_optax
from safe_optax.llm import model as model_lib
from safe_optax.llm import prune

CFG = model_lib.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=4, num_kv_heads=2)


def np_sparsegpt(w, x, sparsity=0.5, nm=None, blocksize=128, percdamp=0.01):
  """SparseGPT without lazy batching: every column's error updates all later columns at once.

  Masks are chosen as in the paper: per block of ``blocksize`` columns at its
  start (unstructured) or per group of ``m`` when reaching it (N:M).
  """
  w = np.array(w, np.float64)
  h = 2 * x.T.astype(np.float64) @ x / x.shape[0]
  dead = np.diag(h) == 0
  h[dead, dead] = 1
  w[:, dead] = 0
  h += percdamp * np.mean(np.diag(h)) * np.eye(len(h))
  u = np.linalg.cholesky(np.linalg.inv(h)).T
  rows, cols = w.shape
  mask = np.zeros_like(w, bool)
  for i in range(cols):
    if nm is None and i % blocksize == 0:
      stop = min(i + blocksize, cols)
      score = (w[:, i:stop] ** 2 / np.diag(u)[i:stop] ** 2).ravel()
      k = int(np.floor(score.size * sparsity))
      chosen = np.zeros(score.size, bool)
      chosen[np.argsort(score, kind="stable")[:k]] = True
      mask[:, i:stop] = chosen.reshape(rows, stop - i)
    if nm is not None and i % nm[1] == 0:
      score = w[:, i:i + nm[1]] ** 2 / np.diag(u)[i:i + nm[1]] ** 2
      for r in range(rows):
        mask[r, i + np.argsort(score[r], kind="stable")[: nm[1] - nm[0]]] = True
    q = np.where(mask[:, i], 0.0, w[:, i])
    err = (w[:, i] - q) / u[i, i]
    w[:, i:] -= np.outer(err, u[i, i:])
    w[:, i] = q
  return w, mask


def _layer(rows=12, cols=32, n=256, seed=0):
  rng = np.random.default_rng(seed)
  # Correlated inputs with uneven scales: where OBS updates pay off.
  x = rng.normal(size=(n, cols)) @ (np.eye(cols) + 0.5 * rng.normal(size=(cols, cols)))
  x *= rng.uniform(0.2, 3.0, size=cols)
  return rng.normal(size=(rows, cols)).astype(np.float32), x.astype(np.float32)


def _recon(w_new, w, x):
  return float(np.sum((x @ (np.asarray(w_new, np.float64) - w).T) ** 2))


@pytest.mark.parametrize("nm, blocksize", [(None, 8), (None, 128), ((2, 4), 8), ((4, 8), 16)])
def test_sparsegpt_matches_numpy_obs(nm, blocksize):
  w, x = _layer()
  got = np.asarray(prune.sparsegpt_prune(w, x.T @ x, x.shape[0], nm=nm, blocksize=blocksize))
  want, mask = np_sparsegpt(w, x, nm=nm, blocksize=blocksize)
  np.testing.assert_array_equal(got == 0, mask)
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
  assert (got == 0).sum() == w.size // 2


def test_sparsegpt_beats_magnitude_and_keeps_dense_weights():
  w, x = _layer(seed=1)
  xtx = x.T @ x
  sgpt = np.asarray(prune.sparsegpt_prune(w, xtx, x.shape[0], sparsity=0.5, blocksize=8))
  mag, _ = safe_optax.project_topk(jnp.asarray(w), 0.5, scope="per_leaf")
  assert (sgpt == 0).sum() == (np.asarray(mag) == 0).sum() == w.size // 2
  assert _recon(sgpt, w, x) < 0.7 * _recon(mag, w, x)
  # Nothing pruned: the dense weights are already the least-squares solution.
  np.testing.assert_allclose(prune.sparsegpt_prune(w, xtx, x.shape[0], sparsity=0.0), w,
                             atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([1, 5]), st.sampled_from([8]), st.sampled_from([0.0, 0.25, 0.5, 0.9]),
       st.booleans())
def test_sparsegpt_exact_counts_and_dead_inputs(rows, cols, sparsity, dead_column):
  """Exactly floor(rows * width * s) zeros per lazy batch; an input never seen is pruned away."""
  w, x = _layer(rows, cols, n=32, seed=rows + cols)
  if dead_column:
    x[:, 0] = 0.0
  out = np.asarray(prune.sparsegpt_prune(w, x.T @ x, 32, sparsity=sparsity, blocksize=4))
  assert np.isfinite(out).all()
  for start in range(0, cols, 4):
    zeros = (out[:, start:start + 4] == 0).sum()
    expected = int(np.floor(rows * 4 * sparsity))
    assert zeros >= expected
    if not dead_column or start > 0:
      assert zeros == expected
  if dead_column:
    assert (out[:, 0] == 0).all()


def _block_data(seed=0, n=8, seq=8):
  """A block, its inputs, dense outputs and the engine's activation statistics."""
  # Weights of std 0.2 (not the init's 0.02), so the block is far from the identity.
  params = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, model_lib.init_params(CFG, seed))
  x = jax.random.normal(jax.random.PRNGKey(seed + 7), (n, seq, CFG.hidden_size))
  _, forward_with_stats = prune._block_fns(CFG, with_hessian=False)
  out, stats = forward_with_stats(params["layers_0"], x)
  return params["layers_0"], x, out, stats


def test_wanda_per_row_counts_and_scores():
  block_params, x, y, stats = _block_data()
  pruned, _ = prune.prune_block(CFG, block_params, x, y, stats, prune.PruneConfig("wanda"))
  for group, linear in model_lib.LINEAR_INPUTS:
    kernel = np.asarray(block_params[group][linear]["kernel"])
    got = np.asarray(pruned[group][linear]["kernel"])
    norms = np.sqrt(np.asarray(stats[model_lib.LINEAR_INPUTS[(group, linear)]]["sq"]))
    score = np.abs(kernel) * norms[:, None]
    for row in range(kernel.shape[1]):  # an output row is a column of the (in, out) kernel
      kept = got[:, row] != 0
      assert kept.sum() == kernel.shape[0] // 2
      assert score[kept, row].min() >= score[~kept, row].max()


def _rel_error(block_params, x, y):
  out = jax.jit(model_lib.Block(CFG).apply)({"params": block_params}, x)
  return float(jnp.sum(jnp.square(out - y)) / jnp.sum(jnp.square(y)))


@pytest.mark.parametrize("method, baseline", [("safe", "magnitude"), ("safe-plus", "wanda")])
def test_safe_block_beats_one_shot_baseline(method, baseline):
  """SAFE lowers the block reconstruction error below magnitude's (SAFE+: below Wanda's)."""
  block_params, x, y, stats = _block_data(seed=1)
  base, _ = prune.prune_block(CFG, block_params, x, y, stats, prune.PruneConfig(baseline))
  # A tiny block learns fast: a larger step than the paper's 2e-4 keeps the test short.
  cfg = prune.PruneConfig(method, epochs=40, batch_size=4, learning_rate=3e-3, warmup_epochs=2,
                          penalty=0.3, dual_every=4, rho=1e-3)
  safe, info = prune.prune_block(CFG, block_params, x, y, stats, cfg)
  for group, linear in model_lib.LINEAR_INPUTS:
    kernel = np.asarray(safe[group][linear]["kernel"])
    assert (kernel == 0).sum() == kernel.size // 2
  assert info["steps"] == 80
  assert _rel_error(safe, x, y) < 0.8 * _rel_error(base, x, y)


@pytest.mark.parametrize("method", prune.METHODS)
def test_nm_groups_along_input_dim(method):
  calib = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 8))
  nm = (2, 4) if method != "wanda" else (4, 8)
  cfg = prune.PruneConfig(method, nm=nm, epochs=1, batch_size=4)
  pruned, report = prune.prune_model(CFG, model_lib.init_params(CFG), calib, cfg,
                                     progress=False)
  for group, linear in model_lib.LINEAR_INPUTS:
    kernel = np.asarray(pruned["layers_0"][group][linear]["kernel"])
    fan_in, fan_out = kernel.shape
    groups = kernel.reshape(fan_in // nm[1], nm[1], fan_out)  # consecutive inputs
    np.testing.assert_array_equal((groups != 0).sum(axis=1), nm[0])
  assert report["blocks"][0]["seconds"] > 0
  assert 0 < report["blocks"][0]["relative_error"] < 1


@pytest.mark.parametrize("kw, match", [
    ({"method": "alps"}, "method"),
    ({"method": "wanda", "sparsity": 1.0}, "sparsity"),
    ({"method": "wanda", "nm": (4, 4)}, "nm"),
    ({"method": "safe", "epochs": 0}, "epochs"),
    ({"method": "safe", "rho": -1.0}, "rho"),
])
def test_bad_prune_config(kw, match):
  with pytest.raises(ValueError, match=match):
    prune.PruneConfig(**kw)


def test_sparsegpt_nm_needs_divisible_width():
  w, x = _layer(rows=4, cols=6)
  with pytest.raises(ValueError, match="divisible by m"):
    prune.sparsegpt_prune(w, x.T @ x, x.shape[0], nm=(2, 4))
