"""Cost of one power-iteration step of lambda_max relative to one gradient evaluation.

One iteration of :func:`safe_optax.flatness.max_hessian_eigenvalue` is a
forward-over-reverse Hessian-vector product (``jax.jvp`` of ``jax.grad``) on
every evaluation batch plus a normalisation; theory says about 2x a gradient.
Both are timed the same way: a jitted loop of ``n`` dependent iterations for
two values of ``n``, the per-iteration cost being the slope (so dispatch and
compile costs cancel), repeated round-robin and summarised by the median.

Models: the 784-300-100-10 MLP (MNIST-shaped inputs) and ResNet-20 (CIFAR
shapes, inference-mode BatchNorm), random inputs and labels (the cost does not
depend on the values). Writes ``hessian_cost.json`` and ``hessian_cost.md``.

``--parts obd`` times instead the Hutchinson diagonal behind OBD scores
(:func:`safe_optax.hutchinson_diagonal`, one Hessian-vector product per probe)
on ResNet-20, in seconds per FLOP against one plain jitted gradient of the
same batch, side by side in one process: the current function called outside
``jax.jit`` (a Python loop over one jitted product) and inside it (probes
unrolled), and the previous one (a ``lax.fori_loop`` over the probes, kept
here as :func:`_fori_hutchinson`) both ways. XLA:CPU runs the backward
convolutions of a loop body on a naive emitter (jax-ml/jax#12868). A path's
per-probe seconds are the slope between 1 and 3 probes; FLOPs are XLA's cost
analysis of the top-level programs (one product, one gradient). Rounds
rotate the paths; the medians of the per-round ratios are reported. Writes
``hessian_cost_obd.json`` and ``hessian_cost_obd.md``.

  python -m benchmarks.perf.hessian_cost --out benchmarks/perf/results
  python -m benchmarks.perf.hessian_cost --parts obd --out benchmarks/perf/results
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

import safe_optax
from safe_optax import flatness
from safe_optax.experiment import cross_entropy, versions
from safe_optax.vision import models

from benchmarks.harness import flops, timed
from benchmarks import harness


def _model_case(name: str, batch: int, num_batches: int):
  key = jax.random.PRNGKey(0)
  if name == "mlp":
    model, shape = models.mlp(), (28, 28, 1)
  else:
    model, shape = models.resnet20(), (32, 32, 3)
  x = jax.random.uniform(key, (num_batches, batch) + shape)
  y = jax.random.randint(key, (num_batches, batch), 0, 10)
  variables = model.init(key, x[0, :1], train=False)
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(p, b):
    logits = model.apply({"params": p, **state}, b[0], train=False)
    return cross_entropy(logits, b[1])

  batches = [(x[i], y[i]) for i in range(num_batches)]
  return loss_fn, params, batches


def _timers(loss_fn, params, batches) -> dict[str, Callable[[int], float]]:
  grad_fn = jax.grad(lambda p: flatness.mean_loss(loss_fn, p, batches))

  def power_n(n):
    @jax.jit
    def run(p):
      # tol=0 stops only if two estimates are bit-equal; the count is read back.
      result = flatness.max_hessian_eigenvalue(loss_fn, p, batches, key=jax.random.PRNGKey(0),
                                               tol=0.0, max_iterations=n)
      return result.eigenvalue, result.num_iterations
    return run

  def grads_n(n):
    @jax.jit
    def run(p):
      # Dependent iterations (each gradient feeds the next point), like power iteration.
      def body(_, q):
        g = grad_fn(q)
        return jax.tree.map(lambda a, b: a - 1e-6 * b, q, g)
      return lax.fori_loop(0, n, body, p), jnp.int32(n)
    return run

  return {"power_step": power_n, "gradient": grads_n}


def _time(fn, params) -> tuple[float, int]:
  """Seconds of one call and the iterations it ran."""
  (_, count), seconds = timed(fn, params)
  return seconds, int(count)


def measure(name: str, batch: int, num_batches: int, low: int, high: int,
            repeats: int) -> dict[str, Any]:
  loss_fn, params, batches = _model_case(name, batch, num_batches)
  makers = _timers(loss_fn, params, batches)
  programs = {kind: (make(low), make(high)) for kind, make in makers.items()}
  for lo, hi in programs.values():  # compile and warm up
    _time(lo, params)
    _time(hi, params)
  slopes: dict[str, list[float]] = {kind: [] for kind in programs}
  for _ in range(repeats):
    for kind, (lo, hi) in programs.items():
      (t_hi, n_hi), (t_lo, n_lo) = _time(hi, params), _time(lo, params)
      slopes[kind].append((t_hi - t_lo) / (n_hi - n_lo))
  per = {kind: statistics.median(v) for kind, v in slopes.items()}
  return {
      "model": name, "batch": batch, "num_batches": num_batches,
      "iterations": [low, high], "repeats": repeats,
      "seconds_per_power_step": per["power_step"],
      "seconds_per_gradient": per["gradient"],
      "ratio": per["power_step"] / per["gradient"],
      "raw_slopes": slopes,
  }


def _fori_hutchinson(grad_fn: Callable[[Any, int], Any], params: Any, key: jax.Array,
                     num_probes: int) -> Any:
  """``safe_optax.hutchinson_diagonal`` before issue 14: a ``fori_loop`` over the probes."""
  probe_keys = jax.random.split(key, num_probes)

  def add_probe(i, total):
    probe = optax.tree.random_like(probe_keys[i], params, jax.random.rademacher)
    _, hvp = jax.jvp(lambda p: grad_fn(p, 0), (params,), (probe,))
    return optax.tree.add(total, optax.tree.mul(probe, hvp))

  total = lax.fori_loop(0, num_probes, add_probe, optax.tree.zeros_like(params))
  return optax.tree.scale(1.0 / num_probes, total)


def measure_obd(batch: int, repeats: int, low: int = 1, high: int = 3) -> dict[str, Any]:
  """Seconds per FLOP of a Hutchinson probe, each path against a plain gradient."""
  loss_fn, params, batches = _model_case("resnet20", batch, 1)
  data = batches[0]
  grad_fn = lambda p, _: jax.grad(loss_fn)(p, data)  # kept: the eager path caches per grad_fn
  key = jax.random.PRNGKey(0)
  gradient = jax.jit(lambda p: jax.grad(loss_fn)(p, data))
  one_probe = jax.jit(lambda p, k: safe_optax.hutchinson_diagonal(grad_fn, p, k, 1))
  counts = {"gradient": flops(gradient, params),
            "probe": flops(one_probe, params, key)}

  def path(fn: Callable[..., Any], jit: bool) -> tuple[Callable[[], Any], Callable[[], Any]]:
    def make(n: int) -> Callable[[], Any]:
      run = jax.jit(lambda p, k: fn(grad_fn, p, k, n)) if jit else (
          lambda p, k: fn(grad_fn, p, k, n))
      return lambda: run(params, key)
    return make(low), make(high)

  paths = {"after_eager": path(safe_optax.hutchinson_diagonal, False),
           "after_jit": path(safe_optax.hutchinson_diagonal, True),
           "before_eager": path(_fori_hutchinson, False),
           "before_jit": path(_fori_hutchinson, True)}

  def seconds(fn: Callable[[], Any]) -> float:
    return timed(fn)[1]

  seconds(lambda: gradient(params))
  for lo, hi in paths.values():  # compile and warm up
    seconds(lo)
    seconds(hi)
  names = list(paths)
  rounds: list[dict[str, float]] = []
  for r in range(repeats):
    order = names[r % len(names):] + names[:r % len(names)]
    row = {"gradient": seconds(lambda: gradient(params))}
    for name in order:
      lo, hi = paths[name]
      row[name] = (seconds(hi) - seconds(lo)) / (high - low)
    rounds.append(row)
  # Seconds per FLOP over a gradient's, per round (the load moves both alike).
  ratio = {name: statistics.median(
      (row[name] / counts["probe"]) / (row["gradient"] / counts["gradient"]) for row in rounds)
      for name in names}
  return {"model": "resnet20", "batch": batch, "probes": [low, high], "repeats": repeats,
          "flops": counts,
          "seconds": {name: statistics.median(row[name] for row in rounds)
                      for name in ["gradient"] + names},
          "per_flop_over_gradient": ratio, "raw_rounds": rounds}


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/perf/results")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--parts", default="power", choices=["power", "obd"],
                      help="power: lambda_max's power step (hessian_cost.json); obd: the "
                      "Hutchinson diagonal of OBD scores (hessian_cost_obd.json)")
  parser.add_argument("--obd-batch", type=int, default=32)
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.parts == "obd":
    return _main_obd(args, out)
  cases = [("mlp", 250, 4, 3, 13), ("resnet20", 32, 1, 2, 5)]
  rows = [measure(name, batch, nb, lo, hi, args.repeats) for name, batch, nb, lo, hi in cases]
  results = {"benchmark": "hessian_cost", "command": "python " + " ".join(sys.argv),
             "versions": versions(), "cases": rows}
  harness.write_json(out / "hessian_cost.json", results)
  lines = [f"Command: `{results['command']}` ({results['versions']['device_kind']}, shared 2-core "
           "CPU)", "",
           "| model | batches x size | power step (ms) | gradient (ms) | ratio |",
           "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['num_batches']} x {r['batch']} | "
                 f"{r['seconds_per_power_step'] * 1e3:.1f} | {r['seconds_per_gradient'] * 1e3:.1f}"
                 f" | {r['ratio']:.2f} |")
  (out / "hessian_cost.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


def _main_obd(args: argparse.Namespace, out: pathlib.Path) -> int:
  row = measure_obd(args.obd_batch, args.repeats)
  results = {"benchmark": "hessian_cost_obd", "command": "python " + " ".join(sys.argv),
             "versions": versions(), "loadavg": list(os.getloadavg()), "obd": row}
  harness.write_json(out / "hessian_cost_obd.json", results)
  gflop = {k: v / 1e9 for k, v in row["flops"].items()}
  lines = [f"Command: `{results['command']}` ({results['versions']['device_kind']}, shared 2-core "
           f"CPU, load {results['loadavg'][0]:.1f}); ResNet-20, one batch of {row['batch']}: a "
           f"gradient is {gflop['gradient']:.2f} GFLOP, a probe (Hessian-vector product) "
           f"{gflop['probe']:.2f} GFLOP", "",
           "| path | s per probe (gradient: s per call) | s per FLOP / gradient's |",
           "|---|---|---|",
           f"| gradient (jit) | {row['seconds']['gradient']:.3f} | 1 |"]
  for name, ratio in row["per_flop_over_gradient"].items():
    lines.append(f"| {name} | {row['seconds'][name]:.3f} | {ratio:.2f} |")
  (out / "hessian_cost_obd.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
