"""benchmarks/claims/robustness_mnist.py: lambda chosen on validation reaches the evaluated runs."""

from __future__ import annotations

import json
import pathlib
import sys
import types

import numpy as np
import pytest

from benchmarks.claims import robustness_mnist

import test_sweeps  # the fake runs of the selection tests


def _peak(config) -> float:
  """Validation peaks at lambda 1 for SAFE and 0.01 for ADMM."""
  lam, peak = ((config.penalty, 1.0) if config.method == "safe" else (config.admm_penalty, 0.01))
  return 0.9 - abs(np.log10(lam) - np.log10(peak))


def _install(monkeypatch):
  selected = test_sweeps.install_fake_runs(monkeypatch, _peak)
  trained = []

  def fake_train(config, run_dir, **kwargs):
    del kwargs
    trained.append((config, pathlib.Path(run_dir).name))
    distance = None if config.method == "dense" else 0.25 * (config.seed + 1)
    return types.SimpleNamespace(results={
        "history": [{"train_loss": 0.1, "distance_to_z": distance}], "final": {}})

  def fake_eval(run_dir, **kwargs):
    del kwargs
    config, _ = next(t for t in trained if t[1] == pathlib.Path(run_dir).name)
    return {"config": robustness_mnist.configs.to_dict(config),  # as evaluate_workdir's
            "clean": 0.9, "corruptions": {"mean": {"3": 0.8, "5": 0.7}},
            "pgd-linf": {"adversarial": 0.5}, "pgd-l2": {"adversarial": 0.6},
            "hessian": {"lambda_max_support": 1.0}}

  monkeypatch.setattr(robustness_mnist.train, "train_and_evaluate", fake_train)
  monkeypatch.setattr(robustness_mnist.evaluation, "evaluate_workdir", fake_eval)
  return selected, trained


def _select_first(monkeypatch, tmp_path):
  """A 3-epoch run that chooses on validation; what the longer run reads with --chosen-from."""
  selected, trained = _install(monkeypatch)
  assert robustness_mnist.main([
      "--data-dir", "unused", "--seeds", "0", "1", "--epochs", "3", "--validation", "100",
      "--safe-grid", "0.1", "1", "10", "--admm-grid", "0.001", "0.01", "0.1", "--rescale-dual",
      "--workdir", str(tmp_path / "w3"), "--out", str(tmp_path / "out3")]) == 0
  return selected, trained, tmp_path / "out3" / "robustness_mlp-mnist.json"


def test_lambdas_chosen_on_validation_reach_the_evaluated_runs(monkeypatch, tmp_path):
  selected, trained, out = _select_first(monkeypatch, tmp_path)
  assert all(c.validation == 100 for c, _ in selected) and len(selected) == 6
  assert sorted((c.method, c.penalty if c.method == "safe" else c.admm_penalty, c.seed,
                 c.rescale_dual) for c, _ in trained) == [
      ("admm", 0.01, 0, False), ("admm", 0.01, 1, False),
      ("safe", 1.0, 0, True), ("safe", 1.0, 1, True)]
  # each lambda its own folder, so a run of another lambda is never read back as this one
  assert {n for _, n in trained} == {"admm-s0.9-lam0.01-seed0", "admm-s0.9-lam0.01-seed1",
                                     "safe-s0.9-lam1-rescaled-seed0",
                                     "safe-s0.9-lam1-rescaled-seed1"}
  saved = json.loads(out.read_text())
  assert saved["selection"]["chosen"] == {"safe@0.9": 1.0, "admm@0.9": 0.01}
  assert saved["selection"]["at_grid_edge"] == []


@pytest.mark.parametrize("flags, message", [
    (["--safe-grid", "0.1", "1"], "pass --validation N"),
    (["--validation", "100", "--safe-grid", "0.1", "1"], "give --admm-grid"),
    (["--validation", "100"], "give --safe-grid and --admm-grid")])
def test_grids_and_validation_go_together_naming_the_flags(flags, message, capsys):
  with pytest.raises(SystemExit):
    robustness_mnist.main(["--data-dir", "unused", *flags])
  assert message in capsys.readouterr().err


def test_a_longer_run_takes_the_lambdas_an_earlier_budget_chose(monkeypatch, tmp_path):
  selected, trained, earlier = _select_first(monkeypatch, tmp_path)
  chosen_runs = len(selected)
  trained.clear()
  assert robustness_mnist.main([
      "--data-dir", "unused", "--seeds", "0", "1", "--epochs", "6", "--chosen-from",
      str(earlier), "--rescale-dual", "--workdir", str(tmp_path / "w6"),
      "--out", str(tmp_path / "out6")]) == 0
  assert len(selected) == chosen_runs  # nothing chosen again
  assert sorted((c.method, c.penalty if c.method == "safe" else c.admm_penalty, c.epochs)
                for c, _ in trained) == [("admm", 0.01, 6)] * 2 + [("safe", 1.0, 6)] * 2
  saved = json.loads((tmp_path / "out6" / "robustness_mlp-mnist.json").read_text())
  assert saved["selection"]["chosen"] == {"safe@0.9": 1.0, "admm@0.9": 0.01}
  assert (saved["selection"]["epochs"], saved["selection"]["file"]) == (3, str(earlier))
  assert saved["config"]["epochs"] == 6
  # each run's ||x - z|| at the end, for the report's convergence rule
  assert [e["constraint_distance"] for e in saved["evals"]["safe"]] == [0.25, 0.5]


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "6"], "its runs differ in --rescale-dual"),
    (["--rescale-dual", "--sparsity", "0.8"], "it chose at sparsity 0.9, not 0.8"),
    (["--rescale-dual", "--test-only-split", "100", "50"], "differ from this run's beyond the epochs"),
    (["--rescale-dual", "--warmup-epochs", "2"], "differ from this run's beyond the epochs"),
    (["--rescale-dual", "--methods", "safe", "safe-plus"], "it chose nothing for ['safe-plus']"),
    (["--validation", "100", "--safe-grid", "1", "--admm-grid", "1"], "drop --validation"),
])
def test_chosen_from_refuses_a_selection_made_for_other_settings(monkeypatch, tmp_path, capsys,
                                                                 flags, message):
  _, trained, earlier = _select_first(monkeypatch, tmp_path)
  trained.clear()
  capsys.readouterr()
  with pytest.raises(SystemExit):
    robustness_mnist.main(["--data-dir", "unused", "--chosen-from", str(earlier), *flags,
                           "--workdir", str(tmp_path / "w6"), "--out", str(tmp_path / "out6")])
  assert message in capsys.readouterr().err and trained == []


def test_a_run_that_diverges_is_recorded_and_the_table_counts_it(monkeypatch, tmp_path):
  _, trained = _install(monkeypatch)
  fake = robustness_mnist.train.train_and_evaluate

  def diverge_admm_seed1(config, run_dir, **kwargs):
    if config.method == "admm" and config.seed == 1:
      trained.append((config, pathlib.Path(run_dir).name))
      raise robustness_mnist.workdirs.TrainingDiverged(str(run_dir), 938, 0.82, 1)
    return fake(config, run_dir, **kwargs)

  monkeypatch.setattr(robustness_mnist.train, "train_and_evaluate", diverge_admm_seed1)
  assert robustness_mnist.main([
      "--data-dir", "unused", "--seeds", "0", "1", "2", "--epochs", "3",
      "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out")]) == 0
  saved = json.loads((tmp_path / "out" / "robustness_mlp-mnist.json").read_text())
  lost = saved["evals"]["admm"][1]
  assert lost["diverged"] == {"step": 938, "last_finite_loss": 0.82}
  assert lost["config"]["seed"] == 1 and "clean" not in lost
  table = (tmp_path / "out" / "robustness_mlp-mnist.md").read_text()
  assert "| admm | 90.00 ± 0.00 (1 of 3 diverged) |" in table
  from benchmarks import report_sources  # pylint: disable=import-outside-toplevel
  arm = report_sources._robustness_arm(tmp_path / "out", "robustness_mlp-mnist.json", "admm",  # pylint: disable=protected-access
                                       "clean")
  assert arm.values == {0: pytest.approx(90.0), 1: None, 2: pytest.approx(90.0)}
