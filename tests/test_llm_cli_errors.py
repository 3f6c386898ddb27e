"""safe-optax-llm refuses bad input early, in one line, and never loses a finished export.

* A finished export in ``--out`` (``report.json``) with other pruning
  arguments is refused by name unless ``--restart``; the same arguments prune
  nothing; ``--restart`` replaces it.
* ``--nsamples 0``, ``--seqlen 0``, an ``--out`` that cannot be created, a
  calibration text shorter than ``--seqlen`` and ``--max-tokens`` below
  ``--seqlen`` are refused before the model is loaded (``load_model`` is
  replaced by a function that fails the test).
* ``--export-dtype float16`` on weights beyond 65504 is refused before
  pruning, and :func:`~safe_optax.llm.export.save_safetensors` refuses it too.
* Ctrl-C while a block's file is being written prints one line, exits 130
  and leaves no ``*.tmp*`` file.
"""

import json
import logging
import os
import sys

import numpy as np
import pytest

from safe_optax.llm import checkpoints
from safe_optax.llm import export
from safe_optax.llm import cli
from safe_optax.llm import model as model_lib
from safe_optax.llm import pipeline
from safe_optax.llm import prune as prune_lib
from safe_optax.llm import prune_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_llm_cli import _byte_tokenizer, _prune_argv, fixture_tiny  # noqa: E402,F401


def _no_model_load(monkeypatch):
  def fail(path):
    raise AssertionError(f"the model was loaded ({path}) before the arguments were checked")
  monkeypatch.setattr(checkpoints, "load_model", fail)


def _one_line(err: str) -> str:
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  return err.strip()


@pytest.mark.slow
def test_a_finished_export_is_not_replaced_by_other_settings(tiny, tmp_path, monkeypatch,
                                                              capsys, caplog):
  folder, text = tiny
  out = tmp_path / "out"
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda")) == 0
  files = {p.name: p.read_bytes() for p in out.iterdir()}
  capsys.readouterr()
  _no_model_load(monkeypatch)
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda", "--sparsity", "0.6")) == 2
  err = _one_line(capsys.readouterr().err)
  assert f"--out '{out}' holds a finished export" in err
  assert "--sparsity: saved 0.5, now 0.6" in err and "--restart" in err
  assert {p.name: p.read_bytes() for p in out.iterdir()} == files
  # The fixed summation order changes the pruned weights' rounding: it is a pruning argument.
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda", "--fixed-order")) == 2
  assert "--fixed-order: saved False, now True" in _one_line(capsys.readouterr().err)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == files
  # The same arguments: nothing to prune, the export is left as it is (an INFO log record).
  caplog.set_level(logging.INFO, logger="safe_optax")
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda")) == 0
  assert any("already holds this export" in r.getMessage() for r in caplog.records)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == files
  monkeypatch.undo()
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda", "--sparsity", "0.6",
                              "--restart")) == 0
  assert json.loads((out / "report.json").read_text())["args"]["sparsity"] == 0.6


@pytest.mark.parametrize("flags, named", [
    (["--nsamples", "0"], "argument --nsamples: must be at least 1, got 0"),
    (["--seqlen", "0"], "argument --seqlen: must be at least 2, got 0"),
    (["--epochs", "-1"], "argument --epochs: must be at least 1, got -1"),
    (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got nan"),
    (["--eval-protocol", "short", "--eval-tokens", "10", "--eval-seqlen", "32"],
     "--eval-tokens 10 is fewer than --eval-seqlen 32"),
])
def test_bad_numbers_are_refused_by_flag_before_loading(tiny, tmp_path, monkeypatch, capsys,
                                                        flags, named):
  folder, text = tiny
  _no_model_load(monkeypatch)
  with pytest.raises(SystemExit) as exit_info:
    cli.main(_prune_argv(folder, text, tmp_path / "o", "--method", "wanda") + flags)
  assert exit_info.value.code == 2
  assert named in capsys.readouterr().err


def test_ppl_max_tokens_below_seqlen_names_the_flags(tiny, monkeypatch, capsys):
  folder, text = tiny
  _no_model_load(monkeypatch)
  with pytest.raises(SystemExit):
    cli.main(["ppl", "--model", str(folder), "--text", str(text), "--protocol", "short",
              "--max-tokens", "10"])
  err = capsys.readouterr().err
  assert "--max-tokens 10 is fewer than --seqlen 512" in err
  assert "has 10 tokens" not in err


def test_an_out_path_that_cannot_be_created_fails_before_loading(tiny, tmp_path, monkeypatch,
                                                                 capsys):
  folder, text = tiny
  (tmp_path / "a-file").write_text("")
  _no_model_load(monkeypatch)
  out = tmp_path / "a-file" / "out"
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda")) == 2
  err = _one_line(capsys.readouterr().err)
  assert f"--out '{out}' cannot be created" in err


def test_a_short_calibration_text_fails_before_loading(tiny, tmp_path, monkeypatch, capsys):
  folder, _ = tiny
  short = tmp_path / "short.txt"
  short.write_text("only a few bytes")
  _no_model_load(monkeypatch)
  assert cli.main(_prune_argv(folder, short, tmp_path / "o", "--method", "wanda")) == 2
  err = _one_line(capsys.readouterr().err)
  assert f"--calib '{short}' has 16 tokens, too few for --seqlen 16" in err


def test_float16_export_of_weights_beyond_its_range_is_refused(tmp_path, monkeypatch, capsys):
  cfg = model_lib.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                              num_layers=1, num_heads=4, num_kv_heads=2)
  params = model_lib.init_params(cfg)
  params["layers_0"]["mlp"]["down_proj"]["kernel"] = (
      params["layers_0"]["mlp"]["down_proj"]["kernel"].at[3, 5].set(1e5))
  folder = export.save_safetensors(tmp_path / "big", cfg, params, _byte_tokenizer(),
                                        dtype="bfloat16")
  text = tmp_path / "calib.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  monkeypatch.setattr(prune_lib, "prune_model", lambda *a, **k: pytest.fail("pruned"))
  out = tmp_path / "out"
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda", "--export-dtype",
                              "float16")) == 2
  err = _one_line(capsys.readouterr().err)
  assert ("--export-dtype float16 cannot hold 'model.layers.0.mlp.down_proj.weight': its "
          "weights reach 9.98e+04") in err and "choose bfloat16 or float32" in err
  assert not (out / "model.safetensors").exists()
  with pytest.raises(ValueError, match="dtype float16 cannot hold"):
    export.save_safetensors(tmp_path / "f16", cfg, params, dtype="float16")
  assert not (tmp_path / "f16" / "model.safetensors").exists()


def test_ctrl_c_while_writing_a_block_prints_one_line_and_leaves_no_tmp_file(
    tiny, tmp_path, monkeypatch, capsys):
  folder, text = tiny
  out = tmp_path / "out"
  savez = np.savez

  def interrupted(file, **arrays):
    savez(file, **arrays)  # the whole temporary file is there, not yet renamed
    if "block_1" in str(file):
      raise KeyboardInterrupt
  monkeypatch.setattr(prune_state.np, "savez", interrupted)
  assert cli.main(_prune_argv(folder, text, out, "--method", "wanda")) == 130
  err = _one_line(capsys.readouterr().err)
  assert err == (f"safe-optax-llm prune: interrupted; the finished blocks are saved in "
                 f"{out / pipeline.STATE_DIR}; rerun the same command to resume")
  assert not [p for p in out.rglob("*") if ".tmp" in p.name]
  assert sorted(p.name for p in (out / pipeline.STATE_DIR).iterdir()) == [
      "block_0.npz", "state.json", "stream_1.npz"]
