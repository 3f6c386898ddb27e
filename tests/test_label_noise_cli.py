"""benchmarks/claims/label_noise.py: which lambda each run uses, and no grid silently ignored."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "claims"))
import label_noise  # noqa: E402  pylint: disable=wrong-import-position

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_sweeps  # noqa: E402  (the fake runs of the selection tests)


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
