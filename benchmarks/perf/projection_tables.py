"""The further tables of ``python -m benchmarks.perf.projection`` (``--parts``).

``dists`` (weight distributions), ``compile`` (compile time against the leaf
count), ``share`` (the projection's share of a SAFE step) and ``per_output``
(Wanda's per-output grouping); the module docstring of
:mod:`benchmarks.perf.projection` says what each measures.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import flax_utils

from benchmarks.perf import _common
from benchmarks.perf.projection import SIZES, Shape, fmt, time_methods


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


def global_projection(kernels: list[jax.Array], s: jax.Array) -> list[jax.Array]:
  """``project_topk``'s global top-k of a list of kernels at sparsity ``s``."""
  return safe_optax.project_topk(kernels, s)[0]


def bench_distributions(sizes: list[str], reps: int) -> list[dict]:
  kernels = {"ours": jax.jit(global_projection)}
  rows = []
  for size in sizes:
    shapes = SIZES[size]()
    trees = distribution_trees(shapes)
    n = sum(math.prod(shape) for shape in shapes)
    k = jnp.int32(safe_optax.num_keep(n, 0.9))
    s = jnp.float32(0.9)
    calls, info = {}, {}
    for dist, tree in trees.items():
      flat = np.abs(np.concatenate([np.asarray(w).ravel() for w in tree]))
      kth = np.partition(flat, n - int(k))[n - int(k)]
      info[dist] = {"distinct_values": int(np.unique(flat).size),
                    "ties_at_threshold": int((flat == kth).sum())}
      outs = {}
      for name, fn in kernels.items():
        calls[(name, dist)] = functools.partial(fn, tree, s)
        outs[name] = [np.asarray(w) for w in fn(tree, s)]
      # The threshold is > 0 for every tree at sparsity 0.9, so kept <=> nonzero.
      info[dist]["kept_exact"] = sum(int((w != 0).sum()) for w in outs["ours"]) == int(k)
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


def bench_compile(leaf_counts: list[int], reps: int, runtime_max_leaves: int) -> list[dict]:
  """Compile (trace + lower + XLA) seconds per method and leaf count, and runtime.

  Every compile starts from cleared caches; methods and leaf counts are
  interleaved round-robin ``reps`` times and the median kept, so machine load
  drifts into all of them alike. ``growth`` is ours over ours at the first leaf
  count. Runtime (ours, sparsity 0.9) is
  measured up to ``runtime_max_leaves`` leaves (the arrays take 4 bytes x 1M
  entries x leaves, several times over).
  """
  methods = {"ours": (global_projection, jax.ShapeDtypeStruct((), jnp.float32)),
             "sort": (_sort_projection, jax.ShapeDtypeStruct((), jnp.int32))}
  samples: dict[tuple[int, str], list[float]] = {}
  cpu_samples: dict[tuple[int, str], list[float]] = {}
  for _ in range(reps):
    for count in leaf_counts:
      kernels = [jax.ShapeDtypeStruct(COMPILE_LEAF_SHAPE, jnp.float32)] * count
      for name, (fn, spec) in methods.items():
        jax.clear_caches()
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.jit(fn).lower(kernels, spec).compile()
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
      row["runtime_ms"] = _compile_table_runtime(row["leaves"])
  cols = list(methods)
  print(f"\n{'leaves':>6} " + " ".join(f"{m + ' s':>11}" for m in cols) + f" {'growth':>7}"
        f" {'cpu gr.':>7} {'ours ms':>9}")
  for row in rows:
    t = row.get("runtime_ms", {})
    print(f"{row['leaves']:>6} " + " ".join(f"{fmt(row['compile_s'].get(m), '11.2f'):>11}"
                                          for m in cols)
          + f" {row['growth']:>6.2f}x {row['growth_cpu']:>6.2f}x"
          f" {fmt(t.get('ours'), '9.1f'):>9}", flush=True)
  return rows


COMPILE_LEAF_SHAPE = (1024, 1025)


def _compile_table_runtime(count: int) -> dict:
  """Median ms of ours on ``count`` random leaves."""
  key = jax.random.key(0)
  kernels = [jax.random.normal(jax.random.fold_in(key, i), COMPILE_LEAF_SHAPE)
             for i in range(count)]
  samples, _ = time_methods({"ours": functools.partial(jax.jit(global_projection), kernels,
                                                       jnp.float32(0.9))}, reps=5)
  return {"ours": 1e3 * statistics.median(samples["ours"])}


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


def per_output_projection(kernels: list[jax.Array]) -> list[jax.Array]:
  """``project_topk(..., structure=PerOutput())``: each row keeps its own top half."""
  return safe_optax.project_topk(kernels, 0.5, structure=PER_OUTPUT)[0]


def bench_per_output(blocks: list[str], reps: int) -> list[dict]:
  project = jax.jit(per_output_projection)
  rows = []
  for block in blocks:
    shapes = PER_OUTPUT_BLOCKS[block]
    key = jax.random.key(0)  # unit scale, as LLM matrices; one tree (7B's is 0.8 GB)
    tree = [jax.random.normal(jax.random.fold_in(key, i), shape) for i, shape in enumerate(shapes)]
    counts = [safe_optax.num_keep(shape[0], 0.5) for shape in shapes]
    kept = [np.asarray(w) != 0 for w in project(tree)]
    samples, _ = time_methods({"ours": functools.partial(project, tree)}, reps)
    rows.append({"block": block, "kernel": "ours", "entries": sum(map(math.prod, shapes)),
                 "sparsity": 0.5, "median_ms": 1e3 * statistics.median(samples["ours"]),
                 "kept_exact": all((m.sum(0) == k).all() for m, k in zip(kept, counts)),
                 "raw_s": samples["ours"]})
  print(f"\n{'block':>14} {'entries':>11} {'ms':>9}")
  for r in rows:
    print(f"{r['block']:>14} {r['entries']:>11,} {r['median_ms']:>9.1f}")
  return rows
