"""What safe-optax-llm prints besides its result: help, --version, log messages, progress bars.

* ``--help`` of the program and of each command: every option and positional
  has help text that states its default (or says it is required), and the
  descriptions are plain text, not reST.
* ``--version`` prints ``safe-optax-llm <version>``.
* Informational messages are ``logging`` records of the ``safe_optax.llm``
  loggers: ``--log-level WARNING`` silences them, and the CLI's own handler
  writes them to stderr as ``LEVEL logger: message``.
* Progress bars (model loading, perplexity windows, blocks, SAFE steps) go to
  stderr, and ``--no-progress`` leaves stderr empty and stdout pure JSON.
"""

import json
import logging
import re

import numpy as np
import pytest

import safe_optax
from safe_optax import experiment
from safe_optax.llm import block
from safe_optax.llm import cli
from safe_optax.llm import model as model_lib
from safe_optax.llm import prune as prune_lib

from cli_help import help_entries
from test_llm_cli import fixture_tiny  # noqa: F401  (the tiny checkpoint)


@pytest.fixture(autouse=True)
def _restore_log_level():
  """``cli.main`` sets the ``safe_optax`` logger's level; later tests get it back."""
  logger = logging.getLogger("safe_optax")
  level = logger.level
  yield
  logger.setLevel(level)


def _help(capsys, monkeypatch, argv):
  monkeypatch.setenv("COLUMNS", "100")
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv + ["--help"])
  assert exit_info.value.code == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["prune"], ["ppl"]])
def test_every_option_has_help_with_its_default(capsys, monkeypatch, command):
  text = _help(capsys, monkeypatch, command)
  usage, _, body = text.partition("\n\n")
  entries = help_entries(body)
  flags = {m for m in re.findall(r"--[a-z][a-z-]*", usage)} - {"--help"}
  by_flag = {}
  for invocation, help_text in entries.items():
    for flag in re.findall(r"--[a-z][a-z-]*", invocation.split(" ", 1)[0]):
      by_flag[flag] = help_text
  assert flags <= set(by_flag), flags - set(by_flag)
  for flag, help_text in by_flag.items():
    assert help_text, f"{flag} has no help text"
    if flag in ("--help", "--version"):
      continue
    assert "(default: " in help_text or "(required)" in help_text, (flag, help_text)
  if not command:
    # The positional command and each subcommand.
    assert "(required)" in entries["{prune,ppl}"]
    assert entries["prune"] and entries["ppl"]
  # Plain text: no reST markup from the module docstring.
  assert not re.search(r"``|:(func|mod|class|data|meth):`", text), text


@pytest.mark.parametrize("flag, default", [
    ("--epochs", "30"), ("--lr", "0.0002"), ("--rho", "0.0002"), ("--nsamples", "128"),
    ("--seqlen", "2048"), ("--penalty", "0.001"), ("--log-level", "INFO")])
def test_prune_help_shows_the_parser_defaults(capsys, monkeypatch, flag, default):
  entries = help_entries(_help(capsys, monkeypatch, ["prune"]))
  (help_text,) = [h for inv, h in entries.items() if inv.split(" ")[0] == flag]
  assert f"(default: {default})" in help_text


def test_version(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out == f"safe-optax-llm {safe_optax.__version__}\n"


def test_bad_log_level_names_the_flag_and_the_choices(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["ppl", "--model", "m", "--text", "t", "--log-level", "LOUD"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("safe-optax-llm ppl: error: argument --log-level")
  assert "'LOUD'" in err and "DEBUG" in err and "WARNING" in err


def _ppl_argv(folder, text, *extra):
  return ["ppl", "--model", str(folder), "--text", str(text), "--seqlen", "32",
          "--protocol", "short", "--max-tokens", "64", *extra]


def test_ppl_logs_and_bars_and_no_progress(tiny, capsys, caplog):
  folder, text = tiny
  caplog.set_level(logging.DEBUG, logger="safe_optax")
  assert cli.main(_ppl_argv(folder, text, "--no-progress")) == 0
  captured = capsys.readouterr()
  assert captured.err == ""  # no bar; the log records went to caplog, the harness's handler
  assert json.loads(captured.out)["windows"] == 2  # stdout is the JSON result alone
  messages = {(r.name, r.levelno): r.getMessage() for r in caplog.records}
  assert "loaded" in messages["safe_optax.llm.checkpoints", logging.INFO]
  assert "perplexity" in messages["safe_optax.llm.pipeline", logging.INFO]
  caplog.clear()
  assert cli.main(_ppl_argv(folder, text, "--log-level", "warning")) == 0
  captured = capsys.readouterr()
  assert "load tiny: 100%" in captured.err and "20/20" in captured.err
  assert "perplexity: 100%" in captured.err and "2/2" in captured.err
  assert json.loads(captured.out)["windows"] == 2
  assert not [r for r in caplog.records if r.name.startswith("safe_optax")]


def test_prune_logs_each_block_and_no_progress_silences_its_bars(tiny, tmp_path, capsys,
                                                                   caplog, monkeypatch):
  folder, text = tiny
  caplog.set_level(logging.DEBUG, logger="safe_optax")
  shown = []
  original = experiment.progress
  monkeypatch.setattr(experiment, "progress",
                      lambda *a, **k: shown.append(k["enabled"]) or original(*a, **k))
  argv = ["prune", "--model", str(folder), "--method", "wanda", "--calib", str(text),
          "--nsamples", "2", "--seqlen", "16", "--out", str(tmp_path / "out"), "--no-progress"]
  assert cli.main(argv) == 0
  captured = capsys.readouterr()
  assert captured.err == ""
  assert shown == [False, False]  # the model's tensors, the blocks
  assert json.loads(captured.out)["sparsity"]["prunable"] == 0.5
  blocks = [r.getMessage() for r in caplog.records if r.name == "safe_optax.llm.prune"]
  assert [m.split(" pruned")[0] for m in blocks] == ["block 1/2", "block 2/2"]
  # A rerun finds the export; the message is a log record, not a print.
  caplog.clear()
  assert cli.main(argv) == 0
  assert capsys.readouterr().err == ""
  assert any("already holds this export" in r.getMessage() for r in caplog.records)


def test_configure_logging_writes_records_to_stderr(monkeypatch, capsys):
  """Without a handler of the program's own (as under the console script), records from
  the level up go to stderr as ``LEVEL logger: message``; other libraries' INFO stays out."""
  root = logging.getLogger()
  monkeypatch.setattr(root, "handlers", [])
  experiment.configure_logging("INFO")
  logging.getLogger("safe_optax.llm.cli").info("loaded %d blocks", 2)
  logging.getLogger("some_library").info("not shown")
  logging.getLogger("safe_optax.llm.prune").debug("not shown either")
  assert capsys.readouterr().err == "INFO safe_optax.llm.cli: loaded 2 blocks\n"
  experiment.configure_logging("WARNING")
  logging.getLogger("safe_optax.llm.cli").info("silenced")
  logging.getLogger("safe_optax.llm.cli").warning("kept")
  assert capsys.readouterr().err == "WARNING safe_optax.llm.cli: kept\n"


@pytest.mark.slow  # compiles a SAFE step (about 15 s on 2 cores)
def test_safe_steps_bar_counts_the_steps_between_jitted_calls(capsys, monkeypatch):
  """The SAFE step bar runs under _run_steps' transfer guard (a bar update that moved data
  between host and device would raise) and ends at epochs x steps per epoch."""
  bars = []
  original = experiment.progress

  def recorded(*args, **kwargs):
    bars.append(original(*args, **kwargs))
    return bars[-1]

  monkeypatch.setattr(experiment, "progress", recorded)
  cfg = model_lib.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                              num_layers=1, num_heads=2, num_kv_heads=1)
  block_params = model_lib.init_params(cfg)["layers_0"]
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 4, 8)).astype(np.float32)
  y = rng.normal(size=(4, 4, 8)).astype(np.float32)
  pc = prune_lib.PruneConfig("safe", epochs=3, batch_size=2, warmup_epochs=1)
  _, info = block.safe_block(cfg, block_params, x, y, pc, progress=True)
  assert "safe steps" in capsys.readouterr().err
  assert [(bar.n, bar.total) for bar in bars] == [(6, 6)] and info["steps"] == 6
  block.safe_block(cfg, block_params, x, y, pc, progress=False)
  assert capsys.readouterr().err == ""
