"""benchmarks/claims/label_noise.py: which lambda each run uses, and no grid silently ignored."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from benchmarks.claims import label_noise

import test_sweeps  # the fake runs of the selection tests


def _grids(*argv: str):
  parser = label_noise.build_parser()
  args = parser.parse_args(["--data-dir", "unused", *argv])
  return label_noise.penalty_grids(args, parser)


def test_without_validation_a_single_lambda_is_used_by_every_run():
  grids, fixed = _grids("--safe-grid", "3", "--admm-grid", "0.3")
  assert fixed["safe"] == {"penalty": 3.0}
  assert fixed["admm"] == {"admm_penalty": 0.3}
  assert fixed["safe-plus"] == {"penalty": 3.0}
  assert grids["admm"] == [0.3]


def test_without_validation_and_without_grids_the_preset_lambdas_stay():
  grids, fixed = _grids()
  assert fixed == {}
  assert grids["safe"] == label_noise.DEFAULT_GRIDS["safe"]
  assert grids["admm"] == label_noise.DEFAULT_GRIDS["admm"]


def test_a_grid_nothing_selects_from_is_refused(capsys):
  with pytest.raises(SystemExit):
    _grids("--safe-grid", "0.1", "1")
  assert "--safe-grid has 2 values" in capsys.readouterr().err


def test_with_validation_grids_are_selected_over_not_fixed():
  grids, fixed = _grids("--validation", "100", "--safe-grid", "0.1", "1")
  assert fixed == {}
  assert grids["safe"] == [0.1, 1.0]


def test_rescale_dual_reaches_the_safe_runs_only_and_renames_the_outputs(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch)
  label_noise.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.5",
                    "--seeds", "0", "--safe-grid", "1", "--admm-grid", "0.1", "--rescale-dual",
                    "--workdir", str(tmp_path / "w"), "--out", str(tmp_path)])
  assert {(c.method, c.rescale_dual) for c, _ in seen} == {("safe", True), ("admm", False)}
  assert (tmp_path / "label_noise_mlp-mnist_rescaled.json").exists()
  assert not (tmp_path / "label_noise_mlp-mnist.json").exists()


def test_rho_reaches_the_sam_runs_names_their_folders_and_the_outputs(monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch)
  label_noise.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.75",
                    "--seeds", "0", "--safe-grid", "3", "--admm-grid", "0.3", "--rho", "0.02",
                    "--workdir", str(tmp_path / "w"), "--out", str(tmp_path)])
  assert {(c.method, c.rho) for c, _ in seen} == {("safe", 0.02), ("admm", 0.1)}
  # ADMM takes no SAM step: its folder is the one a run at the default rho uses.
  assert sorted(name for _, name in seen) == ["noise0.75-admm-s0.9-lam0.3-seed0",
                                              "noise0.75-safe-s0.9-lam3-rho0.02-seed0"]
  assert (tmp_path / "label_noise_mlp-mnist_rho0.02.json").exists()


def test_rho_grid_needs_validation(capsys):
  with pytest.raises(SystemExit):
    label_noise.main(["--data-dir", "unused", "--rho-grid", "0.05", "0.1"])
  assert "--rho-grid selects on the validation split" in capsys.readouterr().err


@pytest.mark.parametrize("flag, flags", [
    ("--rho", ["--rho", "-0.1"]),
    ("--rho-grid", ["--validation", "10", "--rho-grid", "0.05", "-1"])])
def test_a_negative_rho_is_refused_naming_the_flag(flag, flags, capsys):
  with pytest.raises(SystemExit):
    label_noise.main(["--data-dir", "unused", *flags])
  assert f"{flag} must be SAM radii >= 0" in capsys.readouterr().err


def test_rho_grid_final_runs_use_the_chosen_pair(monkeypatch, tmp_path):
  # Validation peaks at rho 0.05 for SAFE (whatever lambda); ADMM is flat.
  seen = test_sweeps.install_fake_runs(
      monkeypatch, lambda c: 0.8 - (abs(c.rho - 0.05) if c.method == "safe" else 0.0))
  label_noise.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.75",
                    "--seeds", "0", "1", "--validation", "100", "--safe-grid", "1", "3",
                    "--admm-grid", "0.3", "--rho-grid", "0.02", "0.05", "0.1",
                    "--workdir", str(tmp_path / "w"), "--out", str(tmp_path)])
  finals = [c for c, _ in seen if c.validation is None]
  assert {(c.method, c.rho, c.penalty if c.method == "safe" else c.admm_penalty)
          for c in finals} == {("safe", 0.05, 1.0), ("admm", 0.1, 0.3)}
  text = (tmp_path / "label_noise_mlp-mnist_rhogrid.md").read_text()
  assert "safe@0.9 1 (rho 0.05)" in text and "Lambda and rho (from [0.02, 0.05, 0.1])" in text


def _validation_peak(config) -> float:
  """Validation peaks at lambda 10 for SAFE (above the first grid) and 0.3 for ADMM."""
  lam, peak = ((config.penalty, 10.0) if config.method == "safe" else (config.admm_penalty, 0.3))
  return 0.9 - abs(np.log10(lam) - np.log10(peak)) if config.validation else 0.8


def _noise_run(tmp_path, out, *flags):
  return label_noise.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.25", "0.5", "--seeds", "0",
      "--validation", "100", "--select-seeds", "2", "--admm-grid", "0.1", "0.3", "1",
      "--rescale-dual", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / out), *flags])


def test_reuse_selection_trains_only_the_edge_rules_value_per_noise_and_uses_the_new_pick(
    monkeypatch, tmp_path):
  seen = test_sweeps.install_fake_runs(monkeypatch, _validation_peak)
  assert _noise_run(tmp_path, "first", "--safe-grid", "1", "3") == 0
  first = json.loads((tmp_path / "first" / "label_noise_mlp-mnist_rescaled.json").read_text())
  assert {n: s["at_grid_edge"] for n, s in first["selection"].items()} == {
      "0.25": ["safe@0.9"], "0.5": ["safe@0.9"]}
  seen.clear()
  assert _noise_run(tmp_path, "second", "--safe-grid", "1", "3", "10", "--reuse-selection",
                    str(tmp_path / "first" / "label_noise_mlp-mnist_rescaled.json")) == 0
  selected = sorted((c.label_noise, c.penalty, c.seed, c.rescale_dual)
                    for c, _ in seen if c.validation)
  assert selected == [(n, 10.0, s, True) for n in (0.25, 0.5) for s in (0, 1)]
  finals = {(c.method, c.penalty if c.method == "safe" else c.admm_penalty)
            for c, _ in seen if not c.validation}
  assert finals == {("safe", 10.0), ("admm", 0.3)}
  second = json.loads((tmp_path / "second" / "label_noise_mlp-mnist_rescaled.json").read_text())
  for sel in second["selection"].values():
    assert sel["chosen"] == {"safe@0.9": 10.0, "admm@0.9": 0.3}
    assert [(g["method"], g["value"]) for g in sel["grid"]] == [
        ("admm", 0.1), ("admm", 0.3), ("admm", 1.0), ("safe", 1.0), ("safe", 3.0),
        ("safe", 10.0)]


@pytest.mark.parametrize("flags, message", [
    (["--noise", "0.75"], "it has no selection at noise 0.75"),
    (["--noise", "0.25", "--select-seeds", "3"], "selection seeds differ"),
    (["--noise", "0.25", "--epochs", "7"], "its config, validation split"),
    (["--noise", "0.25", "--rho-grid", "0.05"], "not --rho-grid"),
    (["--noise", "0.25", "--rho", "0.05"], "its runs used another SAM radius rho")])
def test_a_reused_selection_of_other_runs_is_refused_naming_the_flag(
    monkeypatch, tmp_path, capsys, flags, message):
  test_sweeps.install_fake_runs(monkeypatch, _validation_peak)
  assert _noise_run(tmp_path, "first", "--safe-grid", "1", "3") == 0
  earlier = str(tmp_path / "first" / "label_noise_mlp-mnist_rescaled.json")
  argv = ["--preset", "mlp-mnist", "--data-dir", "unused", "--seeds", "0", "--validation", "100",
          "--select-seeds", "2", "--safe-grid", "1", "3", "10", "--admm-grid", "0.1", "0.3", "1",
          "--rescale-dual", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "x"),
          "--reuse-selection", earlier]
  with pytest.raises(SystemExit):
    label_noise.main([*argv, *flags])
  err = capsys.readouterr().err
  assert "--reuse-selection" in err and message in err


def _rho_selection_first(monkeypatch, tmp_path) -> tuple[list, pathlib.Path]:
  """A 3-epoch run that chooses (lambda, rho) for SAFE and lambda for ADMM per noise ratio."""
  seen = test_sweeps.install_fake_runs(
      monkeypatch, lambda c: 0.8 - (abs(c.rho - 0.05) if c.method == "safe" else 0.0)
      - (abs(np.log10(c.penalty) - np.log10(3.0)) if c.method == "safe" else 0.0))
  assert label_noise.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.25", "0.5", "--seeds", "0",
      "1", "--epochs", "3", "--warmup-epochs", "1", "--validation", "100", "--safe-grid", "1", "3", "10",
      "--admm-grid", "0.1", "0.3", "1", "--rho-grid", "0.02", "0.05", "0.1", "--rescale-dual",
      "--workdir", str(tmp_path / "w3"), "--out", str(tmp_path / "out3")]) == 0
  return seen, tmp_path / "out3" / "label_noise_mlp-mnist_rescaled_rhogrid.json"


def test_chosen_from_runs_what_an_earlier_budget_chose_per_noise_ratio(monkeypatch, tmp_path):
  seen, earlier = _rho_selection_first(monkeypatch, tmp_path)
  seen.clear()
  assert label_noise.main([
      "--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.25", "0.5", "--seeds", "0",
      "1", "2", "--epochs", "6", "--warmup-epochs", "1", "--rescale-dual",
      "--chosen-from", str(earlier),
      "--workdir", str(tmp_path / "w6"), "--out", str(tmp_path / "out6")]) == 0
  # nothing is chosen again: every run is a test run at 6 epochs with the chosen values
  assert all(c.validation is None and c.epochs == 6 for c, _ in seen)
  assert sorted({(c.label_noise, c.method, c.penalty if c.method == "safe" else c.admm_penalty,
                  c.rho if c.method == "safe" else None, c.rescale_dual) for c, _ in seen}) == [
      (0.25, "admm", 0.1, None, False), (0.25, "safe", 3.0, 0.05, True),
      (0.5, "admm", 0.1, None, False), (0.5, "safe", 3.0, 0.05, True)]
  assert len(seen) == 2 * 2 * 3
  saved = json.loads((tmp_path / "out6" / "label_noise_mlp-mnist_rescaled.json").read_text())
  for sel in saved["selection"].values():
    assert (sel["epochs"], sel["file"]) == (3, str(earlier))
    assert sel["chosen"] == {"safe@0.9": 3.0, "admm@0.9": 0.1}
  assert saved["config"]["epochs"] == 6
  text = (tmp_path / "out6" / "label_noise_mlp-mnist_rescaled.md").read_text()
  assert f"(chosen at 3 epochs, `{earlier}`)" in text and "safe@0.9 3 (rho 0.05)" in text


@pytest.mark.parametrize("flags, message", [
    (["--noise", "0.75", "--rescale-dual"], "it has no selection at noise 0.75"),
    (["--noise", "0.25"], "its runs differ in --rescale-dual"),
    (["--noise", "0.25", "--rescale-dual", "--warmup-epochs", "2"],
     "differ from this run's beyond the epochs"),
    (["--noise", "0.25", "--rescale-dual", "--methods", "safe", "safe-plus"],
     "it chose nothing for ['safe-plus']"),
    (["--noise", "0.25", "--rescale-dual", "--validation", "100"], "drop --validation"),
    (["--noise", "0.25", "--rescale-dual", "--safe-grid", "3"], "the lambda grids"),
])
def test_chosen_from_refuses_a_selection_of_other_settings_naming_the_flag(
    monkeypatch, tmp_path, capsys, flags, message):
  seen, earlier = _rho_selection_first(monkeypatch, tmp_path)
  seen.clear()
  capsys.readouterr()
  with pytest.raises(SystemExit):
    label_noise.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--epochs", "6",
                      "--warmup-epochs", "1", "--chosen-from", str(earlier), *flags, "--workdir", str(tmp_path / "w6"),
                      "--out", str(tmp_path / "out6")])
  err = capsys.readouterr().err
  assert "--chosen-from" in err and message in err and seen == []


def test_chosen_from_refuses_a_fixed_rho_other_than_the_selections(monkeypatch, tmp_path, capsys):
  test_sweeps.install_fake_runs(monkeypatch, _validation_peak)
  assert _noise_run(tmp_path, "first", "--safe-grid", "1", "3") == 0
  earlier = tmp_path / "first" / "label_noise_mlp-mnist_rescaled.json"
  with pytest.raises(SystemExit):
    label_noise.main(["--preset", "mlp-mnist", "--data-dir", "unused", "--noise", "0.25",
                      "--rescale-dual", "--rho", "0.05", "--chosen-from", str(earlier),
                      "--workdir", str(tmp_path / "w6"), "--out", str(tmp_path / "x")])
  assert "its runs used another SAM radius rho" in capsys.readouterr().err
