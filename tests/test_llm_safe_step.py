"""benchmarks/perf/llm_safe_step.py: its arguments, and a tiny run's record."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "perf" / "llm_safe_step.py"

from benchmarks.perf import llm_safe_step


@pytest.mark.parametrize("text, match", [("3", "A,B"), ("2,2", "A < B"), ("0,3", "A < B"),
                                         ("a,b", "A,B")])
def test_epochs_refuses_bad_pairs(text, match):
  with pytest.raises(Exception, match=match):
    llm_safe_step._epochs(text)


def test_epochs_pair():
  assert llm_safe_step._epochs("2,6") == (2, 6)


@pytest.mark.parametrize("argv, message", [
    (["--windows", "2", "--batch-size", "4"], "--windows (2) must be at least --batch-size (4)"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--seqlen", "-1"], "--seqlen must be at least 1, got -1"),
    (["--epochs", "3,1"], "need 1 <= A < B"),
    (["--packs", "1"], "--packs: distinct lane counts of at least 2, got [1]"),
    (["--packs", "2", "--layouts", "host"], "a pack is compared with the 'device' layout"),
    (["--packs", "3", "3"], "--packs: distinct lane counts of at least 2, got [3, 3]"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as exit_:
    llm_safe_step.main([*argv, "--out", str(tmp_path / "x.json")])
  assert exit_.value.code == 2 and message in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_tiny_run_records_both_layouts(tmp_path):
  """Every layout (a pack of 2 included) timed every repeat; the ratios are host over
  device and device over the pack's time per calibration set; versions recorded."""
  out = tmp_path / "step.json"
  llm_safe_step.main(["--shape", "tiny", "--windows", "2", "--seqlen", "4", "--batch-size", "1",
                      "--epochs", "1,2", "--repeats", "2", "--packs", "2", "--out", str(out)])
  report = json.loads(out.read_text())
  assert set(report["step_ms"]) == {"device", "host", "pack2"} and report["packs"] == [2]
  assert report["device_over_pack"]["pack2"] == pytest.approx(
      report["median_step_ms"]["device"] / report["median_step_ms"]["pack2"])
  assert all(len(v) == 2 for v in report["step_ms"].values())
  assert report["steps_per_epoch"] == 2
  assert report["host_over_device"] == pytest.approx(
      report["median_step_ms"]["host"] / report["median_step_ms"]["device"])
  assert report["versions"]["jax"] and report["backend"] == "cpu" and report["shape"] == "tiny"


def test_pack_pays_only_on_the_device_kind_it_was_measured_on():
  report = {"device_over_pack": {"pack3": 1.16}, "versions": {"device_kind": "NVIDIA H200"}}
  assert llm_safe_step.pack_pays(report, "NVIDIA H200", 1.2) is False
  assert llm_safe_step.pack_pays(report, "NVIDIA H200", 1.16) is True  # the bound is inclusive
  assert llm_safe_step.pack_pays(report, "NVIDIA H100 80GB HBM3", 1.0) is None


@pytest.mark.parametrize("kind, pack_min, printed", [("cpu", "1.2", "1"), ("cpu", "1.5", "0"),
                                                     ("NVIDIA H200", "1.2", "")])
def test_pack_decision_reads_a_timing_of_this_device_kind_and_measures_nothing(
    tmp_path, capsys, kind, pack_min, printed):
  timing = tmp_path / "timing.json"
  timing.write_text(json.dumps({"device_over_pack": {"pack3": 1.3},
                                "versions": {"device_kind": kind}}))
  llm_safe_step.main(["--pack-decision", str(timing), "--pack-min", pack_min,
                      "--out", str(tmp_path / "x.json")])
  assert capsys.readouterr().out.strip() == printed  # this CPU's device kind is "cpu"
  assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("report, argv, message", [
    ({"device_over_pack": {}, "versions": {"device_kind": "cpu"}}, [],
     "no pack of 3 timed there"),
    ({"device_over_pack": {"pack3": 1.3}, "versions": {"device_kind": "cpu"}},
     ["--pack-min", "0"], "--pack-min must be > 0 (a speed-up per seed), got 0.0"),
])
def test_a_pack_decision_without_a_pack_timing_or_bound_is_refused(tmp_path, capsys, report,
                                                                  argv, message):
  timing = tmp_path / "timing.json"
  timing.write_text(json.dumps(report))
  with pytest.raises(SystemExit) as exit_:
    llm_safe_step.main(["--pack-decision", str(timing), *argv])
  assert exit_.value.code == 2 and message in capsys.readouterr().err
