"""FLOP rates of evaluation, BNT and the Hessian loops next to training's, on ResNet-20 (issue 14).

Every path is the project's own code on one CIFAR-shaped configuration
(``resnet20x2-cifar10`` with ``--width``, SAFE at sparsity 0.9), random uint8
images and labels (the cost does not depend on the values):

* ``train_step``: ``build_programs(...).train``, one SAFE step (two gradients)
  on ``--train-batch`` images;
* ``eval_step`` / ``eval_step_128``: ``programs.eval`` (inference mode) on one
  batch of ``--eval-batch`` / 128 images;
* ``predict``: the evaluation suite's clean / corruption classifier
  (:mod:`safe_optax.vision.evaluation`) on one batch of ``--eval-batch``
  images;
* ``evaluate``: :func:`safe_optax.vision.finish.evaluate` over
  ``2 * --eval-batch`` test images (host gather, padding, transfers included);
* ``bnt``: :func:`safe_optax.vision.finish.recalibrate` (BatchNorm
  re-estimation through :func:`safe_optax.flax_utils.recalibrate_batch_stats`)
  on ``2 * --train-batch`` training images (all of them), a whole call;
* ``gradient``: a plain jitted gradient of the inference-mode loss over the
  ``--hvp-batches`` Hessian batches of ``--hvp-batch`` images;
* ``lambda_max_jit`` / ``lambda_max``: one power iteration (one Hessian-vector
  product per batch) of :func:`safe_optax.flatness.max_hessian_eigenvalue`,
  inside ``jax.jit`` (a ``lax.while_loop``) / called outside it, as the
  evaluation suite now calls it; the
  per-iteration cost is the slope between ``max_iterations`` 1 and 3 (so
  start-up and dispatch cancel);
* ``trace_jit`` / ``trace``: one probe of :func:`safe_optax.flatness.hessian_trace`
  inside ``jax.jit`` / called outside it (slope between 1 and 3 probes);
  inside ``jax.jit`` the loops' convolutions go through
  :func:`safe_optax.experimental.canonical_convs` (``eval_speed_before_canonical.json`` is
  the run before it: ``lambda_max_jit`` at 13.5x);
* ``loss_line`` / ``loss``: :func:`safe_optax.flatness.loss_line` at 4 points
  against one plain jitted loss over the same batches;
* ``pgd``: :func:`safe_optax.vision.robustness.pgd_attack` (10 l_inf steps,
  each an input gradient) on the Hessian images, as the evaluation suite
  calls it.

FLOPs are XLA's cost analysis of the compiled program
(``jitted.lower(...).compile().cost_analysis()``); a program with a loop is
counted from the top-level program of its body (a Hessian-vector product:
``jax.jvp`` of ``jax.grad``; BNT: one training-mode forward pass). Seconds
are medians over ``--repeats`` rounds in which every path runs once, in a
rotated order, in this one process; ratios are taken within each round and
their median reported, so a loaded machine moves both sides together.
``compiles`` counts XLA compilations during a path's timed calls (a cache
miss counter, :mod:`jax.monitoring`): 0 means no recompilation.

Finally ``end_of_run`` counts the passes over the test split made by the last
epoch's record and :func:`~safe_optax.vision.finish.finish` in a one-epoch
:func:`~safe_optax.vision.train.train_and_evaluate`.

  python -m benchmarks.perf.eval_speed --out benchmarks/perf/results/eval_speed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import flops, run_record, timed, write_report
from safe_optax import flatness
from safe_optax.experiment import cross_entropy
from safe_optax.vision import configs
from safe_optax.vision import evaluation
from safe_optax.vision import finish as finish_lib
from safe_optax.vision import input_pipeline
from safe_optax.vision import robustness
from safe_optax.vision import train as train_lib
from safe_optax.vision import datasets
from safe_optax.vision import programs as programs_lib

GOAL_EVAL = 2.0
"""Training's FLOP rate over evaluation's must be at most this."""
GOAL_HVP = 2.0
"""A Hessian-vector product's seconds per FLOP over a plain gradient's must be at most this."""

SLOPE = 2
"""Iterations (probes) between the two calls whose time difference is a loop's cost."""

_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _compiles.__setitem__(0, _compiles[0] + (
        name == "/jax/core/compile/backend_compile_duration")))


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
  before = _compiles[0]
  _, seconds = timed(fn)
  return seconds, _compiles[0] - before


class Case:
  """The programs, data and callables of one configuration."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    self.config = configs.get_config(
        "resnet20x2-cifar10", method="safe", sparsity=0.9, width=args.width, epochs=1,
        warmup_epochs=0, batch_size=args.train_batch, eval_batch_size=args.eval_batch,
        bnt_samples=2 * args.train_batch)
    rng = np.random.default_rng(0)
    self.num_train = 2 * args.train_batch
    self.num_test = 2 * args.eval_batch
    pixels = lambda n: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = lambda n: rng.integers(0, 10, n).astype(np.int32)
    self.data = input_pipeline.Dataset(pixels(self.num_train), labels(self.num_train),
                                       pixels(self.num_test), labels(self.num_test),
                                       tuple(str(c) for c in range(10)))
    self.programs = programs_lib.build_programs(self.config, self.num_train, 10, (32, 32, 3))
    self.state = self.programs.init(jax.random.PRNGKey(0))
    # The measured model: the projected parameters, copies (the training step donates
    # its state's buffers).
    self.params = self.programs.project(self.state.params)
    self.model_state = jax.tree.map(jnp.copy, self.state.model_state)
    mean, std = datasets.NORMALIZATION["cifar10"]
    x = np.asarray(input_pipeline.normalize(jnp.asarray(
        pixels(args.hvp_batch * args.hvp_batches)), mean, std))
    y = labels(args.hvp_batch * args.hvp_batches)
    self.batches = [(x[i::args.hvp_batches], y[i::args.hvp_batches])
                    for i in range(args.hvp_batches)]
    model = self.programs.model
    model_state = self.model_state

    def loss_fn(p, batch):
      return cross_entropy(model.apply({"params": p, **model_state}, batch[0], train=False),
                           batch[1])
    self.loss_fn = loss_fn


def build_paths(case: Case) -> dict[str, dict[str, Any]]:
  """``{name: {"run": () -> result, "flops": per call, "note": ...}}``."""
  args, p, cfg = case.args, case.programs, case.config
  data, params, model_state = case.data, case.params, case.model_state
  paths: dict[str, dict[str, Any]] = {}

  train_x = jnp.asarray(data.train_images[:args.train_batch])
  train_y = jnp.asarray(data.train_labels[:args.train_batch])
  holder = {"state": case.state}

  def train_step():
    holder["state"] = p.train(holder["state"], train_x, train_y)
    return holder["state"]
  paths["train_step"] = {"run": train_step, "flops": flops(p.train, case.state, train_x, train_y),
                         "images": args.train_batch}

  for name, size in (("eval_step", args.eval_batch), ("eval_step_128", 128)):
    ex, ey = jnp.asarray(data.test_images[:size]), jnp.asarray(data.test_labels[:size])
    valid = jnp.ones(size, bool)
    paths[name] = {"run": (lambda ex=ex, ey=ey, valid=valid:
                           p.eval(params, model_state, ex, ey, valid)),
                   "flops": flops(p.eval, params, model_state, ex, ey, valid), "images": size}

  variables = {"params": params, **model_state}
  mean, std = (jnp.asarray(v, jnp.float32) for v in datasets.NORMALIZATION["cifar10"])
  px = jnp.asarray(data.test_images[:args.eval_batch])
  paths["predict"] = {
      "run": lambda: evaluation._predict(p.model, variables, mean, std, px),
      "flops": flops(evaluation._predict, p.model, variables, mean, std, px),
      "images": args.eval_batch}

  paths["evaluate"] = {
      "run": lambda: finish_lib.evaluate(p.eval, params, model_state, data.test_images,
                                         data.test_labels, args.eval_batch, mesh=p.mesh),
      "flops": paths["eval_step"]["flops"] * case.num_test / args.eval_batch,
      "images": case.num_test}

  model = p.model
  bx = p.prepare(jnp.asarray(data.train_images[:args.train_batch]), None)
  forward_train = jax.jit(lambda q, s, x: model.apply({"params": q, **s}, x, train=True,
                                                      mutable=["batch_stats"]))
  bnt_images = min(cfg.bnt_samples, case.num_train)
  bnt_batches = -(-bnt_images // args.train_batch)
  paths["bnt"] = {
      "run": lambda: finish_lib.recalibrate(p, cfg, params, model_state, data.train_images,
                                            case.num_train),
      "flops": flops(forward_train, params, model_state, bx) * bnt_batches,
      "images": bnt_images}

  loss_fn, batches = case.loss_fn, case.batches
  batch_list = [jax.device_put(b) for b in batches]
  one = batch_list[0]
  hvp_one = jax.jit(lambda q, v, b: jax.jvp(lambda r: jax.grad(loss_fn)(r, b), (q,), (v,))[1])
  hvp_flops = flops(hvp_one, params, params, one) * len(batches)
  plain_grad = jax.jit(lambda q, bs: jax.grad(
      lambda r: sum(loss_fn(r, b) for b in bs) / len(bs))(q))
  paths["gradient"] = {"run": lambda: plain_grad(params, batch_list),
                       "flops": flops(plain_grad, params, batch_list),
                       "images": args.hvp_batch * args.hvp_batches}
  key = jax.random.PRNGKey(0)

  def power(n: int, jit: bool) -> Callable[[], Any]:
    def run(q, bs):
      return flatness.max_hessian_eigenvalue(loss_fn, q, bs, key=key, tol=0.0,
                                             max_iterations=n).eigenvalue
    fn = jax.jit(run) if jit else run
    return lambda: fn(params, batch_list)

  for name, jit in (("lambda_max_jit", True), ("lambda_max", False)):
    paths[name] = {"slope": (power(1, jit), power(1 + SLOPE, jit)), "flops": hvp_flops,
                   "images": args.hvp_batch * args.hvp_batches}

  def trace(n: int, jit: bool) -> Callable[[], Any]:
    def run(q, bs):
      return flatness.hessian_trace(loss_fn, q, bs, key=key, num_probes=n)
    fn = jax.jit(run) if jit else run
    return lambda: fn(params, batch_list)

  for name, jit in (("trace_jit", True), ("trace", False)):
    paths[name] = {"slope": (trace(1, jit), trace(1 + SLOPE, jit)), "flops": hvp_flops,
                   "images": args.hvp_batch * args.hvp_batches}

  plain_loss = jax.jit(lambda q, bs: sum(loss_fn(q, b) for b in bs) / len(bs))
  loss_flops = flops(plain_loss, params, batch_list)
  paths["loss"] = {"run": lambda: plain_loss(params, batch_list), "flops": loss_flops,
                   "images": args.hvp_batch * args.hvp_batches}
  alphas = jnp.linspace(-1.0, 1.0, 4)
  line = jax.jit(lambda q, d, bs: flatness.loss_line(loss_fn, q, bs, d, alphas))
  direction = flatness.filter_normalized_direction(key, params)
  paths["loss_line"] = {"run": lambda: line(params, direction, batch_list),
                        "flops": loss_flops * len(alphas),
                        "images": args.hvp_batch * args.hvp_batches * len(alphas)}

  def apply_fn(pixels):
    return p.model.apply(variables, (pixels - mean) / std, train=False)
  pgd_x = jnp.asarray(data.test_images[:args.hvp_batch * args.hvp_batches] / 255.0, jnp.float32)
  pgd_y = jnp.asarray(data.test_labels[:args.hvp_batch * args.hvp_batches])
  paths["pgd"] = {"run": lambda: robustness.pgd_attack(apply_fn, pgd_x, pgd_y),
                  "flops": flops(robustness.pgd_attack, apply_fn, pgd_x, pgd_y),
                  "images": args.hvp_batch * args.hvp_batches}
  return paths


def measure(paths: dict[str, dict[str, Any]], repeats: int) -> dict[str, list[dict[str, Any]]]:
  """Warm every path up (compiles), then ``repeats`` rotated rounds, one call of each."""
  calls = {name: (path["slope"] if "slope" in path else (path["run"],))
           for name, path in paths.items()}
  warm = {}
  for name, fns in calls.items():
    seconds = [_timed(fn)[0] for fn in fns]
    warm[name] = sum(seconds)
    print(f"  warm-up {name}: {warm[name]:.1f} s", flush=True)
  names = list(paths)
  rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
  for r in range(repeats):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      timed = [_timed(fn) for fn in calls[name]]
      if len(timed) == 2:  # slope: SLOPE iterations more
        seconds = (timed[1][0] - timed[0][0]) / SLOPE
      else:
        seconds = timed[0][0]
      rounds[name].append({"seconds": seconds, "compiles": sum(c for _, c in timed),
                           "round": r})
    print(f"  round {r + 1}/{repeats} done", flush=True)
  return {"warmup_seconds": warm, "rounds": rounds}


def end_of_run(case: Case) -> dict[str, Any]:
  """Passes over the test split in the last epoch's record and ``finish``, and their time."""
  counts = {"passes": 0}
  original = finish_lib.evaluate

  def counting(*args: Any, **kwargs: Any) -> Any:
    counts["passes"] += 1
    return original(*args, **kwargs)

  finish_seconds = []
  original_finish = finish_lib.finish

  def timed_finish(*args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    out = original_finish(*args, **kwargs)
    finish_seconds.append(time.perf_counter() - start)
    return out

  config = dataclasses.replace(case.config, eval_every=1)
  saved = (finish_lib.evaluate, finish_lib.evaluate, finish_lib.finish)
  finish_lib.evaluate = finish_lib.evaluate = counting
  finish_lib.finish = timed_finish
  before = _compiles[0]
  try:
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      train_lib.train_and_evaluate(config, workdir, data_dir=None, dataset=case.data)
      total = time.perf_counter() - start
  finally:
    finish_lib.evaluate, finish_lib.evaluate, finish_lib.finish = saved
  return {"test_passes": counts["passes"], "num_test": case.num_test,
          "finish_seconds": finish_seconds[0], "train_and_evaluate_seconds": total,
          "compiles": _compiles[0] - before}


def _median_ratio(rounds: dict[str, list[dict[str, Any]]], num: str, den: str,
                  scale: float) -> float:
  """Median over rounds of ``scale * seconds[num] / seconds[den]``."""
  return statistics.median(scale * a["seconds"] / b["seconds"]
                           for a, b in zip(rounds[num], rounds[den]))


def summarise(paths: dict[str, dict[str, Any]], measured: dict[str, Any]) -> dict[str, Any]:
  rounds = measured["rounds"]
  table = {}
  for name, path in paths.items():
    seconds = statistics.median(r["seconds"] for r in rounds[name])
    table[name] = {"flops": path["flops"], "images": path["images"], "median_seconds": seconds,
                   "gflops_per_second": path["flops"] / seconds / 1e9,
                   "images_per_second": path["images"] / seconds,
                   "compiles_in_timed_calls": sum(r["compiles"] for r in rounds[name]),
                   "warmup_seconds": measured["warmup_seconds"][name],
                   "rounds_seconds": [r["seconds"] for r in rounds[name]]}

  def rate_ratio(fast: str, slow: str) -> float:
    # (flops_fast / s_fast) / (flops_slow / s_slow), per round.
    return _median_ratio(rounds, slow, fast, paths[fast]["flops"] / paths[slow]["flops"])

  ratios = {f"train_over_{name}_rate": rate_ratio("train_step", name)
            for name in ("eval_step", "eval_step_128", "predict", "evaluate", "bnt")}
  ratios.update({f"{name}_per_flop_over_gradient": rate_ratio("gradient", name)
                 for name in ("lambda_max_jit", "lambda_max", "trace_jit", "trace", "pgd")})
  ratios["loss_line_per_flop_over_loss"] = rate_ratio("loss", "loss_line")
  goals = {
      "eval_rate_within_2x_of_training": {
          name: ratios[f"train_over_{name}_rate"] <= GOAL_EVAL
          for name in ("eval_step", "predict", "evaluate", "bnt")},
      "hvp_per_flop_within_2x_of_gradient": {
          name: ratios[f"{name}_per_flop_over_gradient"] <= GOAL_HVP
          for name in ("lambda_max_jit", "lambda_max", "trace_jit", "trace", "pgd")},
  }
  return {"paths": table, "ratios": ratios, "goals": goals}


def print_table(summary: dict[str, Any]) -> None:
  print(f"\n{'path':<16} {'GFLOP/call':>10} {'median s':>9} {'GFLOP/s':>8} {'img/s':>8} "
        f"{'compiles':>8}")
  for name, row in summary["paths"].items():
    print(f"{name:<16} {row['flops'] / 1e9:>10.2f} {row['median_seconds']:>9.3f} "
          f"{row['gflops_per_second']:>8.1f} {row['images_per_second']:>8.1f} "
          f"{row['compiles_in_timed_calls']:>8d}")
  print("\nratios (median of per-round ratios):")
  for name, value in summary["ratios"].items():
    print(f"  {name:<40} {value:8.2f}")
  print("goals:", summary["goals"])


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=1, help="ResNet-20 width multiplier")
  parser.add_argument("--train-batch", type=int, default=128)
  parser.add_argument("--eval-batch", type=int, default=500,
                      help="the evaluation batch (the presets' eval_batch_size)")
  parser.add_argument("--hvp-batch", type=int, default=8,
                      help="images per Hessian batch")
  parser.add_argument("--hvp-batches", type=int, default=2, help="Hessian batches")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/perf/results/eval_speed.json")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  report = run_record()
  report["settings"] = vars(args)
  case = Case(args)
  print(f"ResNet-20 width {args.width}: compiling and warming up", flush=True)
  paths = build_paths(case)
  measured = measure(paths, args.repeats)
  summary = summarise(paths, measured)
  report.update(summary)
  print_table(summary)
  report["end_of_run"] = end_of_run(case)
  print("end of run:", report["end_of_run"])
  write_report(report, args.out, start)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
