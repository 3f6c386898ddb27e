"""benchmarks/claims/budget_doubling.py: the change between budgets, its verdict and order flips."""

from __future__ import annotations

import doctest
import json
import math
import sys

import pytest

from benchmarks.claims import budget_doubling


def _sweep(epochs, accuracies, loss=0.2):
  """``accuracies``: {(method, sparsity): [per-seed accuracy]}."""
  runs = [{"method": m, "sparsity": s, "seed": i, "accuracy": a, "final_train_loss": loss,
           "constraint_distance": 1.0 if m == "safe" else None}
          for (m, s), accs in accuracies.items() for i, a in enumerate(accs)]
  return {"config": {"epochs": epochs}, "runs": runs}


def _plain_mean_se(values):
  n = len(values)
  mean = sum(values) / n
  var = sum((v - mean) ** 2 for v in values) / (n - 1)
  return mean, math.sqrt(var / n)


SHORT = _sweep(20, {("safe", 0.9): [0.890, 0.892, 0.891], ("gmp", 0.9): [0.896, 0.897, 0.895],
                    ("safe", 0.99): [0.860, 0.866, 0.863], ("gmp", 0.99): [0.880, 0.881, 0.879]})
LONG = _sweep(40, {("safe", 0.9): [0.892, 0.893, 0.890], ("gmp", 0.9): [0.889, 0.888, 0.890],
                   ("safe", 0.99): [0.885, 0.887, 0.886], ("gmp", 0.99): [0.881, 0.882, 0.880]},
              loss=0.15)


def test_changes_match_a_plain_computation_and_get_their_verdicts():
  result = budget_doubling.compare(SHORT, LONG, tolerance=0.5)
  rows = {(r["method"], r["sparsity"]): r for r in result["rows"]}
  for key, row in rows.items():
    a = [100 * r["accuracy"] for r in SHORT["runs"] if (r["method"], r["sparsity"]) == key]
    b = [100 * r["accuracy"] for r in LONG["runs"] if (r["method"], r["sparsity"]) == key]
    (ma, sa), (mb, sb) = _plain_mean_se(a), _plain_mean_se(b)
    assert row["change"] == pytest.approx(mb - ma)
    assert row["change_se"] == pytest.approx(math.sqrt(sa ** 2 + sb ** 2))
  # SAFE at 90 % moved 0.07 points (stable); at 99 % 2.3 points (still moving).
  assert rows[("safe", 0.9)]["verdict"] == "stable"
  assert rows[("safe", 0.99)]["verdict"] == "still moving"
  assert rows[("gmp", 0.9)]["verdict"] == "still moving"  # down 0.7 points, s.e. ~0.1
  assert rows[("gmp", 0.99)]["verdict"] == "stable"
  assert rows[("safe", 0.9)]["loss_short"] == pytest.approx(0.2)
  assert rows[("safe", 0.9)]["loss_long"] == pytest.approx(0.15)
  assert rows[("gmp", 0.9)]["distance_long"] is None
  # GMP led at both sparsities after 20 epochs; SAFE leads at both after 40.
  assert result["orders"] == [{"methods": ["safe", "gmp"], "order_changes_at": [0.9, 0.99]}]
  assert result["budgets"] == [20, 40]


def test_a_small_change_that_every_seed_makes_is_not_stable():
  """The 80-epoch MLP at 99 %: +0.43 ± 0.12 against 40 epochs is 3.6 s.e., so still moving."""
  short = _sweep(40, {("safe", 0.99): [0.8720, 0.8730, 0.8728]})
  long = _sweep(80, {("safe", 0.99): [0.8765, 0.8770, 0.8772]})
  row = budget_doubling.compare(short, long, tolerance=0.5)["rows"][0]
  assert abs(row["change"]) <= 0.5 and abs(row["change"]) > 2 * row["change_se"]
  assert row["verdict"] == "still moving"


def test_a_large_change_inside_two_standard_errors_is_within_noise_not_stable():
  short = _sweep(20, {("admm", 0.995): [0.70, 0.80, 0.75]})
  long = _sweep(40, {("admm", 0.995): [0.78, 0.80, 0.82]})
  row = budget_doubling.compare(short, long, tolerance=0.5)["rows"][0]
  assert row["change"] == pytest.approx(5.0) and row["change_se"] > 2.5
  assert row["verdict"] == "within noise"
  assert budget_doubling.compare(short, long, tolerance=6.0)["rows"][0]["verdict"] == "stable"


def test_cli_writes_the_tables_and_refuses_swapped_budgets(tmp_path, capsys):
  for name, sweep in (("short.json", SHORT), ("long.json", LONG)):
    (tmp_path / name).write_text(json.dumps(sweep))
  out = tmp_path / "out"
  assert budget_doubling.main(["--short", str(tmp_path / "short.json"), "--long",
                               str(tmp_path / "long.json"), "--out", str(out)]) == 0
  text = (out / "budget_doubling.md").read_text()
  assert "| safe | 99% | 86.30 ± 0.17 | 88.60 ± 0.06 | +2.30 ± 0.18 | still moving |" in text
  assert "| safe vs gmp | 90%, 99% |" in text
  assert (out / "budget_doubling.png").stat().st_size > 0
  assert json.loads((out / "budget_doubling.json").read_text())["budgets"] == [20, 40]
  with pytest.raises(SystemExit):
    budget_doubling.main(["--short", str(tmp_path / "long.json"), "--long",
                          str(tmp_path / "short.json"), "--out", str(out)])
  assert "--short must be the shorter budget" in capsys.readouterr().err


def test_doctests():
  assert doctest.testmod(budget_doubling).failed == 0
