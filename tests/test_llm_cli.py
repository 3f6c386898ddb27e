"""safe-optax-llm on a tiny generated checkpoint: prune, exported sparsity, ppl, errors."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from safe_optax.llm import checkpoints
from safe_optax.llm import cli
from safe_optax.llm import model as model_lib


def _byte_tokenizer():
  """Byte-level BPE with the 256 byte symbols and no merges (ids < 256)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


@pytest.fixture(name="tiny")
def fixture_tiny(tmp_path):
  cfg = model_lib.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                              num_layers=2, num_heads=4, num_kv_heads=2)
  folder = checkpoints.save_safetensors(tmp_path / "tiny", cfg, model_lib.init_params(cfg),
                                        _byte_tokenizer())
  text = tmp_path / "calib.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  return folder, text


@pytest.mark.parametrize("method, nm", [("sparsegpt", None), ("wanda", "2:4")])
def test_prune_exports_sparse_safetensors(tiny, tmp_path, method, nm, capsys):
  folder, text = tiny
  out = tmp_path / "out"
  argv = ["prune", "--model", str(folder), "--method", method, "--calib", str(text),
          "--nsamples", "4", "--seqlen", "16", "--out", str(out), "--eval", str(text),
          "--eval-seqlen", "32", "--eval-tokens", "64", "--quiet"]
  if nm:
    argv += ["--nm", nm]
  assert cli.main(argv) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["eval"][0]["windows"] == 2 and summary["eval"][0]["perplexity"] > 1
  tensors = load_file(str(out / "model.safetensors"))
  linears = {k: v for k, v in tensors.items() if k.startswith("model.layers.") and v.ndim == 2}
  assert len(linears) == 14
  for name, weight in linears.items():
    assert (weight == 0).mean() == 0.5, name
    if nm:  # (out, in) on disk: 2 nonzeros in every 4 consecutive inputs
      groups = weight.reshape(weight.shape[0], -1, 4)
      np.testing.assert_array_equal((groups != 0).sum(-1), 2)
  assert (tensors["model.embed_tokens.weight"] != 0).all()
  report = json.loads((out / "report.json").read_text())
  assert report["sparsity"]["prunable"] == 0.5
  assert len(report["blocks"]) == 2 and all(b["seconds"] > 0 for b in report["blocks"])
  assert report["command"].startswith("safe-optax-llm prune --model")
  assert report["versions"]["safe_optax"]
  cfg, _ = checkpoints.load_model(out)
  assert cfg.num_layers == 2


def test_ppl_and_errors(tiny, tmp_path, capsys):
  folder, text = tiny
  result_file = tmp_path / "ppl.json"
  assert cli.main(["ppl", "--model", str(folder), "--text", str(text), "--seqlen", "32",
                   "--max-tokens", "96", "--json", str(result_file)]) == 0
  result = json.loads(result_file.read_text())
  # Untrained tiny model: near-uniform predictions over 256 tokens.
  assert result["windows"] == 3 and 100 < result["perplexity"] < 700
  capsys.readouterr()
  assert cli.main(["ppl", "--model", str(tmp_path / "missing"), "--text", str(text)]) == 2
  assert "not found" in capsys.readouterr().err
  assert cli.main(["ppl", "--model", str(folder), "--text", str(text), "--seqlen", "5000"]) == 2
  assert "fewer than seqlen" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["prune", "--model", str(folder), "--method", "wanda", "--calib", str(text),
              "--out", str(tmp_path / "o"), "--nm", "4:2"])
  # --grouping reaches PruneConfig, which rejects it for SparseGPT.
  assert cli.main(["prune", "--model", str(folder), "--method", "sparsegpt", "--grouping",
                   "per_row", "--calib", str(text), "--out", str(tmp_path / "o")]) == 2
  assert "grouping" in capsys.readouterr().err
  # A tokenizer whose ids exceed the model's vocabulary is a mismatched checkpoint.
  small = model_lib.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                num_layers=1, num_heads=4, num_kv_heads=2)
  checkpoints.save_safetensors(tmp_path / "small", small, model_lib.init_params(small),
                               _byte_tokenizer())
  assert cli.main(["prune", "--model", str(tmp_path / "small"), "--method", "magnitude",
                   "--calib", str(text), "--nsamples", "2", "--seqlen", "8",
                   "--out", str(tmp_path / "o")]) == 2
  assert "vocab_size" in capsys.readouterr().err
