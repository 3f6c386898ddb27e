"""Training throughput of SGD, SAM and SAFE (K = 32) on ResNet-20x2 and VGG-19, batch 128.

Each method's step is one jitted forward + backward + optimizer update with
params, BatchNorm state and optimizer state donated, built by
``benchmarks/perf/_common.py`` with :mod:`safe_optax.flax_utils` (the clean pass
keeps its BatchNorm statistics, SAM's perturbed pass discards them):

* sgd:  ``chain(add_decayed_weights(1e-4), sgd(0.1, momentum=0.9))``;
* sam:  ``chain(sam_perturb(0.1), add_decayed_weights(1e-4), sgd(0.1, 0.9))``;
* safe: ``safe(0.1, 0.9, penalty=1e-3, dual_every=32, weight_decay=1e-4)``.

Inputs are one random CIFAR-shaped batch (128 x 32 x 32 x 3) with random
labels, so only compute is timed (the input pipeline is not).

Timing: ``time.perf_counter`` around each call and ``block_until_ready``.
After compile and ``--warmup`` steps, the methods run round-robin, one step
each per round, the order rotated every round; the median step is reported.
SAFE's dual update (a global top-k projection) runs in one step of every 32:
its timed steps are plain ones, and ``--dual-steps`` extra steps are timed
with the step counter set to a multiple of 32 so each runs the dual update.
Per-epoch time is extrapolated to 50,000 CIFAR images (391 steps of 128;
SAFE: ``391 * (31 * plain + dual) / 32``) and to a 200-epoch run. The bar:
SAFE epoch time <= 1.1 x SAM epoch time.

Results go to ``benchmarks/perf/results/train_throughput.json`` (``--out``) with
the command, versions, device, CPU model and load average per round.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

import safe_optax
from benchmarks.perf._common import DUAL_EVERY, make_step, make_tx, parse_steps
from benchmarks.harness import run_record, summary, timed, write_report
from safe_optax.vision import resnet20, vgg19

BATCH = 128
STEPS_PER_EPOCH = -(-50_000 // BATCH)  # 391
EPOCHS = 200
BAR = 1.1
MODELS = {
    "resnet20x2": lambda: resnet20(num_classes=10, width=2),
    "vgg19": lambda: vgg19(num_classes=10),
}
METHODS = ("sgd", "sam", "safe")
DEFAULT_STEPS = {"resnet20x2": 8, "vgg19": 6}


def set_admm_count(opt_state: Any, count: int) -> Any:
  """``opt_state`` with SAFE's step counter set, so the next step runs (or skips) the dual update."""
  def set_count(node):
    if isinstance(node, safe_optax.ADMMState):
      return node._replace(count=jnp.asarray(count, node.count.dtype))
    return node
  return jax.tree.map(set_count, opt_state, is_leaf=lambda n: isinstance(n, safe_optax.ADMMState))


def timed_step(step, state, batch):
  """One training step, timed: (seconds, the new state, the loss)."""
  (*state, loss), seconds = timed(step, *state, batch)
  return seconds, state, loss


def bench_model(name: str, steps: int, warmup: int, dual_steps: int, seed: int = 0
                ) -> dict[str, Any]:
  model = MODELS[name]()
  rng = np.random.default_rng(seed)
  batch = (jnp.asarray(rng.normal(size=(BATCH, 32, 32, 3)), jnp.float32),
           jnp.asarray(rng.integers(0, 10, size=BATCH), jnp.int32))
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(seed),
                                                                  batch[0])
  model_state, params = flax.core.pop(variables, "params")
  n_kernels = sum(l.size for p, l in jax.tree_util.tree_flatten_with_path(params)[0]
                  if p[-1].key == "kernel")
  print(f"\n== {name}: batch {BATCH}x32x32x3, {n_kernels:,} kernel weights, "
        f"{steps} timed steps per method, {warmup} warm-up", flush=True)

  runs: dict[str, dict[str, Any]] = {}
  for method in METHODS:
    tx, needs_grad_fn = make_tx(method)
    step = make_step(model.apply, tx, needs_grad_fn)
    state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, model_state)]
    state.append(tx.init(state[0]))
    first, state, loss = timed_step(step, state, batch)
    for _ in range(warmup):
      _, state, loss = timed_step(step, state, batch)
    runs[method] = {"step": step, "state": state, "times": [], "first_call_s": first,
                    "first_loss": float(loss)}
    print(f"  {method:5s} compile + first step {first:7.1f} s", flush=True)

  loadavg = []
  for r in range(steps):
    order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
    for method in order:
      run = runs[method]
      t, run["state"], loss = timed_step(run["step"], run["state"], batch)
      run["times"].append(t)
      run["last_loss"] = float(loss)
    loadavg.append(os.getloadavg()[0])
    print(f"  round {r + 1}/{steps} (load {loadavg[-1]:.1f}) " + " ".join(
        f"{m}={runs[m]['times'][-1]:.3f}s" for m in METHODS), flush=True)

  # SAFE steps that run the dual update: the counter set to a multiple of K each time.
  safe_run = runs["safe"]
  dual_times = []
  for i in range(dual_steps):
    state = list(safe_run["state"])
    state[2] = set_admm_count(state[2], DUAL_EVERY * (1000 + i))
    t, safe_run["state"], _ = timed_step(safe_run["step"], state, batch)
    dual_times.append(t)

  result: dict[str, Any] = {"kernel_weights": n_kernels, "steps": steps, "warmup": warmup,
                            "loadavg_per_round": loadavg, "methods": {}}
  for method, run in runs.items():
    median = statistics.median(run["times"])
    epoch = STEPS_PER_EPOCH * median
    entry = {"first_call_s": run["first_call_s"], **summary(run["times"]),
             "times_s": run["times"], "first_loss": run["first_loss"],
             "last_loss": run["last_loss"]}
    if method == "safe" and dual_times:
      dual = statistics.median(dual_times)
      epoch = STEPS_PER_EPOCH * ((DUAL_EVERY - 1) * median + dual) / DUAL_EVERY
      entry.update(dual_step_median_ms=1e3 * dual, dual_times_s=dual_times)
    entry.update(images_per_s=BATCH * STEPS_PER_EPOCH / epoch, epoch_s=epoch,
                 run_200_epochs_h=EPOCHS * epoch / 3600)
    result["methods"][method] = entry
  sam_epoch = result["methods"]["sam"]["epoch_s"]
  result["ratios"] = {
      "safe/sam_epoch": result["methods"]["safe"]["epoch_s"] / sam_epoch,
      "sam/sgd_epoch": sam_epoch / result["methods"]["sgd"]["epoch_s"],
      "safe/sam_per_round_median": statistics.median(
          a / b for a, b in zip(runs["safe"]["times"], runs["sam"]["times"])),
  }
  result["bar_met"] = result["ratios"]["safe/sam_epoch"] <= BAR
  return result


def print_table(name: str, result: dict[str, Any]) -> None:
  print(f"\n{name} (batch {BATCH}; epoch = {STEPS_PER_EPOCH} steps, run = {EPOCHS} epochs)")
  print(f"  {'method':6s} {'median step':>12s} {'p10':>9s} {'p90':>9s} {'images/s':>9s} "
        f"{'epoch':>10s} {'200 epochs':>11s}")
  for method, e in result["methods"].items():
    extra = (f"  (dual-update step {e['dual_step_median_ms'] / 1e3:.3f} s)"
             if "dual_step_median_ms" in e else "")
    print(f"  {method:6s} {e['median_ms'] / 1e3:11.3f}s {e['p10_ms'] / 1e3:8.3f}s "
          f"{e['p90_ms'] / 1e3:8.3f}s {e['images_per_s']:9.1f} {e['epoch_s'] / 60:8.1f} min "
          f"{e['run_200_epochs_h']:9.1f} h{extra}")
  r = result["ratios"]
  print(f"  SAFE / SAM epoch time {r['safe/sam_epoch']:.3f} (per-round median "
        f"{r['safe/sam_per_round_median']:.3f}); bar <= {BAR}: "
        f"{'met' if result['bar_met'] else 'NOT met'}; SAM / SGD {r['sam/sgd_epoch']:.3f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="resnet20x2,vgg19",
                      help=f"comma list from {','.join(MODELS)}")
  parser.add_argument("--steps", default=None,
                      help="timed steps per method: N for all models, or resnet20x2=8,vgg19=6")
  parser.add_argument("--warmup", type=int, default=2, help="warm-up steps after compile")
  parser.add_argument("--dual-steps", type=int, default=2,
                      help="extra SAFE steps timed with the dual update")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "train_throughput.json"))
  args = parser.parse_args()
  models = args.models.split(",")
  if unknown := set(models) - set(MODELS):
    parser.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
  steps = parse_steps(args.steps, models, DEFAULT_STEPS)

  report: dict[str, Any] = {**run_record(), "batch": BATCH,
                            "steps_per_epoch": STEPS_PER_EPOCH, "epochs": EPOCHS,
                            "bar": f"SAFE epoch time <= {BAR} x SAM epoch time", "models": {}}
  start = time.perf_counter()
  for name in models:
    report["models"][name] = bench_model(name, steps[name], args.warmup, args.dual_steps)
    print_table(name, report["models"][name])
    # Written after every model, so a slow later model cannot lose the earlier results.
    report["complete"] = name == models[-1]
    write_report(report, args.out, start)


if __name__ == "__main__":
  main()
