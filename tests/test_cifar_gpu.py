"""benchmarks/claims/cifar_gpu.py: the epoch plan for a lease, partial-run summaries, the merged table."""

from __future__ import annotations

import doctest
import json
import math
import sys

from hypothesis import given, settings, strategies as st
import pytest

from benchmarks.claims import cifar_gpu


def _throughput(safe_epoch, sgd_epoch):
  return {"methods": {"safe": {"epoch_s": safe_epoch}, "sgd": {"epoch_s": sgd_epoch}}}


def test_doctests():
  assert doctest.testmod(cifar_gpu, optionflags=doctest.ELLIPSIS).failed == 0


@settings(max_examples=200, deadline=None)
@given(safe=st.floats(0.1, 100), sgd=st.floats(0.05, 50), seconds=st.floats(0, 5000),
       min_epochs=st.integers(1, 80), overhead=st.floats(1.0, 3.0))
def test_plan_fits_the_time_and_the_paper_schedule(safe, sgd, seconds, min_epochs, overhead):
  plan = cifar_gpu.plan_epochs(_throughput(safe, sgd), seconds, min_epochs, overhead)
  shared = overhead * (safe + 2 * sgd) * len(plan["seeds"])
  assert 1 <= plan["epochs"] <= cifar_gpu.PAPER_EPOCHS
  # Fits the time given, except the 1-epoch floor.
  assert plan["epochs"] == 1 or plan["epochs"] * shared <= seconds + 1e-6
  assert plan["seeds"] in ([0], [0, 1, 2])
  if plan["seeds"] == [0, 1, 2]:
    assert plan["epochs"] >= min(min_epochs, cifar_gpu.PAPER_EPOCHS)
  else:  # one seed only when three would fall under the minimum
    assert math.floor(seconds / (3 * overhead * (safe + 2 * sgd))) < min_epochs
  assert 0 <= plan["warmup_epochs"] < plan["epochs"] or plan["epochs"] == 1
  assert plan["planned_shared_epoch_s"] == pytest.approx(shared)


def test_plan_takes_the_largest_epoch_count_that_fits():
  plan = cifar_gpu.plan_epochs(_throughput(3.4, 2.0), 400.0, 40, 1.3)
  per_epoch = 1.3 * (3.4 + 2 * 2.0)
  assert plan["seeds"] == [0]
  assert plan["epochs"] == 41 and 41 * per_epoch <= 400 < 42 * per_epoch


@pytest.mark.parametrize("epochs,warmup", [(1, 0), (2, 1), (39, 1), (60, 2), (120, 3),
                                           (200, 5)])
def test_warmup_scales_the_papers_5_in_200(epochs, warmup):
  assert cifar_gpu.warmup_for(epochs) == warmup


def _write_run(folder, method, seed, epochs, final=None, partial_line=False):
  run = folder / f"{method}-s0.9-seed{seed}"
  run.mkdir(parents=True)
  lines = []
  for e in range(epochs):
    record = {"epoch": e, "train_loss": 1.0 / (e + 1), "epoch_seconds": 2.0 + e,
              "distance_to_projection": 0.0 if method in ("gmp", "dense") else 5.0 - e}
    if e == epochs - 1:
      record.update(test_accuracy=0.5, test_accuracy_projected=0.4)
    lines.append(json.dumps(record))
  text = "\n".join(lines) + "\n" + ('{"epoch": 9, "train_lo' if partial_line else "")
  (run / "metrics.jsonl").write_text(text)
  if final is not None:
    (run / "results.json").write_text(json.dumps(
        {"final": final, "wall_seconds": 10.0, "train_seconds": 8.0,
         "images_per_second": 100.0, "steady_images_per_second": 120.0}))
  return run


def test_summary_of_a_stopped_run_keeps_its_epochs_and_skips_a_half_written_line(tmp_path):
  run = _write_run(tmp_path, "safe", 0, 3, partial_line=True)
  entry = cifar_gpu.summarise_run(run)
  assert entry["finished"] is False
  assert entry["epochs_done"] == 3
  assert entry["epoch_seconds"] == [2.0, 3.0, 4.0]
  assert entry["last_distance_to_projection"] == 3.0
  (run / "results.json").write_text('{"final": {"sparse_acc')  # being written
  assert cifar_gpu.summarise_run(run)["finished"] is False


def _lease(folder, runs):
  """A lease's output folder: cifar_gpu.json and runs.tar.gz of ``runs`` {(method, seed): acc}."""
  work = folder / "work"
  for (method, seed), acc in runs.items():
    final = ({"dense_accuracy": acc} if method == "dense" else
             {"dense_accuracy": acc + 0.01, "sparse_accuracy": acc,
              "sparse_accuracy_before_bnt": acc - 0.02})
    _write_run(work, method, seed, 4, final=final)
  cifar_gpu.pack(work, folder / "runs.tar.gz")
  (folder / "cifar_gpu.json").write_text(json.dumps(
      {"command": "x", "nvidia_smi": "GPU-X", "plan": {"epochs": 4},
       "runs": {f"{m}-seed{s}": {} for m, s in runs}}))
  return folder


def test_merged_table_gives_a_plain_mean_and_standard_error_per_method(tmp_path):
  pytest.importorskip("matplotlib")
  one = _lease(tmp_path / "one", {("safe", 0): 0.80, ("gmp", 0): 0.70})
  two = _lease(tmp_path / "two", {("safe", 1): 0.84, ("gmp", 1): 0.72, ("dense", 1): 0.9})
  out = tmp_path / "out"
  table = cifar_gpu.merge_leases([one, two], out)
  rows = {line.split("|")[1].strip(): line.split("|")[1:-1] for line in table.splitlines()
          if line.startswith("| ") and not line.startswith("| method")}
  assert set(rows) == {"safe", "gmp", "dense"}
  # Plain mean and s.e. (std with ddof 1 over sqrt(n)) of two values a, b: |a - b| / 2.
  assert rows["safe"][2].strip() == "82.00 +- 2.00"
  assert rows["gmp"][2].strip() == "71.00 +- 1.00"
  assert rows["dense"][2].strip() == "90.00"  # one seed: no error
  assert rows["safe"][1].strip() == "0, 1"
  merged = json.loads((out / "runs.json").read_text())
  assert sorted(merged["runs"]["safe"]) == ["0", "1"]
  assert merged["runs"]["safe"]["1"]["lease"] == 1
  assert (out / "curves.png").stat().st_size > 10_000
  assert (out / "runs" / "safe-s0.9-seed1" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, message", [
    ([], "--data-dir is required to train"),
    (["--data-dir", "d", "--sparsity", "1.0"], "--sparsity must lie in (0, 1), got 1.0"),
    (["--data-dir", "d", "--deadline-s", "0"], "--deadline-s must be > 0 seconds, got 0.0"),
    (["--data-dir", "d", "--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--data-dir", "d", "--methods", "sage"], "invalid choice: 'sage'"),
    (["--data-dir", "d", "--seeds", "1"], "--seeds needs --epochs"),
    (["--data-dir", "d", "--overhead", "0.5"], "--overhead must be >= 1, got 0.5"),
    (["--data-dir", "d", "--throughput-steps", "0"], "--throughput-steps must be >= 1, got 0"),
    (["--data-dir", "d", "--finish-s", "-1"], "--finish-s must be >= 0, got -1.0"),
    (["--data-dir", "d", "--fallback-epochs", "0"], "--fallback-epochs must be >= 1, got 0"),
])
def test_bad_flags_are_refused_before_anything_runs(flags, message, capsys, tmp_path):
  with pytest.raises(SystemExit):
    cifar_gpu.main(["--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "w"), *flags])
  assert message in capsys.readouterr().err
  assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()
