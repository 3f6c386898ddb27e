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
  values: ties). ``--compare-kernel FILE`` times another ``_select.py`` (e.g.
  ``git show REV:safe_optax/_select.py > old.py``) in the same rounds;
* ``compile``: compile time (trace, lower and XLA compile, from cleared caches)
  against the number of leaves (3 / 22 / 100 / 300 leaves of 1024 x 1025),
  ours against sort and the compared kernel, interleaved, median of
  ``--compile-reps``; ``growth`` is ours over ours at 3 leaves (``growth_cpu``
  the same in process CPU seconds, all threads: less moved by other processes
  on a shared machine); with the
  projection's runtime (ours and the compared kernel, same kept sets checked)
  up to ``--compile-runtime-max-leaves`` leaves;
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
  one LLaMA-2-7B block's (202M entries, rows of 4,096 and 11,008): the kernel
  against ``--compare-kernel``'s (before 2026-11-29 a stable sort of every row)
  in the same rounds, kept sets checked equal.

Bars on this CPU: ours >= 50x faster than sort at 1.1M and at 20M, compile
< 10 s, compile at 300 leaves within 2x of compile at 3 leaves, the slowest
distribution within 1.3x of the fastest.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

from benchmarks import harness
from benchmarks.perf import _common
import safe_optax
from safe_optax import _projection
from safe_optax import _select
from safe_optax import flax_utils

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


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
  return "-" if x is None else format(x, spec) + suffix


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return ""


def print_row(row: dict) -> None:
  t, c, chk = row["median_ms"], row["compile_s"], row["check"]
  sort = t.get("sort")
  verdict = "ok" if chk["ok"] else (
      f"FAIL kept-exact={chk['kept'] - chk['expected_kept']:+d}"
      f" outside-sort-set={chk.get('kept_outside_sort_set')}"
      f" biases_ok={chk['biases_unchanged']}")
  print(f"{row['size']:>6} {row['sparsity']:>5} {t['ours']:>9.2f} {_fmt(sort, '9.1f'):>9}"
        f" {_fmt(t.get('top_k'), '9.1f'):>9} {t['floor']:>9.2f}"
        f" {_fmt(sort and sort / t['ours'], '.1f', 'x'):>8} {t['ours'] / t['floor']:>6.1f}x"
        f" {c['ours']:>9.2f} {_fmt(c['sort'], '9.2f'):>9}  {verdict}", flush=True)


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


# --------------------------------------------------------------------------- #
# Weight distributions                                                        #
# --------------------------------------------------------------------------- #


def distribution_trees(shapes: list[Shape], seed: int = 0) -> dict[str, list[jax.Array]]:
  """Kernels of the given shapes under each weight distribution (see the module docstring)."""
  key = jax.random.key(seed)
  keys = [jax.random.fold_in(key, i) for i in range(len(shapes))]
  he = [math.sqrt(2.0 / math.prod(shape[:-1])) for shape in shapes]
  normal = [jax.random.normal(k, shape) for k, shape in zip(keys, shapes)]
  trained = []
  for k, x, scale in zip(keys, normal, he):
    k_unit, k_outlier = jax.random.split(jax.random.fold_in(k, 1))
    unit = jnp.exp(0.5 * jax.random.normal(k_unit, x.shape[-1:]))
    outlier = jnp.where(jax.random.uniform(k_outlier, x.shape) < 1e-3, 10.0, 1.0)
    trained.append(x * scale * unit * outlier)
  return {
      "same_scale_normal": normal,
      "he_normal": [x * scale for x, scale in zip(normal, he)],
      "uniform": [jax.random.uniform(jax.random.fold_in(k, 2), shape, minval=-1.0)
                  for k, shape in zip(keys, shapes)],
      "student_t3": [jax.random.t(jax.random.fold_in(k, 3), 3.0, shape) * scale
                     for k, shape, scale in zip(keys, shapes, he)],
      "trained_like": trained,
      "rounded_2dp": [jnp.round(x * scale, 2) for x, scale in zip(normal, he)],
  }


def load_select(path: str) -> Any:
  """Imports a ``_select.py`` from ``path`` as a module (an older kernel to compare)."""
  spec = importlib.util.spec_from_file_location("compared_select", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def kernel_projection(select: Any) -> Callable[[list[jax.Array], jax.Array], list[jax.Array]]:
  """``project_topk``'s global scope on a list of kernels, built on ``select``'s kernel.

  A kernel with ``magnitude_keys`` gets the raw kernels and maps them to keys
  itself (as ``project_topk`` calls it); an older one gets per-leaf keys.
  """
  def project(kernels: list[jax.Array], k: jax.Array) -> list[jax.Array]:
    if hasattr(select, "magnitude_keys"):
      masks, _ = select.topk_masks(kernels, k, key_fn=select.magnitude_keys)
    else:
      masks, _ = select.topk_masks([select.order_keys(jnp.abs(w)) for w in kernels], k)
    # lax.select, as project_topk: jnp.where's wrapper is traced once per leaf.
    return [jax.lax.select(m, w, jnp.zeros_like(w)) for m, w in zip(masks, kernels)]
  return project


def jitted_kernels(build: Callable[[Any], Callable], compare: Any) -> dict[str, Callable]:
  """``build``'s projection on this package's ``_select`` ("ours") and on ``compare``'s."""
  kernels = {"ours": jax.jit(build(_select))}
  if compare is not None:
    kernels["compared"] = jax.jit(build(compare))
  return kernels


def bench_distributions(sizes: list[str], reps: int, compare: Any) -> list[dict]:
  kernels = jitted_kernels(kernel_projection, compare)
  rows = []
  for size in sizes:
    shapes = SIZES[size]()
    trees = distribution_trees(shapes)
    n = sum(math.prod(shape) for shape in shapes)
    k = jnp.int32(safe_optax.num_keep(n, 0.9))
    calls, info = {}, {}
    for dist, tree in trees.items():
      flat = np.abs(np.concatenate([np.asarray(w).ravel() for w in tree]))
      kth = np.partition(flat, n - int(k))[n - int(k)]
      info[dist] = {"distinct_values": int(np.unique(flat).size),
                    "ties_at_threshold": int((flat == kth).sum())}
      outs = {}
      for name, fn in kernels.items():
        calls[(name, dist)] = functools.partial(fn, tree, k)
        outs[name] = [np.asarray(w) for w in fn(tree, k)]
      # The threshold is > 0 for every tree at sparsity 0.9, so kept <=> nonzero.
      info[dist]["kept_exact"] = sum(int((w != 0).sum()) for w in outs["ours"]) == int(k)
      if compare is not None:
        info[dist]["same_as_compared"] = all(
            np.array_equal(a, b) for a, b in zip(outs["ours"], outs["compared"]))
    samples, _ = time_methods(calls, reps)
    for name in kernels:
      base = statistics.median(samples[(name, "he_normal")])
      for dist in trees:
        median = statistics.median(samples[(name, dist)])
        rows.append({"size": size, "kernel": name, "distribution": dist, "sparsity": 0.9,
                     "median_ms": 1e3 * median, "over_he_normal": median / base,
                     "raw_s": samples[(name, dist)], **info[dist]})
  print(f"\n{'size':>6} {'kernel':>9} {'distribution':>18} {'ms':>8} {'/he':>6} "
        f"{'distinct':>9} {'ties@t':>7}")
  for r in rows:
    print(f"{r['size']:>6} {r['kernel']:>9} {r['distribution']:>18} {r['median_ms']:>8.1f}"
          f" {r['over_he_normal']:>5.2f}x {r['distinct_values']:>9} {r['ties_at_threshold']:>7}")
  return rows


# --------------------------------------------------------------------------- #
# Compile time against the leaf count                                         #
# --------------------------------------------------------------------------- #


def bench_compile(leaf_counts: list[int], compare: Any, compare_max_leaves: int, reps: int,
                  runtime_max_leaves: int) -> list[dict]:
  """Compile (trace + lower + XLA) seconds per method and leaf count, and runtime.

  Every compile starts from cleared caches; methods and leaf counts are
  interleaved round-robin ``reps`` times and the median kept, so machine load
  drifts into all of them alike. ``growth`` is ours over ours at the first leaf
  count. Runtime (ours and the compared kernel, sparsity 0.9, round-robin) is
  measured up to ``runtime_max_leaves`` leaves (the arrays take 4 bytes x 1M
  entries x leaves, several times over).
  """
  methods = {"ours": kernel_projection(_select), "sort": _sort_projection}
  if compare is not None:
    methods["compared"] = kernel_projection(compare)
  k_spec = jax.ShapeDtypeStruct((), jnp.int32)
  samples: dict[tuple[int, str], list[float]] = {}
  cpu_samples: dict[tuple[int, str], list[float]] = {}
  for _ in range(reps):
    for count in leaf_counts:
      kernels = [jax.ShapeDtypeStruct(COMPILE_LEAF_SHAPE, jnp.float32)] * count
      for name, fn in methods.items():
        if name == "compared" and count > compare_max_leaves:
          continue
        jax.clear_caches()
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.jit(fn).lower(kernels, k_spec).compile()
        samples.setdefault((count, name), []).append(time.perf_counter() - start)
        cpu_samples.setdefault((count, name), []).append(time.process_time() - start_cpu)
  rows = []
  for count in leaf_counts:
    compile_s = {name: statistics.median(samples[(count, name)])
                 for name in methods if (count, name) in samples}
    compile_cpu_s = {name: statistics.median(cpu_samples[(count, name)]) for name in compile_s}
    first = leaf_counts[0]
    rows.append({"leaves": count, "leaf_shape": list(COMPILE_LEAF_SHAPE), "compile_s": compile_s,
                 "growth": compile_s["ours"] / statistics.median(samples[(first, "ours")]),
                 "compile_cpu_s": compile_cpu_s,
                 "growth_cpu": compile_cpu_s["ours"] / statistics.median(
                     cpu_samples[(first, "ours")]),
                 "raw_compile_s": {name: samples[(count, name)] for name in compile_s},
                 "raw_compile_cpu_s": {name: cpu_samples[(count, name)] for name in compile_s}})
  for row in rows:
    if row["leaves"] <= runtime_max_leaves:
      row["runtime_ms"] = _compile_table_runtime(row["leaves"], methods, compare is not None)
  cols = list(methods)
  print(f"\n{'leaves':>6} " + " ".join(f"{m + ' s':>11}" for m in cols) + f" {'growth':>7}"
        f" {'cpu gr.':>7} {'ours ms':>9} {'cmp ms':>9} {'ours/cmp':>8}")
  for row in rows:
    t = row.get("runtime_ms", {})
    print(f"{row['leaves']:>6} " + " ".join(f"{_fmt(row['compile_s'].get(m), '11.2f'):>11}"
                                          for m in cols)
          + f" {row['growth']:>6.2f}x {row['growth_cpu']:>6.2f}x"
          f" {_fmt(t.get('ours'), '9.1f'):>9}"
          f" {_fmt(t.get('compared'), '9.1f'):>9}"
          f" {_fmt(t.get('compared') and t['ours'] / t['compared'], '7.2f', 'x'):>8}", flush=True)
  return rows


COMPILE_LEAF_SHAPE = (1024, 1025)


def _compile_table_runtime(count: int, methods: dict[str, Callable], compare: bool) -> dict:
  """Median ms of ours (and the compared kernel) on ``count`` random leaves, round-robin."""
  key = jax.random.key(0)
  kernels = [jax.random.normal(jax.random.fold_in(key, i), COMPILE_LEAF_SHAPE)
             for i in range(count)]
  k = jnp.int32(safe_optax.num_keep(count * math.prod(COMPILE_LEAF_SHAPE), 0.9))
  names = ["ours"] + (["compared"] if compare else [])
  calls = {name: functools.partial(jax.jit(methods[name]), kernels, k) for name in names}
  samples, outputs = time_methods(calls, reps=5)
  if compare:  # the same kept set, leaf by leaf
    assert all(np.array_equal(a, b) for a, b in zip(outputs["ours"], outputs["compared"]))
  return {name: 1e3 * statistics.median(samples[name]) for name in names}


def _sort_projection(kernels: list[jax.Array], k: jax.Array) -> list[jax.Array]:
  return [jnp.where(m, w, 0.0) for m, w in zip(_sort_masks(kernels, k), kernels)]


def _sort_masks(kernels: list[jax.Array], k: jax.Array) -> list[jax.Array]:
  flat = jnp.concatenate([jnp.abs(w).ravel() for w in kernels])
  threshold = jnp.sort(flat)[flat.size - k]
  return [jnp.abs(w) >= threshold for w in kernels]


# --------------------------------------------------------------------------- #
# The projection's share of a SAFE step at dual_every = 32                    #
# --------------------------------------------------------------------------- #


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _share_models(batch: int) -> dict[str, tuple[Callable, Any, Any, Callable]]:
  """name -> (apply_fn, variables, (inputs, targets), loss_fn)."""
  from safe_optax.llm.model import Block, LlamaConfig  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import models  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
  out = {}
  for name, module in [("resnet20x2", models.resnet20(num_classes=10, width=2)),
                       ("vgg19", models.vgg19(num_classes=10))]:
    variables = jax.jit(functools.partial(module.init, train=False))(
        jax.random.key(0), images)
    out[name] = (module.apply, variables, (images, labels), _cross_entropy)
  config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=1, num_heads=9, num_kv_heads=3, rope_base=1e5)
  block = Block(config)
  tokens = jnp.asarray(rng.normal(size=(batch, 128, 576)), jnp.float32)
  targets = jnp.asarray(rng.normal(size=(batch, 128, 576)), jnp.float32)

  def block_apply(variables, x, train=True, mutable=(), rngs=None):
    del train, rngs
    y = block.apply(variables, x)
    return (y, {}) if mutable else y

  out["smollm2_block"] = (block_apply, block.init(jax.random.key(0), tokens), (tokens, targets),
                          lambda y, t: jnp.mean((y - t) ** 2))
  return out


def _safe_step(apply_fn: Callable, loss_fn: Callable) -> Callable:
  tx, _ = _common.make_tx("safe_nodual")

  def step(params, model_state, opt_state, batch):
    (loss, (_, new_state)), grads = flax_utils.loss_and_grad_with_state(
        apply_fn, params, model_state, batch, loss_fn)
    grad_fn = flax_utils.sam_grad_fn(apply_fn, model_state, batch, loss_fn)
    updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    return optax.apply_updates(params, updates), new_state, opt_state, loss

  return jax.jit(step), tx


def bench_share(batch: int, reps: int, dual_every: int = _common.DUAL_EVERY) -> list[dict]:
  calls, meta = {}, {}
  project = jax.jit(lambda p, s: safe_optax.project_topk(p, s)[0])
  for name, (apply_fn, variables, data, loss_fn) in _share_models(batch).items():
    model_state, params = flax.core.pop(variables, "params")
    step, tx = _safe_step(apply_fn, loss_fn)
    opt_state = tx.init(params)
    prunable = sum(leaf.size for leaf, flag in zip(
        jax.tree.leaves(params), jax.tree.leaves(safe_optax.prunable_mask(params))) if flag)
    meta[name] = {"prunable_weights": int(prunable),
                  "prunable_leaves": int(sum(jax.tree.leaves(safe_optax.prunable_mask(params))))}
    calls[(name, "safe_step")] = functools.partial(step, params, model_state, opt_state, data)
    calls[(name, "projection")] = functools.partial(project, params, jnp.float32(0.9))
    print(f"{name}: compiling", flush=True)
    for key in [(name, "safe_step"), (name, "projection")]:
      jax.block_until_ready(calls[key]())
  samples, _ = time_methods(calls, reps)
  rows = []
  print(f"\n{'model':>14} {'prunable':>11} {'leaves':>6} {'step ms':>9} {'proj ms':>8}"
        f" {'share@K=' + str(dual_every):>11}")
  for name in meta:
    t_step = statistics.median(samples[(name, "safe_step")])
    t_proj = statistics.median(samples[(name, "projection")])
    share = t_proj / (dual_every * t_step + t_proj)
    rows.append({"model": name, "batch": batch, **meta[name], "dual_every": dual_every,
                 "safe_step_ms": 1e3 * t_step, "projection_ms": 1e3 * t_proj,
                 "projection_share": share, "raw_s": {
                     "safe_step": samples[(name, "safe_step")],
                     "projection": samples[(name, "projection")]}})
    print(f"{name:>14} {meta[name]['prunable_weights']:>11,} {meta[name]['prunable_leaves']:>6}"
          f" {1e3 * t_step:>9.1f} {1e3 * t_proj:>8.1f} {100 * share:>10.2f}%", flush=True)
  return rows


# (in, out) Dense layouts of one LLaMA-family block's seven matrices: q, k, v, o, gate, up, down.
def _llama_block_shapes(hidden: int, kv: int, mlp: int) -> list[Shape]:
  return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, mlp),
          (hidden, mlp), (mlp, hidden)]


PER_OUTPUT = safe_optax.PerOutput()
PER_OUTPUT_BLOCKS = {"smollm2_135m": _llama_block_shapes(576, 192, 1536),
                     "llama2_7b": _llama_block_shapes(4096, 4096, 11008)}


def per_output_projection(select: Any) -> Callable[[list[jax.Array], list[jax.Array]], list]:
  """``project_topk(..., structure=PerOutput())`` on kernels, built on ``select``'s row kernel."""
  def project(kernels: list[jax.Array], counts: list[jax.Array]) -> list[jax.Array]:
    out = []
    for w, k in zip(kernels, counts):
      # project_topk's own grouping into rows and back; only the row kernel differs.
      rows = _projection._to_groups(select.magnitude_keys(w), PER_OUTPUT)
      mask = _projection._from_groups(select.group_topk_mask(rows, k), w.shape, PER_OUTPUT)
      out.append(jax.lax.select(mask, w, jnp.zeros_like(w)))
    return out
  return project


def bench_per_output(blocks: list[str], compare: Any, reps: int) -> list[dict]:
  kernels = jitted_kernels(per_output_projection, compare)
  rows = []
  for block in blocks:
    shapes = PER_OUTPUT_BLOCKS[block]
    key = jax.random.key(0)  # unit scale, as LLM matrices; one tree (7B's is 0.8 GB)
    tree = [jax.random.normal(jax.random.fold_in(key, i), shape) for i, shape in enumerate(shapes)]
    counts = [jnp.int32(safe_optax.num_keep(shape[0], 0.5)) for shape in shapes]
    calls, kept = {}, {}
    for name, fn in kernels.items():
      calls[name] = functools.partial(fn, tree, counts)
      kept[name] = [np.asarray(w) != 0 for w in fn(tree, counts)]
    exact = all((m.sum(0) == int(k)).all() for m, k in zip(kept["ours"], counts))
    same = (None if compare is None else
            all(np.array_equal(a, b) for a, b in zip(kept["ours"], kept["compared"])))
    samples, _ = time_methods(calls, reps)
    medians = {name: statistics.median(samples[name]) for name in kernels}
    for name in kernels:
      rows.append({"block": block, "kernel": name, "entries": sum(map(math.prod, shapes)),
                   "sparsity": 0.5, "median_ms": 1e3 * medians[name],
                   "compared_over_ours": (medians["compared"] / medians["ours"]
                                          if compare is not None else None),
                   "kept_exact": exact, "same_as_compared": same, "raw_s": samples[name]})
  print(f"\n{'block':>14} {'kernel':>9} {'entries':>11} {'ms':>9} {'compared/ours':>14}")
  for r in rows:
    ratio = "" if r["compared_over_ours"] is None else f"{r['compared_over_ours']:.1f}x"
    print(f"{r['block']:>14} {r['kernel']:>9} {r['entries']:>11,} {r['median_ms']:>9.1f} "
          f"{ratio:>14}")
  return rows


PARTS = ("sizes", "dists", "compile", "share", "per_output")


def main() -> None:
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
  parser.add_argument("--compare-kernel", help="another _select.py to time side by side")
  parser.add_argument("--compare-compile-max-leaves", type=int, default=300,
                      help="compile the compared kernel only up to this many leaves")
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
  compare = load_select(args.compare_kernel) if args.compare_kernel else None
  jax.jit(lambda x: x + 1)(jnp.zeros(()))  # keep one-time XLA start-up out of compile times
  start, load_start = time.perf_counter(), os.getloadavg()
  rows = []
  if sizes:
    print(HEADER)
    rows = [row for size in sizes for row in bench_size(size, sparsities, args.reps,
                                                        args.skip_slow)]
  dist_rows = bench_distributions(dist_sizes, args.reps, compare) if dist_sizes else []
  compile_rows = (bench_compile([int(c) for c in args.compile_leaves.split(",")], compare,
                                args.compare_compile_max_leaves, args.compile_reps,
                                args.compile_runtime_max_leaves)
                  if "compile" in parts else [])
  share_rows = bench_share(args.share_batch, args.share_reps) if "share" in parts else []
  per_output_rows = (bench_per_output(["smollm2_135m"] + ["llama2_7b"] * args.per_output_7b,
                                      compare, args.reps) if "per_output" in parts else [])
  verdicts = bars(rows)
  for size in dist_sizes:
    times = [r["median_ms"] for r in dist_rows if r["kernel"] == "ours" and r["size"] == size]
    verdicts[f"slowest / fastest distribution <= 1.3x at {size}"] = max(times) / min(times) <= 1.3
  if compile_rows and compile_rows[0]["leaves"] == 3 and compile_rows[-1]["leaves"] == 300:
    verdicts["ours compile at 300 leaves <= 2x at 3 leaves"] = compile_rows[-1]["growth"] <= 2
  for name, met in verdicts.items():
    print(f"bar {name}: {'n/a' if met is None else 'met' if met else 'NOT met'}")
  report = {
      "command": shlex.join([sys.executable] + sys.argv),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                   "numpy": np.__version__, "python": platform.python_version(),
                   "safe_optax": safe_optax.__version__},
      "cpu": {"processor": platform.processor(), "model": cpu_model(),
              "cpu_count": os.cpu_count(), "machine": platform.machine(),
              "loadavg_1_5_15_start": load_start, "loadavg_1_5_15_end": os.getloadavg()},
      "compare_kernel": args.compare_kernel,
      "total_wall_s": time.perf_counter() - start, "bars": verdicts, "rows": rows,
      "distributions": dist_rows, "compile": compile_rows, "share": share_rows,
      "per_output": per_output_rows}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out} ({report['total_wall_s']:.0f} s)")
  failed = [r for r in rows if not r["check"]["ok"]] + [
      r for r in dist_rows + per_output_rows
      if not r["kept_exact"] or r.get("same_as_compared") is False]
  if failed:
    sys.exit("CHECK FAILED: see the check column and the JSON 'check' / 'kept_exact' entries")


if __name__ == "__main__":
  main()
