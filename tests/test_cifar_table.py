"""benchmarks/claims/cifar_table.py: the lease plan, the measured step time, the merged table."""

from __future__ import annotations

import doctest
import json
import os
import pathlib
import sys

from hypothesis import given, settings, strategies as st
import pytest

from benchmarks.claims import cifar_table


def test_doctests():
  assert doctest.testmod(cifar_table).failed == 0


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.integers(0, 10_000), max_size=8), per_step=st.floats(1e-3, 1.0),
       budget=st.floats(0, 5_000), finish=st.floats(0, 120), start=st.floats(0, 120))
def test_the_plan_finishes_what_fits_in_order_and_starts_at_most_one_more(steps, per_step,
                                                                          budget, finish, start):
  packs = [{"steps_left": n, "i": i} for i, n in enumerate(steps)]
  chosen = cifar_table.plan(packs, per_step, budget, finish, start)
  assert [p["i"] for p in chosen] == list(range(len(chosen)))  # a prefix, in order
  done = [p for p in chosen if p["finishes"]]
  assert sum(p["expected_s"] for p in done) <= budget + 1e-9
  assert all(p["expected_s"] == pytest.approx(start + p["steps_left"] * per_step + finish)
             for p in done)
  partial = [p for p in chosen if not p["finishes"]]
  assert len(partial) <= 1 and (not partial or chosen[-1] is partial[0])
  left = budget - sum(p["expected_s"] for p in done)
  # a pack that will not finish starts only with a minute of steps left after its start
  assert not partial or left - start > 60
  if len(chosen) < len(packs):  # the next pack would not have finished in what was left
    assert start + steps[len(done)] * per_step + finish > left


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


def _bench(lone_ms, pack_ms):
  cells = [{"model": "resnet20x2", "dtype": "float32", "runs": 1, "mean_step_ms": lone_ms},
           {"model": "resnet20x2", "dtype": "float32", "runs": 3, "mean_step_ms": pack_ms},
           # lone runs in 3 processes under the MPS daemon: a layout only while one runs
           {"model": "resnet20x2", "dtype": "float32", "runs": 3, "layout": "processes",
            "mps_daemon": True, "mean_step_ms": 1.0}]
  return {"cells": cells}


@pytest.mark.parametrize("lone_ms,pack_ms,layout", [(9.73, 48.21, "lone"), (20.0, 31.5, "pack")])
def test_auto_takes_the_layout_measured_faster(lone_ms, pack_ms, layout):
  seconds = cifar_table.layout_seconds(_bench(lone_ms, pack_ms), "resnet20x2", "float32", 3)
  assert seconds == {"pack": pytest.approx(pack_ms / 1e3), "lone": pytest.approx(3 * lone_ms / 1e3)}
  assert cifar_table.choose_layout(seconds, "auto") == layout
  assert cifar_table.choose_layout(seconds, "pack") == "pack"
  with pytest.raises(ValueError, match="--layout processes: the throughput JSON has no --proc"):
    cifar_table.choose_layout(seconds, "processes")
  # with the daemon running, the processes cell is measured for these 3 runs (not for 4)
  seconds = cifar_table.layout_seconds(_bench(lone_ms, pack_ms), "resnet20x2", "float32", 3,
                                       mps=True)
  assert cifar_table.choose_layout(seconds, "auto") == "processes"
  assert "processes" not in cifar_table.layout_seconds(_bench(lone_ms, pack_ms), "resnet20x2",
                                                       "float32", 4, mps=True)


class _Planned(Exception):
  pass


@pytest.mark.parametrize("epochs,start_s,layout", [("1", "30", "pack"), ("1", "0", "lone"),
                                                   ("2000", "30", "lone")])
def test_auto_counts_each_lone_runs_start_against_a_packs_one(tmp_path, monkeypatch, capsys,
                                                             epochs, start_s, layout):
  # pylint: disable=import-outside-toplevel
  import types

  from safe_optax.vision import datasets, packing, train
  throughput = tmp_path / "bench.json"
  throughput.write_text(json.dumps(_bench(9.73, 48.21)))  # lone runs step faster than the pack
  monkeypatch.setattr(datasets, "load_dataset",
                      lambda config, data_dir: types.SimpleNamespace(train_labels=[0] * 256))
  for module, name in ((packing, "train_packed"), (train, "train_and_evaluate")):
    monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(_Planned()))
  with pytest.raises(_Planned):
    cifar_table.main(["--data-dir", "unused", "--runs", str(tmp_path / "runs"),
                      "--table", str(tmp_path / "table.json"), "--throughput", str(throughput),
                      "--deadline-s", "100000", "--finish-s", "0", "--start-s", start_s,
                      "--methods", "safe", "--epochs", epochs])
  # 2 steps an epoch: 3 lone starts outweigh the pack's slower steps in a short run only
  assert f'"layout": "{layout}"' in capsys.readouterr().out


def test_lone_runs_train_one_after_another_each_merged_as_it_finishes(tmp_path, monkeypatch):
  # pylint: disable=import-outside-toplevel
  import types

  from safe_optax.vision import checkpoint as checkpoint_lib
  from safe_optax.vision import datasets, packing, sweeps, train
  throughput = tmp_path / "bench.json"
  throughput.write_text(json.dumps(_bench(9.73, 48.21)))
  monkeypatch.setattr(datasets, "load_dataset",
                      lambda config, data_dir: types.SimpleNamespace(train_labels=[0] * 256))
  monkeypatch.setattr(packing, "train_packed", lambda *a, **k: pytest.fail("packed a lone cell"))
  monkeypatch.setattr(sweeps, "record", lambda c, results: {
      "method": c.method, "sparsity": c.sparsity, "seed": c.seed, "accuracy": results["acc"]})
  trained = []

  def train_and_evaluate(config, workdir, **kwargs):
    assert kwargs["on_step"] is not None  # the deadline reaches the lone run
    trained.append(pathlib.Path(workdir).name)
    if config.seed == 2:  # the lease ends during the third run, after a checkpoint of step 5
      (pathlib.Path(workdir) / "checkpoints" / "5").mkdir(parents=True)
      (pathlib.Path(workdir) / "checkpoints" / "5" / "params").write_text("weights")
      raise checkpoint_lib.Interrupted(5, pathlib.Path(workdir) / "checkpoints")
    return types.SimpleNamespace(results={"acc": 0.9 + config.seed / 100})

  monkeypatch.setattr(train, "train_and_evaluate", train_and_evaluate)
  table = tmp_path / "table.json"
  argv = ["--data-dir", "unused", "--runs", str(tmp_path / "runs"), "--table", str(table),
          "--throughput", str(throughput), "--deadline-s", "1000", "--finish-s", "1",
          "--methods", "safe", "--epochs", "1"]
  argv += ["--layout", "lone"]  # for 2 steps auto would take the pack (one start, not three)
  cifar_table.main(argv + ["--bundle", str(tmp_path / "returned")])
  assert trained == ["safe-s0.9-seed0", "safe-s0.9-seed1", "safe-s0.9-seed2"]
  bundle = json.loads((tmp_path / "returned" / "runs_bundle.json").read_text())
  assert bundle["steps"] == {"safe-s0.9-seed2": 5}  # only the unfinished run travels
  runs = json.loads(table.read_text())["runs"]
  assert sorted(runs) == ["safe-s0.9-seed0", "safe-s0.9-seed1"]
  assert runs["safe-s0.9-seed1"]["accuracy"] == pytest.approx(0.91)
  trained.clear()
  monkeypatch.setattr(train, "train_and_evaluate", lambda config, workdir, **kwargs: (
      trained.append(pathlib.Path(workdir).name) or types.SimpleNamespace(results={"acc": 0.5})))
  # the next lease, on a fresh machine: its --runs start from the returned bundle
  fresh = tmp_path / "fresh_runs"
  cifar_table.main([*argv[:3], str(fresh), *argv[4:], "--resume-from", str(tmp_path / "returned")])
  assert trained == ["safe-s0.9-seed2"]
  assert (fresh / "safe-s0.9-seed2" / "checkpoints" / "5" / "params").read_text() == "weights"
  assert len(json.loads(table.read_text())["runs"]) == 3


def test_a_layout_the_benchmark_did_not_measure_is_refused_before_the_data_loads(tmp_path,
                                                                                 monkeypatch):

  from safe_optax.vision import datasets  # pylint: disable=import-outside-toplevel
  throughput = tmp_path / "bench.json"
  throughput.write_text(json.dumps({"cells": [_bench(9.73, 48.21)["cells"][1]]}))  # no lone cell
  monkeypatch.setattr(datasets, "load_dataset", lambda *a: pytest.fail("loaded the data"))
  with pytest.raises(ValueError, match="--layout lone: the throughput JSON has no lone-program"):
    cifar_table.main(["--data-dir", "x", "--runs", str(tmp_path), "--throughput", str(throughput),
                      "--deadline-s", "10", "--layout", "lone"])


def _fake_run(folder: pathlib.Path, steps, payload=b"x"):
  folder.mkdir(parents=True)
  for step in steps:
    (folder / "checkpoints" / str(step) / "params").mkdir(parents=True)
    (folder / "checkpoints" / str(step) / "params" / "data").write_bytes(payload * (100 + step))
  (folder / "config.json").write_text('{"seed": 0}')
  (folder / "metrics.jsonl").write_text('{"epoch": 1}\n')
  (folder / "tensorboard").mkdir()
  (folder / "tensorboard" / "events").write_text("not needed to resume")


def test_a_bundle_carries_the_newest_checkpoint_of_unfinished_runs_in_small_parts(tmp_path):
  import os  # pylint: disable=import-outside-toplevel
  root, out, again = tmp_path / "runs", tmp_path / "out", tmp_path / "next_lease"
  _fake_run(root / "safe-s0.9-seed0", [10, 20], payload=os.urandom(64))
  _fake_run(root / "safe-s0.9-seed1", [])
  manifest = cifar_table.bundle_runs(root, ["safe-s0.9-seed0", "safe-s0.9-seed1",
                                            "safe-s0.9-seed2"], out, part_bytes=200)
  assert manifest["steps"] == {"safe-s0.9-seed0": 20, "safe-s0.9-seed1": None}
  parts = sorted(p.name for p in out.glob("runs_bundle.part*"))
  assert len(parts) == len(manifest["parts"]) > 1
  assert all((out / p).stat().st_size <= 200 for p in parts)
  cifar_table.unbundle_runs(out, again)
  run = again / "safe-s0.9-seed0"
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["20"]
  assert (run / "checkpoints" / "20" / "params" / "data").read_bytes() == (
      root / "safe-s0.9-seed0" / "checkpoints" / "20" / "params" / "data").read_bytes()
  assert (run / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
  assert not (run / "tensorboard").exists()
  assert cifar_table.bundle_runs(root, ["gmp-s0.9-seed0"], tmp_path / "none") is None


def test_a_damaged_or_missing_part_or_an_older_bundle_is_refused(tmp_path):
  root, out = tmp_path / "runs", tmp_path / "out"
  _fake_run(root / "safe-s0.9-seed0", [10])
  cifar_table.bundle_runs(root, ["safe-s0.9-seed0"], out, part_bytes=200)
  # the folder already holds step 10; a bundle of step 10 may land on it, an older one may not
  cifar_table.unbundle_runs(out, root)
  _fake_run(tmp_path / "newer" / "safe-s0.9-seed0", [30])
  with pytest.raises(ValueError, match="already holds step 30, newer than the bundle's 10"):
    cifar_table.unbundle_runs(out, tmp_path / "newer")
  (out / "runs_bundle.part01").write_bytes(b"damaged")
  with pytest.raises(ValueError, match="part runs_bundle.part01 does not match its SHA-256"):
    cifar_table.unbundle_runs(out, tmp_path / "elsewhere")
  (out / "runs_bundle.part01").unlink()
  with pytest.raises(ValueError, match="part runs_bundle.part01 is missing"):
    cifar_table.unbundle_runs(out, tmp_path / "elsewhere")
  with pytest.raises(ValueError, match="no runs_bundle.json"):
    cifar_table.unbundle_runs(tmp_path, tmp_path / "elsewhere")


@pytest.mark.parametrize("has_data_filter", [True, False])
def test_a_bundle_member_outside_the_runs_folder_is_refused(tmp_path, monkeypatch, has_data_filter):
  import hashlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  import tarfile  # pylint: disable=import-outside-toplevel
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    member = tarfile.TarInfo("../evil.txt")
    member.size = 4
    tar.addfile(member, io.BytesIO(b"evil"))
  data = buffer.getvalue()
  source = tmp_path / "bundle"
  source.mkdir()
  (source / "runs_bundle.part00").write_bytes(data)
  (source / "runs_bundle.json").write_text(json.dumps({
      "parts": [{"name": "runs_bundle.part00", "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()}], "steps": {}}))
  if not has_data_filter:
    monkeypatch.delattr(cifar_table.tarfile, "data_filter")
  with pytest.raises((ValueError, tarfile.TarError)):
    cifar_table.unbundle_runs(source, tmp_path / "runs")
  assert not (tmp_path / "evil.txt").exists()


def test_compare_pairs_two_tables_by_seed_and_needs_no_training_arguments(tmp_path, capsys):
  def table(accuracies):
    return {"runs": {f"safe-s0.9-seed{s}": {"method": "safe", "sparsity": 0.9, "seed": s,
                                            "accuracy": acc} for s, acc in accuracies.items()}}
  a, b = tmp_path / "bf16.json", tmp_path / "f32.json"
  a.write_text(json.dumps(table({0: 0.80, 1: 0.82, 2: 0.84, 3: 0.5})))
  b.write_text(json.dumps(table({0: 0.90, 1: 0.91, 2: 0.95})))  # seed 3 only in a
  cifar_table.main(["--compare", str(a), str(b)])
  (row,) = json.loads(capsys.readouterr().out)
  assert row["seeds"] == [0, 1, 2]
  assert row["difference_mean"] == pytest.approx(-10.0)
  assert row["difference_se"] == pytest.approx(((0.0 + 1.0 + 1.0) / 2) ** 0.5 / 3 ** 0.5)
  assert row["verdict"] == "reversed"
  with pytest.raises(SystemExit):
    cifar_table.main(["--runs", str(tmp_path)])
  assert "required to train: --data-dir, --throughput, --deadline-s" in capsys.readouterr().err


def _processes_bench():
  bench = _bench(9.73, 48.21)
  # 3 lone runs at once without MPS: faster than 3 one after another
  bench["cells"][2].update(mean_step_ms=12.0, mps_daemon=False)
  return bench


class _FakeChild:
  """A child ``cifar_table.py`` (``_start_child``) that runs its ``main`` in this process when
  waited for (so the tests' monkeypatches reach it); a raised error is rc 1 and a log line."""

  events: list = []
  preallocate: list = []  # XLA_PYTHON_CLIENT_PREALLOCATE when each main() loaded the data

  def __init__(self, command, log, env):
    self.command, self.env, self.log, self.returncode = command, env, log, None
    self.seed = int(command[command.index("--seeds") + 1])
    _FakeChild.events.append(("start", self.seed))

  def wait(self):
    _FakeChild.events.append(("wait", self.seed))
    assert self.command[1:3] == ["-m", "benchmarks.claims.cifar_table"]
    try:
      cifar_table.main(self.command[3:])
      self.returncode = 0
    except Exception as err:  # pylint: disable=broad-except
      self.log.write(f"Traceback: {err!r}\n")
      self.returncode = 1
    return self.returncode


def _processes_setup(tmp_path, monkeypatch, train_and_evaluate):
  # pylint: disable=import-outside-toplevel
  import types

  from safe_optax.vision import datasets, packing, sweeps, train
  throughput = tmp_path / "bench.json"
  throughput.write_text(json.dumps(_processes_bench()))
  def load_dataset(config, data_dir):
    del config, data_dir
    _FakeChild.preallocate.append(os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
    return types.SimpleNamespace(train_labels=[0] * 256)

  monkeypatch.setattr(datasets, "load_dataset", load_dataset)
  monkeypatch.setattr(packing, "train_packed", lambda *a, **k: pytest.fail("packed a cell"))
  monkeypatch.setattr(sweeps, "record", lambda c, results: {
      "method": c.method, "sparsity": c.sparsity, "seed": c.seed, "accuracy": results["acc"]})
  monkeypatch.setattr(train, "train_and_evaluate", train_and_evaluate)
  for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
    monkeypatch.setenv(name, "unset")  # so that the test leaves it as it was
    monkeypatch.delenv(name)
  monkeypatch.setattr(cifar_table, "_start_child", _FakeChild)
  _FakeChild.events, _FakeChild.preallocate = [], []
  table = tmp_path / "table.json"
  return table, ["--data-dir", "unused", "--runs", str(tmp_path / "runs"), "--table", str(table),
                 "--throughput", str(throughput), "--deadline-s", "1000", "--finish-s", "1",
                 "--methods", "safe", "--epochs", "1"]


def test_processes_start_a_lone_child_per_seed_at_once_and_merge_the_runs_they_finish(
    tmp_path, monkeypatch, capsys):
  # pylint: disable=import-outside-toplevel
  import types

  from safe_optax.vision import checkpoint as checkpoint_lib

  def train_and_evaluate(config, workdir, **kwargs):
    assert kwargs["on_step"] is not None  # each child keeps the deadline
    if config.seed == 2:  # the deadline stops this child after a checkpoint of step 5
      (pathlib.Path(workdir) / "checkpoints" / "5").mkdir(parents=True)
      raise checkpoint_lib.Interrupted(5, pathlib.Path(workdir) / "checkpoints")
    return types.SimpleNamespace(results={"acc": 0.9 + config.seed / 100})

  table, argv = _processes_setup(tmp_path, monkeypatch, train_and_evaluate)
  cifar_table.main(argv + ["--bundle", str(tmp_path / "returned")])  # auto picks processes
  assert '"layout": "processes"' in capsys.readouterr().out
  # the parent stops preallocating before it first uses the device (versions, data), and so
  # do its children (each a lone run, capped at its share)
  assert _FakeChild.preallocate == ["false"] * 4
  # all three children start before the first is waited for
  assert _FakeChild.events[:3] == [("start", 0), ("start", 1), ("start", 2)]
  runs = json.loads(table.read_text())["runs"]
  assert sorted(runs) == ["safe-s0.9-seed0", "safe-s0.9-seed1"]
  assert runs["safe-s0.9-seed1"]["accuracy"] == pytest.approx(0.91)
  bundle = json.loads((tmp_path / "returned" / "runs_bundle.json").read_text())
  assert bundle["steps"] == {"safe-s0.9-seed2": 5}


def test_a_processes_child_gets_a_share_of_the_memory_and_a_failed_one_is_named(
    tmp_path, monkeypatch):
  import types  # pylint: disable=import-outside-toplevel
  children = []
  real = _FakeChild.__init__

  def spy(self, command, log, env):
    real(self, command, log, env)
    children.append(self)

  monkeypatch.setattr(_FakeChild, "__init__", spy)

  def train_and_evaluate(config, workdir, **kwargs):
    del workdir, kwargs
    if config.seed == 1:
      raise FloatingPointError("NaN in the loss")
    return types.SimpleNamespace(results={"acc": 0.8})

  table, argv = _processes_setup(tmp_path, monkeypatch, train_and_evaluate)
  with pytest.raises(RuntimeError, match=r"(?s)a child failed: safe-s0\.9-seed1 \(rc 1\).*NaN"):
    cifar_table.main(argv + ["--layout", "processes", "--seeds", "0", "1"])
  # the child that finished is in the table; each child had half of 0.9 of the device memory
  assert sorted(json.loads(table.read_text())["runs"]) == ["safe-s0.9-seed0"]
  assert {c.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] for c in children} == {"0.4500"}
  command = children[0].command
  assert command[command.index("--layout") + 1] == "lone"
  assert float(command[command.index("--deadline-s") + 1]) <= 1000
  assert command[command.index("--start-s") + 1] == "30.0"  # the child plans as its parent
  # the rerun starts only the run still missing
  children.clear()
  with pytest.raises(RuntimeError, match="seed1"):
    cifar_table.main(argv + ["--layout", "processes", "--seeds", "0", "1"])
  assert [c.seed for c in children] == [1]


def test_the_plan_reads_the_cells_of_its_conv_impl_only():
  bench = _bench(9.73, 48.21)
  bench["cells"] += [{"model": "resnet20x2", "dtype": "float32", "runs": r, "mean_step_ms": ms,
                      "conv_impl": "im2col"} for r, ms in ((1, 8.0), (3, 12.0))]
  # cells written before the flag are XLA's convolutions
  assert cifar_table.layout_seconds(bench, "resnet20x2", "float32", 3) == {
      "pack": pytest.approx(0.04821), "lone": pytest.approx(0.02919)}
  assert cifar_table.layout_seconds(bench, "resnet20x2", "float32", 3, conv_impl="im2col") == {
      "pack": pytest.approx(0.012), "lone": pytest.approx(0.024)}
  with pytest.raises(ValueError, match="conv_impl 'im2col'"):
    cifar_table.step_seconds(bench, "resnet20x2", "bfloat16", 3, conv_impl="im2col")


@pytest.mark.parametrize("flag", ["--start-s", "--finish-s"])
def test_a_negative_start_or_finish_time_is_refused_naming_it(tmp_path, capsys, flag):
  with pytest.raises(SystemExit):
    cifar_table.main(["--data-dir", "x", "--runs", str(tmp_path), "--throughput", "x.json",
                      "--deadline-s", "10", flag, "-1"])
  assert f"{flag} must be >= 0 seconds, got -1.0" in capsys.readouterr().err


def test_throughput_files_of_another_batch_are_left_out_and_dry_runs_kept(tmp_path, capsys):

  def write(name, batch, lone_ms, **extra):
    path = tmp_path / name
    path.write_text(json.dumps({"settings": {"batch": batch}, **extra,
                                "cells": [_bench(lone_ms, 48.21)["cells"][0]]}))
    return str(path)

  # a lone run at batch 2048 (gpu_lease.sh step 7) first, then the table's batch
  paths = [write("b2048.json", 2048, 100.0), write("b128.json", 128, 9.73)]
  throughput = cifar_table.read_throughput(paths, 128)
  assert [c["mean_step_ms"] for c in throughput["cells"]] == [9.73]
  assert "b2048.json: measured at batch 2048, not the runs' 128: left out" in (
      capsys.readouterr().out)
  dry = write("dry.json", 8, 200.0, dry_run=True)  # a CPU check plans at its own batch
  assert len(cifar_table.read_throughput([dry], 128)["cells"]) == 1


def test_the_committed_h200_cells_give_each_mps_state_its_own_processes_cell():
  """The processes cells measured on the 2026-11-28 lease, with and without MPS, are each found
  under their own daemon state (before the MPS check was fixed, both read "no daemon": a plan
  made under MPS found no processes cell, one made without it could take the MPS one)."""
  results = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "perf" / "results"
  bench = cifar_table.read_throughput([str(results / "cifar_processes_gpu.json"),
                                       str(results / "cifar_processes_mps_gpu.json")], 128)
  under_mps = cifar_table.layout_seconds(bench, "resnet20x2", "float32", 3, mps=True)
  without = cifar_table.layout_seconds(bench, "resnet20x2", "float32", 3, mps=False)
  no_mps = cifar_table.read_throughput([str(results / "cifar_processes_gpu.json")], 128)
  assert without["processes"] == cifar_table.layout_seconds(
      no_mps, "resnet20x2", "float32", 3, mps=False)["processes"]
  # MPS ran the three processes' kernels at once: a shorter span than taking turns
  assert under_mps["processes"] < without["processes"]


def test_where_two_files_measure_the_same_cell_the_later_one_counts_in_every_layout(tmp_path):
  """A lease's fresh cells are passed after the committed ones (gpu_lease.sh step 4): the lone,
  pack and processes steps all come from the later file (the lone step once came from the
  first)."""
  old, new = _bench(20.0, 31.5)["cells"], _bench(9.73, 48.21)["cells"]
  new[-1] = dict(new[-1], mean_step_ms=2.0)  # the processes cell (1.0 in the old file)
  paths = [tmp_path / "old.json", tmp_path / "new.json"]
  for path, cells in zip(paths, (old, new)):
    path.write_text(json.dumps({"settings": {"batch": 128}, "cells": cells}))
  for order, (lone_ms, pack_ms, processes_ms) in (((0, 1), (9.73, 48.21, 2.0)),
                                                  ((1, 0), (20.0, 31.5, 1.0))):
    bench = cifar_table.read_throughput([str(paths[i]) for i in order], 128)
    assert cifar_table.layout_seconds(bench, "resnet20x2", "float32", 3, mps=True) == {
        "lone": pytest.approx(3 * lone_ms / 1e3), "pack": pytest.approx(pack_ms / 1e3),
        "processes": pytest.approx(processes_ms / 1e3)}
