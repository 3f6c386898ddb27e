"""benchmarks/claims/cifar_table.py: the lease plan, the measured step time, the merged table."""

from __future__ import annotations

import doctest
import pathlib
import sys

from hypothesis import given, settings, strategies as st
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "claims"))
import cifar_table  # noqa: E402  pylint: disable=wrong-import-position


def test_doctests():
  assert doctest.testmod(cifar_table).failed == 0


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.integers(0, 10_000), max_size=8), per_step=st.floats(1e-3, 1.0),
       budget=st.floats(0, 5_000), finish=st.floats(0, 120))
def test_the_plan_finishes_what_fits_in_order_and_starts_at_most_one_more(steps, per_step,
                                                                          budget, finish):
  packs = [{"steps_left": n, "i": i} for i, n in enumerate(steps)]
  chosen = cifar_table.plan(packs, per_step, budget, finish)
  assert [p["i"] for p in chosen] == list(range(len(chosen)))  # a prefix, in order
  done = [p for p in chosen if p["finishes"]]
  assert sum(p["expected_s"] for p in done) <= budget + 1e-9
  assert all(p["expected_s"] == pytest.approx(p["steps_left"] * per_step + finish) for p in done)
  partial = [p for p in chosen if not p["finishes"]]
  assert len(partial) <= 1 and (not partial or chosen[-1] is partial[0])
  if len(chosen) < len(packs):  # the next pack would not have finished in what was left
    left = budget - sum(p["expected_s"] for p in done)
    assert steps[len(done)] * per_step + finish > left


def test_the_step_time_comes_from_the_measured_pack_and_a_missing_model_is_refused():
  bench = {"cells": [{"model": "resnet20x2", "dtype": "bfloat16", "runs": 3, "mean_step_ms": 12.0},
                     {"model": "resnet20x2", "dtype": "float32", "runs": 3, "mean_step_ms": 20.0},
                     {"model": "resnet20x2", "dtype": "float32", "runs": 9, "skipped": "late"}]}
  assert cifar_table.step_seconds(bench, "resnet20x2", "bfloat16", 3) == pytest.approx(0.012)
  assert cifar_table.step_seconds(bench, "resnet20x2", "float32", 9) == pytest.approx(0.06)
  with pytest.raises(ValueError, match="model 'vgg19'"):
    cifar_table.step_seconds(bench, "vgg19", "float32", 3)


def test_merging_a_later_lease_keeps_earlier_runs_and_records_each_cells_budget():
  def rec(method, sparsity, seed, acc, epochs=200):
    return {"name": cifar_table.run_name(method, sparsity, seed), "method": method,
            "sparsity": sparsity, "seed": seed, "accuracy": acc, "epochs": epochs}
  first = cifar_table.merge({}, [rec("safe", 0.9, s, 0.9 + s / 100) for s in range(3)],
                            [0.9, 0.95])
  second = cifar_table.merge(first, [rec("gmp", 0.95, 0, 0.8, epochs=40),
                                     rec("safe", 0.9, 2, 0.95)], [0.9, 0.95])
  cells = {(c["method"], c["sparsity"]): c for c in second["cells"]}
  assert cells[("safe", 0.9)]["seeds"] == [0, 1, 2]
  assert cells[("safe", 0.9)]["accuracy_mean"] == pytest.approx((0.90 + 0.91 + 0.95) / 3)
  assert cells[("gmp", 0.95)]["epochs"] == [40] and cells[("safe", 0.9)]["epochs"] == [200]
  assert "| safe | 92.00 ± 1.53 | – |" in second["markdown"]
  assert len(second["runs"]) == 4
