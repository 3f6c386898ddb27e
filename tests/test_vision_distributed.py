"""``safe-optax-vision train`` under several processes (gloo collectives on localhost CPU).

The same tiny SAFE run (the ``mlp-mnist`` preset on a random MNIST-format data
set of 8 x 8 images written to a temporary folder: 99 training images in batches of 16, so
the short last batch of 3 is replicated instead of split) on three layouts:
two processes with one device each, one process with two forced host devices,
and one process with one device. Each process reads only its rows of every
batch. The final parameters (read back from each run's last checkpoint) must
agree, bit for bit on the same mesh shape, and so must the sparsity masks;
only process 0 may write anything but checkpoints; a run stopped by two
processes after its first epoch resumes in one process.

Run as a script, this module is the worker that :func:`process_launcher.launch`
starts: the ``safe-optax-vision`` command line, with ``--record-writes DIR``
(each process lists the files it opened for writing, found with an audit hook)
and ``--stop-after-epoch N``; ``--then`` separates several such runs that each
process makes one after the other (the launch flags apply to all of them).

Cost: each launch starts Python, JAX and the distributed runtime, so the five
runs take three launches: two processes (the uninterrupted run, then the run
stopped after its first epoch), one process with two devices (the stopped run
resumed, then the uninterrupted run) and one process with one device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import process_launcher  # noqa: E402  (the launcher shared with test_distributed)

N_TRAIN, N_TEST = 99, 29
RUN = ["train", "--preset", "mlp-mnist", "--method", "safe", "--sparsity", "0.8",
       "--test-only-split", str(N_TRAIN), str(N_TEST), "--epochs", "2", "--warmup-epochs", "0",
       "--batch-size", "16", "--dual-every", "4", "--bnt-samples", "32", "--no-progress"]
TWO_DEVICES = {"XLA_FLAGS": process_launcher.forced_devices_flags(2)}
ONE_DEVICE = {"XLA_FLAGS": process_launcher.forced_devices_flags(1)}


# ----------------------------------------------------------------------------- the worker


def _record_writes(workdir: pathlib.Path, written: set[str]) -> None:
  """Adds every file under ``workdir`` that this process writes to ``written``.

  A file written atomically (a temporary name, then ``os.replace``) counts
  under its final name, the rename's destination.
  """
  root = os.path.abspath(workdir)

  def hook(event, args):
    if event == "os.rename" and isinstance(args[1], (str, os.PathLike)):
      path, writes = os.path.abspath(os.fspath(args[1])), True
    elif event == "open" and isinstance(args[0], (str, os.PathLike)):
      path, mode, flags = os.path.abspath(os.fspath(args[0])), args[1], args[2]
      writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                else bool(flags & (os.O_WRONLY | os.O_RDWR)))
    else:
      return
    if writes and path.startswith(root + os.sep):
      written.add(os.path.relpath(path, root))

  sys.addaudithook(hook)


THEN = "--then"  # separates the runs that one launch makes, one after the other
LAUNCH_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def split_runs(argv: list[str]) -> list[list[str]]:
  """``argv`` cut at each ``--then``; the launch flags (which :func:`process_launcher.launch`
  appends to the end) are moved to the end of every run."""
  runs, launch = [[]], []
  args = iter(argv)
  for arg in args:
    if arg == THEN:
      runs.append([])
    elif arg in LAUNCH_FLAGS:
      launch += [arg, next(args)]
    else:
      runs[-1].append(arg)
  return [run + launch for run in runs]


def worker(argv: list[str]) -> int:
  """One process: each run of ``argv`` (:func:`split_runs`) in turn."""
  for run in split_runs(argv):
    _worker_run(run)
  return 0


def _worker_run(argv: list[str]) -> None:
  """One run: the ``safe-optax-vision`` command line, its writes recorded."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--record-writes")
  parser.add_argument("--stop-after-epoch", type=int)
  own, cli_argv = parser.parse_known_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import cli  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import train  # pylint: disable=import-outside-toplevel

  _, cli_args = cli._parse(cli_argv)  # pylint: disable=protected-access
  written: set[str] = set()
  _record_writes(pathlib.Path(cli_args.workdir), written)
  if own.stop_after_epoch is None:
    cli.main(cli_argv)
  else:  # the command's run, stopped with a checkpoint after this many epochs
    cli._join_runtime(cli_args.parser, cli_args)  # pylint: disable=protected-access
    config = cli._config(cli_args.parser, cli_args,  # pylint: disable=protected-access
                         method=cli_args.method, seed=cli_args.seed,
                         sparsity=cli_args.sparsity)
    train.train_and_evaluate(config, cli_args.workdir, data_dir=cli_args.data_dir,
                             stop_after_epoch=own.stop_after_epoch)
  if own.record_writes:
    out = pathlib.Path(own.record_writes) / f"process{jax.process_index()}.json"
    with open(out, "w", encoding="utf-8") as f:
      json.dump({"process_count": jax.process_count(), "device_count": jax.device_count(),
                 "written": sorted(written)}, f)


# ----------------------------------------------------------------------------- the tests


def _write_mnist(directory: pathlib.Path) -> None:
  import test_input_pipeline  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  n = N_TRAIN + N_TEST
  labels = rng.integers(0, 10, n).astype(np.uint8)
  # Brightness grows with the label, so there is something to learn.
  # 8 x 8 images keep the MLP's first layer small (64 x 300), so few weights lie within float
  # rounding of the top-k threshold, where one device and two could choose differently.
  images = np.clip(20 * labels[:, None, None] + rng.integers(0, 80, (n, 8, 8)), 0, 255)
  test_input_pipeline._write_idx(directory / "t10k-images-idx3-ubyte", images.astype(np.uint8))
  test_input_pipeline._write_idx(directory / "t10k-labels-idx1-ubyte", labels)


def _launch(root: pathlib.Path, num_processes: int, env: dict[str, str],
            *runs: tuple[str, ...]) -> None:
  """One launch of the worker that makes ``runs`` one after the other, each ``(record, workdir,
  *extra flags)``: the run trains in ``root / workdir`` and records its writes in
  ``root / record``."""
  argv: list[str] = []
  for record, name, *extra in runs:
    (root / record).mkdir(exist_ok=True)
    argv += [*([THEN] if argv else []), "--record-writes", str(root / record), *RUN,
             "--data-dir", str(root / "data"), "--workdir", str(root / name), *extra]
  process_launcher.launch(__file__, num_processes, *argv, env=env)


def _final(root: pathlib.Path, name: str) -> dict[str, np.ndarray]:
  """The final params and their projection's mask of a finished run, read in this process."""
  import jax  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import configs  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import datasets  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import programs as programs_lib  # pylint: disable=import-outside-toplevel
  workdir = root / name
  with open(workdir / "config.json", encoding="utf-8") as f:
    config = configs.from_dict(json.load(f))
  programs, state = programs_lib.restore_finished(config, workdir,
                                                  datasets.load_dataset(config, root / "data"))
  out = {}
  projected = programs.project(state.params)
  for (path, leaf), kept in zip(jax.tree_util.tree_leaves_with_path(state.params),
                                jax.tree.leaves(projected)):
    key = jax.tree_util.keystr(path)
    out[key] = np.asarray(leaf)
    out["mask" + key] = np.asarray(kept) != 0
  return out


def _results(root: pathlib.Path, name: str) -> dict:
  with open(root / name / "results.json", encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every run of the tests, in three launches (the module docstring). ``resumed`` is stopped
  by the two processes after its first epoch (its writes in ``stopped-writes``, its workdir as it
  was then in ``stopped``) and finished by the two-device process, as the first run of that
  launch (a fresh process resumes it)."""
  root = tmp_path_factory.mktemp("vision_distributed")
  (root / "data").mkdir()
  _write_mnist(root / "data")
  _launch(root, 2, ONE_DEVICE, ("two_processes-writes", "two_processes"),
          ("stopped-writes", "resumed", "--stop-after-epoch", "1"))
  stopped = {"results": (root / "resumed" / "results.json").exists(),
             "checkpoints": sorted(p.name for p in (root / "resumed" / "checkpoints").iterdir()
                                   if p.name.isdigit())}
  _launch(root, 1, TWO_DEVICES, ("resumed-writes", "resumed"),
          ("two_devices-writes", "two_devices"))
  _launch(root, 1, ONE_DEVICE, ("one_device-writes", "one_device"))
  records = {name: root / f"{name}-writes" for name in
             ("two_processes", "two_devices", "one_device", "stopped", "resumed")}
  return root, records, stopped


def _writes(record: pathlib.Path) -> dict[int, dict]:
  return {int(p.stem.removeprefix("process")): json.loads(p.read_text())
          for p in record.glob("process*.json")}


@pytest.mark.slow
def test_two_processes_form_one_global_mesh(runs):
  root, records, _ = runs
  two = _writes(records["two_processes"])
  assert sorted(two) == [0, 1]
  assert all(w["process_count"] == 2 and w["device_count"] == 2 for w in two.values())
  assert _writes(records["two_devices"])[0]["device_count"] == 2
  assert _results(root, "two_processes")["versions"]["device_count"] == 2


@pytest.mark.slow
def test_only_process_0_writes_outside_the_checkpoints(runs):
  _, records, _ = runs
  writes = _writes(records["two_processes"])
  outside = {i: [p for p in w["written"] if not p.startswith("checkpoints")]
             for i, w in writes.items()}
  assert outside[1] == []
  assert {"config.json", "metrics.jsonl", "results.json", "accuracy.png"} <= set(outside[0])
  # Orbax: both processes take part in writing the checkpoints.
  assert any(p.startswith("checkpoints") for p in writes[0]["written"])


@pytest.mark.slow
def test_two_processes_match_one_process_with_two_devices(runs):
  root, _, _ = runs
  a, b = _final(root, "two_processes"), _final(root, "two_devices")
  assert a.keys() == b.keys()
  for key in a:  # the same program over the same mesh shape: the same bits
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  assert _results(root, "two_processes")["final"] == _results(root, "two_devices")["final"]
  history = [r["train_loss"] for r in _results(root, "two_processes")["history"]]
  assert history == [r["train_loss"] for r in _results(root, "two_devices")["history"]]
  assert _results(root, "two_processes")["history"][-1]["train_examples"] == N_TRAIN


@pytest.mark.slow
def test_two_processes_match_one_device(runs):
  root, _, _ = runs
  a, b = _final(root, "two_processes"), _final(root, "one_device")
  for key in a:
    if key.startswith("mask"):
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    else:  # one device sums the batch in another order: equal to float rounding
      np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6, err_msg=key)
  # Not a trivial agreement: the projection keeps 20 % of the prunable weights.
  kept = [v for k, v in a.items() if k.startswith("mask") and v.ndim > 1]
  assert sum(int(v.sum()) for v in kept) / sum(v.size for v in kept) == pytest.approx(0.2,
                                                                                      abs=1e-3)


@pytest.mark.slow
def test_a_run_stopped_by_two_processes_resumes_in_one(runs):
  root, records, stopped = runs
  assert not stopped["results"]
  assert stopped["checkpoints"] == [str(-(-N_TRAIN // 16))]
  two = _writes(records["stopped"])
  assert sorted(two) == [0, 1] and all(w["process_count"] == 2 for w in two.values())
  assert [w for w in two[1]["written"] if not w.startswith("checkpoints")] == []
  one = _writes(records["resumed"])
  assert sorted(one) == [0] and one[0]["process_count"] == 1 and one[0]["device_count"] == 2
  a, b = _final(root, "resumed"), _final(root, "two_devices")
  for key in b:  # resumed on the mesh shape of the uninterrupted run: bit-identical
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  history = _results(root, "resumed")["history"]
  assert [r["epoch"] for r in history] == [0, 1]
  assert [r["train_loss"] for r in history] == [
      r["train_loss"] for r in _results(root, "two_devices")["history"]]


def test_bad_launch_flags_are_named(capsys):
  from safe_optax.vision import cli  # pylint: disable=import-outside-toplevel
  for flags, message in [
      (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"],
       r"['--process-id'] is missing"),
      (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
       "--process-id must lie in [0, 2) for --num-processes=2, got 2"),
      (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
       "--coordinator must be 'host:port'"),
  ]:
    with pytest.raises(SystemExit) as info:
      cli.main(["train", "--preset", "mlp-mnist", "--data-dir", "nowhere", "--workdir",
                "nowhere", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


if __name__ == "__main__":
  sys.exit(worker(sys.argv[1:]))
