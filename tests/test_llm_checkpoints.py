"""Loaders: safetensors folder and GGUF round trips, tokenizer from GGUF metadata, errors."""

import dataclasses
import json

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from safe_optax.llm import checkpoints
from safe_optax.llm import export
from safe_optax.llm import model as model_lib

CFG = model_lib.LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=24, num_layers=2,
                            num_heads=4, num_kv_heads=2, rope_base=1e4, rms_eps=2.0**-20,
                            tie_embeddings=False)
TOKENS = np.array([[5, 100, 7, 259, 3, 42]])


def _params(cfg, seed=0):
  params = model_lib.init_params(cfg, seed)
  # Non-unit norm scales, so a swapped or dropped norm shows.
  return jax.tree.map(lambda a: a + 0.1 * np.arange(a.shape[0]) if a.ndim == 1 else a, params)


def _logits(cfg, params, tokens=TOKENS):
  return np.asarray(jax.jit(model_lib.Llama(cfg).apply)({"params": params}, tokens))


def _writer_with_fields(reader, path):
  """A GGUF writer at ``path`` holding every metadata field of ``reader`` (tensors to add)."""
  writer = gguf.GGUFWriter(str(path), "llama")
  for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    value = field.contents()
    if isinstance(value, list):
      writer.add_array(key, value)
    else:
      writer.add_key_value(key, value, field.types[0])
  return writer


@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_round_trip(tmp_path, tie):
  cfg = dataclasses.replace(CFG, tie_embeddings=tie)
  params = _params(cfg)
  export.save_safetensors(tmp_path, cfg, params)
  raw = load_file(str(tmp_path / "model.safetensors"))
  # Hugging Face layout: (out, in) linear weights.
  assert raw["model.layers.1.self_attn.k_proj.weight"].shape == (8, 16)
  assert ("lm_head.weight" in raw) is not tie
  loaded_cfg, loaded = checkpoints.load_model(tmp_path)
  assert loaded_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_export_interleaved_as_hf_layout(tmp_path):
  """A GGUF-layout (interleaved) model exports to a half-layout folder with the same logits."""
  cfg = dataclasses.replace(CFG, rope_layout="interleaved")
  params = _params(cfg, seed=1)
  export.save_safetensors(tmp_path, cfg, params)
  loaded_cfg, loaded = checkpoints.load_safetensors(tmp_path)
  assert loaded_cfg.rope_layout == "half"
  np.testing.assert_allclose(_logits(loaded_cfg, loaded), _logits(cfg, params), atol=1e-5)


def _write_gguf(path, cfg, params, tokens, merges, pre="gpt2"):
  """A llama GGUF the way llama.cpp's converter lays it out (numpy (out, in) tensors).

  ``pre`` is the pre-tokenizer's name (``tokenizer.ggml.pre``); ``None`` leaves it out.
  """
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(cfg.num_layers)
  writer.add_context_length(64)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_rope_freq_base(cfg.rope_base)
  writer.add_layer_norm_rms_eps(cfg.rms_eps)
  writer.add_vocab_size(cfg.vocab_size)
  writer.add_tokenizer_model("gpt2")
  if pre is not None:
    writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types([1] * (len(tokens) - 1) + [3])
  writer.add_token_merges(merges)
  # What llama.cpp's converter writes for SmolLM2-Instruct besides the vocabulary.
  writer.add_bos_token_id(len(tokens) - 1)
  writer.add_eos_token_id(len(tokens) - 1)
  writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
  f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))
  writer.add_tensor("token_embd.weight", f32(params["embed_tokens"]["embedding"]))
  writer.add_tensor("output_norm.weight", f32(params["norm"]["scale"]))
  if not cfg.tie_embeddings:
    writer.add_tensor("output.weight", f32(params["lm_head"]["kernel"]).T.copy())
  names = {v: k for k, v in checkpoints._GGUF_LINEARS.items()}
  for i in range(cfg.num_layers):
    block = params[f"layers_{i}"]
    for (group, linear), name in names.items():
      writer.add_tensor(f"blk.{i}.{name}.weight", f32(block[group][linear]["kernel"]).T.copy())
    writer.add_tensor(f"blk.{i}.attn_norm.weight", f32(block["input_layernorm"]["scale"]))
    writer.add_tensor(f"blk.{i}.ffn_norm.weight", f32(block["post_attention_layernorm"]["scale"]))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _byte_vocab():
  from tokenizers import pre_tokenizers
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  merges = ["h e", "l l", "he ll"]
  return alphabet + ["he", "ll", "hell", "<|end|>"], merges


def test_gguf_round_trip_and_tokenizer(tmp_path):
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), rope_layout="interleaved")
  params = _params(cfg, seed=2)
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, cfg, params, tokens, merges)
  loaded_cfg, loaded = checkpoints.load_model(path)
  assert loaded_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  tokenizer = checkpoints.load_tokenizer(path)
  ids = tokenizer.encode("hello hell<|end|>").ids
  assert tokens[ids[0]] == "hell" and tokens.index("<|end|>") == ids[-1]
  assert tokenizer.decode(ids, skip_special_tokens=False) == "hello hell<|end|>"
  # Exported to safetensors (Hugging Face layout) it is the same model.
  export.save_safetensors(tmp_path / "hf", loaded_cfg, loaded, tokenizer)
  hf_cfg, hf = checkpoints.load_model(tmp_path / "hf")
  np.testing.assert_allclose(_logits(hf_cfg, hf), _logits(cfg, params), atol=1e-5)
  assert checkpoints.load_tokenizer(tmp_path / "hf").encode("hello").ids == ids[:2]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", None])
def test_gguf_unknown_pre_tokenizer_is_refused_by_name(tmp_path, pre):
  """A pre-tokenizer the rebuild does not reproduce is an error naming it and those supported,
  not GPT-2's regex in its place (other token ids, no error)."""
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), num_layers=1)
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, cfg, _params(cfg), tokens, merges, pre=pre)
  found = "absent" if pre is None else repr(pre)
  with pytest.raises(ValueError) as err:
    checkpoints.load_tokenizer(path)
  message = str(err.value)
  assert f"tokenizer.ggml.pre is {found};" in message and str(path) in message
  assert "'gpt2', 'smollm'" in message and "tokenizer.json" in message
  assert "\n" not in message
  checkpoints.load_model(path)  # the weights load: only the tokenizer is refused


@pytest.mark.parametrize("pre, pieces", [("gpt2", ["12", "3"]), ("smollm", ["1", "2", "3"])])
def test_gguf_pre_tokenizer_digits(tmp_path, pre, pieces):
  """GPT-2's regex keeps a run of digits together, SmolLM's splits every digit first."""
  tokens, merges = _byte_vocab()
  tokens = tokens[:-1] + ["12", "<|end|>"]
  merges = merges + ["1 2"]
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), num_layers=1)
  path = tmp_path / f"{pre}.gguf"
  _write_gguf(path, cfg, _params(cfg), tokens, merges, pre=pre)
  ids = checkpoints.load_tokenizer(path).encode("123").ids
  assert [tokens[i] for i in ids] == pieces


def test_gguf_source_metadata_becomes_hf_side_files(tmp_path):
  """Context length, special tokens and chat template go to config / generation / tokenizer
  configs, and the exported tokenizer.json encodes as the GGUF's did."""
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), rope_layout="interleaved")
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, cfg, _params(cfg), tokens, merges)
  meta = checkpoints.source_metadata(path)
  end = len(tokens) - 1
  assert meta["config.json"] == {"bos_token_id": end, "eos_token_id": end,
                                 "max_position_embeddings": 64}
  assert meta["generation_config.json"] == {"bos_token_id": end, "eos_token_id": end}
  tokenizer_config = meta["tokenizer_config.json"]
  assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert tokenizer_config["bos_token"] == tokenizer_config["eos_token"] == "<|end|>"
  assert tokenizer_config["model_max_length"] == 64
  assert tokenizer_config["chat_template"].startswith("{% for m in messages %}")
  config, params = checkpoints.load_model(path)
  tokenizer = checkpoints.load_tokenizer(path)
  out = export.save_safetensors(tmp_path / "hf", config, params, tokenizer,
                                     source_metadata=meta)
  written = json.loads((out / "config.json").read_text())
  assert written["max_position_embeddings"] == 64 and written["eos_token_id"] == end
  assert json.loads((out / "tokenizer_config.json").read_text()) == tokenizer_config
  assert json.loads((out / "generation_config.json").read_text()) == meta[
      "generation_config.json"]
  text = "hello hell<|end|>"
  assert checkpoints.load_tokenizer(out).encode(text).ids == tokenizer.encode(text).ids
  with pytest.raises(FileNotFoundError, match="model"):
    checkpoints.source_metadata(tmp_path / "nope.gguf")


@pytest.mark.slow
def test_gguf_quantized_tensor_dequantised(tmp_path):
  """A Q8_0 tensor comes back dequantised, within the format's rounding."""
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), hidden_size=32, num_heads=4,
                            num_kv_heads=4, intermediate_size=32, num_layers=1)
  params = _params(cfg, seed=4)
  path = tmp_path / "q8.gguf"
  _write_gguf(path, cfg, params, tokens, merges)
  reader = gguf.GGUFReader(str(path))
  up = np.asarray(params["layers_0"]["mlp"]["up_proj"]["kernel"], np.float32).T.copy()
  quantised = gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0)
  writer = _writer_with_fields(reader, tmp_path / "q8b.gguf")
  for tensor in reader.tensors:
    if tensor.name == "blk.0.ffn_up.weight":
      writer.add_tensor(tensor.name, quantised, raw_shape=quantised.shape,
                        raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      writer.add_tensor(tensor.name, np.asarray(tensor.data))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  _, loaded = checkpoints.load_gguf(tmp_path / "q8b.gguf")
  got = loaded["layers_0"]["mlp"]["up_proj"]["kernel"]
  step = np.abs(up).max() / 127
  np.testing.assert_allclose(got, up.T, atol=step)
  assert not np.array_equal(got, up.T)


def test_bad_paths_and_mismatched_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="model"):
    checkpoints.load_model(tmp_path / "nope")
  (tmp_path / "weights.bin").write_bytes(b"x")
  with pytest.raises(ValueError, match="folder .* or a .gguf file"):
    checkpoints.load_model(tmp_path / "weights.bin")
  with pytest.raises(FileNotFoundError, match="config.json"):
    checkpoints.load_safetensors(tmp_path)
  folder = tmp_path / "ckpt"
  export.save_safetensors(folder, CFG, _params(CFG))
  raw = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(dict(raw, intermediate_size=32)))
  with pytest.raises(ValueError, match="kernel' has shape .* but the config implies"):
    checkpoints.load_safetensors(folder)
  (folder / "config.json").write_text(json.dumps(dict(raw, num_hidden_layers=3)))
  with pytest.raises(ValueError, match="missing"):
    checkpoints.load_safetensors(folder)
  (folder / "config.json").write_text(json.dumps(dict(raw, rope_scaling={"rope_type": "llama3"})))
  with pytest.raises(ValueError, match="rope_scaling"):
    checkpoints.load_safetensors(folder)
  (folder / "config.json").write_text(json.dumps(raw))
  tensors = load_file(str(folder / "model.safetensors"))
  tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
  save_file(tensors, str(folder / "model.safetensors"))
  with pytest.raises(ValueError, match="unexpected tensors"):
    checkpoints.load_safetensors(folder)
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    checkpoints.load_tokenizer(folder)


@pytest.mark.parametrize("keep", [0.6, 0.995])
def test_truncated_gguf_names_the_file_and_says_truncated(tmp_path, keep):
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), rope_layout="interleaved")
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, cfg, _params(cfg), tokens, merges)
  data = path.read_bytes()
  path.write_bytes(data[:int(keep * len(data))])
  for load in (checkpoints.load_model, checkpoints.load_tokenizer, checkpoints.source_dtype):
    with pytest.raises(ValueError, match="truncated or corrupt") as err:
      load(path)
    assert str(path) in str(err.value), load


def test_a_gguf_is_parsed_once_per_version_of_the_file(tmp_path):
  """The loaders of one file share one parse; a file rewritten in place is parsed again."""
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), rope_layout="interleaved")
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, cfg, _params(cfg), tokens, merges)
  reader = checkpoints.gguf_reader(path)
  assert checkpoints.gguf_reader(tmp_path / "." / "tiny.gguf") is reader  # one file, one parse
  checkpoints.load_tokenizer(path)
  checkpoints.source_dtype(path)
  assert checkpoints.gguf_reader(path) is reader
  wider = dataclasses.replace(cfg, num_layers=cfg.num_layers + 1)
  _write_gguf(path, wider, _params(wider), tokens, merges)
  assert checkpoints.gguf_reader(path) is not reader
  assert checkpoints.load_model(path)[0].num_layers == wider.num_layers


def _safetensors_dtypes(file):
  """The dtype names in a safetensors header (what is on disk, not what numpy makes of it)."""
  with open(file, "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


_ON_DISK = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@pytest.mark.parametrize("dtype, on_disk", list(_ON_DISK.items()))
def test_export_keeps_the_requested_dtype_and_reloads(tmp_path, dtype, on_disk):
  import ml_dtypes
  params = _params(CFG)
  folder = export.save_safetensors(tmp_path / dtype, CFG, params, dtype=dtype)
  assert _safetensors_dtypes(folder / "model.safetensors") == {on_disk}
  assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype
  assert checkpoints.source_dtype(folder) == dtype
  loaded_cfg, loaded = checkpoints.load_model(folder)
  assert loaded_cfg == CFG
  np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(
      got, np.asarray(want, np.float32).astype(np_dtype).astype(np.float32)), loaded, params)
  size = (folder / "model.safetensors").stat().st_size
  n = sum(np.asarray(a).size for a in jax.tree.leaves(params))
  assert abs(size - n * np.dtype(np_dtype).itemsize) < 4096  # the header is all that is extra
  with pytest.raises(ValueError, match="dtype must be one of"):
    export.save_safetensors(tmp_path / "bad", CFG, params, dtype="int8")


@pytest.mark.slow
def test_gguf_source_dtype_is_its_matrices_type(tmp_path):
  """F32 matrices -> float32; F16 -> float16; quantised (Q8_0) -> float16 (documented)."""
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), hidden_size=32, num_heads=4,
                            num_kv_heads=4, intermediate_size=32, num_layers=1)
  path = tmp_path / "f32.gguf"
  _write_gguf(path, cfg, _params(cfg), tokens, merges)
  assert checkpoints.source_dtype(path) == "float32"
  reader = gguf.GGUFReader(str(path))
  for name, quantise in (("f16", lambda a: (a.astype(np.float16), None)),
                         ("q8", lambda a: (gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                                           gguf.GGMLQuantizationType.Q8_0))):
    writer = _writer_with_fields(reader, tmp_path / f"{name}.gguf")
    for tensor in reader.tensors:
      data = np.asarray(tensor.data)
      if data.ndim == 2:  # llama.cpp keeps the 1-D norms in F32 whatever the matrices are
        stored, raw = quantise(np.ascontiguousarray(data))
        writer.add_tensor(tensor.name, stored, raw_shape=stored.shape if raw else None,
                          raw_dtype=raw)
      else:
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert checkpoints.source_dtype(tmp_path / f"{name}.gguf") == "float16", name


def _tiny_prune_argv(folder, text, out, *extra):
  return ["prune", "--model", str(folder), "--method", "wanda", "--calib", str(text),
          "--nsamples", "2", "--seqlen", "16", "--out", str(out), "--no-progress", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_prune_exports_in_the_source_dtype_with_sparsity_metadata(tmp_path, capsys, dtype):
  """bf16 stays bf16, f16 stays f16, f32 stays f32; sparsity.json describes the 2:4 zeros;
  the source's config fields are carried; --export-dtype overrides the precision only."""
  from safe_optax.llm import cli
  params = _params(CFG)
  folder = export.save_safetensors(tmp_path / dtype, CFG, params, dtype=dtype)
  raw = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(dict(raw, max_position_embeddings=8192)))
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[:CFG.vocab_size])}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.save(str(folder / "tokenizer.json"))
  text = tmp_path / "calib.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
  assert cli.main(_tiny_prune_argv(folder, text, tmp_path / "kept", "--nm", "2:4")) == 0
  kept_dir = tmp_path / "kept"
  assert _safetensors_dtypes(kept_dir / "model.safetensors") == {_ON_DISK[dtype]}
  assert json.loads((kept_dir / "report.json").read_text())["export_dtype"] == dtype
  config = json.loads((kept_dir / "config.json").read_text())
  assert config["torch_dtype"] == dtype and config["max_position_embeddings"] == 8192
  kept_cfg, kept = checkpoints.load_model(kept_dir)
  assert kept_cfg == CFG
  sparsity = json.loads((kept_dir / "sparsity.json").read_text())
  assert (sparsity["method"], sparsity["structure"], sparsity["nm"]["n"], sparsity["nm"]["m"]) == (
      "wanda", "n:m", 2, 4)
  assert len(sparsity["pruned"]) == 7 * CFG.num_layers
  tensors = load_file(str(kept_dir / "model.safetensors"))
  for name, entry in sparsity["pruned"].items():
    weight = np.asarray(tensors[name], np.float32)
    assert entry["nonzero"] == np.count_nonzero(weight) == weight.size // 2, name
    np.testing.assert_array_equal((weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1), 2)
  assert (tokenizer.encode("lazy dog").ids
          == checkpoints.load_tokenizer(kept_dir).encode("lazy dog").ids)
  if dtype != "bfloat16":
    return
  assert cli.main(_tiny_prune_argv(folder, text, tmp_path / "f32", "--nm", "2:4",
                                   "--export-dtype", "float32")) == 0
  assert _safetensors_dtypes(tmp_path / "f32" / "model.safetensors") == {"F32"}
  _, wide = checkpoints.load_model(tmp_path / "f32")
  # Same pruning; only the file's precision differs.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      (np.asarray(a) == 0), (np.asarray(b) == 0)), kept, wide)
  capsys.readouterr()
  with pytest.raises(SystemExit):
    cli.main(_tiny_prune_argv(folder, text, tmp_path / "x", "--export-dtype", "int8"))
  assert "--export-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", list(_ON_DISK))
@pytest.mark.parametrize("tie", [True, False])
def test_gguf_export_reads_in_transformers(tmp_path, tie, dtype):
  """The export of a GGUF model, read by transformers: same logits, same token ids.

  Runs where ``transformers`` (< 5, which still has the Flax Llama; PyTorch
  not needed) is installed; it is not a dependency of this package.
  """
  transformers = pytest.importorskip("transformers")
  if not hasattr(transformers, "FlaxLlamaForCausalLM"):
    pytest.skip("this transformers has no Flax Llama (removed in v5)")
  import safe_optax
  from safe_optax.llm.prune_config import PruneConfig
  tokens, merges = _byte_vocab()
  cfg = dataclasses.replace(CFG, vocab_size=len(tokens), rope_layout="interleaved",
                            tie_embeddings=tie)
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, cfg, _params(cfg, seed=5), tokens, merges)
  config, params = checkpoints.load_model(path)
  tokenizer = checkpoints.load_tokenizer(path)
  pruned, _ = safe_optax.project_topk(
      params, structure=safe_optax.NM(2, 4),
      prunable=lambda p, leaf: "layers_" in jax.tree_util.keystr(p) and leaf.ndim == 2)
  folder = export.save_safetensors(
      tmp_path / "hf", config, pruned, tokenizer, dtype=dtype,
      prune_config=PruneConfig("magnitude", nm=(2, 4)),
      source_metadata=checkpoints.source_metadata(path))
  text = "hello hell<|end|>"
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
  assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids
  model = transformers.FlaxLlamaForCausalLM.from_pretrained(str(folder))
  hf_params = jax.tree.map(lambda a: np.asarray(a, np.float32), model.params)
  if tie:  # the Flax port leaves the head untied; PyTorch's LlamaForCausalLM ties it
    hf_params["lm_head"]["kernel"] = hf_params["model"]["embed_tokens"]["embedding"].T
  ids = np.array([tokenizer.encode(text).ids])
  theirs = np.asarray(model(ids, params=hf_params).logits)
  ours_cfg, ours = checkpoints.load_model(folder)
  np.testing.assert_allclose(_logits(ours_cfg, ours, ids), theirs, atol=1e-5)
