"""safe-optax-llm on a tiny generated checkpoint: prune, exported sparsity, ppl, errors."""

import functools
import importlib.metadata
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from safe_optax.llm import checkpoints
from safe_optax.llm import export
from safe_optax.llm import cli
from safe_optax.llm import pipeline
from safe_optax.llm import model as model_lib
from safe_optax.llm import prune as prune_lib


def _byte_tokenizer():
  """Byte-level BPE with the 256 byte symbols and no merges (ids < 256)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def make_tiny(folder):
  """A tiny generated checkpoint ``folder/tiny`` and a calibration text ``folder/calib.txt``."""
  cfg = model_lib.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                              num_layers=2, num_heads=4, num_kv_heads=2)
  checkpoint = export.save_safetensors(folder / "tiny", cfg, model_lib.init_params(cfg),
                                       _byte_tokenizer())
  text = folder / "calib.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  return checkpoint, text


@pytest.fixture(name="tiny")
def fixture_tiny(tmp_path):
  return make_tiny(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method, nm", [("sparsegpt", None), ("wanda", "2:4")])
def test_prune_exports_sparse_safetensors(tiny, tmp_path, method, nm, capsys):
  folder, text = tiny
  out = tmp_path / "out"
  argv = ["prune", "--model", str(folder), "--method", method, "--calib", str(text),
          "--nsamples", "4", "--seqlen", "16", "--out", str(out), "--eval", str(text),
          "--eval-protocol", "short", "--eval-seqlen", "32", "--eval-tokens", "64",
          "--no-progress"]
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
  sparsity = json.loads((out / "sparsity.json").read_text())
  assert sparsity["method"] == method and set(sparsity["pruned"]) == set(linears)
  assert sparsity["structure"] == ("n:m" if nm else "unstructured")
  if not nm:
    assert sparsity["grouping"] == "per lazy batch of 128 input columns (SparseGPT)"
  for name, entry in sparsity["pruned"].items():
    assert entry["nonzero"] == np.count_nonzero(linears[name]), name
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
                   "--protocol", "short", "--max-tokens", "96", "--json",
                   str(result_file)]) == 0
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
  export.save_safetensors(tmp_path / "small", small, model_lib.init_params(small),
                               _byte_tokenizer())
  assert cli.main(["prune", "--model", str(tmp_path / "small"), "--method", "magnitude",
                   "--calib", str(text), "--nsamples", "2", "--seqlen", "8",
                   "--out", str(tmp_path / "o")]) == 2
  assert "vocab_size" in capsys.readouterr().err


def _prune_argv(folder, text, out, *extra):
  return ["prune", "--model", str(folder), "--calib", str(text), "--nsamples", "4",
          "--seqlen", "16", "--out", str(out), "--no-progress", "--epochs", "2", "--batch-size", "2",
          "--lr", "3e-3", *extra]


@pytest.mark.slow
def test_prune_resumes_after_interruption(tiny, tmp_path, monkeypatch, capsys):
  """Ctrl-C after block 0: the same command finishes with the uninterrupted export; other
  arguments are refused by name unless --restart."""
  folder, text = tiny
  want_dir, out = tmp_path / "want", tmp_path / "out"
  assert cli.main(_prune_argv(folder, text, want_dir, "--method", "safe-plus")) == 0
  original = prune_lib.prune_model

  def interrupted(*args, **kwargs):
    def hook(index, entry):
      raise KeyboardInterrupt
    return original(*args, **kwargs, on_block=hook)

  monkeypatch.setattr(prune_lib, "prune_model", interrupted)
  capsys.readouterr()
  assert cli.main(_prune_argv(folder, text, out, "--method", "safe-plus")) == 130
  assert capsys.readouterr().err == (
      f"safe-optax-llm prune: interrupted; the finished blocks are saved in "
      f"{out / pipeline.STATE_DIR}; rerun the same command to resume\n")
  monkeypatch.setattr(prune_lib, "prune_model", original)
  state = json.loads((out / pipeline.STATE_DIR / "state.json").read_text())
  assert [b["block"] for b in state["blocks"]] == [0]
  capsys.readouterr()
  assert cli.main(_prune_argv(folder, text, out, "--method", "safe", "--seed", "1")) == 2
  err = capsys.readouterr().err
  assert "--method: saved 'safe-plus', now 'safe'" in err and "--seed: saved 0, now 1" in err
  assert (out / pipeline.STATE_DIR / "block_0.npz").exists()  # a refused rerun keeps the state
  # Evaluation arguments do not change the pruned weights: allowed to differ.
  assert cli.main(_prune_argv(folder, text, out, "--method", "safe-plus", "--eval", str(text),
                              "--eval-protocol", "short", "--eval-seqlen", "32",
                              "--eval-tokens", "64")) == 0
  report = json.loads((out / "report.json").read_text())
  want_report = json.loads((want_dir / "report.json").read_text())
  assert report["resumed_blocks"] == 1 and len(report["blocks"]) == 2
  assert report["blocks"][0] == state["blocks"][0]  # block 0 was not pruned again
  assert [b["relative_error"] for b in report["blocks"]] == [
      b["relative_error"] for b in want_report["blocks"]]
  got, want = load_file(str(out / "model.safetensors")), load_file(str(want_dir / "model.safetensors"))
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  assert not (out / pipeline.STATE_DIR).exists()  # removed once the export is written


@pytest.mark.slow
def test_prune_restart_discards_saved_state(tiny, tmp_path, monkeypatch):
  folder, text = tiny
  out = tmp_path / "out"
  original = prune_lib.prune_model
  calls = []

  def recording(*args, **kwargs):
    hook = lambda index, entry: calls.append(index)
    return original(*args, **kwargs, on_block=hook)

  monkeypatch.setattr(prune_lib, "prune_model", functools.partial(
      original, on_block=lambda i, e: (_ for _ in ()).throw(KeyboardInterrupt)))
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda")) == 130
  monkeypatch.setattr(prune_lib, "prune_model", recording)
  assert cli.main(_prune_argv(folder, text, out, "--method", "magnitude", "--restart")) == 0
  assert calls == [0, 1]
  report = json.loads((out / "report.json").read_text())
  assert report["prune_config"]["method"] == "magnitude" and report["resumed_blocks"] == 0


def test_nm_fixes_sparsity(tiny, tmp_path, capsys):
  folder, text = tiny
  with pytest.raises(SystemExit):
    cli.main(_prune_argv(folder, text, tmp_path / "o", "--method", "wanda", "--nm", "2:4",
                         "--sparsity", "0.7"))
  err = capsys.readouterr().err
  assert "--sparsity 0.7" in err and "--nm 2:4" in err and "0.5" in err
  assert cli.main(_prune_argv(folder, text, tmp_path / "o", "--method", "wanda", "--nm", "1:4",
                              "--sparsity", "0.75")) == 0
  report = json.loads((tmp_path / "o" / "report.json").read_text())
  assert report["args"]["sparsity"] == 0.75 and report["sparsity"]["prunable"] == 0.75
  assert cli.main(_prune_argv(folder, text, tmp_path / "p", "--method", "wanda", "--nm",
                              "2:8")) == 0
  assert json.loads((tmp_path / "p" / "report.json").read_text())["args"]["sparsity"] == 0.75


@pytest.mark.parametrize("which", ["--calib", "--eval"])
@pytest.mark.parametrize("problem", ["missing", "empty"])
def test_bad_text_fails_before_model_load(tmp_path, capsys, which, problem):
  """The model path does not exist either: the error must be about the text, found first."""
  good = tmp_path / "good.txt"
  good.write_text("some calibration text " * 20)
  bad = tmp_path / "bad.txt"
  if problem == "empty":
    bad.write_text(" \n\n")
  texts = {"--calib": str(good), "--eval": str(good), which: str(bad)}
  argv = ["prune", "--model", str(tmp_path / "no-model"), "--method", "wanda",
          "--calib", texts["--calib"], "--eval", texts["--eval"], "--out", str(tmp_path / "o")]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "bad.txt" in err and "no-model" not in err
  assert ("not found" if problem == "missing" else "is empty") in err


def test_versions_from_package_metadata():
  found = pipeline.versions()
  assert found["gguf"] == importlib.metadata.version("gguf") != "missing"
  assert found["numpy"] == np.__version__
