"""benchmarks/claims/sparsity_sweep.py: selection reaches the final runs, CrAM's rho included."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from benchmarks.claims import sparsity_sweep

import test_sweeps  # the fake runs of the selection tests


def _score(config) -> float:
  """Validation peaks: SAFE at lambda 0.01, ADMM at 0.001, CrAM at rho 0.03; test is flat."""
  if config.validation is None:
    return 0.8 + 0.001 * config.seed
  if config.method == "cram":
    return 0.9 - abs(np.log10(config.rho) - np.log10(0.03))
  lam, peak = ((config.penalty, 0.01) if config.method == "safe"
               else (config.admm_penalty, 0.001))
  return 0.9 - abs(np.log10(lam) - np.log10(peak))


def test_chosen_lambdas_and_rho_reach_the_final_runs_and_the_tables(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch, _score)
  out = tmp_path / "out"
  assert sparsity_sweep.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "admm", "gmp",
      "cram", "--sparsities", "0.99", "--seeds", "0", "1", "--epochs", "4",
      "--warmup-epochs", "0", "--safe-grid", "0.001", "0.01", "0.1", "--admm-grid", "0.0001",
      "0.001", "0.01", "--cram-grid", "0.01", "0.03", "0.1", "--rescale-dual",
      "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
  by_method = {}
  for config, name in [(c, n) for c, n in seen if c.validation is None]:
    by_method.setdefault(config.method, []).append((config, name))
  assert {c.penalty for c, _ in by_method["safe"]} == {0.01}
  assert {c.rescale_dual for c, _ in by_method["safe"]} == {True}
  assert {c.admm_penalty for c, _ in by_method["admm"]} == {0.001}
  assert {c.rho for c, _ in by_method["cram"]} == {0.03}
  assert sorted(n for _, n in by_method["cram"]) == ["cram-s0.99-rho0.03-seed0",
                                                     "cram-s0.99-rho0.03-seed1"]
  # GMP has nothing to tune; its rho is not recorded (it takes no SAM step).
  assert len(by_method["gmp"]) == 2
  summary = json.loads((out / "sweep.json").read_text())
  assert summary["selection"]["chosen"] == {"safe@0.99": 0.01, "admm@0.99": 0.001,
                                            "cram@0.99": 0.03}
  assert summary["selection"]["at_grid_edge"] == []
  rows = {r["method"]: r for r in summary["convergence"]}
  assert rows["cram"]["rho"] == 0.03 and "rho" not in rows["gmp"]
  assert rows["safe"]["penalty"] == 0.01 and rows["safe"]["rho"] == 0.1
  table = (out / "table.md").read_text()
  assert "cram@0.99 rho 0.03" in table and "safe@0.99 0.01" in table
  assert "| cram | 99% | – | 0.03 |" in table


def test_rho_grid_picks_safes_pair_and_the_final_runs_use_it(monkeypatch, tmp_path):
  # SAFE's validation accuracy peaks at rho 0.05 whatever lambda; ADMM and GMP are flat.
  seen = test_sweeps.install_fake_runs(
      monkeypatch, lambda c: 0.8 - (abs(c.rho - 0.05) if c.method == "safe" else 0.0))
  out = tmp_path / "out"
  sparsity_sweep.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "admm", "gmp",
      "--sparsities", "0.9", "--seeds", "0", "--epochs", "4", "--warmup-epochs", "0",
      "--safe-grid", "0.01", "0.1", "--admm-grid", "0.01", "--rho-grid", "0.02", "0.05", "0.1",
      "--workdir", str(tmp_path / "work"), "--out", str(out)])
  finals = [n for c, n in seen if c.validation is None]
  assert sorted(finals) == ["admm-s0.9-lam0.01-seed0", "gmp-s0.9-seed0",
                                          "safe-s0.9-lam0.01-rho0.05-seed0"]
  assert "safe@0.9 0.01 (rho 0.05)" in (out / "table.md").read_text()
  summary = json.loads((out / "sweep.json").read_text())
  assert summary["selection"]["chosen_rho"] == {"safe@0.9": 0.05}


@pytest.mark.parametrize("flag", ["--cram-grid", "--rho-grid"])
def test_a_negative_rho_grid_is_refused_naming_the_flag(flag, capsys):
  with pytest.raises(SystemExit):
    sparsity_sweep.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe",
                         "--sparsities", "0.9", flag, "0.05", "-0.1", "--workdir", "w",
                         "--out", "o"])
  assert f"{flag} must be SAM radii >= 0" in capsys.readouterr().err


def test_train_and_test_subsets_reach_selection_and_final_runs(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(
      monkeypatch, lambda c: 0.8 - abs(np.log10(c.penalty or c.admm_penalty) + 2))
  out = tmp_path / "out"
  assert sparsity_sweep.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "admm",
      "--sparsities", "0.995", "--seeds", "0", "1", "--epochs", "4", "--warmup-epochs", "0",
      "--train-subset", "4000", "--test-subset", "2000", "--validation", "1000",
      "--safe-grid", "0.01", "0.1", "--admm-grid", "0.001", "0.01",
      "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
  selection = [c for c, _ in seen if c.validation is not None]
  finals = [c for c, _ in seen if c.validation is None]
  assert len(selection) == 4 and len(finals) == 4
  assert {(c.train_subset, c.test_subset) for c in selection + finals} == {(4000, 2000)}
  assert {c.validation for c in selection} == {1000}
  summary = json.loads((out / "sweep.json").read_text())
  assert summary["config"]["train_subset"] == 4000
  assert "on 4000 training examples, tested on 2000 test examples" in (out / "table.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--train-subset", "4000"], "`validation` (10000) must be smaller than `train_subset` (4000)"),
    (["--train-subset", "0"], "`train_subset` must be a positive int, got 0"),
    (["--test-subset", "-5"], "`test_subset` must be a positive int, got -5"),
])
def test_bad_subsets_are_refused_up_front_naming_the_setting(flags, message, capsys, tmp_path):
  with pytest.raises(SystemExit):
    sparsity_sweep.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe",
                         "--sparsities", "0.9", *flags,
                         "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
  assert message in capsys.readouterr().err
  assert not (tmp_path / "w").exists()


def test_imp_every_epochs_reaches_the_imp_runs(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch, lambda c: 0.5)
  assert sparsity_sweep.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "imp-sam",
      "--sparsities", "0.995", "--seeds", "0", "1", "--epochs", "20", "--warmup-epochs", "1",
      "--imp-every-epochs", "2", "--workdir", str(tmp_path / "w"),
      "--out", str(tmp_path / "o")]) == 0
  assert len(seen) == 2 and {c.imp_every_epochs for c, _ in seen} == {2}
  assert json.loads((tmp_path / "o" / "sweep.json").read_text())["config"][
      "imp_every_epochs"] == 2


def test_a_bad_imp_every_epochs_is_refused_naming_the_field(capsys, tmp_path):
  with pytest.raises(SystemExit):
    sparsity_sweep.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--methods",
                         "imp-sam", "--sparsities", "0.9", "--imp-every-epochs", "0",
                         "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
  assert "imp_every_epochs" in capsys.readouterr().err


def _select_only(tmp_path, name, *flags):
  return sparsity_sweep.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "admm",
      "--sparsities", "0.99", "--epochs", "4", "--warmup-epochs", "0", "--rescale-dual",
      "--select-only", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / name),
      *flags])


def test_reuse_selection_trains_only_the_edge_rules_new_values(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch, _score)
  # SAFE's validation peak (0.01) and ADMM's (0.001) sit at an end of these grids.
  assert _select_only(tmp_path, "first", "--safe-grid", "0.003", "0.01",
                      "--admm-grid", "0.001", "0.01") == 0
  first = json.loads((tmp_path / "first" / "sweep.json").read_text())
  assert first["runs"] == [] and all(c.validation is not None for c, _ in seen)
  assert first["selection"]["at_grid_edge"] == ["admm@0.99", "safe@0.99"]
  seen.clear()
  assert _select_only(tmp_path, "extended", "--safe-grid", "0.003", "0.01", "0.03",
                      "--admm-grid", "0.0001", "0.001", "0.01", "--reuse-selection",
                      str(tmp_path / "first" / "sweep.json")) == 0
  assert sorted((c.method, c.penalty if c.method == "safe" else c.admm_penalty)
                for c, _ in seen) == [("admm", 0.0001), ("safe", 0.03)]
  selection = json.loads((tmp_path / "extended" / "sweep.json").read_text())["selection"]
  assert selection["chosen"] == {"safe@0.99": 0.01, "admm@0.99": 0.001}
  assert selection["at_grid_edge"] == []
  assert [(g["method"], g["value"]) for g in selection["grid"]] == [
      ("admm", 0.0001), ("admm", 0.001), ("admm", 0.01), ("safe", 0.003), ("safe", 0.01),
      ("safe", 0.03)]


def test_a_selection_whose_rows_lack_value_and_field_is_refused_naming_them(monkeypatch, tmp_path,
                                                                          capsys):
  # Files older than safe_optax 0.1.0 named a grid row's value "penalty" only; the committed
  # ones were rewritten, and such a file is refused before anything trains.
  seen = test_sweeps.install_fake_runs(monkeypatch, _score)
  assert _select_only(tmp_path, "first", "--safe-grid", "0.003", "0.01",
                      "--admm-grid", "0.001", "0.01") == 0
  path = tmp_path / "first" / "sweep.json"
  old = json.loads(path.read_text())
  for row in old["selection"]["grid"]:
    row["penalty"] = row.pop("value")
    row.pop("field")
  path.write_text(json.dumps(old))
  seen.clear()
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    _select_only(tmp_path, "extended", "--safe-grid", "0.003", "0.01",
                 "--admm-grid", "0.0001", "0.001", "0.01", "--reuse-selection", str(path))
  assert exit_info.value.code == 2 and not seen
  assert "lack 'value' and 'field'" in capsys.readouterr().err


def test_reuse_selection_extends_crams_rho_grid_training_only_the_new_value(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch, _score)
  flags = ["--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "cram",
           "--sparsities", "0.99", "--epochs", "4", "--warmup-epochs", "0", "--select-only",
           "--safe-grid", "0.003", "0.01", "0.03", "--workdir", str(tmp_path / "work")]
  # CrAM's validation peak (0.03) sits at the upper end of the first grid.
  assert sparsity_sweep.main([*flags, "--cram-grid", "0.003", "0.01", "0.03",
                              "--out", str(tmp_path / "first")]) == 0
  first = json.loads((tmp_path / "first" / "sweep.json").read_text())["selection"]
  assert first["chosen"]["cram@0.99"] == 0.03 and first["at_grid_edge"] == ["cram@0.99"]
  seen.clear()
  assert sparsity_sweep.main([*flags, "--cram-grid", "0.003", "0.01", "0.03", "0.1",
                              "--reuse-selection", str(tmp_path / "first" / "sweep.json"),
                              "--out", str(tmp_path / "second")]) == 0
  assert [(c.method, c.rho) for c, _ in seen] == [("cram", 0.1)]
  second = json.loads((tmp_path / "second" / "sweep.json").read_text())["selection"]
  assert second["chosen"] == {"safe@0.99": 0.01, "cram@0.99": 0.03}
  assert second["at_grid_edge"] == []
  assert [(g["method"], g["value"]) for g in second["grid"]] == [
      ("cram", 0.003), ("cram", 0.01), ("cram", 0.03), ("cram", 0.1), ("safe", 0.003),
      ("safe", 0.01), ("safe", 0.03)]


def test_reuse_selection_refuses_a_rho_grid_naming_both_flags(capsys):
  with pytest.raises(SystemExit):
    sparsity_sweep.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe",
                         "--sparsities", "0.9", "--rho-grid", "0.05", "0.1",
                         "--reuse-selection", "earlier.json", "--workdir", "w", "--out", "o"])
  assert "--reuse-selection reuses the lambda and CrAM rho grids only, not --rho-grid" in (
      capsys.readouterr().err)


def test_reused_runs_of_another_config_are_refused_naming_the_flag(monkeypatch, tmp_path, capsys):
  test_sweeps.install_fake_runs(monkeypatch, _score)
  assert _select_only(tmp_path, "first", "--safe-grid", "0.003", "0.01",
                      "--admm-grid", "0.001", "0.01") == 0
  with pytest.raises(SystemExit):
    sparsity_sweep.main([
        "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "admm",
        "--sparsities", "0.99", "--epochs", "5", "--warmup-epochs", "0", "--rescale-dual",
        "--select-only", "--safe-grid", "0.003", "0.01", "0.03", "--admm-grid", "0.001", "0.01",
        "--reuse-selection", str(tmp_path / "first" / "sweep.json"),
        "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "second")])
  assert "its config, validation split or selection seeds differ" in capsys.readouterr().err


def test_the_merged_choice_is_the_best_undiverged_mean_the_smaller_on_a_tie():
  rows = [{"method": "safe", "sparsity": 0.9, "value": v, "validation_accuracy_mean": m,
           "diverged": d} for v, m, d in ((0.001, 0.8, False), (0.003, 0.8, False),
                                          (0.01, 0.7, False), (0.03, None, True))]
  merged = sparsity_sweep.selection_lib.merged_selection(rows, {"safe": [0.001, 0.003, 0.01, 0.03]}, 10, [0])
  assert merged["chosen"] == {"safe@0.9": 0.001} and merged["at_grid_edge"] == ["safe@0.9"]
  with pytest.raises(ValueError, match="every value of safe's grid diverged"):
    sparsity_sweep.selection_lib.merged_selection(rows[3:], {"safe": [0.03]}, 10, [0])


def test_an_extension_that_diverges_loses_and_the_pick_stays(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch, _score)
  assert _select_only(tmp_path, "first", "--safe-grid", "0.003", "0.01",
                      "--admm-grid", "0.0001", "0.001") == 0
  fake = sparsity_sweep.sweeps.run_or_load

  def diverge_at_one(config, workdir, **kwargs):
    if config.method == "admm" and config.admm_penalty == 0.01:
      raise sparsity_sweep.selection_lib.workdirs.TrainingDiverged(str(workdir), 7, None, None)
    return fake(config, workdir, **kwargs)

  monkeypatch.setattr(sparsity_sweep.sweeps, "run_or_load", diverge_at_one)
  seen.clear()
  assert _select_only(tmp_path, "extended", "--safe-grid", "0.003", "0.01",
                      "--admm-grid", "0.0001", "0.001", "0.01", "--reuse-selection",
                      str(tmp_path / "first" / "sweep.json")) == 0
  selection = json.loads((tmp_path / "extended" / "sweep.json").read_text())["selection"]
  assert selection["chosen"]["admm@0.99"] == 0.001 and selection["at_grid_edge"] == ["safe@0.99"]
  lost, = [g for g in selection["grid"] if g["method"] == "admm" and g["value"] == 0.01]
  assert lost["diverged"] and lost["runs"][0]["diverged"]["step"] == 7


def test_a_test_run_that_diverges_is_recorded_and_the_sweep_finishes(monkeypatch, tmp_path):
  test_sweeps.install_fake_runs(monkeypatch, _score)
  fake = sparsity_sweep.sweeps.run_or_load

  def diverge_seed1(config, workdir, **kwargs):
    if config.method == "admm" and config.seed == 1 and config.validation is None:
      raise sparsity_sweep.workdirs.TrainingDiverged(str(workdir), 938, 0.82, 1)
    return fake(config, workdir, **kwargs)

  monkeypatch.setattr(sparsity_sweep.sweeps, "run_or_load", diverge_seed1)
  out = tmp_path / "out"
  assert sparsity_sweep.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--methods", "safe", "admm",
      "--sparsities", "0.99", "--seeds", "0", "1", "2", "--epochs", "4", "--warmup-epochs", "0",
      "--safe-grid", "0.01", "--admm-grid", "0.1", "--workdir", str(tmp_path / "work"),
      "--out", str(out)]) == 0
  summary = json.loads((out / "sweep.json").read_text())
  admm = [r for r in summary["runs"] if r["method"] == "admm"]
  assert [r["accuracy"] is None for r in admm] == [False, True, False]
  lost = admm[1]
  assert lost["diverged"] == {"step": 938, "last_finite_loss": 0.82}
  assert (lost["penalty"], lost["seed"], lost["sparsity"]) == (0.1, 1, 0.99)
  row, = [r for r in summary["table"] if r["method"] == "admm"]
  assert row["diverged"] == 1 and row["seeds"] == [0, 1, 2]
  assert row["accuracy_mean"] == pytest.approx(0.801)  # the mean of the two finished seeds
  assert "| admm | 80.10 ± 0.10 (1 of 3 diverged) |" in (out / "table.md").read_text()
  # the evidence report reads the diverged seed as chance
  from benchmarks import report_sources  # pylint: disable=import-outside-toplevel
  arm = report_sources._sweep_arm(out, "ADMM", "admm", 0.99, "sweep.json", None)  # pylint: disable=protected-access
  assert arm.values[1] is None and arm.values[0] == pytest.approx(80.0)
