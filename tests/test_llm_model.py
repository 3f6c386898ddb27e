"""LLaMA decoder vs a plain numpy reference (both RoPE layouts, GQA, tied / untied head)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safe_optax.llm import export
from safe_optax.llm import model as model_lib


def _config(**kw):
  base = dict(vocab_size=50, hidden_size=24, intermediate_size=40, num_layers=2, num_heads=6,
              num_kv_heads=2, rope_base=500.0, rms_eps=1e-5)
  base.update(kw)
  return model_lib.LlamaConfig(**base)


def _random_params(cfg, seed=0):
  """Random weights with unit-ish scale (norm scales not 1) so every term matters."""
  params = model_lib.init_params(cfg, seed)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  leaves = [0.3 * jax.random.normal(k, l.shape) + (1.0 if l.ndim == 1 else 0.0)
            for k, l in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, leaves)


def np_rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x, base, layout):
  """x: (T, H, D). Rotates pair p = (a_i, b_i) by t * base^(-2i/D), pair by pair."""
  seq, _, dim = x.shape
  out = x.copy()
  for i in range(dim // 2):
    a, b = (i, i + dim // 2) if layout == "half" else (2 * i, 2 * i + 1)
    theta = np.arange(seq)[:, None] * base ** (-2.0 * i / dim)
    out[:, :, a] = x[:, :, a] * np.cos(theta) - x[:, :, b] * np.sin(theta)
    out[:, :, b] = x[:, :, b] * np.cos(theta) + x[:, :, a] * np.sin(theta)
  return out


def np_block(p, x, cfg):
  """One decoder block for one sequence x (T, d), float64, loops over heads and positions."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  seq = x.shape[0]
  hd = cfg.dim_per_head
  h = np_rmsnorm(x, p["input_layernorm"]["scale"], cfg.rms_eps)
  att = p["self_attn"]
  q = (h @ att["q_proj"]["kernel"]).reshape(seq, cfg.num_heads, hd)
  k = (h @ att["k_proj"]["kernel"]).reshape(seq, cfg.num_kv_heads, hd)
  v = (h @ att["v_proj"]["kernel"]).reshape(seq, cfg.num_kv_heads, hd)
  q, k = np_rope(q, cfg.rope_base, cfg.rope_layout), np_rope(k, cfg.rope_base, cfg.rope_layout)
  out = np.zeros((seq, cfg.num_heads, hd))
  per_kv = cfg.num_heads // cfg.num_kv_heads
  for head in range(cfg.num_heads):
    kv = head // per_kv
    for t in range(seq):
      s = k[: t + 1, kv] @ q[t, head] / np.sqrt(hd)
      w = np.exp(s - s.max())
      out[t, head] = (w / w.sum()) @ v[: t + 1, kv]
  x = x + out.reshape(seq, -1) @ att["o_proj"]["kernel"]
  h = np_rmsnorm(x, p["post_attention_layernorm"]["scale"], cfg.rms_eps)
  mlp = p["mlp"]
  gate = h @ mlp["gate_proj"]["kernel"]
  hidden = gate / (1 + np.exp(-gate)) * (h @ mlp["up_proj"]["kernel"])
  return x + hidden @ mlp["down_proj"]["kernel"]


def np_model(params, tokens, cfg):
  x = np.asarray(params["embed_tokens"]["embedding"], np.float64)[tokens]
  for i in range(cfg.num_layers):
    x = np_block(params[f"layers_{i}"], x, cfg)
  x = np_rmsnorm(x, np.asarray(params["norm"]["scale"], np.float64), cfg.rms_eps)
  if cfg.tie_embeddings:
    return x @ np.asarray(params["embed_tokens"]["embedding"], np.float64).T
  return x @ np.asarray(params["lm_head"]["kernel"], np.float64)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("num_kv_heads", [2, 6])
def test_block_matches_numpy(layout, num_kv_heads):
  cfg = _config(rope_layout=layout, num_kv_heads=num_kv_heads)
  params = _random_params(cfg)
  x = np.random.default_rng(0).normal(size=(2, 7, cfg.hidden_size)).astype(np.float32)
  block = model_lib.Block(cfg)
  got = jax.jit(block.apply)({"params": params["layers_0"]}, x)
  for b in range(2):
    want = np_block(params["layers_0"], x[b].astype(np.float64), cfg)
    np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_model_matches_numpy(tie):
  cfg = _config(tie_embeddings=tie, rope_layout="interleaved")
  params = _random_params(cfg, seed=3)
  tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
  got = jax.jit(model_lib.Llama(cfg).apply)({"params": params}, tokens)
  want = np_model(params, tokens[0], cfg)
  np.testing.assert_allclose(got[0], want, rtol=1e-3, atol=1e-3)
  assert ("lm_head" in params) is not tie


def test_causal_prefix_invariance():
  """A token's logits ignore every later token (the causal mask)."""
  cfg = _config()
  params = _random_params(cfg)
  apply = jax.jit(model_lib.Llama(cfg).apply)
  a = apply({"params": params}, jnp.array([[1, 2, 3, 4, 5]]))
  b = apply({"params": params}, jnp.array([[1, 2, 3, 9, 9]]))
  np.testing.assert_allclose(a[0, :3], b[0, :3], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[0, 3], b[0, 3])


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.integers(1, 9), st.integers(1, 3), st.sampled_from([2, 4, 8]), st.floats(2.0, 1e6))
def test_rope_layouts_are_a_permutation(seq, heads, dim, base):
  """Interleaved RoPE of interleave-ordered features equals half RoPE of the originals."""
  x = np.random.default_rng(seq).normal(size=(1, seq, heads, dim)).astype(np.float32)
  rope = jax.jit(model_lib.apply_rope, static_argnames=("layout",))
  half = np.asarray(rope(x, jnp.arange(seq), base, layout="half"))
  as_kernel = lambda a: a.reshape(-1, heads * dim)
  to_inter = lambda a: export.half_to_interleaved(as_kernel(a), dim).reshape(a.shape)
  inter = np.asarray(rope(to_inter(x), jnp.arange(seq), base, layout="interleaved"))
  np.testing.assert_allclose(inter, to_inter(half), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(half[0], np_rope(x[0].astype(np.float64), base, "half"),
                             rtol=1e-4, atol=1e-4)
  back = export.interleaved_to_half(as_kernel(to_inter(x)), dim).reshape(x.shape)
  np.testing.assert_array_equal(back, x)


def test_bfloat16_close_to_float32():
  cfg = _config()
  params = _random_params(cfg)
  tokens = jnp.array([[1, 2, 3, 4, 5, 6]])
  f32 = jax.jit(model_lib.Llama(cfg).apply)({"params": params}, tokens)
  bf16 = jax.jit(model_lib.Llama(dataclasses.replace(cfg, dtype="bfloat16")).apply)(
      {"params": params}, tokens)
  assert bf16.dtype == jnp.float32
  rel = float(jnp.linalg.norm(bf16 - f32) / jnp.linalg.norm(f32))
  assert 0 < rel < 0.05


@pytest.mark.parametrize("kw, match", [
    ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
    ({"rope_layout": "neox"}, "rope_layout"),
    ({"dtype": "float16"}, "dtype"),
    ({"hidden_size": 25}, "not divisible"),
    ({"num_layers": 0}, "num_layers"),
])
def test_bad_config(kw, match):
  with pytest.raises(ValueError, match=match):
    _config(**kw)
