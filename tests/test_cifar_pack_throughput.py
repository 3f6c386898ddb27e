"""benchmarks/perf/cifar_pack_throughput.py: FLOPs counted before the backend's passes, recounts."""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.perf import cifar_pack_throughput as bench
from safe_optax.vision import configs  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _device_env(monkeypatch):
  """``share_device`` writes ``os.environ``: each test starts without its two variables and
  leaves them as they were."""
  for name in (bench.PREALLOCATE, bench.MEM_FRACTION):
    monkeypatch.setenv(name, "unset")
    monkeypatch.delenv(name)


def _config(batch=8):
  return configs.get_config("resnet20x2-cifar10", method="safe", sparsity=0.9, batch_size=batch,
                            dtype="float32")


def _conv_flops(batch):
  """ResNet-20x2's convolutions and classifier, forward, by hand: 2 x MACs per image."""
  macs, size, channels = 3 * 32 * 9 * 32 * 32, 32, 32  # the stem: 3 -> 32 channels at 32 x 32
  for stage, width in enumerate((32, 64, 128)):
    for block in range(3):
      stride = 2 if stage and not block else 1
      size //= stride
      macs += channels * width * 9 * size * size + width * width * 9 * size * size
      if channels != width:
        macs += channels * width * size * size  # the 1 x 1 projection shortcut
      channels = width
  return 2 * batch * (macs + channels * 10)


@pytest.mark.slow
def test_the_lowered_count_holds_the_convolutions_and_grows_with_the_pack():
  lone = bench.flops(bench.lowered_step(_config(), 1).lowered)
  # SAM's two gradients: two forward and two backward passes, the backward about twice the forward
  forward = _conv_flops(8)
  assert 5.0 * forward < lone < 7.5 * forward
  packed = bench.flops(bench.lowered_step(_config(), 3).lowered)
  assert packed == pytest.approx(3 * lone, rel=0.02)


@pytest.mark.slow
def test_a_recount_replaces_the_flops_keeps_the_times_and_says_how(tmp_path):
  path = tmp_path / "gpu.json"
  cells = [{"model": "resnet20x2", "dtype": "float32", "runs": 1, "plain_step": {"median_ms": 2.0},
            "flops_per_step": 1.0e6, "images_per_second": 4000.0, "mean_step_ms": 2.0},
           {"model": "resnet20x2", "dtype": "float32", "runs": 3, "skipped": "past --deadline-s"}]
  path.write_text(json.dumps({"settings": {"method": "safe", "sparsity": 0.9, "batch": 8},
                              "device_kind": "NVIDIA H200", "platform": "gpu", "cells": cells}))
  report = bench.recount_flops(str(path))
  assert json.loads(path.read_text()) == report
  cell = report["cells"][0]
  expected = bench.flops(bench.lowered_step(_config(), 1).lowered)
  assert cell["flops_per_step"] == expected and cell["flops_per_step_compiled"] == 1.0e6
  assert cell["flops_per_second"] == pytest.approx(expected / 2.0e-3)
  assert cell["plain_step"] == {"median_ms": 2.0} and cell["speedup_vs_lone_float32"] == 1.0
  assert "skipped" in report["cells"][1] and "flops_per_step" not in report["cells"][1]
  assert "lowered" in report["flops_recounted"]["how"]


def test_the_barrier_holds_each_process_until_all_have_arrived(tmp_path):
  arrived, released = [], []

  def process(name, delay):
    time.sleep(delay)
    arrived.append((name, time.time()))
    bench.file_barrier(str(tmp_path), name, 2)()
    released.append((name, time.time()))

  threads = [threading.Thread(target=process, args=(n, d)) for n, d in (("0", 0.0), ("1", 0.3))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  last_arrival = max(t for _, t in arrived)
  assert sorted(n for n, _ in released) == ["0", "1"]
  assert all(t >= last_arrival for _, t in released)
  (tmp_path / "alone").mkdir()
  with pytest.raises(TimeoutError, match="3 processes"):
    bench.file_barrier(str(tmp_path / "alone"), "0", 3, timeout_s=0.05)()


def _args(**changes):
  return argparse.Namespace(**{"method": "safe", "sparsity": 0.9, "batch": 128, "steps": 10,
                               "warmup": 2, **changes})


class _Child:
  """A finished ``--child`` process: its lone cell as the last line of its output."""

  def __init__(self, cell, returncode=0):
    self.cell, self.returncode = cell, returncode

  def communicate(self):
    return "compiling\n" + json.dumps(self.cell) + "\n", "a traceback"


def test_processes_are_scored_over_the_span_of_all_their_timed_steps(monkeypatch):
  # two processes: one times its steps over [100, 102] s, the other over [101, 104] s
  cells = iter([{"timed_from": 100.0, "timed_to": 102.0, "compile_s": 5.0, "flops_per_step": 7.0},
                {"timed_from": 101.0, "timed_to": 104.0, "compile_s": 6.0, "flops_per_step": 7.0}])
  commands = []

  def popen(command, **kwargs):
    commands.append((command, kwargs["env"]))
    return _Child(next(cells))

  monkeypatch.setattr(bench.subprocess, "Popen", popen)
  monkeypatch.setattr(bench, "mps_daemon_running", lambda: False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  cell = bench.concurrent_cell(_args(), "resnet20x2", "bfloat16", 2)
  # 2 runs x 128 images x 10 steps over the 4 s from the first start to the last end
  assert cell["span_s"] == 4.0 and cell["images_per_second"] == pytest.approx(640.0)
  assert cell["images_per_second_per_run"] == pytest.approx(320.0)
  assert cell["mean_step_ms"] == pytest.approx(400.0) and cell["compile_s"] == 6.0
  assert cell["flops_per_second"] == pytest.approx(2 * 7.0 * 10 / 4.0)
  assert [c[0][c[0].index("--child") + 1] for c in commands] == ["0", "1"]
  assert all(env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4500" for _, env in commands)
  assert {"--barrier-count", "2", "--dtypes", "bfloat16"} <= set(commands[0][0])


def test_a_failed_process_fails_the_cell_with_its_error(monkeypatch):
  monkeypatch.setattr(bench.subprocess, "Popen", lambda command, **_: _Child({}, returncode=1))
  monkeypatch.setattr(bench, "mps_daemon_running", lambda: False)
  with pytest.raises(RuntimeError, match="--processes 2 child failed .rc 1.:\na traceback"):
    bench.concurrent_cell(_args(), "resnet20x2", "float32", 2)


def test_the_speedup_is_over_the_lone_program_before_a_lone_process():
  cells = [{"model": "m", "dtype": "float32", "runs": 1, "layout": "processes",
            "images_per_second": 90.0},
           {"model": "m", "dtype": "float32", "runs": 1, "images_per_second": 100.0},
           {"model": "m", "dtype": "float32", "runs": 3, "layout": "processes",
            "images_per_second": 300.0}]
  speedups = [c["speedup_vs_lone_float32"] for c in bench.with_speedups({"cells": cells})["cells"]]
  assert speedups == [0.9, 1.0, 3.0]


def test_cells_skipped_at_the_deadline_are_written_too(tmp_path):
  out = tmp_path / "bench.json"
  bench.main(["--models", "resnet20x2", "--dtypes", "float32", "--packs", "1", "3",
              "--processes", "2", "--deadline-s", "0", "--out", str(out)])
  cells = json.loads(out.read_text())["cells"]
  assert [(c["runs"], c.get("layout"), c["skipped"]) for c in cells] == [
      (1, None, "past --deadline-s"), (3, None, "past --deadline-s"),
      (2, "processes", "past --deadline-s")]


@pytest.mark.parametrize("flag", ["--packs", "--processes"])
def test_a_count_below_one_is_refused_before_anything_runs(tmp_path, flag, capsys):
  with pytest.raises(SystemExit):
    bench.main([flag, "0", "--out", str(tmp_path / "x.json")])
  assert "--packs and --processes take counts >= 1" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


def test_each_conv_impl_is_its_own_set_of_cells_and_the_speedup_is_over_xlas_lone_run(
    tmp_path, monkeypatch):
  built = []

  def fake_bench(config, runs, *args):
    del args
    built.append((config.conv_impl, runs))
    step_ms = 10.0 if config.conv_impl == "xla" else 4.0 * runs  # im2col: faster per run
    return {"runs": runs, "mean_step_ms": step_ms, "compile_s": 1.0,
            "images_per_second": runs * 128e3 / step_ms,
            "images_per_second_per_run": 128e3 / step_ms, "flops_per_second": None}

  monkeypatch.setattr(bench, "bench", fake_bench)
  out = tmp_path / "bench.json"
  bench.main(["--models", "resnet20x2", "--dtypes", "float32", "--packs", "1", "3",
              "--conv-impls", "xla", "im2col", "--out", str(out)])
  assert built == [("xla", 1), ("xla", 3), ("im2col", 1), ("im2col", 3)]
  cells = json.loads(out.read_text())["cells"]
  assert [(c["conv_impl"], c["runs"]) for c in cells] == built
  # one baseline for every cell: the lone float32 run with XLA's convolutions
  assert [round(c["speedup_vs_lone_float32"], 2) for c in cells] == [1.0, 3.0, 2.5, 2.5]


def test_a_processes_child_is_told_the_conv_impl(monkeypatch):
  commands = []

  def popen(command, **kwargs):
    del kwargs
    commands.append(command)
    return _Child({"timed_from": 0.0, "timed_to": 1.0, "compile_s": 1.0, "flops_per_step": None})

  monkeypatch.setattr(bench.subprocess, "Popen", popen)
  monkeypatch.setattr(bench, "mps_daemon_running", lambda: False)
  cell = bench.concurrent_cell(_args(), "resnet20x2", "float32", 2, "im2col")
  assert cell["conv_impl"] == "im2col"
  assert all(c[c.index("--conv-impls") + 1] == "im2col" for c in commands)


def test_sharing_the_device_stops_preallocating_here_and_caps_each_child():
  env = bench.share_device(3)
  assert env[bench.MEM_FRACTION] == "0.3000" and env[bench.PREALLOCATE] == "false"
  assert os.environ[bench.PREALLOCATE] == "false"
  assert bench.MEM_FRACTION not in os.environ  # this process's own memory is not capped
  assert bench.share_device(1)[bench.MEM_FRACTION] == "0.9000"
  with pytest.raises(ValueError, match="count must be >= 1, got 0"):
    bench.share_device(0)


def test_a_sharing_setting_the_caller_made_is_kept(monkeypatch):
  monkeypatch.setenv(bench.PREALLOCATE, "true")
  monkeypatch.setenv(bench.MEM_FRACTION, "0.2")
  env = bench.share_device(6)
  assert env[bench.MEM_FRACTION] == "0.2" and env[bench.PREALLOCATE] == "true"
  assert os.environ[bench.PREALLOCATE] == "true"


class _FirstDeviceUse(Exception):
  pass


@pytest.mark.parametrize("processes,preallocate", [(["--processes", "3", "6"], "false"),
                                                   ([], None)])
def test_processes_stop_preallocation_before_the_device_is_first_used(
    tmp_path, monkeypatch, processes, preallocate):
  seen = []

  def devices():
    seen.append(os.environ.get(bench.PREALLOCATE))
    raise _FirstDeviceUse

  monkeypatch.setattr(bench.jax, "devices", devices)
  with pytest.raises(_FirstDeviceUse):
    bench.main(["--models", "resnet20x2", "--packs", "1", *processes,
                "--out", str(tmp_path / "x.json")])
  # the lone cell this process times shares the device with the children started later
  assert seen == [preallocate]


def test_show_prints_several_files_with_speedups_over_the_first_lone_run(tmp_path, capsys):
  def cell(runs, step_ms, **extra):
    return {"model": "resnet20x2", "dtype": "float32", "runs": runs, "mean_step_ms": step_ms,
            "images_per_second": runs * 128e3 / step_ms,
            "images_per_second_per_run": 128e3 / step_ms, "flops_per_second": None,
            "compile_s": 1.0, **extra}

  # under MPS: 3 processes and no lone run of their own; then a call with the lone run
  mps, lone = tmp_path / "mps.json", tmp_path / "lone.json"
  mps.write_text(json.dumps({"device_kind": "GPU", "cells": [
      cell(3, 20.0, layout="processes", mps_daemon=True),
      cell(6, 60.0, layout="processes", mps_daemon=False)]}))
  lone.write_text(json.dumps({"device_kind": "GPU", "cells": [cell(1, 10.0)]}))
  bench.main(["--show", str(mps), str(lone)])
  out = capsys.readouterr().out.splitlines()
  assert out[0] == f"GPU: {mps}, {lone}"
  rows = {line.split()[2]: line.split() for line in out[2:]}
  # 3 x 128 images in 20 ms against 128 in 10 ms
  assert rows["3mps"][6] == "1.50" and rows["3mps"][-1] == "mps.json"
  assert rows["6p"][6] == "1.00"  # 6 x 128 in 60 ms, the processes taking turns
  assert rows["1"][6] == "1.00" and rows["1"][-1] == "lone.json"
  assert not (tmp_path / "benchmarks").exists()  # measured and wrote nothing


def test_show_refuses_a_missing_file_naming_it(tmp_path, capsys):
  with pytest.raises(SystemExit):
    bench.main(["--show", str(tmp_path / "none.json")])
  assert f"--show: no such file: {tmp_path / 'none.json'}" in capsys.readouterr().err


MPS = bench.MPS_CONTROL


def test_a_running_mps_daemon_is_seen_though_its_name_is_longer_than_15_characters(tmp_path):
  """Linux keeps 15 characters of a process name, so ``pgrep -x nvidia-cuda-mps-control`` never
  matches: the 2026-11-28 lease recorded ``mps_daemon: false`` for cells measured under MPS. A
  real process started as the daemon is (``nvidia-cuda-mps-control -d``) must be seen."""
  if bench.mps_daemon_running():
    pytest.skip("a real MPS daemon runs on this machine: the fake one could not be told apart")
  fake = tmp_path / MPS
  shutil.copy(shutil.which("sleep"), fake)
  proc = subprocess.Popen([str(fake), "30"])
  try:
    deadline = time.time() + 10
    while not (pathlib.Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0]
               .endswith(MPS.encode())) and time.time() < deadline:
      time.sleep(0.01)  # until the exec has replaced the forked child's command line
    assert bench.mps_daemon_running()
  finally:
    proc.kill()
    proc.wait()
  assert not bench.mps_daemon_running()


def _fake_proc(root, commands):
  for pid, argv in commands.items():
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
  (root / "self").mkdir()  # not a process number: ignored
  return root


@pytest.mark.parametrize("argv, running", [
    ([f"/usr/bin/{MPS}", "-d"], True),
    ([MPS, "-d"], True),
    (["python3", "-c", f"print('{MPS}')"], False),  # named in an argument, not the program
    ([f"/usr/bin/{MPS}-helper"], False),
    ([], False),  # a zombie's empty command line
])
def test_the_daemon_is_the_program_a_process_runs(tmp_path, argv, running):
  proc = _fake_proc(tmp_path / "proc", {1: ["/sbin/init"], 4242: argv})
  assert bench.mps_daemon_running(proc) is running
