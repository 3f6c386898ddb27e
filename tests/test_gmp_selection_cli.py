"""benchmarks/claims/gmp_selection.py: its choice rule and the refusals made before any run."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "claims"))
import gmp_selection  # noqa: E402  pylint: disable=wrong-import-position

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
