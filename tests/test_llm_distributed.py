"""LLM pruning over two processes (gloo on localhost) gives one process's bits.

Two layouts of the same tiny random LLaMA pruned with SAFE+ (SAM's two
gradients, the dual steps, Wanda's norms) and SparseGPT (the Hessians): two
processes with one device each (``jax.distributed``), and one process. Both
use the fixed-order engine (:mod:`safe_optax.llm.fixed_order`, the default
with several processes); the pruned weights and the reconstruction errors
must be equal bit for bit, in both processes. Also: ``safe-optax-llm prune``
over two processes writes one export, equal to one process's, and a process
count that does not divide the windows is refused naming ``--nsamples``.

Run as a script, this module is the worker :func:`process_launcher.launch` starts.
Each launch (one process, then two) runs the command line first, in fresh
processes that it joins to the distributed runtime as a user's launch does, and
then prunes with the library in the same processes: three processes in all. The
one process draws the model's parameters (``model.init_params``) and saves them;
the two processes prune those same parameters, read from the file.
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
import process_launcher  # noqa: E402
from test_llm_cli import make_tiny  # noqa: E402  (the tiny checkpoint of test_llm_cli's "tiny")

METHODS = ("safe-plus", "sparsegpt")
ONE_DEVICE = {"XLA_FLAGS": process_launcher.forced_devices_flags(1)}
TIMEOUT = 400  # a hang guard: two processes on 2 cores shared with other jobs can be slow


def _cli_argv(model, calib, out):
  """``safe-optax-llm prune`` of the tiny checkpoint with Wanda (the launcher's flags follow)."""
  return ["prune", "--model", str(model), "--method", "wanda", "--calib", str(calib),
          "--nsamples", "4", "--seqlen", "16", "--out", str(out), "--no-progress"]


def _worker(argv):
  """The command line, then the library's prunes (saved to ``OUT.<process>.npz``)."""
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--cli-model", required=True)
  parser.add_argument("--cli-calib", required=True)
  parser.add_argument("--cli-out", required=True)
  parser.add_argument("--cli-fixed-order", action="store_true")
  parser.add_argument("--params", required=True, help="the one process saves, two read")
  parser.add_argument("--coordinator")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  args = parser.parse_args(argv)
  # First the command line, in a fresh process as a user's launch starts it: it joins the
  # distributed runtime from the launcher's flags before anything touches a device.
  from safe_optax.llm import cli
  launch = ([] if args.coordinator is None else
            ["--coordinator", args.coordinator, "--num-processes", str(args.num_processes),
             "--process-id", str(args.process_id)])
  fixed = ["--fixed-order"] if args.cli_fixed_order else []
  code = cli.main(_cli_argv(args.cli_model, args.cli_calib, args.cli_out) + fixed + launch)
  if code:
    sys.exit(code)
  from safe_optax import distributed
  # Joined already (a no-op); one process: nothing to join.
  assert distributed.initialize(args.coordinator, args.num_processes,
                                args.process_id) == (args.num_processes or 1)
  _prune_with_the_library(args.out, pathlib.Path(args.params))


def _prune_with_the_library(out, saved):
  import jax
  import jax.numpy as jnp
  from flax import serialization
  from safe_optax.llm import model, prune
  cfg = model.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                          num_layers=1, num_heads=4, num_kv_heads=2)
  if jax.process_count() == 1:  # draws the parameters (compiling init's programs once, here)
    params = model.init_params(cfg)
    saved.write_bytes(serialization.msgpack_serialize(params))
  else:  # the one process's parameters, as they were saved
    params = jax.tree.map(jnp.asarray, serialization.msgpack_restore(saved.read_bytes()))
  calib = np.random.default_rng(0).integers(0, 32, (8, 8))
  results = {}
  for method in METHODS:
    pc = prune.PruneConfig(method, epochs=2, batch_size=4, dual_every=2, learning_rate=3e-3)
    pruned, report = prune.prune_model(cfg, params, calib, pc, progress=False, fixed_order=True)
    for i in range(cfg.num_layers):
      for path, leaf in jax.tree_util.tree_leaves_with_path(pruned[f"layers_{i}"]):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        results[f"{method}/{i}/{name}"] = np.asarray(leaf)
      results[f"{method}/{i}/error"] = np.asarray(report["blocks"][i]["relative_error"])
  np.savez(f"{out}.{jax.process_index()}.npz", **results)


def _load(path):
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


@pytest.fixture(name="launches", scope="module")
def fixture_launches(tmp_path_factory):
  """One launch of one process and one of two; each runs the command line (the one process
  with ``--fixed-order``), then prunes with the library. Returns the folder."""
  tmp = tmp_path_factory.mktemp("llm_mp")
  model, calib = make_tiny(tmp)
  for name, processes, fixed in (("one", 1, ["--cli-fixed-order"]), ("two", 2, [])):
    process_launcher.launch(
        __file__, processes, str(tmp / name), "--cli-model", str(model), "--cli-calib",
        str(calib), "--cli-out", str(tmp / f"cli_{name}"), *fixed,
        "--params", str(tmp / "params.msgpack"), env=ONE_DEVICE, timeout=TIMEOUT)
  return tmp


@pytest.fixture(scope="module")
def layouts(launches):
  return (_load(launches / "one.0.npz"), _load(launches / "two.0.npz"),
          _load(launches / "two.1.npz"))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_two_processes_prune_bit_for_bit_like_one(layouts, method):
  one, two0, two1 = layouts
  names = [k for k in one if k.startswith(method + "/")]
  assert names and set(names) == {k for k in two0 if k.startswith(method + "/")}
  for name in names:
    # Bit for bit: the same float32 (or float64 error) bytes, in both processes.
    assert one[name].tobytes() == two0[name].tobytes(), name
    assert two0[name].tobytes() == two1[name].tobytes(), name


@pytest.mark.slow
def test_pruning_did_prune(layouts):
  one = layouts[0]
  kernels = [k for k in one if k.endswith("kernel")]
  assert len(kernels) == len(METHODS) * 7
  for name in kernels:
    assert (one[name] == 0).mean() == 0.5, name
  # SAFE+ moved the kept weights: the methods disagree.
  assert not np.array_equal(one["safe-plus/0/mlp/up_proj/kernel"],
                            one["sparsegpt/0/mlp/up_proj/kernel"])


@pytest.mark.slow
def test_cli_two_processes_write_one_export_like_one_process(launches):
  """``safe-optax-llm prune`` (Wanda, the tiny checkpoint): two processes write one export,
  bit for bit the one process's ``--fixed-order`` export."""
  one, two = launches / "cli_one", launches / "cli_two"
  from safetensors.numpy import load_file
  got, want = load_file(str(two / "model.safetensors")), load_file(str(one / "model.safetensors"))
  assert set(got) == set(want)
  for name, weight in want.items():
    assert weight.tobytes() == got[name].tobytes(), name
  report = json.loads((two / "report.json").read_text())
  assert report["processes"] == 2 and report["fixed_order"]
  assert json.loads((one / "report.json").read_text())["processes"] == 1
  assert not (two / "prune_state").exists()


def test_layout_that_does_not_split_is_refused(monkeypatch):
  import jax
  from safe_optax import distributed
  from safe_optax.llm import fixed_order, prune
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"3 calibration windows \(--nsamples\) cannot be split "
                                       r"over 2 processes"):
    fixed_order.check_layout(3, prune.PruneConfig("wanda"))
  with pytest.raises(ValueError, match=r"3 windows a batch \(--batch-size\).*divides it"):
    fixed_order.check_layout(12, prune.PruneConfig("safe", batch_size=3))
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  with pytest.raises(ValueError, match="power of two"):
    distributed.process_items(6)


def test_fixed_order_sums_are_tree_sums():
  from safe_optax import distributed

  def reference(items):  # the recursive halving, in plain float32 numpy
    if len(items) == 1:
      return items[0]
    mid = len(items) // 2
    return np.float32(reference(items[:mid]) + reference(items[mid:]))

  rng = np.random.default_rng(0)
  for n in (1, 2, 3, 5, 8, 13):
    items = [np.float32(v) for v in rng.standard_normal(n) * 10.0 ** rng.integers(-4, 8, n)]
    assert np.float32(distributed.tree_sum(items)) == reference(items), n
  assert distributed.process_items(8) == slice(0, 8)  # one process holds every item


if __name__ == "__main__":
  _worker(sys.argv[1:])
