"""The Hugging Face folder an export writes: names, layout, dtypes, sparsity metadata, reload.

The expected tensor names and shapes are written out here from the
``transformers`` ``LlamaForCausalLM`` state dict convention, not taken from
``export.py``; the files are read with plain ``safetensors``.
"""

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import safe_optax
from safe_optax.llm import checkpoints
from safe_optax.llm import export
from safe_optax.llm import model as model_lib
from safe_optax.llm.prune_config import PruneConfig

CFG = model_lib.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                            num_heads=4, num_kv_heads=2, rope_base=1e4, tie_embeddings=False)
TOKENS = np.array([[5, 60, 7, 33, 3, 42, 1, 0]])
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
ON_DISK = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _block_matrices(path, leaf):
  return "layers_" in jax.tree_util.keystr(path) and leaf.ndim == 2


def _pruned(cfg, seed=0, nm=(2, 4)):
  """Random params with the block matrices N:M pruned along the input axis; and the keep masks."""
  params = model_lib.init_params(cfg, seed)
  # Non-unit norm scales, so a swapped or dropped norm shows in the logits.
  params = jax.tree.map(lambda a: a + 0.1 * np.arange(a.shape[0]) if a.ndim == 1 else a, params)
  return safe_optax.project_topk(params, structure=safe_optax.NM(*nm), prunable=_block_matrices)


def _hf_llama_shapes(cfg):
  """``LlamaForCausalLM.state_dict()`` names and shapes for ``cfg`` (weights are (out, in))."""
  h, i, head = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_heads
  q, kv = cfg.num_heads * head, cfg.num_kv_heads * head
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
  for layer in range(cfg.num_layers):
    p = f"model.layers.{layer}."
    shapes.update({
        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
  return shapes


def _read(folder):
  """(tensors, header metadata, on-disk dtype names) of model.safetensors, with plain safetensors."""
  with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
    tensors = {name: f.get_tensor(name) for name in f.keys()}
    metadata = f.metadata()
  with open(folder / "model.safetensors", "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  return tensors, metadata, {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _logits(cfg, params):
  return np.asarray(jax.jit(model_lib.Llama(cfg).apply)({"params": params}, TOKENS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_export_is_a_hf_llama_folder_with_the_masks(tmp_path, dtype):
  pruned, masks = _pruned(CFG)
  folder = export.save_safetensors(tmp_path / "out", CFG, pruned, dtype=dtype,
                                   prune_config=PruneConfig("magnitude", nm=(2, 4)))
  tensors, metadata, on_disk = _read(folder)
  # Names, shapes and dtype of the transformers Llama convention.
  assert {k: v.shape for k, v in tensors.items()} == _hf_llama_shapes(CFG)
  assert on_disk == {ON_DISK[dtype]}
  assert metadata["format"] == "pt"  # transformers refuses other formats
  # (out, in) layout: each weight is the Flax (in, out) kernel transposed, rounded to dtype.
  kernel = pruned["layers_1"]["self_attn"]["o_proj"]["kernel"]
  np.testing.assert_array_equal(tensors["model.layers.1.self_attn.o_proj.weight"],
                                np.asarray(kernel).T.astype(NP_DTYPES[dtype]))
  config = json.loads((folder / "config.json").read_text())
  assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
  assert config["torch_dtype"] == dtype
  assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (2, 2, 4)
  # sparsity.json: the pattern, and every pruned tensor's zeros are the keep masks' zeros.
  sparsity = json.loads((folder / "sparsity.json").read_text())
  assert sparsity["structure"] == "n:m" and sparsity["nm"]["n"] == 2 and sparsity["nm"]["m"] == 4
  assert sparsity["nm"]["axis"] == 1 and sparsity["safe_optax_version"] == safe_optax.__version__
  assert json.loads(metadata["sparsity"])["nm"] == sparsity["nm"]
  block = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
  expected = {f"model.layers.{i}.{group}.{name}.weight": masks[f"layers_{i}"][group][name]["kernel"]
              for i in range(CFG.num_layers) for group, names in block.items() for name in names}
  assert set(sparsity["pruned"]) == set(expected)
  assert set(sparsity["dense"]) == set(tensors) - set(expected)
  for name, keep in expected.items():
    weight = tensors[name]
    np.testing.assert_array_equal(weight != 0, np.asarray(keep).T, err_msg=name)
    assert sparsity["pruned"][name]["nonzero"] == np.count_nonzero(weight) == weight.size // 2
    groups = (weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1)
    np.testing.assert_array_equal(groups, 2, err_msg=name)  # 2:4 along the input axis
  assert sparsity["sparsity"] == 0.5
  for name in sparsity["dense"]:
    assert np.count_nonzero(tensors[name]) == tensors[name].size, name
  # Our loader reads it back: same architecture, and the logits of the rounded weights.
  loaded_cfg, loaded = checkpoints.load_model(folder)
  assert loaded_cfg == CFG
  rounded = jax.tree.map(lambda a: np.asarray(a).astype(NP_DTYPES[dtype]).astype(np.float32),
                         pruned)
  np.testing.assert_array_equal(_logits(loaded_cfg, loaded), _logits(CFG, rounded))


def test_interleaved_model_exports_nm_pattern_intact(tmp_path):
  """GGUF-layout Q/K rows are permuted to the HF order: the N:M groups along the inputs hold."""
  cfg = dataclasses.replace(CFG, rope_layout="interleaved", tie_embeddings=True)
  pruned, _ = _pruned(cfg, seed=3)
  folder = export.save_safetensors(tmp_path, cfg, pruned,
                                   prune_config=PruneConfig("wanda", nm=(2, 4)))
  tensors, _, _ = _read(folder)
  assert {k: v.shape for k, v in tensors.items()} == _hf_llama_shapes(cfg)
  for name in json.loads((folder / "sparsity.json").read_text())["pruned"]:
    groups = (tensors[name].reshape(tensors[name].shape[0], -1, 4) != 0).sum(-1)
    np.testing.assert_array_equal(groups, 2, err_msg=name)
  loaded_cfg, loaded = checkpoints.load_model(folder)
  assert loaded_cfg.rope_layout == "half"
  np.testing.assert_allclose(_logits(loaded_cfg, loaded), _logits(cfg, pruned), atol=1e-5)


def test_unstructured_metadata_counts_what_is_on_disk(tmp_path):
  params = model_lib.init_params(CFG, 1)
  pruned, _ = safe_optax.project_topk(params, 0.75, structure=safe_optax.PerOutput(),
                                      prunable=_block_matrices)
  folder = export.save_safetensors(tmp_path, CFG, pruned, dtype="bfloat16",
                                   prune_config=PruneConfig("wanda", sparsity=0.75))
  sparsity = json.loads((folder / "sparsity.json").read_text())
  assert (sparsity["structure"], sparsity["grouping"], sparsity["nm"]) == (
      "unstructured", "per output row", None)
  assert sparsity["target_sparsity"] == 0.75 and sparsity["method"] == "wanda"
  tensors, _, _ = _read(folder)
  for name, entry in sparsity["pruned"].items():
    assert entry["shape"] == list(tensors[name].shape)
    assert entry["sparsity"] == 1 - np.count_nonzero(tensors[name]) / tensors[name].size == 0.75


def test_a_broken_nm_claim_is_refused(tmp_path):
  """Dense weights with an N:M PruneConfig: sparsity.json would lie, so nothing is written."""
  params = model_lib.init_params(CFG, 0)
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight'.* "
                                       r"not 2:4 sparse"):
    export.save_safetensors(tmp_path / "a", CFG, params, prune_config=PruneConfig(
        "magnitude", nm=(2, 4)))
  assert not (tmp_path / "a" / "model.safetensors").exists()
  with pytest.raises(ValueError, match="16 inputs, not a multiple of m=5"):
    export.save_safetensors(tmp_path / "b", CFG, params, prune_config=PruneConfig(
        "magnitude", nm=(2, 5)))
  with pytest.raises(ValueError, match="source_metadata has .*'vocab.json'"):
    export.save_safetensors(tmp_path / "c", CFG, params, source_metadata={"vocab.json": {}})


def test_source_folder_metadata_is_carried(tmp_path):
  """Fields LlamaConfig does not hold (context, token ids) and the side files survive an export."""
  source = export.save_safetensors(tmp_path / "src", CFG, model_lib.init_params(CFG),
                                   dtype="bfloat16")
  raw = json.loads((source / "config.json").read_text())
  raw.update(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, hidden_size=999,
             dtype="bfloat16")
  (source / "config.json").write_text(json.dumps(raw))
  generation = {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 7}
  tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>"}
  (source / "generation_config.json").write_text(json.dumps(generation))
  (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  meta = checkpoints.source_metadata(source)
  assert set(meta) == {"config.json", "generation_config.json", "tokenizer_config.json"}
  out = export.save_safetensors(tmp_path / "out", CFG, model_lib.init_params(CFG),
                                source_metadata=meta)
  config = json.loads((out / "config.json").read_text())
  assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (
      8192, 1, 2)
  # The architecture and the precision are this model's, not the source's.
  assert config["hidden_size"] == 16
  assert config["torch_dtype"] == config["dtype"] == "float32"
  assert json.loads((out / "generation_config.json").read_text()) == generation
  assert json.loads((out / "tokenizer_config.json").read_text()) == tokenizer_config
  assert not (out / "sparsity.json").exists()  # not pruned: no sparsity claim
  assert checkpoints.load_model(out)[0] == CFG
