"""Block-wise pruning: Wanda rows, SparseGPT vs numpy OBS and least squares, SAFE, N:M, errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import safe_optax
from safe_optax.llm import model as model_lib
from safe_optax.llm import block
from safe_optax.llm import prune
from safe_optax.llm import prune_config

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
  mag, _ = safe_optax.project_topk(jnp.asarray(w), 0.5, structure=safe_optax.PerLeaf())
  assert (sgpt == 0).sum() == (np.asarray(mag) == 0).sum() == w.size // 2
  assert _recon(sgpt, w, x) < 0.7 * _recon(mag, w, x)
  # Nothing pruned: the dense weights are already the least-squares solution.
  np.testing.assert_allclose(prune.sparsegpt_prune(w, xtx, x.shape[0], sparsity=0.0), w,
                             atol=1e-5)


def test_sparsegpt_first_column_is_constrained_least_squares():
  """Pruning only the first column: OBS is min ||(W - W')X^T||^2 s.t. W'[:, 0] = 0 exactly."""
  rng = np.random.default_rng(3)
  rows, cols, n = 12, 16, 256
  x = rng.normal(size=(n, cols))
  x[:, 0] = x[:, 1:4].sum(axis=1) + 0.5 * rng.normal(size=n)  # much to compensate for
  w = np.sign(rng.normal(size=(rows, cols))) * rng.uniform(1.0, 2.0, size=(rows, cols))
  w[:, 0] = np.sign(rng.normal(size=rows)) * rng.uniform(0.3, 0.6, size=rows)
  x, w = x.astype(np.float32), w.astype(np.float32)
  # One lazy batch, rows * cols / cols = rows pruned: the lowest OBS saliencies, column 0.
  got = np.asarray(prune.sparsegpt_prune(w, x.T @ x, n, sparsity=1 / cols, blocksize=cols,
                                         percdamp=0.0))
  np.testing.assert_array_equal(got == 0, np.arange(cols)[None, :].repeat(rows, 0) == 0)
  x64, want = x.astype(np.float64), w.astype(np.float64)
  want[:, 1:] += np.linalg.lstsq(x64[:, 1:], np.outer(x64[:, 0], want[:, 0]), rcond=None)[0].T
  want[:, 0] = 0.0
  assert np.abs(want - w)[:, 1:].max() > 0.3  # the compensation is far from negligible
  np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("nm, blocksize", [(None, 8), (None, 128), ((2, 4), 8)])
def test_sparsegpt_is_sequential_least_squares(nm, blocksize):
  """What OBS guarantees, lazy batches or not: when column i is reached, columns i.. are the
  exact least-squares continuation of the columns already fixed, so a kept W[:, i] is that
  continuation's first entry. Checked against numpy.linalg.lstsq on ``[sqrt(2/n) X; sqrt(d) I]``
  (whose Gram matrix is the damped Hessian), column by column."""
  w, x = _layer()
  got = np.asarray(prune.sparsegpt_prune(w, x.T @ x, x.shape[0], nm=nm, blocksize=blocksize))
  n, cols = x.shape
  x64, w64, q = x.astype(np.float64), w.astype(np.float64), got.astype(np.float64)
  h_diag = 2 * np.sum(x64 ** 2, axis=0) / n
  design = np.vstack([np.sqrt(2 / n) * x64, np.sqrt(0.01 * h_diag.mean()) * np.eye(cols)])
  want = np.empty_like(w64)
  for i in range(cols):
    rhs = -design[:, :i] @ (q[:, :i] - w64[:, :i]).T
    want[:, i] = w64[:, i] + np.linalg.lstsq(design[:, i:], rhs, rcond=None)[0][0]
  kept = got != 0
  assert kept.sum() == w.size // 2
  assert np.abs(got - w)[kept].max() > 0.5  # kept weights really were updated
  np.testing.assert_allclose(got[kept], want[kept], atol=1e-4)


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


@functools.lru_cache(maxsize=None)
def _block_fns(config):
  """``block.block_fns(config, with_hessian=False)``, made once a config: each call of
  ``block_fns`` makes new jitted functions, which trace and lower again."""
  return block.block_fns(config, with_hessian=False)


@functools.lru_cache(maxsize=None)
def _block_data(seed=0, n=8, seq=8):
  """A block, its inputs, dense outputs and the engine's activation statistics.

  Made once per arguments (the tests only read them; JAX arrays are immutable).
  """
  # Weights of std 0.2 (not the init's 0.02), so the block is far from the identity.
  params = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, model_lib.init_params(CFG, seed))
  x = jax.random.normal(jax.random.PRNGKey(seed + 7), (n, seq, CFG.hidden_size))
  _, forward_with_stats = _block_fns(CFG)
  out, stats = forward_with_stats(params["layers_0"], x)
  return params["layers_0"], x, out, stats


@pytest.mark.slow
def test_wanda_per_row_counts_and_scores():
  block_params, x, y, stats = _block_data()
  pruned, _ = prune.prune_block(CFG, block_params, x, y, stats, prune_config.PruneConfig("wanda"))
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


# A tiny block learns fast: a larger step than the paper's 2e-4 keeps the test short.
BEATS_KW = dict(epochs=40, batch_size=4, learning_rate=3e-3, warmup_epochs=2, penalty=0.3,
                dual_every=4, rho=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("method, baseline", [("safe", "magnitude"), ("safe-plus", "wanda")])
def test_safe_block_beats_one_shot_baseline(method, baseline):
  """SAFE lowers the block reconstruction error below magnitude's (SAFE+: below Wanda's)."""
  block_params, x, y, stats = _block_data(seed=1)
  base, _ = prune.prune_block(CFG, block_params, x, y, stats, prune_config.PruneConfig(baseline))
  cfg = prune_config.PruneConfig(method, **BEATS_KW)
  safe, info = prune.prune_block(CFG, block_params, x, y, stats, cfg)
  for group, linear in model_lib.LINEAR_INPUTS:
    kernel = np.asarray(safe[group][linear]["kernel"])
    assert (kernel == 0).sum() == kernel.size // 2
  assert info["steps"] == 80
  assert _rel_error(safe, x, y) < 0.8 * _rel_error(base, x, y)


def test_safe_schedule_and_adam():
  """Warm-up then linear decay to 0, and Adam(0.9, 0.95) on the (rho = 0, lambda = 0) gradient."""
  cfg = prune_config.PruneConfig("safe", epochs=5, warmup_epochs=2, learning_rate=1e-3, rho=0.0,
                          penalty=0.0)
  schedule = block.safe_schedule(cfg, steps_per_epoch=3)  # 15 steps, 6 of warm-up
  t = np.arange(16)
  want = np.where(t < 6, 1e-3 * t / 6, 1e-3 * (1 - (t - 6) / 9))
  np.testing.assert_allclose([float(schedule(i)) for i in t], want, rtol=1e-5, atol=1e-9)

  target = np.arange(6.0).reshape(2, 3)
  grad_fn = jax.jit(lambda p, _: jax.grad(lambda q: jnp.sum((q["w"] - target) ** 2))(p))
  tx = block.safe_transform(cfg, steps_per_epoch=3)
  params = {"w": jnp.ones((2, 3))}
  state = tx.init(params)
  w, m, v = np.ones((2, 3)), 0.0, 0.0
  for step in range(8):
    g = grad_fn(params, 0)
    updates, state = tx.update(g, state, params, grad_fn=grad_fn)
    params = optax.apply_updates(params, updates)
    g = 2 * (w - target)
    m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g ** 2
    m_hat, v_hat = m / (1 - 0.9 ** (step + 1)), v / (1 - 0.95 ** (step + 1))
    w = w - want[step] * m_hat / (np.sqrt(v_hat) + 1e-8)
  np.testing.assert_allclose(params["w"], w, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method, grouping", [("magnitude", "per_row"), ("wanda", "per_matrix"),
                                              ("safe-plus", "per_matrix")])
def test_grouping(method, grouping):
  """Per row: every output row keeps half; per matrix: one threshold for the whole matrix."""
  block_params, x, y, stats = _block_data()
  cfg = prune_config.PruneConfig(method, grouping=grouping, epochs=1, batch_size=4)
  pruned, _ = prune.prune_block(CFG, block_params, x, y, stats, cfg)
  unequal_rows = 0
  for group, linear in model_lib.LINEAR_INPUTS:
    kernel = np.asarray(block_params[group][linear]["kernel"])
    kept = np.asarray(pruned[group][linear]["kernel"]) != 0
    assert kept.sum() == kernel.size // 2
    per_row_kept = kept.sum(axis=0)
    unequal_rows += int((per_row_kept != kernel.shape[0] // 2).any())
    if method == "magnitude":
      score = np.abs(kernel)
      for row in range(kernel.shape[1]):
        assert per_row_kept[row] == kernel.shape[0] // 2
        assert score[kept[:, row], row].min() >= score[~kept[:, row], row].max()
    elif method == "wanda":
      norms = np.sqrt(np.asarray(stats[model_lib.LINEAR_INPUTS[(group, linear)]]["sq"]))
      score = np.abs(kernel) * norms[:, None]
      assert score[kept].min() >= score[~kept].max()
  if grouping == "per_matrix":
    assert unequal_rows > 0


@pytest.mark.slow
def test_prune_model_runs_on_the_pruned_stream():
  """Targets are the dense block on the pruned stream's inputs; its statistics come from there."""
  cfg = dataclasses.replace(CFG, num_layers=2)
  params = jax.tree.map(lambda a: a * 10 if a.ndim == 2 else a, model_lib.init_params(cfg, 2))
  calib = np.random.default_rng(1).integers(0, cfg.vocab_size, (5, 8))
  pruned, report = prune.prune_model(cfg, params, calib, prune_config.PruneConfig("wanda", chunk=2),
                                     progress=False)
  block = jax.jit(model_lib.Block(cfg).apply)
  x = np.asarray(params["embed_tokens"]["embedding"])[calib]
  for i in range(2):
    dense = np.asarray(block({"params": params[f"layers_{i}"]}, x))
    if i == 1:  # Wanda's norms of q_proj's input, by hand from this (pruned-stream) x
      h = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + cfg.rms_eps)
      h = (h * np.asarray(params["layers_1"]["input_layernorm"]["scale"])).reshape(-1, 16)
      kernel = np.asarray(params["layers_1"]["self_attn"]["q_proj"]["kernel"])
      score = np.abs(kernel) * np.linalg.norm(h, axis=0)[:, None]
      want = score >= np.sort(score, axis=0)[kernel.shape[0] // 2][None, :]
      np.testing.assert_array_equal(
          np.asarray(pruned["layers_1"]["self_attn"]["q_proj"]["kernel"]) != 0, want)
    x = np.asarray(block({"params": pruned[f"layers_{i}"]}, x))
    error = np.sum((x - dense) ** 2) / np.sum(dense ** 2)
    np.testing.assert_allclose(report["blocks"][i]["relative_error"], error, rtol=1e-4)


@pytest.mark.slow
def test_bad_calibration():
  params = model_lib.init_params(CFG)
  with pytest.raises(ValueError, match="vocab_size is 40"):
    prune.prune_model(CFG, params, np.full((2, 4), 40), prune_config.PruneConfig("magnitude"),
                      progress=False)
  with pytest.raises(ValueError, match="integer array"):
    prune.prune_model(CFG, params, np.zeros(8, np.int32), prune_config.PruneConfig("magnitude"),
                      progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("method", prune_config.METHODS)
def test_nm_groups_along_input_dim(method):
  calib = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 8))
  nm = (2, 4) if method != "wanda" else (4, 8)
  cfg = prune_config.PruneConfig(method, nm=nm, epochs=1, batch_size=4)
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
    ({"method": "wanda", "grouping": "rows"}, "grouping"),
    ({"method": "sparsegpt", "grouping": "per_row"}, "grouping"),
    ({"method": "safe", "lr_scale": "layer"}, "lr_scale"),
    ({"method": "wanda", "nm": (2, 4), "grouping": "per_row"}, "grouping"),
])
def test_bad_prune_config(kw, match):
  with pytest.raises(ValueError, match=match):
    prune_config.PruneConfig(**kw)


def test_sparsegpt_nm_needs_divisible_width():
  w, x = _layer(rows=4, cols=6)
  with pytest.raises(ValueError, match="divisible by m"):
    prune.sparsegpt_prune(w, x.T @ x, x.shape[0], nm=(2, 4))


class _Interrupt(Exception):
  """Stands for Ctrl-C in the resume tests."""


def _stop_after(block):
  def hook(index, entry):
    del entry
    if index == block:
      raise _Interrupt
  return hook


@pytest.mark.slow
@pytest.mark.parametrize("method", ["safe-plus", "sparsegpt"])
def test_resume_after_interruption_matches_uninterrupted_run(tmp_path, method):
  """Stopped after block 1 of 4, a rerun prunes only blocks 2-3 and returns the same params."""
  cfg = dataclasses.replace(CFG, num_layers=4)
  params = model_lib.init_params(cfg, 3)
  calib = np.random.default_rng(2).integers(0, cfg.vocab_size, (6, 8))
  prune_cfg = prune_config.PruneConfig(method, epochs=3, batch_size=2, learning_rate=3e-3,
                                dual_every=2, chunk=4)
  want, want_report = prune.prune_model(cfg, params, calib, prune_cfg, progress=False)
  state = tmp_path / "state"
  with pytest.raises(_Interrupt):
    prune.prune_model(cfg, params, calib, prune_cfg, progress=False, state_dir=state,
                      on_block=_stop_after(1))
  assert sorted(f.name for f in state.iterdir()) == [
      "block_0.npz", "block_1.npz", "state.json", "stream_2.npz"]
  visited = []
  got, report = prune.prune_model(cfg, params, calib, prune_cfg, progress=False,
                                  state_dir=state, on_block=lambda i, _: visited.append(i))
  assert visited == [2, 3] and report["resumed_blocks"] == 2
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert [b["relative_error"] for b in report["blocks"]] == [
      b["relative_error"] for b in want_report["blocks"]]
  # A finished state continues to the same result without pruning anything.
  visited.clear()
  again, _ = prune.prune_model(cfg, params, calib, prune_cfg, progress=False, state_dir=state,
                               on_block=lambda i, _: visited.append(i))
  assert visited == []
  jax.tree.map(np.testing.assert_array_equal, again, want)


@pytest.mark.slow
def test_resume_keeps_bfloat16_params(tmp_path):
  cfg = dataclasses.replace(CFG, num_layers=2)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model_lib.init_params(cfg, 1))
  calib = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 8))
  prune_cfg = prune_config.PruneConfig("magnitude")
  want, _ = prune.prune_model(cfg, params, calib, prune_cfg, progress=False)
  with pytest.raises(_Interrupt):
    prune.prune_model(cfg, params, calib, prune_cfg, progress=False, state_dir=tmp_path,
                      on_block=_stop_after(0))
  got, _ = prune.prune_model(cfg, params, calib, prune_cfg, progress=False, state_dir=tmp_path)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow
def test_resume_refuses_different_arguments(tmp_path):
  cfg = dataclasses.replace(CFG, num_layers=2)
  params = model_lib.init_params(cfg)
  calib = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 8))
  with pytest.raises(_Interrupt):
    prune.prune_model(cfg, params, calib, prune_config.PruneConfig("wanda"), progress=False,
                      state_dir=tmp_path, identity={"--model": "a"}, on_block=_stop_after(0))
  with pytest.raises(ValueError, match=r"prune_config.sparsity: saved 0.5, now 0.6") as err:
    prune.prune_model(cfg, params, calib, prune_config.PruneConfig("wanda", sparsity=0.6),
                      progress=False, state_dir=tmp_path, identity={"--model": "a"})
  assert "prune_config.method" not in str(err.value) and "--restart" in str(err.value)
  with pytest.raises(ValueError, match="calibration_sha256"):
    prune.prune_model(cfg, params, calib[::-1], prune_config.PruneConfig("wanda"), progress=False,
                      state_dir=tmp_path, identity={"--model": "a"})
  with pytest.raises(ValueError, match="--model: saved 'a', now 'b'"):
    prune.prune_model(cfg, params, calib, prune_config.PruneConfig("wanda"), progress=False,
                      state_dir=tmp_path, identity={"--model": "b"})


@pytest.mark.slow
def test_lr_scale_rms_multiplies_each_matrix_step():
  """``lr_scale="rms"``: each matrix's update is the unscaled update times its dense RMS."""
  linears = {"a": {"kernel": jnp.full((4, 4), 3.0)}, "b": {"kernel": jnp.arange(8.0).reshape(2, 4)}}
  scales = block.lr_scales(prune_config.PruneConfig("safe", lr_scale="rms"), linears)
  np.testing.assert_allclose(scales["a"]["kernel"], 3.0)
  np.testing.assert_allclose(scales["b"]["kernel"], np.sqrt(np.mean(np.arange(8.0) ** 2)))
  assert block.lr_scales(prune_config.PruneConfig("safe"), linears) is None
  cfg = prune_config.PruneConfig("safe", epochs=3, warmup_epochs=0, learning_rate=1e-2, rho=0.0)
  grads = jax.tree.map(lambda w: jnp.sin(w + 1.0), linears)
  grad_fn = lambda p, _: grads
  plain = block.safe_transform(cfg, 2)
  scaled = block.safe_transform(cfg, 2, scales=scales)
  state_p, state_s = plain.init(linears), scaled.init(linears)
  for _ in range(2):
    up_p, state_p = plain.update(grads, state_p, linears, grad_fn=grad_fn)
    up_s, state_s = scaled.update(grads, state_s, linears, grad_fn=grad_fn)
    assert float(jnp.abs(up_p["a"]["kernel"]).max()) > 0
    jax.tree.map(lambda p, s, c: np.testing.assert_allclose(s, p * c, rtol=1e-6),
                 up_p, up_s, scales)


@pytest.mark.xla_default_codegen  # bit for bit / HLO: XLA's own code generation
@pytest.mark.slow
@pytest.mark.parametrize("method", ["safe", "safe-plus"])
def test_safe_block_keeps_calibration_on_the_device(method):
  """One device: bit for bit what host minibatches over a one-device mesh give.

  The one-device path sends the windows, targets and each epoch's minibatch
  indices in explicit ``device_put`` calls and gathers minibatches in the step;
  the several-device path gathers them on the host and places them over the
  mesh. Both see the same minibatches, so weights and losses are identical.
  """
  block_params, x, y, stats = _block_data(seed=2, n=12)
  norms = (block.map_linears(lambda key: jnp.sqrt(stats[model_lib.LINEAR_INPUTS[key]]["sq"]))
           if method == "safe-plus" else None)
  # 12 windows in batches of 5: 2 steps an epoch, and two windows left out of each epoch.
  cfg = prune_config.PruneConfig(method, epochs=5, batch_size=5, learning_rate=3e-3,
                                 warmup_epochs=1, penalty=0.3, dual_every=3, rho=1e-3)
  x, y = np.asarray(x), np.asarray(y)
  on_device, info = block.safe_block(CFG, block_params, x, y, cfg, norms)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
  from_host, host_info = block.safe_block(CFG, block_params, x, y, cfg, norms, mesh)
  assert info == host_info and info["steps"] == 10 and len(info["epoch_last_loss"]) == 5
  for a, b in zip(jax.tree.leaves(on_device), jax.tree.leaves(from_host)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("leak", ["numpy batch", "numpy indices"])
def test_safe_block_steps_refuse_implicit_transfers(monkeypatch, leak):
  """One device: the step loop runs under ``jax.transfer_guard("disallow")``.

  A step handed a numpy minibatch, or numpy minibatch indices, raises instead
  of costing a host-to-device transfer every step. (Reading a loss back is
  refused too on an accelerator; on the CPU backend that read is no transfer.)
  The block and config of ``test_safe_block_beats_one_shot_baseline[safe-magnitude]``,
  whose compiled step this reuses (the first step raises).
  """
  block_params, x, y, _ = _block_data(seed=1)
  cfg = prune_config.PruneConfig("safe", **BEATS_KW)
  real = block.safe_step

  def leaky_step(*args):
    step = real(*args)

    def wrapped(linears, norms, input_norms, scales, opt_state, x, y, idx=None, *, dual_due):
      if leak == "numpy batch":
        x, y, idx = np.asarray(x)[:4], np.asarray(y)[:4], None
      else:
        idx = np.asarray(idx)
      return step(linears, norms, input_norms, scales, opt_state, x, y, idx, dual_due=dual_due)

    return wrapped

  monkeypatch.setattr(block, "safe_step", leaky_step)
  with pytest.raises(Exception, match="Disallowed (host-to-device|device-to-host) transfer"):
    block.safe_block(CFG, block_params, np.asarray(x), np.asarray(y), cfg)
