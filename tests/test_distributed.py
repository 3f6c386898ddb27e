"""Multi-process training on JAX's distributed runtime (gloo collectives on localhost CPU).

The same SAFE run (tests/distributed_worker.py: an MLP, a fixed stream of
global batches, dual updates every 4 steps) on three layouts: one process with
one device, one process with two forced host devices, and two processes with
one device each, each process feeding only its own rows. The parameters and
the sparse targets must agree; checkpoints written by one layout resume in
another.

Cost: each launch starts Python, JAX and the distributed runtime, so the runs
take three launches (the worker's ``--then``): one process (the uninterrupted
run, saving a checkpoint on the way), two processes (the one-process checkpoint
resumed, the uninterrupted run, then a run whose processes die) and one process
with two devices (the two-process checkpoint resumed, then the uninterrupted
run). A resumed run is the first of its launch: a fresh process resumes it.
"""

from __future__ import annotations

import os
import pathlib
import sys

import jax
import numpy as np
import pytest

from safe_optax import distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import process_launcher  # noqa: E402  (the launcher shared with test_vision_distributed)

WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")
THEN = "--then"  # between the runs of one launch (tests/distributed_worker.py)
STEPS = 12
TIMEOUT = process_launcher.TIMEOUT


def launch(num_processes: int, *args: str, timeout: float = TIMEOUT) -> float:
  """Runs the worker as ``num_processes`` processes (:func:`process_launcher.launch`)."""
  return process_launcher.launch(WORKER, num_processes, *args, timeout=timeout)


def _load(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def _weights(run: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {k: v for k, v in run.items() if k not in ("process_count", "device_count")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
  """The three layouts, uninterrupted; one process and two processes also save a checkpoint at
  step 6 on the way (``checkpoints``), which the other layout resumes (``resumed_in_one``,
  ``resumed_in_two``). The two-process launch ends with a run whose processes exit abruptly at
  step 2: the error of that launch is ``dead_peer`` (None if it ended well)."""
  root = tmp_path_factory.mktemp("distributed")
  save = lambda name: ("--save-at", "6", "--go-on", "--checkpoint", str(root / f"ckpt_{name}"))
  steps = ("--steps", str(STEPS))
  launch(1, "--out", str(root / "one.npz"), *steps, *save("one"))
  dead_peer = None
  try:
    launch(2, "--out", str(root / "resumed_in_two.npz"), *steps, "--checkpoint",
           str(root / "ckpt_one"),
           THEN, "--out", str(root / "two_processes.npz"), *steps, *save("two_processes"),
           THEN, "--out", str(root / "dead.npz"), *steps, "--die-at", "2")
  except RuntimeError as err:
    dead_peer = err
  launch(1, "--out", str(root / "resumed_in_one.npz"), *steps, "--checkpoint",
         str(root / "ckpt_two_processes"),
         THEN, "--out", str(root / "two_devices.npz"), *steps, "--devices", "2")
  names = ("one", "two_devices", "two_processes", "resumed_in_one", "resumed_in_two")
  runs_ = {name: _load(root / f"{name}.npz") for name in names}
  runs_["checkpoints"] = {name: root / f"ckpt_{name}" for name in ("one", "two_processes")}
  runs_["dead_peer"] = dead_peer
  return runs_


@pytest.mark.slow
def test_two_processes_form_one_global_mesh(runs):
  assert int(runs["two_processes"]["process_count"]) == 2
  assert int(runs["two_processes"]["device_count"]) == 2
  assert int(runs["two_devices"]["process_count"]) == 1
  assert int(runs["two_devices"]["device_count"]) == 2


@pytest.mark.slow
def test_two_processes_match_one_process_with_two_devices(runs):
  # The same program over the same mesh shape: the same bits.
  a, b = _weights(runs["two_processes"]), _weights(runs["two_devices"])
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_two_processes_match_one_device(runs):
  # One device reduces the batch in another order: equal to float rounding.
  a, b = _weights(runs["two_processes"]), _weights(runs["one"])
  for name in a:
    np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(a[name] != 0, b[name] != 0, err_msg=f"mask of {name}")


@pytest.mark.slow
def test_sparse_target_has_the_requested_sparsity(runs):
  # Not a trivial agreement: the dual updates ran and z is 75 % sparse over the kernels.
  z = [v for k, v in _weights(runs["two_processes"]).items() if k.startswith("z/")]
  total = sum(v.size for v in z)
  assert sum(int(np.count_nonzero(v)) for v in z) == total - int(0.75 * total)


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_one(runs):
  ckpt = runs["checkpoints"]["two_processes"]
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["6"]
  resumed, straight = _weights(runs["resumed_in_one"]), _weights(runs["two_devices"])
  assert int(runs["resumed_in_one"]["process_count"]) == 1
  assert int(runs["resumed_in_one"]["device_count"]) == 2
  for name in straight:
    # Same mesh shape as the uninterrupted run: bit-identical.
    np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


@pytest.mark.slow
def test_checkpoint_of_one_process_resumes_in_two(runs):
  ckpt = runs["checkpoints"]["one"]
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["6"]
  resumed, straight = _weights(runs["resumed_in_two"]), _weights(runs["one"])
  assert int(runs["resumed_in_two"]["process_count"]) == 2
  for name in straight:
    # Steps 7-12 ran on two devices instead of one: equal to float rounding.
    np.testing.assert_allclose(resumed[name], straight[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_a_dead_peer_fails_the_launch_fast(runs):
  # The last run of the two-process launch: its processes exit with 3 at step 2.
  with pytest.raises(RuntimeError, match=r"exited with 3"):
    if runs["dead_peer"] is not None:
      raise runs["dead_peer"]


# ---- launch settings (no processes) ----------------------------------------------------------


def test_no_settings_means_one_process():
  assert distributed.resolve_launch(environ={}) is None
  assert distributed.initialize() == jax.process_count() == 1


@pytest.mark.parametrize("environ, cluster", [
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"}, "slurm"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}, None),
    ({"SLURM_JOB_ID": "1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "openmpi"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "many"}, None),
])
def test_detected_cluster(environ, cluster):
  assert distributed.detected_cluster(environ) == cluster
  launch_ = distributed.resolve_launch(environ=environ)
  assert (launch_ is None) == (cluster is None)
  if cluster is not None:
    assert launch_ == distributed.Launch(None, None, None, cluster)


def test_arguments_win_over_environment():
  env = {distributed.ENV_COORDINATOR: "h:1", distributed.ENV_NUM_PROCESSES: "4",
         distributed.ENV_PROCESS_ID: "3", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"}
  assert distributed.resolve_launch("c:2", 2, 0, environ=env) == distributed.Launch(
      "c:2", 2, 0, "arguments")
  assert distributed.resolve_launch(environ=env) == distributed.Launch(
      "h:1", 4, 3, "environment")


@pytest.mark.parametrize("args, match", [
    (("127.0.0.1:1234", None, 0), r"\['num_processes'\] is missing"),
    ((None, 2, None), r"\['coordinator', 'process_id'\] are missing"),
    (("127.0.0.1", 2, 0), r"coordinator must be 'host:port'"),
    (("127.0.0.1:99999", 2, 0), r"port in 1..65535"),
    (("127.0.0.1:1234", 0, 0), r"num_processes must be >= 1"),
    (("127.0.0.1:1234", 2, -1), r"process_id must lie in \[0, 2\)"),
    (("127.0.0.1:1234", "two", 0), r"num_processes must be an integer"),
    (("127.0.0.1:1234", 2.5, 0), r"num_processes must be an integer"),
])
def test_bad_launch_settings_name_the_argument(args, match):
  with pytest.raises(ValueError, match=match):
    distributed.resolve_launch(*args, environ={})


def test_bad_environment_names_the_variable():
  env = {distributed.ENV_COORDINATOR: "h:1", distributed.ENV_NUM_PROCESSES: "2"}
  with pytest.raises(ValueError, match=distributed.ENV_PROCESS_ID):
    distributed.resolve_launch(environ=env)


def test_single_process_launch_initializes_nothing():
  assert distributed.initialize("127.0.0.1:1234", 1, 0) == 1
  assert not jax.distributed.is_initialized()


def test_process_rows_and_global_batch_in_one_process():
  mesh = distributed.data_mesh()
  assert distributed.process_rows(mesh, 6) == slice(0, 6)
  batch = distributed.global_batch(mesh, {"x": np.ones((6, 2)), "y": np.arange(6)})
  assert batch["x"].shape == (6, 2)
  np.testing.assert_array_equal(np.asarray(batch["y"]), np.arange(6))
  with pytest.raises(ValueError, match=r"rows 0..6 of the global batch of 6"):
    distributed.global_batch(mesh, np.ones((4, 2)), size=6)
