"""benchmarks/claims/llm_block_studies.py: the edge rule that extends a selection grid, up to a range bound."""

import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.claims import llm_block_studies
from benchmarks.claims.llm_block_studies import edge_rule_pick


def test_an_edge_pick_extends_the_grid_until_it_is_inside():
  tried = []

  def error(lam):  # lowest at 1e-5, below the first grid
    tried.append(lam)
    return abs(math.log10(lam) + 5)

  pick, grid, inside = edge_rule_pick(error, [1e-4, 1e-3, 1e-2], 10.0)
  assert (pick, inside) == (1e-5, True)
  assert grid == [1e-6, 1e-5, 1e-4, 1e-3, 1e-2]
  assert sorted(set(tried)) == grid  # every value in the returned grid was scored


def test_an_interior_pick_keeps_the_grid_and_integer_grids_stay_integer():
  pick, grid, inside = edge_rule_pick(lambda steps: abs(steps - 120), [60, 120, 250], 2.0,
                                      integer=True)
  assert (pick, grid, inside) == (120, [60, 120, 250], True)
  pick, grid, inside = edge_rule_pick(lambda steps: -steps, [60, 120, 250], 2.0, integer=True)
  assert not inside and pick == grid[-1] == 1000 and all(isinstance(g, int) for g in grid)


def test_the_extensions_are_bounded():
  pick, grid, inside = edge_rule_pick(lambda lr: lr, [1e-3, 3e-3, 1e-2], 3.0, max_extensions=2)
  assert not inside and pick == grid[0] and len(grid) == 5


def test_a_top_pick_after_the_extensions_tries_the_range_bound_once_and_settles_there():
  tried = []

  def error(steps):  # more steps always help: the pick runs up to the bound
    tried.append(steps)
    return -steps

  pick, grid, inside = edge_rule_pick(error, [60, 120, 250], 2.0, integer=True, upper=1920)
  assert (pick, inside) == (1920, False)  # at the bound: an end, but not an extendable one
  assert grid == [60, 120, 250, 500, 1000, 1920] and sorted(set(tried)) == grid


def test_the_bound_can_move_the_pick_back_inside():
  pick, grid, inside = edge_rule_pick(lambda steps: abs(steps - 1100), [60, 120, 250], 2.0,
                                      integer=True, upper=1920)
  assert (pick, inside) == (1000, True) and grid[-1] == 1920


def test_an_extension_past_the_bound_stops_at_it_and_the_bottom_end_ignores_it():
  pick, grid, inside = edge_rule_pick(lambda steps: -steps, [60, 120, 250], 2.0, integer=True,
                                      upper=400)
  assert (pick, grid, inside) == (400, [60, 120, 250, 400], False)
  # A pick at the bottom end extends as without a bound, and the bound is never run.
  pick, grid, inside = edge_rule_pick(lambda lr: lr, [1e-3, 3e-3, 1e-2], 3.0, upper=1.0)
  assert not inside and pick == grid[0] and len(grid) == 5 and 1.0 not in grid


def test_a_bound_below_the_grid_is_refused():
  with pytest.raises(ValueError, match="upper=100"):
    edge_rule_pick(lambda steps: steps, [60, 120, 250], 2.0, upper=100)


def test_the_steps_bound_is_the_papers_block_budget_and_the_cli_refuses_one_below_the_grid(
    monkeypatch, capsys):
  # SPEC §3: 30 epochs over 128 sequences of 2,048 tokens, in batches of 8 x 512 tokens.
  assert llm_block_studies.STEPS_BOUND * 8 * 512 == 30 * 128 * 2048
  # The report checks the recorded grids against tuning.py's declaration of the same bound.
  from benchmarks.claims import tuning  # pylint: disable=import-outside-toplevel
  rows = tuning.DECLARED["llm_pruning"]["rows"]
  assert {rows[label][name]["steps"]["upper"] for label in rows for name in rows[label]
          if "steps" in rows[label][name]} == {llm_block_studies.STEPS_BOUND}
  monkeypatch.setattr(sys, "argv", ["llm_block_studies.py", "select", "--steps-bound", "200"])
  with pytest.raises(SystemExit):
    llm_block_studies.main()
  assert "--steps-bound must be at least the step grid's top value 250; got 200" in (
      capsys.readouterr().err)


def test_select_at_2of4_has_its_own_file_and_run_keys(monkeypatch, tmp_path, capsys):
  """``select --nm 2:4`` writes ``..._2of4`` files and keys its runs by the structure, so a
  2:4 run is never taken for the 50 % study's run of the same lr, lambda and steps."""
  monkeypatch.setattr(llm_block_studies, "OUT", tmp_path)
  path = llm_block_studies.select_path(0, 64, 128, (2, 4))
  assert path == tmp_path / "selection_block0_64x128_2of4.json"
  assert llm_block_studies.select_path(0, 64, 128, None).name == "selection_block0_64x128.json"
  monkeypatch.setattr(sys, "argv", ["llm_block_studies.py", "select", "--nm", "2:4",
                                    "--table-only"])
  llm_block_studies.main()
  out = capsys.readouterr().out
  assert "stops at a run not done yet: safe-plus|default|n64x128|seed0|steps60|" in out
  assert out.split("not done yet: ")[1].split("\n")[0].endswith("|2of4")
  assert path.with_suffix(".md").exists()


@pytest.mark.parametrize("study", ["grouping", "calib"])
def test_nm_is_refused_outside_select(monkeypatch, capsys, study):
  monkeypatch.setattr(sys, "argv", ["llm_block_studies.py", study, "--nm", "2:4"])
  with pytest.raises(SystemExit):
    llm_block_studies.main()
  assert f"--nm is for the select study only, not {study}" in capsys.readouterr().err


def test_calib_reuses_the_unstructured_selection_runs_only(monkeypatch, tmp_path):
  """The calibration-size study compares unstructured 50 % prunes: it takes the 50 % select
  study's runs (a file without ``structure`` is one) and none of the 2:4 study's."""
  monkeypatch.setattr(llm_block_studies, "OUT", tmp_path)
  held = {"windows": 16, "seqlen": 512}
  for name, structure, key in (("selection_block0_64x128.json", None, "a"),
                               ("selection_block0_64x128_2of4.json", "2of4", "b|2of4")):
    record = {"held_out": held, "runs": {key: {"held_out_error": 0.1}}}
    if structure:
      record["structure"] = structure
    (tmp_path / name).write_text(json.dumps(record))
  study = llm_block_studies.Study(tmp_path / "calibration_size_block0.json", 0, (16, 512), "calib")
  llm_block_studies._shared_runs(study)
  assert set(study.runs) == {"a"} and study.runs["a"]["from"] == "selection_block0_64x128.json"
