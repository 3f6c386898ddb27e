"""Tests of the ``safe-optax-vision`` command line: errors, the sweep table, a 2-epoch smoke run."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from importlib import metadata

import numpy as np
import pytest

import safe_optax
from safe_optax.vision import cli
from safe_optax.vision import sweeps

from cli_help import help_entries
from data_required import require_data


def _run(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  return exit_info.value.code, capsys.readouterr().err


def test_entry_point_is_registered():
  scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
  assert scripts.get("safe-optax-vision") == "safe_optax._entry:vision"  # checks the extra


def test_missing_data_dir_is_a_clear_error(tmp_path, capsys):
  code, err = _run(["train", "--preset", "mlp-mnist", "--data-dir", str(tmp_path / "nope"),
                    "--workdir", str(tmp_path / "out")], capsys)
  assert code == 2 and "nope" in err and "does not exist" in err


@pytest.mark.parametrize("preset, expected", [
    ("mlp-mnist", "t10k-images-idx3-ubyte"),
    ("resnet20x2-cifar10", "data_batch_1"),
])
def test_malformed_data_dir_names_the_expected_files(tmp_path, capsys, preset, expected):
  (tmp_path / "readme.txt").write_text("not a data set")
  code, err = _run(["train", "--preset", preset, "--data-dir", str(tmp_path),
                    "--workdir", str(tmp_path / "out")], capsys)
  assert code == 2 and expected in err and str(tmp_path) in err


def test_bad_override_is_a_usage_error(tmp_path, capsys):
  code, err = _run(["train", "--preset", "mlp-mnist", "--epochs", "2", "--warmup-epochs", "2",
                    "--data-dir", str(tmp_path), "--workdir", str(tmp_path)], capsys)
  assert code == 2 and "warmup_epochs" in err
  code, err = _run(["train", "--preset", "mlp-mnist", "--method", "sgd", "--data-dir",
                    str(tmp_path), "--workdir", str(tmp_path)], capsys)
  assert code == 2 and "invalid choice" in err


@pytest.mark.parametrize("flag", ["--test-subset", "--corruption-subset"])
def test_eval_subsets_must_be_positive(tmp_path, capsys, flag):
  code, err = _run(["eval", "--workdir", str(tmp_path), "--data-dir", str(tmp_path),
                    flag, "0"], capsys)
  assert code == 2 and flag in err and "positive" in err


def test_eval_passes_the_subsets_through(tmp_path, monkeypatch):
  from safe_optax.vision import evaluation
  seen = {}

  def fake_evaluate_workdir(workdir, **kwargs):
    seen.update(kwargs, workdir=workdir)
    return {"workdir": str(workdir), "sparsity": 0.9, "clean": 0.5,
            "config": {"method": "safe", "sparsity": 0.9, "seed": 0}}

  monkeypatch.setattr(evaluation, "evaluate_workdir", fake_evaluate_workdir)
  assert cli.main(["eval", "--workdir", str(tmp_path), "--data-dir", str(tmp_path),
                   "--suite", "clean,pgd-linf", "--test-subset", "300",
                   "--corruption-subset", "200", "--no-progress"]) == 0
  assert seen["test_subset"] == 300 and seen["corruption_subset"] == 200
  assert seen["suite"] == ("clean", "pgd-linf") and seen["progress"] is False


def test_sweep_table_is_mean_and_standard_error():
  rng = np.random.default_rng(0)
  runs = []
  for method in ("dense", "safe", "admm"):
    for s in ((0.0,) if method == "dense" else (0.9, 0.95)):
      for seed in range(3):
        runs.append({"method": method, "sparsity": s, "seed": seed,
                     "accuracy": float(rng.uniform(0.8, 0.95))})
  table = sweeps.summarize(runs, [0.9, 0.95])
  lines = table["markdown"].splitlines()
  assert lines[0] == "| method | 90% | 95% |"
  assert len(table["rows"]) == 1 + 2 + 2
  for row in table["rows"]:
    values = np.array([100 * r["accuracy"] for r in runs if r["method"] == row["method"]
                       and (row["method"] == "dense" or r["sparsity"] == row["sparsity"])])
    mean, se = values.mean(), values.std(ddof=1) / math.sqrt(len(values))
    assert row["accuracy_mean"] == pytest.approx(mean / 100)
    assert row["accuracy_se"] == pytest.approx(se / 100)
    assert row["seeds"] == [0, 1, 2]
    line = next(l for l in lines if l.startswith(f"| {row['method']} |"))
    assert f"{mean:.2f} ± {se:.2f}" in line
  assert lines[2].count("±") == 2  # dense repeats its accuracy in every column


def test_two_epoch_smoke_run_has_exact_sparsity_and_beats_chance(tmp_path, capsys):
  workdir = tmp_path / "run"
  mnist = str(require_data("mnist"))
  code = cli.main(["train", "--preset", "mlp-mnist", "--method", "safe", "--sparsity", "0.9",
                   "--data-dir", mnist, "--test-only-split", "8000", "2000",
                   "--train-subset", "2048", "--epochs", "2", "--warmup-epochs", "1",
                   "--workdir", str(workdir), "--no-progress"])
  assert code == 0
  printed = json.loads(capsys.readouterr().out)
  with open(workdir / "results.json", encoding="utf-8") as f:
    results = json.load(f)
  report = results["sparsity_report"]
  assert report["prunable_size"] == 266_200  # 784*300 + 300*100 + 100*10
  assert report["prunable_nonzero"] == safe_optax.num_keep(266_200, 0.9)
  assert sum(l["nonzero"] for l in report["leaves"] if l["prunable"]) == report[
      "prunable_nonzero"]
  assert all(l["nonzero"] == l["size"] for l in report["leaves"] if not l["prunable"])
  assert printed["sparse_accuracy"] == results["final"]["sparse_accuracy"] > 0.5  # chance 0.1
  assert results["data"] == {"num_train": 2048, "num_test": 2000, "num_classes": 10,
                             "evaluated_on": "test", "steps_per_epoch": 16}
  assert [r["train_examples"] for r in results["history"]] == [2048, 2048]
  assert (workdir / "accuracy.png").exists() and (workdir / "distance.png").exists()


def test_eval_of_an_empty_workdir_is_a_clear_error(tmp_path, capsys):
  code, err = _run(["eval", "--workdir", str(tmp_path), "--data-dir", str(tmp_path),
                    "--suite", "clean"], capsys)
  assert code == 2 and "results.json' not found: train the run first" in err
  assert "Traceback" not in err


def test_eval_help_says_the_subsets_are_seeded_samples(capsys):
  """The subsets are seeded samples (never the first N images, one class in a sorted folder)."""
  with pytest.raises(SystemExit):
    cli.main(["eval", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "first N" not in text
  assert text.count("seeded sample of N") == 2


# ----------------------------------------------------------------------------- errors before data


@pytest.fixture
def no_data_loading(monkeypatch):
  """Loading data fails the test: the errors below must come before it."""
  from safe_optax.vision import datasets  # pylint: disable=import-outside-toplevel

  def refuse(*args, **kwargs):
    raise AssertionError("the data set was loaded before the arguments were checked")

  monkeypatch.setattr(datasets, "load_dataset", refuse)


def _one_line_error(argv, capsys) -> str:
  code, err = _run(argv, capsys)
  assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_workdir_that_cannot_be_created_is_named_before_data_loads(tmp_path, capsys, command,
                                                                     no_data_loading):
  (tmp_path / "file").write_text("not a folder")
  grid = ["--methods", "safe", "--sparsities", "0.9"] if command == "sweep" else []
  for workdir, cause in ((tmp_path / "file" / "run", "is a file, not a folder"),
                         (tmp_path / "file", "is a file, not a folder")):
    err = _one_line_error([command, "--preset", "mlp-mnist", *grid, "--data-dir",
                           str(tmp_path), "--workdir", str(workdir)], capsys)
    assert "--workdir" in err and cause in err and "choose another workdir" in err


def test_a_truncated_config_json_in_a_workdir_names_the_file_and_restart(tmp_path, capsys,
                                                                         no_data_loading):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text('{"model": "mlp", "epo')
  err = _one_line_error(["train", "--preset", "mlp-mnist", "--data-dir", str(tmp_path),
                         "--workdir", str(workdir)], capsys)
  assert str(workdir / "config.json") in err and "--restart" in err


def test_a_config_file_with_a_syntax_error_is_one_line_naming_it(tmp_path, capsys,
                                                                  no_data_loading):
  (tmp_path / "mine.py").write_text("def get_config(:\n  return None\n")
  err = _one_line_error(["train", "--config", str(tmp_path / "mine.py"), "--data-dir",
                         str(tmp_path), "--workdir", str(tmp_path / "out")], capsys)
  assert "--config" in err and str(tmp_path / "mine.py") in err and "line 1" in err
  (tmp_path / "raises.py").write_text("def get_config():\n  return 1 / 0\n")
  err = _one_line_error(["train", "--config", str(tmp_path / "raises.py"), "--data-dir",
                         str(tmp_path), "--workdir", str(tmp_path / "out")], capsys)
  assert "raises.py" in err and "ZeroDivisionError" in err


def test_truncated_results_json_is_one_line_in_eval_and_sweeps(tmp_path, capsys):
  (tmp_path / "results.json").write_text('{"config": {"mod')
  err = _one_line_error(["eval", "--workdir", str(tmp_path), "--data-dir", str(tmp_path),
                         "--suite", "clean"],
                        capsys)
  assert str(tmp_path / "results.json") in err and "--restart" in err
  from safe_optax.vision import configs  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="results.json' cannot be read .*; delete"):
    sweeps.run_or_load(configs.get_config("mlp-mnist"), tmp_path, data=None, data_dir=tmp_path)


def test_usage_errors_are_one_line_pointing_at_help(tmp_path, capsys, no_data_loading):
  for argv, flag in ((["train", "--preset", "nope"], "--preset"),
                     (["train", "--preset", "mlp-mnist", "--epochs", "x"], "--epochs"),
                     (["sweep", "--preset", "mlp-mnist", "--methods", "safe", "--sparsities",
                       "1.5"], "--sparsities")):
    err = _one_line_error([*argv, "--data-dir", str(tmp_path), "--workdir", str(tmp_path / "o")],
                          capsys)
    assert flag in err and f"(see safe-optax-vision {argv[0]} --help)" in err, err


def test_conv_impl_reaches_the_config_and_a_bad_one_names_the_choices(tmp_path, capsys):
  args = cli.build_parser().parse_args(["train", "--preset", "resnet20x2-cifar10", "--data-dir",
                                        str(tmp_path), "--workdir", str(tmp_path),
                                        "--conv-impl", "im2col"])
  assert cli._overrides(args)["conv_impl"] == "im2col"  # pylint: disable=protected-access
  code, err = _run(["train", "--preset", "resnet20x2-cifar10", "--conv-impl", "winograd",
                    "--data-dir", str(tmp_path), "--workdir", str(tmp_path)], capsys)
  assert code == 2 and "--conv-impl" in err and "'xla', 'im2col'" in err


# ----------------------------------------------------------------------------- help, version, logs



def _help(argv, capsys) -> str:
  with pytest.raises(SystemExit) as info:
    cli.main([*argv, "--help"])
  assert info.value.code == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "sweep", "eval"])
def test_every_flag_has_help_with_its_default(capsys, command):
  text = _help([command], capsys)
  entries = {k: v for k, v in help_entries(text).items() if k.startswith("-")}
  assert len(entries) >= {"train": 35, "sweep": 35, "eval": 9}[command], sorted(entries)
  for invocation, help_text in entries.items():
    if invocation.startswith("-h"):
      continue
    assert help_text, f"{command} {invocation} has no help text"
    assert "(default: " in help_text or "(required" in help_text, (
        f"{command} {invocation} shows no default: {help_text!r}")
  assert "all three, or none: then the SAFE_OPTAX_COORDINATOR" in " ".join(text.split())
  assert entries["--log-level {DEBUG,INFO,WARNING,ERROR}"].endswith("(default: INFO)")
  progress = {i.split()[0] for i in entries if "progress" in i}
  assert progress == {"--no-progress"}  # one spelling across the CLIs
  if command == "train":
    assert "--structure {global,per_leaf,erk,N:M}" in entries
    assert entries["--epochs EPOCHS"] == "training epochs (default: from --preset or --config)"
  if command == "eval":
    assert entries["--seed SEED"].endswith("(default: 0)")
    assert entries["--corruption-subset CORRUPTION_SUBSET"].endswith("(default: 1000)")


def test_top_level_help_names_the_commands_and_version(capsys):
  entries = help_entries(_help([], capsys))
  assert entries["COMMAND"].startswith("train, sweep or eval")
  for command in ("train", "sweep", "eval"):
    assert entries[command], command  # each subcommand has a one-line description
  assert "--version" in entries


def test_version(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["--version"])
  assert info.value.code == 0
  assert capsys.readouterr().out == f"safe-optax-vision {safe_optax.__version__}\n"


@pytest.mark.parametrize("level, logged", [("INFO", True), ("warning", False)])
def test_informational_messages_are_log_records_on_safe_optax_loggers(tmp_path, capsys, caplog,
                                                                      level, logged):
  caplog.set_level(logging.DEBUG, logger="safe_optax")  # main sets it to --log-level
  data = tmp_path / "empty"
  data.mkdir()
  code, err = _run(["train", "--preset", "mlp-mnist", "--data-dir", str(data), "--workdir",
                    str(tmp_path / "run"), "--log-level", level], capsys)
  assert code == 2 and "t10k-images-idx3-ubyte" in err  # the data load was reached and failed
  records = [r for r in caplog.records if r.name.startswith("safe_optax")]
  if logged:
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("safe_optax.vision.cli", logging.INFO, f"loading mnist from {data}")]
  else:
    assert not records


def test_bad_log_level_names_the_argument_and_choices(tmp_path, capsys):
  code, err = _run(["train", "--preset", "mlp-mnist", "--data-dir", str(tmp_path), "--workdir",
                    str(tmp_path), "--log-level", "loud"], capsys)
  assert code == 2 and err.count("\n") == 1
  assert "argument --log-level" in err and "'DEBUG', 'INFO', 'WARNING', 'ERROR'" in err


def test_eval_without_imagecorruptions_names_the_extra_before_loading(tmp_path, capsys,
                                                                      monkeypatch):
  from safe_optax.vision import corruption_functions, evaluation  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(sys.modules, "imagecorruptions", None)
  monkeypatch.setattr(evaluation, "evaluate_workdir", lambda *a, **k: pytest.fail("evaluated"))
  assert not corruption_functions.available()
  code, err = _run(["eval", "--workdir", str(tmp_path), "--data-dir", str(tmp_path)], capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert "argument --suite" in err and 'pip install "safe-optax[corruptions]"' in err
  assert "leave corruptions out of --suite" in err


@pytest.mark.slow
def test_log_messages_reach_stderr_of_the_command_and_log_level_silences_them(tmp_path):
  """The command's own logging set-up (no test harness handler): records on stderr, not stdout."""
  import subprocess  # pylint: disable=import-outside-toplevel
  data = tmp_path / "empty"
  data.mkdir()
  argv = [sys.executable, "-m", "safe_optax.vision.cli", "train", "--preset", "mlp-mnist",
          "--data-dir", str(data), "--workdir", str(tmp_path / "run")]
  shown = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
  assert shown.returncode == 2 and shown.stdout == ""
  assert shown.stderr.splitlines()[0] == f"INFO safe_optax.vision.cli: loading mnist from {data}"
  quiet = subprocess.run([*argv, "--log-level", "WARNING"], capture_output=True, text=True,
                         check=False, timeout=120)
  assert quiet.returncode == 2 and quiet.stderr.count("\n") == 1
  assert quiet.stderr.startswith("safe-optax-vision train: error: cannot load mnist")
