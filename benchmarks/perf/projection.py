"""Benchmark of the global ``safe_optax.project_topk(tree, s)`` against baselines.

Median wall time of one jitted global top-k projection of a float32 parameter
tree (kernels pruned, 1-D biases left alone); ours gets the sparsity as a
traced scalar, so one compile serves all sparsities. Every method returns the
projected tree only:

* ours:  ``project_topk`` (2-pass 16-bit radix select, per-leaf masks);
* sort:  the official SAFE code's approach: concatenate |w| of all kernels,
  full ``jnp.sort``, threshold at index ``n - k``, ``where(|w| >= thr, w, 0)``
  (``k = n - floor(s*n)`` computed exactly in Python, passed as traced int32);
* top_k: ``lax.top_k`` on the concatenation for the threshold (static ``k``,
  so compiled once per sparsity), then the same per-leaf ``where``;
* floor: ``where(mask, w, 0)`` with a precomputed bool mask per leaf, i.e. one
  read and one write of every leaf: the memory floor for any projection.

Sizes (prunable kernel counts): 0.27M ResNet-20 (270,896), 1.1M ResNet-20x2
(1,081,440), 20M VGG-19-BN (20,548,288), 100M an 8-layer GPT-2-medium-width
stack of Dense kernels (100,663,296; 24 layers of these shapes would be 302M).

Timing: ``time.perf_counter`` around ``jax.block_until_ready``, methods
interleaved round-robin. A first call under 1 s is a discarded warm-up, a
slower one a sample; each method gets at most ``--reps`` samples and about
``BUDGET_S`` s per case, so sort and top_k at 100M (1-3 min a call on a 2-core
Xeon) get one sample per sparsity. The full run takes 15-35 min with machine
load, 10-25 min of it sort and top_k at 100M, which ``--skip-slow`` drops.

The table's ``ours cs`` / ``sort cs`` columns are compile seconds (trace, lower
and XLA compile of one jitted call).

Checks: ours keeps exactly ``n - floor(s*n)`` kernel entries, its kept set is
inside the sort baseline's (so equal to it when there are no ties at the
threshold), and biases are unchanged.

Further tables (``--parts``; ``sizes`` is the table above):

* ``dists``: the kernel's time at 1.1M and 20M (sparsity 0.9) on trees of the
  same shapes drawn from different weight distributions, round-robin, with the
  ratio to He-normal: same-scale normal (``jax.random.normal``, every leaf unit
  scale, as LLM matrices), He-normal, uniform, Student-t (3 degrees of freedom),
  trained-like (He-normal with a log-normal scale per output unit and 0.1 %
  outliers at 10x) and He-normal rounded to 2 decimals (a few dozen distinct
  values: ties);
* ``compile``: compile time (trace, lower and XLA compile, from cleared caches)
  against the number of leaves (3 / 22 / 100 / 300 leaves of 1024 x 1025),
  ours against sort, interleaved, median of
  ``--compile-reps``; ``growth`` is ours over ours at 3 leaves (``growth_cpu``
  the same in process CPU seconds, all threads: less moved by other processes
  on a shared machine); with the
  projection's runtime up to ``--compile-runtime-max-leaves`` leaves;
* ``share``: the projection's share of SAFE training at ``dual_every`` K = 32:
  ``t_proj / (K * t_step + t_proj)``, with ``t_step`` a SAFE step without dual
  update (``benchmarks/perf/_common.py``'s ``safe_nodual``) and ``t_proj`` the jitted
  ``project_topk`` of the same params at sparsity 0.9, timed side by side for
  ResNet-20x2, VGG-19 (both 32x32x3 inputs, ``--share-batch``) and one
  SmolLM2-135M-shaped LLaMA block (576 / 1536, 9 heads, 3 KV heads; random
  weights, block-output MSE on ``--share-batch`` x 128 tokens);
* ``per_output``: Wanda's per-output grouping (``PerOutput``, each output unit's
  row of input weights keeps its own top half) on one SmolLM2-135M block's seven
  matrices (3.3M entries, rows of 576 and 1,536) and, with ``--per-output-7b``,
  one LLaMA-2-7B block's (202M entries, rows of 4,096 and 11,008), kept counts
  checked exact.

Every kernel is timed through the public ``project_topk``; comparing another
revision's private selection kernel is ``git worktree`` + this script in each.

Bars on this CPU: ours >= 50x faster than sort at 1.1M and at 20M, compile
< 10 s, compile at 300 leaves within 2x of compile at 3 leaves, the slowest
distribution within 1.3x of the fastest.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
import safe_optax

Params = dict[str, dict[str, jax.Array]]
Shape = tuple[int, ...]
BUDGET_S = 20.0
SLOW_FIRST_CALL_S = 1.0


def resnet20_shapes(width: int) -> list[Shape]:
  """CIFAR ResNet-20 kernels: 3 stages x 3 basic blocks, 1x1 projection shortcuts."""
  widths = [16 * width, 32 * width, 64 * width]
  shapes: list[Shape] = [(3, 3, 3, widths[0])]
  cin = widths[0]
  for cout in widths:
    for _ in range(3):
      shapes += [(3, 3, cin, cout), (3, 3, cout, cout)]
      if cin != cout:
        shapes.append((1, 1, cin, cout))
      cin = cout
  return shapes + [(cin, 10)]


def vgg19_shapes() -> list[Shape]:
  widths = [64, 64, 128, 128] + [256] * 4 + [512] * 8
  return [(3, 3, cin, cout) for cin, cout in zip([3] + widths, widths)] + [
      (512, 512), (512, 512), (512, 10)]


def gpt_shapes(layers: int = 8, d: int = 1024) -> list[Shape]:
  return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * layers


SIZES: dict[str, Callable[[], list[Shape]]] = {
    "0.27M": lambda: resnet20_shapes(1), "1.1M": lambda: resnet20_shapes(2),
    "20M": vgg19_shapes, "100M": gpt_shapes}


def make_params(shapes: list[Shape], seed: int = 0) -> Params:
  """He-normal float32 kernels (no exact zeros) with a 1-D bias per layer."""
  rng = np.random.default_rng(seed)
  params = {}
  for i, shape in enumerate(shapes):
    kernel = rng.standard_normal(shape, dtype=np.float32)
    kernel *= np.float32(math.sqrt(2.0 / math.prod(shape[:-1])))
    kernel[kernel == 0] = np.finfo(np.float32).tiny  # nonzero <=> kept, in the checks
    bias = 0.01 * rng.standard_normal(shape[-1], dtype=np.float32)
    params[f"layer_{i:03d}"] = {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}
  return params


def _flat_abs(params: Params) -> jax.Array:
  return jnp.concatenate([jnp.abs(l["kernel"]).ravel() for l in params.values()])


def _apply_threshold(params: Params, thr: jax.Array) -> Params:
  return {name: {"kernel": jnp.where(jnp.abs(l["kernel"]) >= thr, l["kernel"], 0.0),
                 "bias": l["bias"]} for name, l in params.items()}


def ours(params: Params, s: jax.Array) -> Params:
  return safe_optax.project_topk(params, s)[0]


def sort_baseline(params: Params, k: jax.Array) -> Params:
  flat = _flat_abs(params)
  return _apply_threshold(params, jnp.sort(flat)[flat.size - k])


def topk_baseline(params: Params, k: int) -> Params:
  return _apply_threshold(params, jax.lax.top_k(_flat_abs(params), k)[0][-1])


def floor_baseline(params: Params, masks: dict[str, jax.Array]) -> Params:
  return {name: {"kernel": jnp.where(masks[name], l["kernel"], 0.0), "bias": l["bias"]}
          for name, l in params.items()}


def compile_timed(fn: Callable[..., Any], *args: Any, **static: Any) -> tuple[Any, float]:
  return harness.timed(lambda: jax.jit(fn, static_argnames=tuple(static)).lower(
      *args, **static).compile())


def time_methods(calls: dict[str, Callable[[], Any]], reps: int) -> tuple[dict, dict]:
  """Round-robin timing; returns raw seconds per method and each method's last output."""
  samples: dict[str, list[float]] = {}
  wanted, outputs = {}, {}
  for name, fn in calls.items():
    outputs[name], first = harness.timed(fn)
    samples[name] = [first] if first >= SLOW_FIRST_CALL_S else []
    wanted[name] = max(1, min(reps, int(BUDGET_S / first)))
  while any(len(samples[n]) < wanted[n] for n in calls):
    for name, fn in calls.items():
      if len(samples[name]) < wanted[name]:
        outputs[name], elapsed = harness.timed(fn)
        samples[name].append(elapsed)
  return samples, outputs


def _kept(tree: Params) -> list[np.ndarray]:
  return [np.asarray(layer["kernel"]) != 0 for layer in tree.values()]


def check(params: Params, s: float, out: Params, ref: Params | None) -> dict[str, Any]:
  """Kept count vs the exact formula, kept set vs the sort baseline, biases untouched."""
  kept = _kept(out)
  n = sum(m.size for m in kept)
  num_keep_jit = jax.jit(functools.partial(safe_optax.num_keep, n))
  # Under jit the sparsity is a traced float32, whose documented keep count is
  # n - floor((s + ulp(s)/2) * n); it can differ from the decimal count by < n * ulp(s).
  result: dict[str, Any] = {
      "expected_kept": int(num_keep_jit(jnp.float32(s))), "kept": int(sum(m.sum() for m in kept)),
      "decimal_kept": safe_optax.num_keep(n, s),
      "biases_unchanged": all(np.array_equal(out[name]["bias"], layer["bias"])
                              for name, layer in params.items())}
  if ref is not None:
    ref_kept = _kept(ref)
    result["sort_ties_kept"] = int(sum(m.sum() for m in ref_kept)) - result["expected_kept"]
    result["kept_outside_sort_set"] = int(sum((a & ~b).sum() for a, b in zip(kept, ref_kept)))
  result["ok"] = (result["kept"] == result["expected_kept"] and result["biases_unchanged"]
                  and not result.get("kept_outside_sort_set"))
  return result


def bench_size(size: str, sparsities: list[float], reps: int, skip_slow: bool) -> list[dict]:
  shapes = SIZES[size]()
  params = make_params(shapes)
  n = sum(math.prod(shape) for shape in shapes)
  ours_c, ours_compile = compile_timed(ours, params, jnp.float32(sparsities[0]))
  slow = skip_slow and size == "100M"
  sort_c, sort_compile = (
      (None, None) if slow else compile_timed(sort_baseline, params, jnp.int32(n)))
  masks0 = {name: jnp.ones(layer["kernel"].shape, bool) for name, layer in params.items()}
  floor_c, floor_compile = compile_timed(floor_baseline, params, masks0)
  rows = []
  for s in sparsities:
    # Baselines keep the same k as ours: the float32 rule of a traced sparsity.
    s_arr = jnp.float32(s)
    k = int(jax.jit(functools.partial(safe_optax.num_keep, n))(s_arr))
    calls = {"ours": functools.partial(ours_c, params, s_arr)}
    topk_compile = None
    if not slow:
      topk_c, topk_compile = compile_timed(topk_baseline, params, k=k)
      calls |= {"sort": functools.partial(sort_c, params, jnp.int32(k)),
                "top_k": functools.partial(topk_c, params)}
    masks = jax.block_until_ready({name: layer["kernel"] != 0
                                   for name, layer in ours_c(params, s_arr).items()})
    calls["floor"] = functools.partial(floor_c, params, masks)
    samples, outputs = time_methods(calls, reps)
    rows.append({
        "size": size, "sparsity": s, "num_kernel_params": n, "num_leaves": 2 * len(shapes),
        "median_ms": {m: 1e3 * statistics.median(t) for m, t in samples.items()},
        "raw_s": samples, "compile_s": {"ours": ours_compile, "sort": sort_compile,
                                        "top_k": topk_compile, "floor": floor_compile},
        "check": check(params, s, outputs["ours"], outputs.get("sort"))})
    print_row(rows[-1])
  return rows


HEADER = (f"{'size':>6} {'s':>5} {'ours ms':>9} {'sort ms':>9} {'top_k ms':>9} {'floor ms':>9}"
          f" {'vs sort':>8} {'/floor':>7} {'ours cs':>9} {'sort cs':>9}  check")


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
  return "-" if x is None else format(x, spec) + suffix




def print_row(row: dict) -> None:
  t, c, chk = row["median_ms"], row["compile_s"], row["check"]
  sort = t.get("sort")
  verdict = "ok" if chk["ok"] else (
      f"FAIL kept-exact={chk['kept'] - chk['expected_kept']:+d}"
      f" outside-sort-set={chk.get('kept_outside_sort_set')}"
      f" biases_ok={chk['biases_unchanged']}")
  print(f"{row['size']:>6} {row['sparsity']:>5} {t['ours']:>9.2f} {fmt(sort, '9.1f'):>9}"
        f" {fmt(t.get('top_k'), '9.1f'):>9} {t['floor']:>9.2f}"
        f" {fmt(sort and sort / t['ours'], '.1f', 'x'):>8} {t['ours'] / t['floor']:>6.1f}x"
        f" {c['ours']:>9.2f} {fmt(c['sort'], '9.2f'):>9}  {verdict}", flush=True)


def bars(rows: list[dict]) -> dict[str, bool | None]:
  """The acceptance bars; None where the run did not cover them."""
  def all_of(size: str, pred: Callable[[dict], bool]) -> bool | None:
    hits = [pred(r) for r in rows if r["size"] == size and "sort" in r["median_ms"]]
    return all(hits) if hits else None

  def speed(r: dict) -> bool:
    return r["median_ms"]["sort"] / r["median_ms"]["ours"] >= 50

  return {"ours >= 50x sort at 1.1M": all_of("1.1M", speed),
          "ours >= 50x sort at 20M": all_of("20M", speed),
          "ours compile < 10 s": all(r["compile_s"]["ours"] < 10 for r in rows) if rows else None}


PARTS = ("sizes", "dists", "compile", "share", "per_output")


def main() -> None:
  from benchmarks.perf import projection_tables as tables  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default="sizes,dists,compile,share",
                      help="comma-separated tables to run: sizes, dists, compile, share, "
                      "per_output")
  parser.add_argument("--per-output-7b", action="store_true",
                      help="per_output: also a LLaMA-2-7B block (202M entries)")
  parser.add_argument("--sizes", default=",".join(SIZES))
  parser.add_argument("--sparsities", default="0.5,0.9,0.99")
  parser.add_argument("--reps", type=int, default=10, help="max timed samples per case")
  parser.add_argument("--skip-slow", action="store_true", help="skip sort and top_k at 100M")
  parser.add_argument("--dist-sizes", default="1.1M,20M")
  parser.add_argument("--compile-leaves", default="3,22,100,300")
  parser.add_argument("--compile-reps", type=int, default=3,
                      help="interleaved compiles per method and leaf count (median kept)")
  parser.add_argument("--compile-runtime-max-leaves", type=int, default=100,
                      help="time the projection itself up to this many 1M-entry leaves")
  parser.add_argument("--share-batch", type=int, default=32)
  parser.add_argument("--share-reps", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                    "results", "projection.json"))
  args = parser.parse_args()
  parts = args.parts.split(",")
  if unknown := set(parts) - set(PARTS):
    parser.error(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
  sizes = args.sizes.split(",") if "sizes" in parts else []
  dist_sizes = args.dist_sizes.split(",") if "dists" in parts else []
  if unknown := set(sizes + dist_sizes) - set(SIZES):
    parser.error(f"unknown sizes {sorted(unknown)}; choose from {list(SIZES)}")
  sparsities = [float(s) for s in args.sparsities.split(",")]
  jax.jit(lambda x: x + 1)(jnp.zeros(()))  # keep one-time XLA start-up out of compile times
  report = harness.run_record()
  start = time.perf_counter()
  rows = []
  if sizes:
    print(HEADER)
    rows = [row for size in sizes for row in bench_size(size, sparsities, args.reps,
                                                        args.skip_slow)]
  dist_rows = tables.bench_distributions(dist_sizes, args.reps) if dist_sizes else []
  leaves = [int(c) for c in args.compile_leaves.split(",")]
  compile_rows = (tables.bench_compile(leaves, args.compile_reps, args.compile_runtime_max_leaves)
                  if "compile" in parts else [])
  share_rows = tables.bench_share(args.share_batch, args.share_reps) if "share" in parts else []
  blocks = ["smollm2_135m"] + ["llama2_7b"] * args.per_output_7b
  per_output_rows = tables.bench_per_output(blocks, args.reps) if "per_output" in parts else []
  verdicts = bars(rows)
  for size in dist_sizes:
    times = [r["median_ms"] for r in dist_rows if r["kernel"] == "ours" and r["size"] == size]
    verdicts[f"slowest / fastest distribution <= 1.3x at {size}"] = max(times) / min(times) <= 1.3
  if compile_rows and compile_rows[0]["leaves"] == 3 and compile_rows[-1]["leaves"] == 300:
    verdicts["ours compile at 300 leaves <= 2x at 3 leaves"] = compile_rows[-1]["growth"] <= 2
  for name, met in verdicts.items():
    print(f"bar {name}: {'n/a' if met is None else 'met' if met else 'NOT met'}")
  report.update({"bars": verdicts, "rows": rows, "distributions": dist_rows,
                 "compile": compile_rows, "share": share_rows, "per_output": per_output_rows})
  harness.write_report(report, args.out, start)
  failed = [r for r in rows if not r["check"]["ok"]] + [
      r for r in dist_rows + per_output_rows if not r["kept_exact"]]
  if failed:
    sys.exit("CHECK FAILED: see the check column and the JSON 'check' / 'kept_exact' entries")


if __name__ == "__main__":
  main()
