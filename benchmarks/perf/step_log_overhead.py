"""What the vision trainer's per-step log costs a training step (safe_optax.vision.metrics).

The trainer's own step (``safe_optax.vision.steps_lib.train_step``: LeNet-5 on
28 x 28 images, batch 128, SAFE with a dual update every 32 steps, the
``lenet5-fashion-mnist`` preset at sparsity 0.9) is jitted three times, the
state donated:

* ``none``: no step logger (the step before the log existed);
* ``every50``: the default ``log_every=50`` (one row in 50 steps: loss,
  accuracy, learning rate, sparsity, ``lambda_t``, ``||x - z||``; mask churn at
  each dual update);
* ``every1``: a row at every step (the most the log can cost).

Inputs are one random batch already on the device, so only the step is timed.
After compiling, the variants run round-robin, ``--chunk`` steps each per
round with no host synchronisation inside a chunk (as the trainer's loop),
the order rotated every round; a chunk's wall time over its steps is one
sample, and the median over rounds is reported with the ratio to ``none``.

Results go to ``benchmarks/perf/results/step_log_overhead.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import numpy as np

from benchmarks.harness import run_record, write_report
from safe_optax.vision import configs
from safe_optax.vision import metrics
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import steps as steps_lib
from safe_optax.vision import train_state
from safe_optax.vision.datasets import NORMALIZATION

VARIANTS = ("none", "every50", "every1")
NUM_TRAIN, IMAGE = 60_000, (28, 28, 1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=12)
  parser.add_argument("--chunk", type=int, default=64, help="steps per variant per round")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "step_log_overhead.json"))
  args = parser.parse_args()
  start = time.perf_counter()
  config = configs.get_config("lenet5-fashion-mnist", sparsity=0.9)
  programs = programs_lib.build_programs(config, NUM_TRAIN, 10, IMAGE)
  base = programs.step_logger
  loggers = {"none": None, "every50": base, "every1": metrics.StepLogger(
      1, base.steps_per_epoch, base.learning_rate, base.penalty, base.dual_every)}
  mean, std = NORMALIZATION[config.dataset]
  rng = np.random.default_rng(0)
  batch = jax.device_put((rng.integers(0, 256, (config.batch_size, *IMAGE)).astype(np.uint8),
                          rng.integers(0, 10, config.batch_size).astype(np.int32)))
  runs = {}
  for name, logger in loggers.items():
    step = jax.jit(functools.partial(
        steps_lib.train_step, apply_fn=programs.model.apply, tx=programs.tx, uses_grad_fn=True,
        augment=config.augment, mean=mean, std=std, step_logger=logger), donate_argnums=0)
    state = programs.init(jax.random.PRNGKey(0))
    state = state._replace(metrics=train_state.zero_metrics((logger or base).empty()))
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(state, *batch))
    runs[name] = {"step": step, "state": state, "compile_s": time.perf_counter() - t0,
                  "ms_per_step": []}
    print(f"{name:8s} compile + first step {runs[name]['compile_s']:.1f} s", flush=True)

  loadavg = []
  for r in range(args.rounds):
    order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
    for name in order:
      run = runs[name]
      t0 = time.perf_counter()
      for _ in range(args.chunk):
        run["state"] = run["step"](run["state"], *batch)
      jax.block_until_ready(run["state"])
      run["ms_per_step"].append(1e3 * (time.perf_counter() - t0) / args.chunk)
    loadavg.append(os.getloadavg()[0])
    print(f"round {r + 1}/{args.rounds} (load {loadavg[-1]:.1f}) " + " ".join(
        f"{n}={runs[n]['ms_per_step'][-1]:.2f}ms" for n in VARIANTS), flush=True)

  none = statistics.median(runs["none"]["ms_per_step"])
  report = {**run_record(), "config": configs.to_dict(config), "chunk": args.chunk,
            "rounds": args.rounds, "loadavg_per_round": loadavg, "variants": {}}
  print(f"\n| variant | median ms/step | ratio to none | compile + first step (s) |")
  print("|---|---|---|---|")
  for name in VARIANTS:
    median = statistics.median(runs[name]["ms_per_step"])
    report["variants"][name] = {"median_ms_per_step": median, "ratio_to_none": median / none,
                                "compile_s": runs[name]["compile_s"],
                                "ms_per_step": runs[name]["ms_per_step"]}
    print(f"| {name} | {median:.2f} | {median / none:.3f} | {runs[name]['compile_s']:.1f} |")
  write_report(report, args.out, start)


if __name__ == "__main__":
  main()
