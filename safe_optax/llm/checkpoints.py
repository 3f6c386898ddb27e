"""Load LLaMA-family checkpoints (safetensors folders, GGUF files).

* A Hugging Face folder: ``config.json`` plus ``*.safetensors`` with LLaMA /
  SmolLM / Mistral names (``model.layers.{i}.self_attn.q_proj.weight``, ...),
  and ``tokenizer.json``. Linear weights are stored ``(out, in)`` there and
  transposed to Flax ``(in, out)`` kernels here. RoPE layout ``"half"``.
* A GGUF file (llama.cpp), dequantised to float32 by PyPI ``gguf``. GGUF
  permutes the Q/K rows of each head for the interleaved-pair RoPE, so the
  model is built with ``rope_layout="interleaved"`` and the weights are used
  as stored. The tokenizer is rebuilt from the file's BPE metadata for the
  pre-tokenizers in :data:`GGUF_PRE_TOKENIZERS` (others are refused, since a
  wrong pre-tokenizer gives other token ids without an error). A cut or
  damaged file raises ``ValueError`` naming it.

Parameters are float32 in memory whatever the source. :func:`source_dtype`
says what precision the source holds, so an export can keep it (a bf16 model
is not written at twice its size). A GGUF's quantised matrices (Q4_1, Q8_0,
...) count as ``float16``: a dequantised block is an fp16 scale times small
integers, which float16 holds to within 2^-11 relative error, far below the
quantisation step, at half the size of float32. :func:`source_metadata`
collects what the source says beyond the weights (context length, special
tokens, chat template) for the export.

Writing is :mod:`safe_optax.llm.export`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import time
from typing import Any

import jax
import numpy as np

from safe_optax import experiment
from safe_optax.llm import model as model_lib
from safe_optax.llm.export import HF_LINEARS as _HF_LINEARS
from safe_optax.llm.export import HF_NORMS as _HF_NORMS
from safe_optax.llm.export import SIDE_FILES

_GGUF_LINEARS = {
    "attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"), "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
_GGUF_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_SAFETENSORS_DTYPES = {"F64": "float32", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}

GGUF_PRE_TOKENIZERS = {
    "gpt2": "GPT-2's byte-level regex",
    "smollm": "every digit on its own, then GPT-2's byte-level regex",
}
"""The GGUF pre-tokenizers (``tokenizer.ggml.pre``) :func:`tokenizer_from_gguf` rebuilds.

Each is llama.cpp's regex split for that name, and the name's Hugging Face
``tokenizer.json`` pre-tokenizer; ``smollm`` is checked token for token against
an independent BPE on WikiText (``tests/test_llm_real.py``).
"""

_LOG = logging.getLogger(__name__)


def _missing(path: pathlib.Path, what: str) -> FileNotFoundError:
  return FileNotFoundError(f"{what} not found at '{path}'.")


def _config_from_hf(raw: dict[str, Any], path: pathlib.Path) -> model_lib.LlamaConfig:
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  absent = [key for key in required if key not in raw]
  if absent:
    raise ValueError(f"'{path}' lacks {absent}; is this a LLaMA-family config.json?")
  if raw.get("rope_scaling"):
    # Llama 3.1-style frequency scaling is not in model.py: refusing beats wrong logits.
    raise ValueError(f"'{path}' sets rope_scaling={raw['rope_scaling']!r}; only plain RoPE "
                     "(rope_scaling null) is supported.")
  head_dim = raw.get("head_dim")
  if head_dim == raw["hidden_size"] // raw["num_attention_heads"]:
    head_dim = None  # the default; keeps configs equal whether or not the file spells it out
  return model_lib.LlamaConfig(
      vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
      intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
      num_heads=raw["num_attention_heads"],
      num_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
      head_dim=head_dim, rope_base=float(raw.get("rope_theta", 10000.0)),
      rope_layout="half", rms_eps=float(raw.get("rms_norm_eps", 1e-5)),
      tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
  )


def _empty_params(config: model_lib.LlamaConfig) -> dict[str, Any]:
  return {f"layers_{i}": {"self_attn": {}, "mlp": {}} for i in range(config.num_layers)}


def _check_shapes(params: dict[str, Any], config: model_lib.LlamaConfig, source: str) -> None:
  """Compares every loaded array against the shapes the config implies."""
  expected = jax.eval_shape(lambda: model_lib.init_params(config))
  flat_expected = _flatten(expected)
  flat = _flatten(params)
  missing = sorted(set(flat_expected) - set(flat))
  extra = sorted(set(flat) - set(flat_expected))
  if missing or extra:
    raise ValueError(
        f"{source}: tensors do not match the config: missing {missing[:6]}, "
        f"unexpected {extra[:6]}.")
  for key, spec in flat_expected.items():
    if tuple(flat[key].shape) != tuple(spec.shape):
      raise ValueError(
          f"{source}: '{'/'.join(key)}' has shape {tuple(flat[key].shape)} but the config "
          f"implies {tuple(spec.shape)}.")


def _flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, prefix + (key,)))
    else:
      flat[prefix + (key,)] = value
  return flat


def load_safetensors(path: os.PathLike, *,
                     progress: bool = False) -> tuple[model_lib.LlamaConfig, dict[str, Any]]:
  """Reads a Hugging Face LLaMA-family folder into ``(config, params)`` (float32).

  bf16 / fp16 tensors are widened exactly; :func:`source_dtype` tells which
  the folder holds.

  Args:
    path: folder with ``config.json`` and one or more ``*.safetensors`` files.
    progress: show a bar of the tensors read on stderr.

  Returns:
    The :class:`~safe_optax.llm.model.LlamaConfig` and Flax parameters.
  """
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path)
  if not path.is_dir():
    raise _missing(path, "checkpoint folder (config.json + *.safetensors)")
  if not (path / "config.json").is_file():
    raise _missing(path / "config.json", "config.json")
  config = _config_from_hf(json.loads((path / "config.json").read_text()), path / "config.json")
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise _missing(path / "*.safetensors", "safetensors weights")
  names = {}
  for file in files:
    with safe_open(str(file), framework="np") as f:
      names[file] = list(f.keys())
  bar = experiment.progress(sum(map(len, names.values())), desc=f"load {path.name}",
                            unit="tensor", enabled=progress)
  params = _empty_params(config)
  unknown = []
  for file, keys in names.items():
    with safe_open(str(file), framework="np") as f:
      for name in keys:
        _place_hf_tensor(params, config, name, np.asarray(f.get_tensor(name), np.float32),
                         unknown)
        bar.update(1)
  bar.close()
  if unknown:
    raise ValueError(f"'{path}': unexpected tensors for a LLaMA-family model: {unknown[:6]}.")
  _check_shapes(params, config, str(path))
  return config, params


def _place_hf_tensor(params: dict[str, Any], config: model_lib.LlamaConfig, name: str,
                     value: np.ndarray, unknown: list[str]) -> None:
  """Puts one Hugging Face tensor where the Flax model has it; an unknown name joins ``unknown``."""
  parts = name.split(".")
  if name == "model.embed_tokens.weight":
    params["embed_tokens"] = {"embedding": value}
  elif name == "model.norm.weight":
    params["norm"] = {"scale": value}
  elif name == "lm_head.weight":
    if not config.tie_embeddings:
      params["lm_head"] = {"kernel": value.T}
  elif name.startswith("model.layers.") and len(parts) >= 5 and parts[2].isdigit():
    block = params.setdefault(f"layers_{parts[2]}", {"self_attn": {}, "mlp": {}})
    inner = ".".join(parts[3:-1])
    if inner in _HF_LINEARS and parts[-1] == "weight":
      group, linear = _HF_LINEARS[inner]
      block[group][linear] = {"kernel": value.T}
    elif inner in _HF_NORMS and parts[-1] == "weight":
      block[_HF_NORMS[inner]] = {"scale": value}
    elif "rotary_emb" not in inner:
      unknown.append(name)
  else:
    unknown.append(name)


def gguf_reader(path: os.PathLike) -> Any:
  """The read-only ``gguf.GGUFReader`` of ``path``, parsed once per version of the file (its
  size and mtime): the loaders share a parse, seconds of pure Python for a tokenizer."""
  stat = (resolved := pathlib.Path(path).resolve()).stat()
  return _parsed_gguf(str(resolved), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, size: int, mtime_ns: int) -> Any:  # pylint: disable=unused-argument
  import gguf  # pylint: disable=import-outside-toplevel
  try:
    return gguf.GGUFReader(path)
  except (ValueError, IndexError, EOFError) as err:
    raise ValueError(f"'{path}' is truncated or corrupt, or not a GGUF file (gguf says: {err}); "
                     "download it again.") from err


def source_dtype(path: os.PathLike) -> str:
  """The precision of a checkpoint's weights: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

  Read from the file headers, without loading the weights. A safetensors
  folder: the floating dtype of its tensors (float32 when they mix bf16 and
  fp16). A GGUF file: the type of its matrices (llama.cpp keeps 1-D norms in
  F32 whatever the matrices are); quantised matrices count as ``float16``
  (see the module docstring).
  """
  import gguf  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path)
  found: set[str] = set()
  if path.is_dir():
    for file in sorted(path.glob("*.safetensors")):
      with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
      found |= {_SAFETENSORS_DTYPES[v["dtype"]] for k, v in header.items()
                if k != "__metadata__" and v["dtype"] in _SAFETENSORS_DTYPES}
    if not found:
      raise _missing(path / "*.safetensors", "floating-point safetensors weights")
    return found.pop() if len(found) == 1 else "float32"  # bf16 + fp16 need float32
  if not (path.is_file() and path.suffix == ".gguf"):
    raise _missing(path, "model (a safetensors folder or a .gguf file)")
  kinds = gguf.GGMLQuantizationType
  named = {kinds.F32: "float32", kinds.F64: "float32", kinds.BF16: "bfloat16",
           kinds.F16: "float16"}
  for tensor in gguf_reader(path).tensors:
    if len(tensor.shape) == 2:
      found.add(named.get(tensor.tensor_type, "float16"))
  return found.pop() if len(found) == 1 else "float32"


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def _gguf_metadata(reader: Any) -> dict[str, dict[str, Any]]:
  """The Hugging Face side files a GGUF's metadata implies (see :func:`source_metadata`)."""
  tokens = _gguf_field(reader, "tokenizer.ggml.tokens") or []
  ids = {hf: _gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
         for hf, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
  ids = {k: int(v) for k, v in ids.items() if v is not None}
  context = _gguf_field(reader, "llama.context_length")
  config = {f"{k}_token_id": v for k, v in ids.items() if k != "unk"}
  if context is not None:
    config["max_position_embeddings"] = int(context)
  out = {"config.json": config}
  generation = {k: v for k, v in config.items() if k.endswith("_token_id")}
  if generation:
    out["generation_config.json"] = generation
  if tokens:
    # PreTrainedTokenizerFast reads tokenizer.json as it is; without this file
    # AutoTokenizer would pick LlamaTokenizerFast from config.json, which adds
    # its own "<s>" BOS that SmolLM's vocabulary does not have.
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                        "clean_up_tokenization_spaces": False,
                        **{f"{k}_token": tokens[v] for k, v in ids.items() if v < len(tokens)}}
    if context is not None:
      tokenizer_config["model_max_length"] = int(context)
    template = _gguf_field(reader, "tokenizer.chat_template")
    if template:
      tokenizer_config["chat_template"] = template
    out["tokenizer_config.json"] = tokenizer_config
  return out


def source_metadata(path: os.PathLike) -> dict[str, dict[str, Any]]:
  """What a checkpoint says beyond its weights, as Hugging Face files for an export.

  Read from a folder: its ``config.json`` (every field; the export overrides
  the architecture's) and those of :data:`~safe_optax.llm.export.SIDE_FILES`
  it has, unchanged. From a GGUF file: ``config.json`` fields for the
  context length (``max_position_embeddings``) and the special token ids,
  ``generation_config.json`` with those ids, and ``tokenizer_config.json``
  (``PreTrainedTokenizerFast``, the special tokens, the chat template).

  Args:
    path: a safetensors folder or a ``.gguf`` file.

  Returns:
    ``{file name: JSON object}`` for
    :func:`~safe_optax.llm.export.save_safetensors`'s ``source_metadata``.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    out = {}
    for name in ("config.json",) + SIDE_FILES:
      if (path / name).is_file():
        out[name] = json.loads((path / name).read_text())
    return out
  if path.is_file() and path.suffix == ".gguf":
    return _gguf_metadata(gguf_reader(path))
  raise _missing(path, "model (a safetensors folder or a .gguf file)")


def load_gguf(path: os.PathLike, *,
              progress: bool = False) -> tuple[model_lib.LlamaConfig, dict[str, Any]]:
  """Reads a llama.cpp GGUF file (architecture ``llama``), dequantised to float32.

  The Q/K weights keep GGUF's row order, so the config says
  ``rope_layout="interleaved"``.

  Args:
    path: a ``.gguf`` file.
    progress: show a bar of the tensors dequantised on stderr.

  Returns:
    The :class:`~safe_optax.llm.model.LlamaConfig` and Flax parameters.
  """
  import gguf  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path)
  if not path.is_file():
    raise _missing(path, "GGUF file")
  reader = gguf_reader(path)
  arch = _gguf_field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"'{path}': general.architecture is {arch!r}; only 'llama' is supported.")
  names = {t.name for t in reader.tensors}
  hidden = int(_gguf_field(reader, "llama.embedding_length"))
  heads = int(_gguf_field(reader, "llama.attention.head_count"))
  rope_dim = _gguf_field(reader, "llama.rope.dimension_count")
  tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
  vocab = _gguf_field(reader, "llama.vocab_size", len(tokens) if tokens else None)
  config = model_lib.LlamaConfig(
      vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(_gguf_field(reader, "llama.feed_forward_length")),
      num_layers=int(_gguf_field(reader, "llama.block_count")), num_heads=heads,
      num_kv_heads=int(_gguf_field(reader, "llama.attention.head_count_kv", heads)),
      head_dim=None if rope_dim is None or int(rope_dim) == hidden // heads else int(rope_dim),
      rope_base=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
      rope_layout="interleaved",
      rms_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in names,
  )
  params = _empty_params(config)
  unknown = []
  bar = experiment.progress(len(reader.tensors), desc=f"load {path.name}", unit="tensor",
                            enabled=progress)
  for tensor in reader.tensors:
    # gguf gives numpy (out, in) order; dequantize handles F32/F16 as well.
    value = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    parts = tensor.name.split(".")
    if tensor.name == "token_embd.weight":
      params["embed_tokens"] = {"embedding": value}
    elif tensor.name == "output_norm.weight":
      params["norm"] = {"scale": value}
    elif tensor.name == "output.weight":
      params["lm_head"] = {"kernel": value.T}
    elif parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight":
      block = params[f"layers_{parts[1]}"]
      if parts[2] in _GGUF_LINEARS:
        group, linear = _GGUF_LINEARS[parts[2]]
        block[group][linear] = {"kernel": value.T}
      elif parts[2] in _GGUF_NORMS:
        block[_GGUF_NORMS[parts[2]]] = {"scale": value}
      else:
        unknown.append(tensor.name)
    elif tensor.name != "rope_freqs.weight":
      unknown.append(tensor.name)
    bar.update(1)
  bar.close()
  if unknown:
    raise ValueError(f"'{path}': unexpected tensors for a llama GGUF: {unknown[:6]}.")
  _check_shapes(params, config, str(path))
  return config, params


def load_model(path: os.PathLike, *,
               progress: bool = False) -> tuple[model_lib.LlamaConfig, dict[str, Any]]:
  """Loads a safetensors folder or a ``.gguf`` file (by what ``path`` is).

  Args:
    path: a Hugging Face folder (:func:`load_safetensors`) or a ``.gguf``
      file (:func:`load_gguf`).
    progress: show a bar of the tensors read on stderr.

  Returns:
    ``(config, params)``, the parameters in float32.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    load = load_safetensors
  elif path.is_file() and path.suffix == ".gguf":
    load = load_gguf
  elif path.exists():
    raise ValueError(
        f"--model '{path}' must be a folder (config.json + *.safetensors) or a .gguf file.")
  else:
    raise _missing(path, "model (a safetensors folder or a .gguf file)")
  start = time.perf_counter()
  config, params = load(path, progress=progress)
  _LOG.info("loaded %s in %.1f s: %d blocks, width %d, %d heads (%d key/value), vocabulary %d",
            path, time.perf_counter() - start, config.num_layers, config.hidden_size,
            config.num_heads, config.num_kv_heads, config.vocab_size)
  return config, params


def tokenizer_from_gguf(path: os.PathLike) -> Any:
  """The byte-level BPE ``tokenizers.Tokenizer`` stored in a GGUF file's metadata.

  The vocabulary, merges and special tokens come from ``path`` (whose
  ``tokenizer.ggml.model`` must be ``gpt2``); the pre-tokenizer from its name,
  ``tokenizer.ggml.pre``, which must be one of :data:`GGUF_PRE_TOKENIZERS`.

  Raises:
    ValueError: another tokenizer model, or a pre-tokenizer that is absent or
      not in :data:`GGUF_PRE_TOKENIZERS` (the message names it and those
      supported).
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel

  reader = gguf_reader(pathlib.Path(path))
  kind = _gguf_field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"'{path}': tokenizer.ggml.model is {kind!r}; only byte-level BPE "
                     "('gpt2') is supported.")
  pre = _gguf_field(reader, "tokenizer.ggml.pre")
  if pre not in GGUF_PRE_TOKENIZERS:
    found = "absent" if pre is None else repr(pre)
    raise ValueError(
        f"'{path}': tokenizer.ggml.pre is {found}; the tokenizer can be rebuilt only for the "
        f"pre-tokenizers {', '.join(map(repr, GGUF_PRE_TOKENIZERS))} (another one would split "
        "the text differently and give other token ids); use the model's Hugging Face folder "
        "(config.json, *.safetensors, tokenizer.json) instead.")
  tokens = list(_gguf_field(reader, "tokenizer.ggml.tokens"))
  merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges", [])]
  vocab = {token: i for i, token in enumerate(tokens)}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    # SmolLM's tokenizer.json splits digits one by one before the GPT-2 regex.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tokenizer.pre_tokenizer = byte_level
  tokenizer.decoder = decoders.ByteLevel()
  special = [t for t, kind in zip(tokens, _gguf_field(reader, "tokenizer.ggml.token_type", []))
             if kind == 3]
  tokenizer.add_special_tokens(special)
  return tokenizer


def load_tokenizer(path: os.PathLike) -> Any:
  """The ``tokenizers.Tokenizer`` of a checkpoint: ``tokenizer.json`` or GGUF metadata."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path)
  if path.is_dir():
    if not (path / "tokenizer.json").is_file():
      raise _missing(path / "tokenizer.json", "tokenizer.json")
    return Tokenizer.from_file(str(path / "tokenizer.json"))
  if path.is_file() and path.suffix == ".gguf":
    return tokenizer_from_gguf(path)
  raise _missing(path, "tokenizer (a folder with tokenizer.json or a .gguf file)")
