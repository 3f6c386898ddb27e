"""Where the time of a global top-k projection goes on XLA CPU, part by part.

This script times, side by side in one process on the same VGG-19-BN kernels
(20,548,288 weights), the operations a projection can be built from, against
the memory floor (``where(mask, w, 0)``: one read and one write of every leaf):

* floor:        ``where(mask, w, 0)`` with a precomputed mask per leaf;
* sum:          ``sum(w)`` per leaf: one read, no write (XLA's fast reduction);
* count:        ``sum(|w| >= t)`` per leaf: one compare fused into the reduction;
* concat:       the leaves concatenated into one flat array (the copy
                ``project_topk``'s select makes) and mapped to keys;
* histogram:    one 2**16-bin scatter-add of the high 16 bits of every key,
                i.e. one radix pass of ``project_topk``'s select;
* threshold:    ``project_topk``'s exact k-th largest key (two radix passes);
* project_topk: the whole projection at sparsity 0.9, traced.

Methods run round-robin (``--rounds`` samples each, after one warm-up call);
the table gives the minimum and median in ms and the median over the floor's
median. Ratios are meaningful within one run only: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

import safe_optax
from safe_optax import _select

from benchmarks.harness import run_record, timed, write_report
from benchmarks.perf.projection import make_params, vgg19_shapes


def _flat_keys(kernels: list[jax.Array]) -> jax.Array:
  # As project_topk: the raw leaves concatenated, keys computed on the flat copy.
  return _select.magnitude_keys(jnp.concatenate([w.reshape(-1) for w in kernels]))


def _histogram_pass(kernels: list[jax.Array]) -> jax.Array:
  return _select._histogram(_flat_keys(kernels) >> 16)


def _threshold(kernels: list[jax.Array], k: jax.Array) -> jax.Array:
  return _select._threshold(_flat_keys(kernels), k).key


def parts(kernels: list[jax.Array], sparsity: float) -> dict[str, tuple[Callable, tuple]]:
  n = sum(w.size for w in kernels)
  masks = [jnp.abs(w) >= 0.01 for w in kernels]
  k = jnp.int32(safe_optax.num_keep(n, sparsity))
  return {
      "floor": (lambda ws, ms: [jnp.where(m, w, 0.0) for w, m in zip(ws, ms)], (kernels, masks)),
      "sum": (lambda ws: sum(jnp.sum(w) for w in ws), (kernels,)),
      "count": (lambda ws, t: sum(jnp.sum(jnp.abs(w) >= t) for w in ws),
                (kernels, jnp.float32(0.01))),
      "concat": (_flat_keys, (kernels,)),
      "histogram": (_histogram_pass, (kernels,)),
      "threshold": (_threshold, (kernels, k)),
      "project_topk": (lambda ws, s: safe_optax.project_topk(ws, s)[0],
                       (kernels, jnp.float32(sparsity))),
  }


def time_round_robin(cases: dict[str, tuple[Callable, tuple]], rounds: int) -> dict[str, list]:
  compiled = {name: (jax.jit(fn), args) for name, (fn, args) in cases.items()}
  for fn, args in compiled.values():
    jax.block_until_ready(fn(*args))
  samples: dict[str, list[float]] = {name: [] for name in compiled}
  for _ in range(rounds):
    for name, (fn, args) in compiled.items():
      samples[name].append(timed(fn, *args)[1])
  return samples


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=25)
  parser.add_argument("--sparsity", type=float, default=0.9)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "projection_parts.json"))
  args = parser.parse_args()
  start = time.perf_counter()
  report: dict[str, Any] = run_record()
  params = make_params(vgg19_shapes())
  kernels = [layer["kernel"] for layer in params.values()]
  samples = time_round_robin(parts(kernels, args.sparsity), args.rounds)
  floor = statistics.median(samples["floor"])
  rows = {}
  print(f"{'part':>14} {'min ms':>8} {'median ms':>10} {'/ floor':>8}")
  for name, times in samples.items():
    median = statistics.median(times)
    rows[name] = {"min_ms": 1e3 * min(times), "median_ms": 1e3 * median,
                  "median_over_floor": median / floor, "raw_s": times}
    print(f"{name:>14} {1e3 * min(times):>8.1f} {1e3 * median:>10.1f} {median / floor:>7.1f}x")
  report |= {"num_kernel_params": sum(w.size for w in kernels), "sparsity": args.sparsity,
             "rounds": args.rounds, "parts": rows}
  write_report(report, args.out, start)


if __name__ == "__main__":
  main()
