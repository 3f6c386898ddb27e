"""SAFE's block step with the calibration windows on the device against minibatches from the host.

``safe_optax.llm.block.safe_block`` on one device keeps a block's calibration
windows and dense targets on the device and gathers each minibatch inside the
jitted step (``device``). Before, every step gathered its minibatch on the
host and sent it over (``host``; still the several-device path, here over a
one-device mesh): two copies of ``batch x seqlen x hidden`` floats a step.
Both give the same weights bit for bit (``tests/test_llm_prune.py``); this
script times them side by side in one process, alternating, on one block of
SmolLM2-135M's shape (the standard rows of issue 33) or LLaMA-2-7B's (``--shape tiny``: a dry run).

``--packs 3``: also ``pack3``, three calibration sets' SAFE steps as one
vmapped program (``safe_optax.llm.block.safe_blocks``, what ``safe-optax-llm
prune --seed 0 1 2`` runs); its time a step is per calibration set (the
pack's step over 3), so ``device / pack3`` is the pack's speed-up per seed.

Time a step: each layout runs ``--epochs`` A and B (one compiled warm-up of
each first); the step time is the difference of the two block times over the
extra steps, which cancels the setup and the final projection. ``--repeats``
alternations; the table gives the median and the ratio host / device.

  python -m benchmarks.perf.llm_safe_step                                # SmolLM2 block, 64 x 512
  python -m benchmarks.perf.llm_safe_step --windows 8 --seqlen 128 --epochs 1,3   # CPU dry run
  python -m benchmarks.perf.llm_safe_step --packs 3 6                      # and packs of seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import numpy as np

from benchmarks import harness

OUT = pathlib.Path(__file__).resolve().parent / "results" / "llm_safe_step.json"
SHAPES = {
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3},
    "llama7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_heads": 32,
                "num_kv_heads": 32},
    # A dry run's: every layout and pack compiled and timed, in seconds on a CPU.
    "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "num_kv_heads": 2},
}
LAYOUTS = ("device", "host")


def _epochs(text: str) -> tuple[int, int]:
  try:
    a, b = (int(v) for v in text.split(","))
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"--epochs: expected A,B (two integers), got {text!r}") from e
  if not 1 <= a < b:
    raise argparse.ArgumentTypeError(f"--epochs: need 1 <= A < B, got {a},{b}")
  return a, b


def pack_pays(report: dict, device_kind: str, pack_min: float) -> bool | None:
  """Whether ``report`` (this script's JSON, with ``--packs 3``) found a pack of 3 calibration
  seeds at least ``pack_min`` times as fast per seed as a lone prune; None where it was
  measured on another device kind than ``device_kind`` (its verdict does not carry over).

  Examples:
    >>> report = {"device_over_pack": {"pack3": 1.16}, "versions": {"device_kind": "NVIDIA H200"}}
    >>> pack_pays(report, "NVIDIA H200", 1.2), pack_pays(report, "NVIDIA H200", 1.1)
    (False, True)
    >>> pack_pays(report, "NVIDIA H100 80GB HBM3", 1.2) is None
    True
  """
  if report["versions"]["device_kind"] != device_kind:
    return None
  return bool(report["device_over_pack"]["pack3"] >= pack_min)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
  parser.add_argument("--windows", type=int, default=64)
  parser.add_argument("--seqlen", type=int, default=512)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--epochs", type=_epochs, default=(2, 6), help="A,B epochs (A < B)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--method", choices=("safe", "safe-plus"), default="safe")
  parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                      help="the lone layouts to time (device: the one-device path); a pack "
                           "is compared with 'device', which --packs needs")
  parser.add_argument("--packs", type=int, nargs="*", default=[],
                      help="also time packs of this many calibration sets (each at least 2)")
  parser.add_argument("--out", default=str(OUT))
  parser.add_argument("--pack-decision", metavar="FILE", default=None,
                      help="measure nothing: print 1 if FILE (this script's JSON with --packs 3, "
                           "from this device kind) found the pack at least --pack-min times as "
                           "fast per seed, 0 if not, nothing if FILE was measured on another "
                           "device kind (llm_gpu_lease.sh run packs the prunes on 1)")
  parser.add_argument("--pack-min", type=float, default=1.2)
  args = parser.parse_args(argv)
  if args.pack_min <= 0:
    parser.error(f"--pack-min must be > 0 (a speed-up per seed), got {args.pack_min}")
  if args.pack_decision is not None:
    import jax  # pylint: disable=import-outside-toplevel
    report = json.loads(pathlib.Path(args.pack_decision).read_text(encoding="utf-8"))
    if "pack3" not in report.get("device_over_pack", {}):
      parser.error(f"--pack-decision {args.pack_decision}: no pack of 3 timed there "
                   "(this script's JSON with --packs 3)")
    pays = pack_pays(report, jax.devices()[0].device_kind, args.pack_min)
    print("" if pays is None else int(pays))
    return
  for flag in ("windows", "seqlen", "batch_size", "repeats"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
  if any(n < 2 for n in args.packs) or len(set(args.packs)) != len(args.packs):
    parser.error(f"--packs: distinct lane counts of at least 2, got {args.packs}")
  if args.packs and "device" not in args.layouts:
    parser.error("--packs: a pack is compared with the 'device' layout; add it to --layouts")
  if args.windows < args.batch_size:
    parser.error(f"--windows ({args.windows}) must be at least --batch-size ({args.batch_size})")

  import jax  # pylint: disable=import-outside-toplevel
  from safe_optax.llm import block, model, prune_config  # pylint: disable=import-outside-toplevel

  start = time.perf_counter()
  config = model.LlamaConfig(vocab_size=256, num_layers=1, **SHAPES[args.shape])
  params = model.init_params(config)["layers_0"]
  rng = np.random.default_rng(0)
  x = rng.normal(size=(args.windows, args.seqlen, config.hidden_size)).astype(np.float32)
  _, forward_with_stats = block.block_fns(config, with_hessian=False)
  y, stats = forward_with_stats(params, x)
  y = np.asarray(y)
  norms = (block.map_linears(lambda k: jax.numpy.sqrt(stats[model.LINEAR_INPUTS[k]]["sq"]))
           if args.method == "safe-plus" else None)
  meshes = {"device": None,
            "host": jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))}
  steps_per_epoch = args.windows // args.batch_size
  # A pack's lanes: the same windows and targets (the step's cost does not depend on
  # their values), each lane with its own minibatch order.
  lanes = {f"pack{n}": n for n in args.packs}
  layouts = tuple(args.layouts) + tuple(lanes)

  def block_seconds(layout: str, epochs: int) -> float:
    cfg = prune_config.PruneConfig(args.method, epochs=epochs, warmup_epochs=1,
                                   batch_size=args.batch_size)
    t0 = time.perf_counter()
    if layout in lanes:
      n = lanes[layout]
      cfgs = [dataclasses.replace(cfg, seed=s) for s in range(n)]
      stacked = None if norms is None else jax.tree.map(lambda a: np.stack([a] * n), norms)
      pruned = block.safe_blocks(config, params, np.stack([x] * n), np.stack([y] * n), cfgs,
                                 stacked)
    else:
      pruned, _ = block.safe_block(config, params, x, y, cfg, norms, meshes[layout])
    jax.block_until_ready(pruned)
    return time.perf_counter() - t0

  for layout in layouts:  # compile every layout at both epoch counts
    for epochs in args.epochs:
      block_seconds(layout, epochs)
  extra_steps = (args.epochs[1] - args.epochs[0]) * steps_per_epoch
  step_ms: dict[str, list[float]] = {layout: [] for layout in layouts}
  for _ in range(args.repeats):
    for layout in layouts:
      short, long = (block_seconds(layout, e) for e in args.epochs)
      # Per calibration set: a pack's step serves all its lanes.
      step_ms[layout].append(1e3 * (long - short) / extra_steps / lanes.get(layout, 1))
  median = {layout: float(np.median(v)) for layout, v in step_ms.items()}
  report = {
      "benchmark": "llm_safe_step", "shape": args.shape, "config": SHAPES[args.shape],
      "method": args.method, "windows": args.windows, "seqlen": args.seqlen,
      "batch_size": args.batch_size, "epochs": list(args.epochs), "repeats": args.repeats,
      "steps_per_epoch": steps_per_epoch, "step_ms": step_ms, "median_step_ms": median,
      "host_over_device": (median["host"] / median["device"]
                           if {"host", "device"} <= set(median) else None),
      "packs": args.packs,
      # > 1: a pack steps each calibration set faster than a lone run does.
      "device_over_pack": {layout: median["device"] / median[layout] for layout in lanes},
      "tokens_per_step": args.batch_size * args.seqlen,
      **harness.run_record(),
  }
  print(f"{args.shape} block, {args.method}, {args.batch_size} x {args.seqlen} tokens a step, "
        f"{jax.devices()[0].device_kind}")
  print("| calibration | ms a step per calibration set (median) | runs |")
  print("|---|---|---|")
  for layout in layouts:
    print(f"| {layout} | {median[layout]:.2f} | "
          + ", ".join(f"{v:.2f}" for v in step_ms[layout]) + " |")
  if report["host_over_device"] is not None:
    print(f"host / device: {report['host_over_device']:.3f}")
  for layout, ratio in report["device_over_pack"].items():
    print(f"device / {layout} (speed-up per calibration set): {ratio:.3f}")
  harness.write_report(report, args.out, start)


if __name__ == "__main__":
  main()
