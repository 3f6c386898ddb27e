"""One process of the multi-process tests (tests/test_distributed.py); not a test module.

Trains a small MLP with ``safe_optax.safe`` for ``--steps`` steps on a fixed
stream of global batches, each process feeding only its own rows of every
batch, optionally saving an Orbax checkpoint at ``--save-at`` and stopping
there (or going on, with ``--go-on``), or starting from the newest checkpoint in ``--checkpoint``. Process 0
writes the final parameters and masks to ``--out`` (``.npz``).

  python tests/distributed_worker.py --out p.npz --steps 12 \\
      [--coordinator 127.0.0.1:PORT --num-processes 2 --process-id I] [--devices N]

``--then`` separates several runs that each process makes one after the other
(one start of Python, JAX and the distributed runtime for all of them); the
launch flags and ``--devices`` apply to every run, wherever they stand.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--devices", type=int, default=1, help="forced CPU devices in this process")
  p.add_argument("--coordinator")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  p.add_argument("--checkpoint", help="Orbax checkpoint folder (resume from its newest step)")
  p.add_argument("--save-at", type=int, help="save a checkpoint after this step and stop")
  p.add_argument("--go-on", action="store_true", help="after --save-at, train to --steps")
  p.add_argument("--die-at", type=int, help="exit abruptly (code 3) before this step")
  return p.parse_args(argv)


THEN = "--then"  # separates the runs of one launch
SHARED = ("--coordinator", "--num-processes", "--process-id", "--devices")  # apply to every run


def split_runs(argv) -> list[list[str]]:
  """``argv`` cut at each ``--then``, the flags of ``SHARED`` added to every run."""
  runs, shared = [[]], []
  args = iter(argv)
  for arg in args:
    if arg == THEN:
      runs.append([])
    elif arg in SHARED:
      shared += [arg, next(args)]
    else:
      runs[-1].append(arg)
  return [run + shared for run in runs]


def main(argv=None) -> int:
  runs = [parse(run) for run in split_runs(sys.argv[1:] if argv is None else argv)]
  import process_launcher  # pylint: disable=import-outside-toplevel  (beside this script)
  os.environ["XLA_FLAGS"] = process_launcher.forced_devices_flags(runs[0].devices)
  for args in runs:
    code = run(args)
    if code:
      return code
  return 0


def run(args) -> int:
  """One run of the worker (the module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  import safe_optax  # pylint: disable=import-outside-toplevel
  from safe_optax import distributed  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import checkpoint  # pylint: disable=import-outside-toplevel

  distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                         timeout_seconds=60)
  mesh = distributed.data_mesh()
  replicated = distributed.replicated(mesh)

  sizes = (12, 16, 8, 3)
  keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
  params = {f"layer{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}

  def loss_fn(p, batch):
    x, y = batch
    for i in range(len(sizes) - 1):
      x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
      if i < len(sizes) - 2:
        x = jnp.tanh(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

  tx = safe_optax.safe(0.05, 0.75, penalty=0.1, rho=0.05, dual_every=4, total_steps=args.steps)
  params = jax.device_put(params, replicated)
  state = {"params": params, "opt": jax.jit(tx.init, out_shardings=replicated)(params),
           "step": jax.device_put(jnp.int32(0), replicated)}

  @jax.jit
  def step(state, batch):
    grad_fn = lambda p, _: jax.grad(loss_fn)(p, batch)
    grads = grad_fn(state["params"], 0)
    updates, opt = tx.update(grads, state["opt"], state["params"], grad_fn=grad_fn)
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
            "step": state["step"] + 1}

  ckpt = checkpoint.Checkpointer(args.checkpoint) if args.checkpoint else None
  if ckpt is not None and ckpt.latest_step() is not None:
    state = ckpt.restore(ckpt.latest_step(), state)
  rows = distributed.process_rows(mesh, args.batch)
  for t in range(int(state["step"].addressable_data(0)), args.steps):
    if args.die_at is not None and t == args.die_at:
      os._exit(3)  # a crashed peer: no shutdown, no goodbye to the coordinator
    # The global batch of step t is fixed; this process reads only its rows.
    rng = np.random.default_rng(t)
    x = rng.normal(size=(args.batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], size=args.batch).astype(np.int32)
    batch = distributed.global_batch(mesh, (x[rows], y[rows]), args.batch)
    state = step(state, batch)
    if args.save_at is not None and t + 1 == args.save_at:
      ckpt.save(t + 1, state)
      if not args.go_on:
        ckpt.close()
        return 0
  final = multihost_utils.process_allgather(state["params"], tiled=True)
  admm = safe_optax.find_admm_state(state["opt"])
  z = multihost_utils.process_allgather(admm.z, tiled=True)
  if distributed.is_primary():
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(final)}
    flat.update({"z/" + "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                 for path, v in jax.tree_util.tree_leaves_with_path(z)})
    flat["process_count"] = np.asarray(jax.process_count())
    flat["device_count"] = np.asarray(jax.device_count())
    np.savez(args.out, **flat)
  if ckpt is not None:
    ckpt.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
