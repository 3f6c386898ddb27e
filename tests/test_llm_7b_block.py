"""benchmarks/perf/llm_7b_block.py: the extrapolation from two runs, and keeping the methods not rerun."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.perf import llm_7b_block as bench


def _result(method, runs):
  key = "windows" if method == "sparsegpt" else "steps"
  return {"method": method, "runs": [{key: k, "windows": k if key == "windows" else 1,
                                      "block_s": t} for k, t in runs]}


def test_safe_extrapolates_a_step_from_the_difference_of_two_runs():
  ex = bench.extrapolate(_result("safe", [(1, 20.0), (5, 60.0)]), windows=1, seqlen=256)
  assert ex["step_s"] == pytest.approx(10.0) and ex["fixed_s"] == pytest.approx(10.0)
  # 480 steps of 8 x 2,048 tokens, each 64 times a 256-token step
  paper_step = 10.0 * 8 * 2048 / 256
  low, high = ex["paper_budget_block_s"]
  assert low == pytest.approx(480 * paper_step + 10.0)
  assert high == pytest.approx(480 * paper_step + 10.0 * 128 * 2048 / 256)


def test_sparsegpt_separates_the_passes_from_the_solves():
  ex = bench.extrapolate(_result("sparsegpt", [(32, 164.0), (64, 196.0)]), windows=32, seqlen=256)
  assert ex["passes_per_window_s"] == pytest.approx(1.0) and ex["fixed_s"] == pytest.approx(132.0)
  assert ex["paper_budget_block_s"] == [pytest.approx(132.0 + 128 * 2048 / 256)] * 2


@pytest.mark.parametrize("method,runs", [("safe", [(1, 143.5), (2, 133.1)]),
                                         ("safe-plus", [(1, 50.0), (5, 50.0)]),
                                         ("sparsegpt", [(1, 168.2), (2, 156.6)]),
                                         # slower, but by 0.2 %: the H200's first try at 2,10 steps
                                         ("safe", [(2, 10.604), (10, 10.630)]),
                                         ("sparsegpt", [(8, 30.0), (16, 32.9)])])
def test_a_difference_lost_in_noise_extrapolates_nothing_and_says_so(method, runs):
  ex = bench.extrapolate(_result(method, runs), windows=runs[0][0], seqlen=256)
  assert ex["paper_budget_block_s"] is None and "noise" in ex["note"]
  assert "ratio_to_paper" not in ex


def _report(**changes):
  return {"shape": bench.SHAPE, "windows": 1, "seqlen": 256, "steps": [1, 5], "backend": "cpu",
          "devices": ["TFRT_CPU_0"], **changes}


def test_rerunning_some_methods_keeps_the_others_with_how_they_were_measured(tmp_path):
  out = tmp_path / "block.json"
  old = {**_report(), "command": "python llm_7b_block.py", "date": "d",
         "cpu": {"loadavg_start": [1.0], "loadavg_end": [2.0]},
         "methods": {m: {"method": m} for m in bench.METHODS}}
  out.write_text(json.dumps(old))
  kept = bench._kept_methods(out, _report(), ["sparsegpt"])  # pylint: disable=protected-access
  assert sorted(kept) == ["safe", "safe-plus"]
  assert kept["safe"]["measured_by"] == {"command": "python llm_7b_block.py", "date": "d",
                                         "loadavg_start": [1.0], "loadavg_end": [2.0]}
  assert bench._kept_methods(out, _report(), list(bench.METHODS)) == {}  # pylint: disable=protected-access
  with pytest.raises(SystemExit, match="measured another setting"):
    bench._kept_methods(out, _report(steps=[1, 2]), ["sparsegpt"])  # pylint: disable=protected-access
  # a GPU run never joins a CPU file
  with pytest.raises(SystemExit, match="measured another setting"):
    bench._kept_methods(  # pylint: disable=protected-access
        out, _report(backend="gpu", devices=["cuda:0"]), ["sparsegpt"])
  with pytest.raises(SystemExit, match="--methods"):
    bench._kept_methods(out, _report(), ["obs"])  # pylint: disable=protected-access


def test_a_window_count_below_one_is_refused_before_anything_runs(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["llm_7b_block.py", "--sparsegpt-windows", "0"])
  with pytest.raises(SystemExit):
    bench.main()
  assert "--sparsegpt-windows must be a window count >= 1, got 0" in capsys.readouterr().err


def test_the_table_shows_the_device_peak_only_where_the_backend_counts_one(capsys):
  assert bench.peak_device_mib() is None  # the CPU keeps no allocation count
  ex = bench.extrapolate(_result("safe", [(1, 20.0), (5, 60.0)]), windows=1, seqlen=256)
  report = {"methods": {
      "safe": {"peak_rss_mib": 900.0, "peak_device_mib": None, "extrapolation": ex},
      "safe-plus": {"peak_rss_mib": 900.0, "peak_device_mib": 20480.0, "extrapolation": ex}}}
  bench._table(report)  # pylint: disable=protected-access
  rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
  assert rows["safe"][2] == "-" and rows["safe-plus"][2] == "20480"
  assert rows["safe"][3] == "10.00"


def test_each_method_is_written_as_it_finishes_so_a_stopped_run_keeps_it(tmp_path, monkeypatch):
  out = tmp_path / "block.json"
  finished = []

  class Proc:  # the first method's worker finishes, the second's process is killed
    def __init__(self, method):
      self.returncode = 0 if method == "safe" else -9
      self.stderr = "Killed"
      self.stdout = json.dumps({"method": method, "peak_rss_mib": 1.0, "peak_device_mib": None,
                                "runs": [{"steps": 1, "windows": 1, "block_s": 20.0},
                                         {"steps": 5, "windows": 1, "block_s": 60.0}]})

  real_run = bench.subprocess.run

  def run(cmd, **kwargs):
    if "--worker" not in cmd:  # the run record's own commands
      return real_run(cmd, **kwargs)
    method = cmd[cmd.index("--worker") + 1]
    finished.append(method)
    return Proc(method)

  monkeypatch.setattr(bench.subprocess, "run", run)
  monkeypatch.setattr(sys, "argv", ["llm_7b_block.py", "--out", str(out)])
  with pytest.raises(SystemExit, match="safe-plus failed"):
    bench.main()
  assert finished == ["safe", "safe-plus"]
  written = json.loads(out.read_text())
  assert list(written["methods"]) == ["safe"]
  assert written["methods"]["safe"]["extrapolation"]["step_s"] == pytest.approx(10.0)
