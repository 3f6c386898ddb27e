"""Throughput of packed vision runs: one run, then 3, 6, 9, 15 runs as one vmapped program.

The programs are the trainer's own: ``safe_optax.vision.programs.build_programs``
of the preset (``resnet20x2-cifar10``, ``vgg19-cifar10``) with ``--method``
(SAFE by default) at batch ``--batch``, and for ``N`` runs
``safe_optax.vision.packing.packed_programs`` (``jax.vmap`` of that step over a
run axis, what ``safe-optax-vision sweep --pack N`` runs). Pack size 1 is the
lone run's own jitted step (today's trainer), not a vmap of one.

For each model, dtype (``float32``; ``bfloat16`` compute with float32 weights
and optimizer state) and pack size: the median of ``--steps`` plain steps
(after ``--warmup``), the median of ``--dual-steps`` dual programs (the
ADMM-type methods' projection and dual update, one step in ``dual_every``),
the step of an average ``dual_every`` window, images/s per run and for the
pack, and the FLOP/s achieved: XLA's cost analysis of the compiled plain step
(``jitted.lower(...).compile().cost_analysis()["flops"]``) over its median
time. Inputs are random CIFAR-shaped uint8 batches (one per run), so the input
pipeline is not timed; augmentation is (it runs inside the step).

``--deadline-s``: cells not started before it are skipped, and the JSON is
rewritten after every cell, so a lease cut short keeps what it measured.
``--dry-run``: batch 8, two steps, packs 1 and 3, for checking on a CPU; its
JSON says ``"dry_run": true`` and measures nothing about a GPU.

Usage (first thing on a GPU lease)::

  python benchmarks/perf/cifar_pack_throughput.py --deadline-s 300 \\
      --out benchmarks/perf/results/cifar_pack_throughput_gpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from _common import run_record, summary, write_report  # noqa: E402
from safe_optax.vision import configs  # noqa: E402
from safe_optax.vision import packing  # noqa: E402
from safe_optax.vision import programs as programs_lib  # noqa: E402
from safe_optax.vision import steps as steps_lib  # noqa: E402

PRESETS = {"resnet20x2": "resnet20x2-cifar10", "vgg19": "vgg19-cifar10"}
NUM_TRAIN, IMAGE = 50_000, (32, 32, 3)


def flops_of(compiled: Any) -> float | None:
  """The FLOP count of XLA's cost analysis (a dict, or a list of one per program)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None


def timed(fn, *args) -> tuple[Any, float]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def bench(config: configs.Config, runs: int, steps: int, warmup: int, dual_steps: int
          ) -> dict[str, Any]:
  """One cell: ``runs`` runs of ``config`` (1: the lone program; more: the packed one)."""
  programs = programs_lib.build_programs(config, NUM_TRAIN, 10, IMAGE)
  rng = np.random.default_rng(0)
  shape = ((config.batch_size,) if runs == 1 else (runs, config.batch_size))
  images = rng.integers(0, 256, shape + IMAGE, dtype=np.uint8)
  labels = rng.integers(0, 10, shape, dtype=np.int32)
  states = [programs.init(jax.random.PRNGKey(i)) for i in range(runs)]
  if runs == 1:
    state, train, dual = states[0], programs.train, programs.dual
  else:
    state = jax.device_put(packing.stack(states), programs.replicated)
    train, dual = packing.packed_programs(programs)
  del states
  due = programs_lib.plan(programs, config, 1)[1]  # a step without the dual update
  start = time.perf_counter()
  compiled = train.lower(state, images, labels, dual_due=due).compile()
  compile_s = time.perf_counter() - start
  flops = flops_of(compiled)
  times = []
  for i in range(warmup + steps):
    state, seconds = timed(compiled, state, images, labels)
    if i >= warmup:
      times.append(seconds)
  plain = summary(times)
  cell = {"runs": runs, "compile_s": compile_s, "plain_step": plain, "flops_per_step": flops}
  step_ms = plain["median_ms"]
  if dual is not None and dual_steps:
    dual_times = []
    for i in range(1 + dual_steps):
      out, seconds = timed(dual, state)
      state = steps_lib.with_dual_step(state, out)
      if i:
        dual_times.append(seconds)
    cell["dual_program"] = summary(dual_times)
    step_ms += cell["dual_program"]["median_ms"] / config.dual_every
  cell["mean_step_ms"] = step_ms
  cell["images_per_second_per_run"] = 1e3 * config.batch_size / step_ms
  cell["images_per_second"] = runs * cell["images_per_second_per_run"]
  cell["flops_per_second"] = flops / (1e-3 * plain["median_ms"]) if flops else None
  cell["epoch_s"] = step_ms * 1e-3 * -(-NUM_TRAIN // config.batch_size)
  return cell


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS))
  parser.add_argument("--dtypes", nargs="+", default=list(configs.DTYPES), choices=configs.DTYPES)
  parser.add_argument("--packs", nargs="+", type=int, default=[1, 3, 6, 9, 15])
  parser.add_argument("--method", default="safe", choices=configs.METHODS)
  parser.add_argument("--sparsity", type=float, default=0.9)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--dual-steps", type=int, default=3)
  parser.add_argument("--deadline-s", type=float, default=None)
  parser.add_argument("--dry-run", action="store_true",
                      help="batch 8, 2 steps, packs 1 and 3: a CPU check, not a measurement")
  parser.add_argument("--out", default="benchmarks/perf/results/cifar_pack_throughput.json")
  args = parser.parse_args(argv)
  if args.dry_run:
    args.batch, args.steps, args.warmup, args.dual_steps, args.packs = 8, 2, 1, 1, [1, 3]
  start = time.perf_counter()
  device = jax.devices()[0]
  report = {**run_record(), "dry_run": args.dry_run,
            "device_kind": device.device_kind, "platform": device.platform,
            "settings": {k: v for k, v in vars(args).items() if k != "out"}, "cells": []}
  print(f"{device.device_kind} ({device.platform}){'  DRY RUN' if args.dry_run else ''}")
  print(f"{'model':>10} {'dtype':>8} {'runs':>4} {'step ms':>8} {'img/s/run':>10} "
        f"{'img/s':>9} {'TFLOP/s':>8} {'compile s':>9}")
  for model in args.models:
    for dtype in args.dtypes:
      config = configs.get_config(PRESETS[model], method=args.method, sparsity=args.sparsity,
                                  batch_size=args.batch, dtype=dtype)
      for runs in args.packs:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
          report["cells"].append({"model": model, "dtype": dtype, "runs": runs,
                                  "skipped": "past --deadline-s"})
          continue
        cell = {"model": model, "dtype": dtype, **bench(config, runs, args.steps, args.warmup,
                                                          args.dual_steps)}
        report["cells"].append(cell)
        tflops = cell["flops_per_second"] / 1e12 if cell["flops_per_second"] else float("nan")
        print(f"{model:>10} {dtype:>8} {runs:>4} {cell['mean_step_ms']:8.2f} "
              f"{cell['images_per_second_per_run']:10.0f} {cell['images_per_second']:9.0f} "
              f"{tflops:8.3f} {cell['compile_s']:9.1f}", flush=True)
        write_report(report, args.out, start)


if __name__ == "__main__":
  main()
