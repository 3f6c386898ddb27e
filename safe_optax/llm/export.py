"""Write a (pruned) LLaMA-family model as a Hugging Face folder.

:func:`save_safetensors` writes what ``transformers`` and llama.cpp's
``convert_hf_to_gguf.py`` read, and what
:func:`safe_optax.llm.checkpoints.load_model` reads back:

* ``model.safetensors``: Hugging Face tensor names
  (``model.layers.{i}.self_attn.q_proj.weight``, ...), linear weights
  ``(out, in)`` (Flax kernels are ``(in, out)``), Q/K rows in the Hugging
  Face ("half") RoPE order, in ``float32``, ``bfloat16`` or ``float16``.
  The header's metadata says ``"format": "pt"`` (``transformers`` refuses a
  header with metadata but another or no format) and carries the sparsity
  summary.
* ``config.json``: the fields of ``transformers.LlamaConfig``; those a
  :class:`~safe_optax.llm.model.LlamaConfig` does not hold (context length,
  special token ids, ...) come from the source checkpoint
  (:func:`safe_optax.llm.checkpoints.source_metadata`).
* ``tokenizer.json`` and, from the source, ``tokenizer_config.json``,
  ``special_tokens_map.json`` and ``generation_config.json``.
* ``sparsity.json`` when the model was pruned: method, structure, the N:M
  pattern and its axis, every pruned tensor with its measured sparsity, the
  dense ones, the ``safe_optax`` version. An N:M claim is checked against
  the written tensors: a tensor breaking it raises instead of being written.

Each file is written under a temporary name and renamed into place
(:func:`safe_optax.experiment.atomic_write`), so a killed export never leaves
a part of a file. A weight the chosen precision cannot hold (above 65504 in
float16) raises (:func:`check_range`) instead of being written as infinity.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Optional

import ml_dtypes
import numpy as np

import safe_optax
from safe_optax import experiment
from safe_optax.llm import model as model_lib
from safe_optax.llm.prune_config import PruneConfig

# Hugging Face name inside model.layers.{i}. -> the Flax path in a block.
HF_LINEARS = {".".join(key): key for key in model_lib.LINEAR_INPUTS}
HF_NORMS = {"input_layernorm": "input_layernorm",
            "post_attention_layernorm": "post_attention_layernorm"}

EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}
"""Precisions :func:`save_safetensors` writes, by name."""

SPARSITY_FORMAT = "safe_optax.sparsity/1"
# Files of a source folder written out unchanged (they describe the tokenizer
# and generation, which pruning does not touch).
SIDE_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
# What nn.Dense weights are on disk; the N:M groups run along ``_NM_AXIS``.
_LAYOUT = "linear weights are (out, in), as torch.nn.Linear"
_NM_AXIS = 1


def interleaved_to_half(kernel: np.ndarray, head_dim: int) -> np.ndarray:
  """Reorders a Q/K ``(in, heads * head_dim)`` kernel from interleaved to half RoPE order.

  Within each head, output ``2i`` moves to ``i`` and ``2i + 1`` to
  ``i + head_dim / 2`` (the inverse of llama.cpp's conversion permutation).
  """
  rows = kernel.shape[0]
  heads = kernel.shape[1] // head_dim
  return (kernel.reshape(rows, heads, head_dim // 2, 2).swapaxes(2, 3)
          .reshape(rows, heads * head_dim))


def half_to_interleaved(kernel: np.ndarray, head_dim: int) -> np.ndarray:
  """Inverse of :func:`interleaved_to_half` (what llama.cpp's converter does)."""
  rows = kernel.shape[0]
  heads = kernel.shape[1] // head_dim
  return (kernel.reshape(rows, heads, 2, head_dim // 2).swapaxes(2, 3)
          .reshape(rows, heads * head_dim))


def hf_tensors(config: model_lib.LlamaConfig, params: dict[str, Any]
               ) -> tuple[dict[str, np.ndarray], list[str]]:
  """The Hugging Face state dict of ``params`` (float32), and the names of the block matrices.

  The block matrices are what the pruning engine prunes; the embedding, an
  untied head and the norms stay dense.
  """
  tensors = {
      "model.embed_tokens.weight": np.asarray(params["embed_tokens"]["embedding"], np.float32),
      "model.norm.weight": np.asarray(params["norm"]["scale"], np.float32),
  }
  if not config.tie_embeddings:
    # safetensors writes the raw buffer: transposed views must be made contiguous.
    tensors["lm_head.weight"] = np.ascontiguousarray(
        np.asarray(params["lm_head"]["kernel"], np.float32).T)
  matrices = []
  for i in range(config.num_layers):
    block = params[f"layers_{i}"]
    for hf, (group, linear) in HF_LINEARS.items():
      kernel = np.asarray(block[group][linear]["kernel"], np.float32)
      if config.rope_layout == "interleaved" and linear in ("q_proj", "k_proj"):
        # A row permutation of the (out, in) weight: N:M groups along `in` are unchanged.
        kernel = interleaved_to_half(kernel, config.dim_per_head)
      name = f"model.layers.{i}.{hf}.weight"
      tensors[name] = np.ascontiguousarray(kernel.T)
      matrices.append(name)
    for hf, norm in HF_NORMS.items():
      tensors[f"model.layers.{i}.{hf}.weight"] = np.asarray(block[norm]["scale"], np.float32)
  return tensors, matrices


def hf_config(config: model_lib.LlamaConfig, dtype: str,
              base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
  """``config.json`` for ``transformers.LlamaForCausalLM``.

  Args:
    config: the architecture; its fields override ``base``'s.
    dtype: the weights' precision (``torch_dtype``).
    base: the source's ``config.json`` fields (context length, token ids,
      ...), from :func:`safe_optax.llm.checkpoints.source_metadata`.

  Returns:
    The JSON object.
  """
  out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
         "mlp_bias": False, "rope_scaling": None, "use_cache": True, **(base or {})}
  out.update({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.dim_per_head, "rope_theta": config.rope_base,
      "rms_norm_eps": config.rms_eps, "tie_word_embeddings": config.tie_embeddings,
      "torch_dtype": dtype,
  })
  if "dtype" in out:  # transformers >= 4.56 spells it `dtype`; a stale source value would win
    out["dtype"] = dtype
  return out


def _structure(prune_config: PruneConfig) -> dict[str, Any]:
  """How the pruned tensors' zeros are arranged, in the written (out, in) layout."""
  if prune_config.nm is not None:
    n, m = prune_config.nm
    return {"structure": "n:m", "nm": {
        "n": n, "m": m, "axis": _NM_AXIS,
        "groups": f"at most {n} nonzeros in every {m} consecutive entries along axis "
                  f"{_NM_AXIS} (the input dimension) of each row"}}
  if prune_config.method == "sparsegpt":
    grouping = f"per lazy batch of {prune_config.blocksize} input columns (SparseGPT)"
  else:
    grouping = "per output row" if prune_config.per_row else "per matrix"
  return {"structure": "unstructured", "grouping": grouping, "nm": None}


def _check_nm(name: str, weight: np.ndarray, n: int, m: int) -> None:
  rows, cols = weight.shape
  if cols % m:
    raise ValueError(f"'{name}' has {cols} inputs, not a multiple of m={m}: it cannot be "
                     f"{n}:{m} sparse; give a PruneConfig without nm, or none.")
  worst = int((weight.reshape(rows, cols // m, m) != 0).sum(-1).max())
  if worst > n:
    raise ValueError(f"'{name}' has a group of {m} inputs with {worst} nonzeros; it is not "
                     f"{n}:{m} sparse, so sparsity.json would be wrong (was it pruned with "
                     "this PruneConfig?).")


def check_range(tensors: dict[str, np.ndarray], dtype: str, what: str = "dtype") -> None:
  """Raises if casting ``tensors`` to ``dtype`` turns a finite value infinite.

  Args:
    tensors: named arrays (a state dict, as :func:`hf_tensors` returns).
    dtype: one of :data:`EXPORT_DTYPES`.
    what: how the message names the choice of ``dtype`` (the CLI's flag).

  Raises:
    ValueError: naming the first such tensor, its largest magnitude and the
      precisions that hold it.

  Examples:
    >>> check_range({"w": np.array([1.0, 7e4], np.float32)}, "bfloat16")
    >>> check_range({"w": np.array([1.0, 7e4], np.float32)}, "float16")
    Traceback (most recent call last):
    ...
    ValueError: dtype float16 cannot hold 'w': its weights reach 7e+04, beyond float16's largest 65504; choose bfloat16 or float32.
  """
  def holds(kind: np.dtype, magnitude: float) -> bool:
    with np.errstate(over="ignore"):
      return bool(np.isfinite(np.asarray(magnitude).astype(kind)))

  for name, value in tensors.items():
    value = np.asarray(value)
    largest = float(np.max(np.abs(value), initial=0.0, where=np.isfinite(value)))
    target = EXPORT_DTYPES[dtype]
    if not holds(target, largest):
      others = " or ".join(k for k in ("bfloat16", "float32")
                           if k != dtype and holds(EXPORT_DTYPES[k], largest))
      raise ValueError(f"{what} {dtype} cannot hold '{name}': its weights reach {largest:.3g}, "
                       f"beyond {dtype}'s largest {float(np.finfo(target).max):.6g}; "
                       f"choose {others}.")


def sparsity_metadata(tensors: dict[str, np.ndarray], pruned: list[str],
                      prune_config: PruneConfig) -> dict[str, Any]:
  """What ``sparsity.json`` says about the written ``tensors``.

  Args:
    tensors: the state dict as written (after the cast: a kept weight that
      underflows float16 is a zero on disk, and is counted as one).
    pruned: the names of the pruned tensors.
    prune_config: how they were pruned.

  Returns:
    The JSON object.

  Raises:
    ValueError: with N:M, a pruned tensor breaks the pattern.
  """
  per_tensor = {}
  for name in pruned:
    weight = tensors[name]
    if prune_config.nm is not None:
      _check_nm(name, weight, *prune_config.nm)
    nonzero = int(np.count_nonzero(weight))
    per_tensor[name] = {"shape": list(weight.shape), "nonzero": nonzero,
                        "sparsity": 1.0 - nonzero / weight.size}
  size = sum(tensors[name].size for name in pruned)
  return {
      "format": SPARSITY_FORMAT, "safe_optax_version": safe_optax.__version__,
      "method": prune_config.method, "target_sparsity": prune_config.target_sparsity,
      **_structure(prune_config), "layout": _LAYOUT,
      "sparsity": 1.0 - sum(t["nonzero"] for t in per_tensor.values()) / size if size else 0.0,
      "prune_config": dataclasses.asdict(prune_config),
      "pruned": per_tensor, "dense": sorted(set(tensors) - set(pruned)),
  }


def save_safetensors(
    path: os.PathLike,
    config: model_lib.LlamaConfig,
    params: dict[str, Any],
    tokenizer: Optional[Any] = None,
    dtype: str = "float32",
    *,
    prune_config: Optional[PruneConfig] = None,
    source_metadata: Optional[dict[str, dict[str, Any]]] = None,
) -> pathlib.Path:
  """Writes a Hugging Face LLaMA folder (see the module docstring for its files).

  Interleaved-layout Q/K kernels are reordered to the Hugging Face layout
  (a row permutation, so sparsity and N:M groups along the input dimension
  are unchanged).

  Args:
    path: the folder (created).
    config: the model's configuration.
    params: its Flax parameters.
    tokenizer: a ``tokenizers.Tokenizer`` saved as ``tokenizer.json``.
    dtype: precision of the written tensors, one of :data:`EXPORT_DTYPES`
      (``config.json``'s ``torch_dtype`` says which); use
      :func:`safe_optax.llm.checkpoints.source_dtype` to keep the source's.
      Zeros stay zeros.
    prune_config: how the block matrices were pruned; writes
      ``sparsity.json`` and the header's sparsity summary.
    source_metadata: ``{file name: JSON object}`` from
      :func:`safe_optax.llm.checkpoints.source_metadata`: ``"config.json"``
      fields under this model's, the :data:`SIDE_FILES` as they are.

  Returns:
    The folder.

  Raises:
    ValueError: ``dtype`` is not one of :data:`EXPORT_DTYPES`, or cannot hold
      a weight (:func:`check_range`); a pruned tensor breaks
      ``prune_config``'s N:M pattern.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"save_safetensors dtype must be one of {tuple(EXPORT_DTYPES)}, "
                     f"got {dtype!r}.")
  source_metadata = source_metadata or {}
  unknown = sorted(set(source_metadata) - {"config.json", *SIDE_FILES})
  if unknown:
    raise ValueError(f"save_safetensors source_metadata has {unknown}; allowed file names: "
                     f"{('config.json',) + SIDE_FILES}.")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors, matrices = hf_tensors(config, params)
  check_range(tensors, dtype)
  tensors = {name: value.astype(EXPORT_DTYPES[dtype]) for name, value in tensors.items()}
  header = {"format": "pt", "safe_optax_version": safe_optax.__version__}
  sparsity = None
  if prune_config is not None:
    sparsity = sparsity_metadata(tensors, matrices, prune_config)
    summary = {k: v for k, v in sparsity.items() if k not in ("pruned", "dense", "prune_config")}
    header["sparsity"] = json.dumps(summary)
  with experiment.atomic_write(path / "model.safetensors") as tmp:
    save_file(tensors, str(tmp), metadata=header)
  files = {name: source_metadata[name] for name in SIDE_FILES if name in source_metadata}
  files["config.json"] = hf_config(config, dtype, source_metadata.get("config.json"))
  if sparsity is not None:
    files["sparsity.json"] = sparsity
  for name, content in files.items():
    with experiment.atomic_write(path / name) as tmp:
      tmp.write_text(json.dumps(content, indent=2) + "\n")
  if tokenizer is not None:
    with experiment.atomic_write(path / "tokenizer.json") as tmp:
      tokenizer.save(str(tmp))
  return path
