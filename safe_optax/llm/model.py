r"""A LLaMA-architecture decoder in Flax Linen (LLaMA, SmolLM, Mistral-style).

Pre-norm blocks ``x + Attn(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))`` with

* RMSNorm: :math:`x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \odot g`;
* rotary position embedding with base ``rope_base`` on each head, in either
  layout: ``"half"`` rotates the pairs ``(x_i, x_{i + d/2})`` (Hugging Face),
  ``"interleaved"`` rotates adjacent pairs ``(x_{2i}, x_{2i+1})`` (Meta, GGUF);
  the two are the same model up to a permutation of the Q/K output rows;
* grouped-query attention (``num_kv_heads`` divides ``num_heads``), causal;
* SwiGLU MLP ``down(silu(gate(x)) * up(x))``;
* a tied (``embed.attend``) or untied output head.

Every linear map is a bias-free ``nn.Dense`` with an ``(in, out)`` kernel, so
the core's :class:`safe_optax.NM` default axis ``-2`` groups along the input
dimension as hardware 2:4 sparsity needs. Parameter names follow Hugging Face
(``layers_{i}/self_attn/q_proj/kernel``, ...), so a block's parameters are
``params['layers_{i}']`` and :class:`Block` applies on its own: the pruning
engine runs one block at a time. Each block ``sow``\ s the input of every
linear map into the ``'intermediates'`` collection (a no-op unless that
collection is mutable), which is where Wanda and SparseGPT read activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

ROPE_LAYOUTS = ("half", "interleaved")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Which captured activation feeds each linear map of a block.
LINEAR_INPUTS = {
    ("self_attn", "q_proj"): "attn_in",
    ("self_attn", "k_proj"): "attn_in",
    ("self_attn", "v_proj"): "attn_in",
    ("self_attn", "o_proj"): "o_in",
    ("mlp", "gate_proj"): "mlp_in",
    ("mlp", "up_proj"): "mlp_in",
    ("mlp", "down_proj"): "down_in",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a LLaMA-family decoder.

  Attributes:
    vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
    num_kv_heads: sizes (``num_kv_heads < num_heads`` is GQA).
    head_dim: per-head width; ``None`` means ``hidden_size // num_heads``.
    rope_base: RoPE frequency base ``theta`` (1e4 LLaMA-2, 1e5 SmolLM2).
    rope_layout: ``"half"`` (Hugging Face) or ``"interleaved"`` (GGUF / Meta).
    rms_eps: RMSNorm epsilon.
    tie_embeddings: output head shares the token embedding.
    dtype: computation dtype, ``"float32"`` or ``"bfloat16"`` (parameters
      stay float32; norms and softmax compute in float32).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: Optional[int] = None
  rope_base: float = 10000.0
  rope_layout: str = "half"
  rms_eps: float = 1e-5
  tie_embeddings: bool = True
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError(
          f"LlamaConfig.hidden_size={self.hidden_size} is not divisible by "
          f"num_heads={self.num_heads}; pass head_dim.")
    if self.dim_per_head % 2:
      raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.dim_per_head}.")
    if self.rope_layout not in ROPE_LAYOUTS:
      raise ValueError(
          f"LlamaConfig.rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}.")
    if self.dtype not in DTYPES:
      raise ValueError(f"LlamaConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}.")
    if not self.rope_base > 0 or not self.rms_eps > 0:
      raise ValueError(
          f"LlamaConfig.rope_base and rms_eps must be > 0, got {self.rope_base}, {self.rms_eps}.")

  @property
  def dim_per_head(self) -> int:
    """Each head's width: ``head_dim``, or ``hidden_size // num_heads`` when it is ``None``."""
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    """The jax dtype of :attr:`dtype`, in which activations are computed."""
    return DTYPES[self.dtype]


class RMSNorm(nn.Module):
  """Root-mean-square norm with a learned scale, computed in float32."""

  eps: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(self.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float, layout: str) -> jax.Array:
  r"""Rotates each head's pairs by :math:`p\,\theta_i`, :math:`\theta_i = b^{-2i/d}`.

  Args:
    x: ``(batch, seq, heads, head_dim)``.
    positions: ``(seq,)`` integer positions.
    base: the frequency base ``b``.
    layout: ``"half"`` pairs ``(i, i + d/2)``; ``"interleaved"`` pairs ``(2i, 2i + 1)``.

  Returns:
    The rotated ``x`` in its dtype.
  """
  dim = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  if layout == "half":
    a, b = x32[..., : dim // 2], x32[..., dim // 2:]
    out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  else:
    pairs = x32.reshape(x.shape[:-1] + (dim // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
  return out.astype(x.dtype)


def _dense(features: int, name: str, dtype: Any) -> nn.Dense:
  return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=nn.initializers.normal(0.02))


class Attention(nn.Module):
  """Causal grouped-query self-attention with RoPE."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype, head_dim = cfg.compute_dtype, cfg.dim_per_head
    batch, seq, _ = x.shape
    self.sow("intermediates", "attn_in", x)
    q = _dense(cfg.num_heads * head_dim, "q_proj", dtype)(x)
    k = _dense(cfg.num_kv_heads * head_dim, "k_proj", dtype)(x)
    v = _dense(cfg.num_kv_heads * head_dim, "v_proj", dtype)(x)
    q = q.reshape(batch, seq, cfg.num_heads, head_dim)
    k = k.reshape(batch, seq, cfg.num_kv_heads, head_dim)
    v = v.reshape(batch, seq, cfg.num_kv_heads, head_dim)
    positions = jnp.arange(seq)
    q = apply_rope(q, positions, cfg.rope_base, cfg.rope_layout)
    k = apply_rope(k, positions, cfg.rope_base, cfg.rope_layout)
    group = cfg.num_heads // cfg.num_kv_heads
    # Query head h reads KV head h // group (the Hugging Face repeat_kv order).
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(head_dim))
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    logits = jnp.where(causal[None, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, -1)
    self.sow("intermediates", "o_in", out)
    return _dense(cfg.hidden_size, "o_proj", dtype)(out)


class MLP(nn.Module):
  """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype = cfg.compute_dtype
    self.sow("intermediates", "mlp_in", x)
    gate = _dense(cfg.intermediate_size, "gate_proj", dtype)(x)
    up = _dense(cfg.intermediate_size, "up_proj", dtype)(x)
    hidden = nn.silu(gate) * up
    self.sow("intermediates", "down_in", hidden)
    return _dense(cfg.hidden_size, "down_proj", dtype)(hidden)


class Block(nn.Module):
  """One pre-norm decoder block: attention then MLP, each with a residual."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = RMSNorm(cfg.rms_eps, cfg.compute_dtype, name="input_layernorm")(x)
    x = x + Attention(cfg, name="self_attn")(h)
    h = RMSNorm(cfg.rms_eps, cfg.compute_dtype, name="post_attention_layernorm")(x)
    return x + MLP(cfg, name="mlp")(h)


class Llama(nn.Module):
  """The decoder: token embedding, ``num_layers`` blocks, final norm, head.

  ``__call__(tokens)`` returns float32 logits ``(batch, seq, vocab)``;
  :meth:`embed` and :meth:`head` are the two ends the block-wise pruning
  engine calls around its own loop over :class:`Block`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from safe_optax.llm.model import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_layers=2, num_heads=4, num_kv_heads=2)
    >>> model = Llama(cfg)
    >>> tokens = jnp.zeros((1, 5), jnp.int32)
    >>> params = model.init(jax.random.PRNGKey(0), tokens)['params']
    >>> params['layers_0']['self_attn']['k_proj']['kernel'].shape  # (in, out)
    (16, 8)
    >>> jax.jit(model.apply)({'params': params}, tokens).shape
    (1, 5, 32)
  """

  config: LlamaConfig

  def setup(self):
    """The embedding, the blocks ``layers_<i>``, the final norm and (untied) the head."""
    cfg = self.config
    self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
                                 param_dtype=jnp.float32,
                                 embedding_init=nn.initializers.normal(0.02))
    self.layers = [Block(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
    self.norm = RMSNorm(cfg.rms_eps, cfg.compute_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _dense(cfg.vocab_size, "lm_head", cfg.compute_dtype)

  def embed(self, tokens):
    """Token ids ``(batch, seq)`` to the first block's inputs ``(batch, seq, hidden)``."""
    return self.embed_tokens(tokens)

  def head(self, x):
    """The last block's outputs to float32 logits: final norm, then the (tied) head."""
    x = self.norm(x)
    if self.config.tie_embeddings:
      logits = self.embed_tokens.attend(x)
    else:
      logits = self.lm_head(x)
    return logits.astype(jnp.float32)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.head(x)


def init_params(config: LlamaConfig, seed: int = 0) -> dict[str, Any]:
  """Random parameters (normal(0.02) kernels and embeddings, unit norm scales)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  return Llama(config).init(jax.random.PRNGKey(seed), tokens)["params"]
