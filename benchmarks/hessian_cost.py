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

  python benchmarks/hessian_cost.py --out results/flatness
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from safe_optax import flatness
from safe_optax.experiment import cross_entropy, versions
from safe_optax.vision import models


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
  start = time.perf_counter()
  _, count = jax.block_until_ready(fn(params))
  return time.perf_counter() - start, int(count)


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


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/flatness")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  cases = [("mlp", 250, 4, 3, 13), ("resnet20", 32, 1, 2, 5)]
  rows = [measure(name, batch, nb, lo, hi, args.repeats) for name, batch, nb, lo, hi in cases]
  results = {"benchmark": "hessian_cost", "command": "python " + " ".join(sys.argv),
             "versions": versions(), "cases": rows}
  (out / "hessian_cost.json").write_text(json.dumps(results, indent=1))
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


if __name__ == "__main__":
  sys.exit(main())
