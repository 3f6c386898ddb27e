"""Perplexity protocols: windowing against a plain reference, row joining, what the CLI records."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safe_optax.llm import checkpoints
from safe_optax.llm import export
from safe_optax.llm import cli
from safe_optax.llm import data
from safe_optax.llm import model as model_lib
from safe_optax.llm import pipeline
from test_llm_cli import _byte_tokenizer

CONTEXT = 48  # the tiny model's context: the standard window is min(48, 2048)


def reference_windows(tokens, window):
  """Non-overlapping windows from the start; a partial last window is dropped (SparseGPT)."""
  out = []
  start = 0
  while start + window <= len(tokens):
    out.append(list(tokens[start:start + window]))
    start += window
  return out


@pytest.mark.parametrize("length, window, count", [(96, 32, 3), (100, 32, 3), (32, 32, 1)])
def test_windows_match_reference(length, window, count):
  tokens = np.arange(1000, 1000 + length)
  got = data.eval_windows(tokens, window)
  assert got.shape == (count, window)
  assert got.tolist() == reference_windows(tokens, window)


def test_text_shorter_than_one_window_names_the_flag():
  with pytest.raises(ValueError, match=r"31 tokens, fewer than seqlen=32.*--eval-seqlen"):
    data.eval_windows(np.arange(31), 32, flag="--eval-seqlen")


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 300), window=st.integers(2, 64),
       max_tokens=st.one_of(st.none(), st.integers(1, 300)))
def test_windows_property(length, window, max_tokens):
  tokens = np.random.default_rng(length).integers(0, 50_000, length)
  kept = tokens if max_tokens is None else tokens[:max_tokens]
  want = reference_windows(kept, window)
  if not want:
    with pytest.raises(ValueError, match="fewer than seqlen"):
      data.eval_windows(tokens, window, max_tokens)
    return
  got = data.eval_windows(tokens, window, max_tokens)
  assert got.dtype == np.int32 and got.tolist() == want


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.text(alphabet="ab =.\t", min_size=0, max_size=8), min_size=1, max_size=6))
def test_join_rows_is_hf_join(rows):
  # A WikiText row is one line of the .raw file with its line end.
  rows = [r + "\n" for r in rows]
  assert data.join_rows("".join(rows)) == "\n\n".join(rows)


def test_protocol_window():
  assert data.protocol_window("standard", 8192) == 2048
  assert data.protocol_window("standard", 1024) == 1024
  assert data.protocol_window("standard", None) == 2048
  assert data.protocol_window("short", 8192) == 512
  assert data.protocol_window("standard", 8192, seqlen=100) == 100
  with pytest.raises(ValueError, match=r"protocol must be one of \('standard', 'short'\)"):
    data.protocol_window("long", 2048)


@pytest.fixture(name="tiny")
def fixture_tiny(tmp_path):
  cfg = model_lib.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                              num_layers=2, num_heads=4, num_kv_heads=2)
  folder = export.save_safetensors(
      tmp_path / "tiny", cfg, model_lib.init_params(cfg), _byte_tokenizer(),
      source_metadata={"config.json": {"max_position_embeddings": CONTEXT}})
  text = tmp_path / "rows.txt"
  text.write_text("".join(f" = row {i} = \n the fox {i} .\n" for i in range(12)))
  return cfg, folder, text


@pytest.mark.slow
def test_ppl_standard_is_default_and_recorded(tiny, tmp_path):
  cfg, folder, text = tiny
  assert pipeline.model_context(str(folder)) == CONTEXT
  out = tmp_path / "ppl.json"
  assert cli.main(["ppl", "--model", str(folder), "--text", str(text), "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  # The byte tokenizer: one token per byte of the joined text.
  joined = "\n\n".join(text.read_text().splitlines(keepends=True))
  assert result["protocol"] == "standard" and result["window"] == CONTEXT
  assert result["context"] == CONTEXT
  assert result["text_tokens"] == len(joined.encode())
  assert result["windows"] == len(joined.encode()) // CONTEXT
  assert result["tokens"] == result["windows"] * CONTEXT
  # The same number as the perplexity of the reference windows of the joined text.
  _, params = checkpoints.load_model(folder)
  apply = model_lib.Llama(cfg).apply
  ids = _byte_tokenizer().encode(joined).ids
  windows = np.asarray(reference_windows(ids, CONTEXT), np.int32)
  want, _ = data.perplexity(lambda t: apply({"params": params}, t), windows)
  np.testing.assert_allclose(result["perplexity"], want, rtol=1e-5)


@pytest.mark.slow
def test_ppl_short_protocol_recorded(tiny, tmp_path):
  _, folder, text = tiny
  out = tmp_path / "ppl.json"
  assert cli.main(["ppl", "--model", str(folder), "--text", str(text), "--protocol", "short",
                   "--seqlen", "16", "--max-tokens", "40", "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  assert (result["protocol"], result["window"], result["windows"], result["tokens"]) == (
      "short", 16, 2, 32)
  assert result["text_tokens"] is None


def test_protocol_errors_name_the_flags(tiny, tmp_path, capsys):
  _, folder, text = tiny
  with pytest.raises(SystemExit):
    cli.main(["ppl", "--model", str(folder), "--text", str(text), "--max-tokens", "40"])
  assert "--max-tokens applies only to --protocol short" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["prune", "--model", str(folder), "--method", "wanda", "--calib", str(text),
              "--out", str(tmp_path / "o"), "--eval", str(text), "--eval-tokens", "40"])
  assert "--eval-tokens applies only to --eval-protocol short" in capsys.readouterr().err
  short = tmp_path / "short.txt"
  short.write_text("tiny\n")
  assert cli.main(["ppl", "--model", str(folder), "--text", str(short)]) == 2
  err = capsys.readouterr().err
  assert f"fewer than seqlen={CONTEXT}" in err and "--seqlen" in err


@pytest.mark.slow
def test_prune_eval_records_the_protocol(tiny, tmp_path, capsys):
  _, folder, text = tiny
  out = tmp_path / "out"
  assert cli.main(["prune", "--model", str(folder), "--method", "wanda", "--calib", str(text),
                   "--nsamples", "4", "--seqlen", "16", "--out", str(out), "--eval", str(text),
                   "--no-progress"]) == 0
  capsys.readouterr()
  (entry,) = json.loads((out / "report.json").read_text())["eval"]
  joined_bytes = len("\n\n".join(text.read_text().splitlines(keepends=True)).encode())
  assert (entry["protocol"], entry["window"], entry["text_tokens"]) == (
      "standard", CONTEXT, joined_bytes)
  assert entry["windows"] == joined_bytes // CONTEXT
