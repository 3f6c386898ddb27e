"""benchmarks/claims/gmp_selection.py: its choice rule and the refusals made before any run."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.claims import gmp_selection

SWEEP = ROOT / "results" / "sparse_set_995_small" / "sweep_60epochs.json"


def test_a_sparsity_the_test_sweep_lacks_is_refused_naming_the_flag(tmp_path, capsys):
  with pytest.raises(SystemExit):
    gmp_selection.main(["--sweep", str(SWEEP), "--end-grid", "0.5", "0.75", "--sparsities", "0.9",
                        "--data-dir", "unused", "--workdir", str(tmp_path), "--out",
                        str(tmp_path / "out.json")])
  assert "--sparsities [0.9] are not among the test sweep's [0.995]" in capsys.readouterr().err


def test_selections_of_several_sparsities_merge_with_their_edges():
  a = {"validation_examples": 10, "seeds": [0], "grid": [{"sparsity": 0.99, "value": 0.5}],
       "chosen": {"gmp@0.99": 0.5}, "at_grid_edge": ["gmp@0.99"]}
  b = {**a, "grid": [{"sparsity": 0.995, "value": 0.75}], "chosen": {"gmp@0.995": 0.75},
       "at_grid_edge": []}
  merged = gmp_selection.merge([a, b], epochs=40)
  assert merged["chosen"] == {"gmp@0.99": 0.5, "gmp@0.995": 0.75}
  assert merged["at_grid_edge"] == ["gmp@0.99"] and len(merged["grid"]) == 2
  assert merged["epochs"] == 40 and merged["validation_examples"] == 10


def test_select_only_selects_every_sparsity_and_makes_no_test_run(tmp_path, monkeypatch):
  scored = []

  def fake_select(base, grid, seeds, validation, root, data_dir):
    scored.append(base.sparsity)
    return {"validation_examples": validation, "seeds": seeds, "grid": [], "at_grid_edge": [],
            "chosen": {f"gmp@{base.sparsity:g}": grid[0]}}

  def no_test_run(*args, **kwargs):
    raise AssertionError("--select-only made a test run")

  monkeypatch.setattr(gmp_selection, "select_end", fake_select)
  monkeypatch.setattr(gmp_selection.sweeps, "run_or_load", no_test_run)
  out = tmp_path / "out.json"
  mlp = ROOT / "results" / "sparsity_mlp_fmnist" / "sweep_40epochs.json"
  assert gmp_selection.main(["--sweep", str(mlp), "--end-grid", "0.5", "0.75", "--select-only",
                             "--sparsities", "0.9", "0.95", "0.98", "0.99", "0.995",
                             "--data-dir", "unused", "--workdir", str(tmp_path), "--out",
                             str(out)]) == 0
  record = json.loads(out.read_text(encoding="utf-8"))
  assert scored == [0.9, 0.95, 0.98, 0.99, 0.995] and record["runs"] == []
  assert record["selection"]["chosen"]["gmp@0.995"] == 0.5 and record["selection"]["epochs"] == 40


ERK = ROOT / "results" / "erk_cram"


def _erk(tmp_path, *flags):
  return gmp_selection.main(["--sweep", str(ERK / "sweep_40epochs.json"), "--data-dir", "unused",
                             "--workdir", str(tmp_path), "--out", str(tmp_path / "out.json"),
                             *flags])


def test_chosen_from_runs_the_earlier_ends_at_the_test_budget_without_selecting(tmp_path,
                                                                                monkeypatch):
  import test_sweeps  # pylint: disable=import-outside-toplevel

  def no_selection(*args, **kwargs):
    raise AssertionError("--chosen-from selected again")

  monkeypatch.setattr(gmp_selection, "select_end", no_selection)
  seen = test_sweeps.install_fake_runs(monkeypatch)
  earlier = ERK / "gmp_selection_40epochs.json"
  assert _erk(tmp_path, "--test-sweep", str(ERK / "sweep_20epochs_chosen40_s995.json"),
              "--chosen-from", str(earlier)) == 0
  # the 40-epoch pick at 99.5 % (0.25), its three test seeds at the test sweep's 20 epochs
  assert sorted((c.sparsity, c.gmp_end_fraction, c.epochs, c.seed) for c, _ in seen) == [
      (0.995, 0.25, 20, s) for s in (0, 1, 2)]
  record = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
  sel = record["selection"]
  assert sel["chosen"] == {"gmp@0.995": 0.25} and sel["epochs"] == 40
  assert sel["file"] == str(earlier) and {g["sparsity"] for g in sel["grid"]} == {0.995}
  assert record["config"]["epochs"] == 20


@pytest.mark.parametrize("flags, message", [
    ([], "give --end-grid (select on the validation split) or --chosen-from"),
    (["--end-grid", "0.5", "--chosen-from", "x.json"], "one of them"),
    (["--chosen-from", str(ROOT / "results" / "sparse_set_995_small" / "gmp_selection_60epochs.json")],
     "it chose at another budget, validation split or selection seeds"),
    (["--chosen-from", str(ERK / "gmp_selection_40epochs.json"), "--select-only"],
     "drop --select-only"),
])
def test_chosen_from_refuses_a_selection_of_other_runs_naming_the_flag(tmp_path, capsys, flags,
                                                                      message):
  with pytest.raises(SystemExit):
    _erk(tmp_path, *flags)
  assert message in capsys.readouterr().err


def test_chosen_from_refuses_a_selection_lacking_a_sparsity(tmp_path, capsys):
  earlier = json.loads((ERK / "gmp_selection_40epochs.json").read_text(encoding="utf-8"))
  del earlier["selection"]["chosen"]["gmp@0.995"]
  (tmp_path / "earlier.json").write_text(json.dumps(earlier), encoding="utf-8")
  with pytest.raises(SystemExit):
    _erk(tmp_path, "--chosen-from", str(tmp_path / "earlier.json"))
  assert "it chose nothing at sparsities [0.995]" in capsys.readouterr().err


def test_chosen_from_refuses_a_selection_made_for_other_settings(tmp_path, capsys):
  earlier = json.loads((ERK / "gmp_selection_40epochs.json").read_text(encoding="utf-8"))
  earlier["config"]["weight_decay"] = 5e-4
  (tmp_path / "earlier.json").write_text(json.dumps(earlier), encoding="utf-8")
  with pytest.raises(SystemExit):
    _erk(tmp_path, "--chosen-from", str(tmp_path / "earlier.json"))
  assert "its settings differ from the --sweep's beyond the budget" in capsys.readouterr().err


def test_chosen_from_takes_a_selection_whose_test_runs_warmed_up_for_their_longer_budget():
  # LeNet-5 at 95 %: GMP's end chosen on the 30-epoch validation runs (1 warm-up epoch), tested
  # at 60 epochs (2): the shorter row's test runs at 30 epochs reuse that choice
  lenet = ROOT / "results" / "sparsity_lenet5_fmnist"
  earlier, committed = (json.loads((lenet / name).read_text(encoding="utf-8"))
                        for name in ("gmp_60epochs_s95.json", "sweep_30epochs_95.json"))
  assert earlier["config"]["warmup_epochs"] != committed["config"]["warmup_epochs"]
  assert gmp_selection.earlier_problem(earlier, committed, [0.95]) is None
  # another warm-up is still part of the budget only: other settings are refused
  earlier["config"]["weight_decay"] = 2 * earlier["config"]["weight_decay"] + 1e-4
  assert "beyond the budget" in gmp_selection.earlier_problem(earlier, committed, [0.95])
