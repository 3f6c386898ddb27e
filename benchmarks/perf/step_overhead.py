"""Per-step cost of SAFE against SAM and SGD: whole jitted training steps on CPU.

Each method's step is forward + backward + optimizer update, jitted as one
function with params, BatchNorm state and optimizer state donated, built with
the :mod:`safe_optax.flax_utils` helpers (the perturbed pass of SAM / SAFE
keeps the first pass's BatchNorm statistics):

* sgd:  ``chain(add_decayed_weights(1e-4), sgd(0.1, momentum=0.9))``;
* sam:  ``chain(sam_perturb(0.1), add_decayed_weights(1e-4), sgd(0.1, 0.9))``;
* safe: ``safe(0.1, 0.9, penalty=1e-3, total_steps=10000, dual_every=32,
  weight_decay=1e-4)`` (SAM + ADMM penalty, a top-k dual update every 32 steps).

Against the optax reference: ``optax_sam`` is ``optax.contrib.sam(chain(
add_decayed_weights(1e-4), sgd(0.1, 0.9)), chain(contrib.normalize(),
sgd(0.1)), sync_period=2, opaque_mode=True)`` (one whole SAM step per
``update``, same ``grad_fn``), and ``safe_k8`` is ``safe`` with ``dual_every=8``.
Per SAFE method the amortised step is ``((K - 1) * plain median + dual
median) / K``, compared with ``optax_sam``'s median.

``safe_split`` is ``safe`` run as a host loop should run it: two programs,
picked by the host's step counter (``update(..., dual_due=is_dual_step(t,
32))``, jitted with the hint static); the 31 steps of 32 without a dual update
run a program that holds no projection, so their temporary buffer is SAM's.
``safe_alone`` is ``safe`` run as the vision trainer runs it: on a dual step
the dual update first runs as a program of its own
(``safe_optax.experimental.run_dual_update``), then the step without the projection
(``dual_due=False``); both are timed as that step.

Diagnostics (``--methods``): ``admm`` (SAFE without SAM, ``safe_optax.admm``
with the same settings: the ADMM overhead over ``sgd``) and ``safe_nodual``
(SAFE with ``dual_every`` larger than the run: the penalty and the untaken
``lax.cond`` only, no projection after step 0).

Models: the 784-300-100-10 MLP on a batch of 128 random 28x28x1 inputs and
ResNet-20x2 (1.08M kernel weights) on 128 random 32x32x3 inputs.

Timing: ``time.perf_counter`` around each step call and ``block_until_ready``.
After compilation and warm-up the methods run round-robin in blocks of
``--block`` steps (32, one dual period, so every SAFE block holds exactly one
dual update), the order rotated each round. Reported per method: the median
step (SAFE's median is a step without dual update), the mean (which amortises
SAFE's dual update), and for SAFE the median of the dual-update steps alone.
Ratios are given from the pooled medians / means and, as a noise-robust
check, the median over rounds of the per-round ratio of block means. On a
shared machine the process CPU time per step (``time.process_time``, summed
over XLA's threads) is recorded too: it is far less sensitive to other
processes' load than wall time.

Page faults: each step's minor page faults (``ru_minflt``) and XLA's
temporary buffer size are recorded. XLA:CPU allocates the temporary buffer
at every call, 64-byte aligned (``posix_memalign``); a program's buffer holds
the temporaries of both branches of every ``cond``, so SAFE's includes the
dual update's (the projection's flat copy and histograms: 4.71 MiB against
SAM's 1.31 MiB for the MLP). glibc served that 4.71 MiB request with a fresh
``mmap`` at every call (strace: one ``mmap``/``munmap`` of 4,943,872 bytes a
step, where a plain ``malloc`` of that size is mapped once and then reused), so
every page the step touches faults: 376 faults and about 0.5 ms a non-dual
MLP step. Which sizes glibc maps afresh depends on the allocation history
(its mmap threshold adapts at run time), so this changes from model to model
and run to run. ``safe_split`` compiles its non-dual steps without the
projection (SAM's 1.31 MiB buffer, no faults) and pays the faults only at its
dual steps.
``--fixed-malloc`` fixes glibc's thresholds (:func:`fix_malloc_thresholds`,
the same as ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648``
in the environment) so that the comparison measures compute, not the
allocator; run with and without it to see both.

``--llm-block`` adds the check that a SAFE step without a dual update pays
nothing for the projection branch its ``lax.cond`` carries: the jitted LLM
block step of :mod:`safe_optax.llm.prune` (SAM + ADMM penalty + Adam, per-matrix
top-k) with ``dual_every`` 32 (its non-dual steps timed) against the same step
with ``dual_every`` 2**30 and against SAM + Adam without the penalty (no
branch at all), interleaved one step at a time; XLA's FLOP estimate of each
compiled step is recorded (it counts both branches of a ``cond``).

Bars: SAFE step <= 1.05 x SAM step, SAM step <= 2.1 x SGD step.
Results go to ``benchmarks/perf/results/step_overhead.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import json
import os
import resource
import statistics
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

import optax

import safe_optax
from benchmarks.perf._common import DUAL_EVERY, METHODS, make_step, make_tx, parse_steps
from benchmarks.harness import flops, run_record, summary, write_report
from safe_optax.vision import MLP, resnet20

BATCH = 128
MODELS = {
    "mlp": (lambda: MLP(), (28, 28, 1)),
    "resnet20x2": (lambda: resnet20(num_classes=10, width=2), (32, 32, 3)),
}
DEFAULT_STEPS = {"mlp": 128, "resnet20x2": 64}
DEFAULT_WARMUP = {"mlp": 8, "resnet20x2": 2}
BARS = {"safe/sam": 1.05, "sam/sgd": 2.1, "safe/optax_sam": 1.05, "safe_split/optax_sam": 1.05,
        "safe_alone/optax_sam": 1.05}
ALL_METHODS = (*METHODS, "optax_sam", "safe_k8", "safe_split", "safe_alone")
DUAL_PERIODS = {"safe": DUAL_EVERY, "admm": DUAL_EVERY, "safe_k8": 8, "safe_split": DUAL_EVERY,
                "safe_alone": DUAL_EVERY}


def make_method(method: str) -> tuple[optax.GradientTransformation, bool]:
  """:func:`_common.make_tx`, plus ``optax_sam`` (the optax reference) and ``safe_k8``."""
  if method == "optax_sam":
    outer = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
    ascent = optax.chain(optax.contrib.normalize(), optax.sgd(0.1))
    return optax.contrib.sam(outer, ascent, sync_period=2, opaque_mode=True), True
  if method in ("safe_split", "safe_alone"):
    return make_tx("safe")
  if method == "safe_k8":
    return safe_optax.safe(0.1, 0.9, penalty=1e-3, total_steps=10000, dual_every=8,
                           weight_decay=1e-4), True
  return make_tx(method)


def temp_mb(jitted: Any, *args: Any) -> float:
  """The size of XLA's temporary buffer for ``jitted(*args)`` (MiB): allocated at every call."""
  return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def bench_model(name: str, methods: list[str], steps: int, block: int, warmup: int,
                seed: int = 0) -> dict[str, Any]:
  make_model, shape = MODELS[name]
  model = make_model()
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(BATCH, *shape)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, size=BATCH), jnp.int32)
  batch = (x, y)
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(seed), x)
  model_state, params = flax.core.pop(variables, "params")
  n_kernels = sum(l.size for p, l in jax.tree_util.tree_flatten_with_path(params)[0]
                  if p[-1].key == "kernel")
  print(f"\n== {name}: batch {BATCH}x{'x'.join(map(str, shape))}, "
        f"{n_kernels:,} kernel weights, {steps} timed steps per method "
        f"(blocks of {block}), {warmup} warm-up", flush=True)

  runs: dict[str, dict[str, Any]] = {}
  for method in methods:
    tx, needs_grad_fn = make_method(method)
    state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, model_state)]
    state.append(tx.init(state[0]))
    if method == "safe_split":
      # The host's step counter picks one of two programs; only the dual one holds the
      # projection (``admm_penalty``'s ``dual_due`` hint).
      variants = {due: make_step(model.apply, tx, needs_grad_fn, dual_due=due)
                  for due in (False, True)}
      step = lambda count, *a, v=variants: v[count % DUAL_EVERY == 0](*a)
      dual_temp_mb = temp_mb(variants[True], *state, batch)
      plain_step = variants[False]
    elif method == "safe_alone":
      # As the vision trainer runs SAFE: on a dual step the dual update runs first as a
      # program of its own (``safe_optax.experimental.run_dual_update``), then the step
      # without it.
      plain_step = make_step(model.apply, tx, needs_grad_fn, dual_due=False)
      # Not donated: on XLA:CPU a donated dual program took 4-5 ms in most calls against
      # 0.7-1.3 ms undonated (the same program, interleaved; docs/performance.md, "Step overhead").
      dual = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx))
      dual_temp_mb = temp_mb(dual, state[2], state[0])

      def step(count, params, model_state, opt_state, batch, f=plain_step, dual=dual):
        if count % DUAL_EVERY == 0:
          opt_state = dual(opt_state, params)
        return f(params, model_state, opt_state, batch)
    else:
      plain_step = make_step(model.apply, tx, needs_grad_fn)
      step = lambda count, *a, f=plain_step: f(*a)
      dual_temp_mb = None
    t0 = time.perf_counter()
    *state, loss = step(0, *state, batch)
    jax.block_until_ready(loss)
    first_call = time.perf_counter() - t0
    for i in range(warmup):
      *state, loss = step(1 + i, *state, batch)
    jax.block_until_ready((state, loss))
    runs[method] = {"step": step, "state": state, "count": 1 + warmup, "times": [],
                    "cpu_times": [], "page_faults": [],
                    "temp_mb": temp_mb(plain_step, *state, batch), "dual_temp_mb": dual_temp_mb,
                    "dual": [], "round": [], "first_call_s": first_call,
                    "first_loss": float(loss)}
    print(f"  {method:12s} compile+first step {first_call:6.1f} s", flush=True)

  rounds = -(-steps // block)
  loadavg = []
  for r in range(rounds):
    n = min(block, steps - r * block)
    order = methods[r % len(methods):] + methods[:r % len(methods)]
    for method in order:
      run = runs[method]
      step, state = run["step"], run["state"]
      for _ in range(n):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, t0 = time.process_time(), time.perf_counter()
        *state, loss = step(run["count"], *state, batch)
        jax.block_until_ready((state, loss))
        run["times"].append(time.perf_counter() - t0)
        run["cpu_times"].append(time.process_time() - c0)
        run["page_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        run["dual"].append(method in DUAL_PERIODS
                           and run["count"] % DUAL_PERIODS[method] == 0)
        run["round"].append(r)
        run["count"] += 1
      run["state"] = state
      run["last_loss"] = float(loss)
    loadavg.append(os.getloadavg()[0])
    print(f"  round {r + 1}/{rounds} done (load {loadavg[-1]:.1f}) " + " ".join(
        f"{m}={1e3 * statistics.median(runs[m]['times'][-n:]):.1f}ms" for m in methods),
        flush=True)

  result: dict[str, Any] = {"kernel_weights": n_kernels, "steps": steps, "block": block,
                            "warmup": warmup, "loadavg_per_round": loadavg, "methods": {}}
  for method, run in runs.items():
    entry = {"first_call_s": run["first_call_s"], **summary(run["times"]),
             "p25_ms": 1e3 * sorted(run["times"])[len(run["times"]) // 4],
             "first_loss": run["first_loss"], "last_loss": run["last_loss"],
             "cpu": summary(run["cpu_times"]),
             "page_faults_median": statistics.median(run["page_faults"]),
             "page_faults_mean": statistics.fmean(run["page_faults"]),
             "temp_mb": run["temp_mb"],
             **({"dual_temp_mb": run["dual_temp_mb"]} if run["dual_temp_mb"] else {}),
             "times_s": run["times"], "cpu_times_s": run["cpu_times"],
             "dual_update": run["dual"], "round": run["round"]}
    if any(run["dual"]):
      entry["dual_page_faults_median"] = statistics.median(
          [f for f, d in zip(run["page_faults"], run["dual"]) if d])
      dual = [t for t, d in zip(run["times"], run["dual"]) if d]
      plain = [t for t, d in zip(run["times"], run["dual"]) if not d]
      entry["dual_steps_median_ms"] = 1e3 * statistics.median(dual)
      entry["plain_steps_median_ms"] = 1e3 * statistics.median(plain)
      entry["plain_steps_mean_ms"] = 1e3 * statistics.fmean(plain)
      entry["n_dual"] = len(dual)
      k = DUAL_PERIODS[method]
      entry["dual_every"] = k
      entry["amortised_median_ms"] = ((k - 1) * entry["plain_steps_median_ms"]
                                      + entry["dual_steps_median_ms"]) / k
    result["methods"][method] = entry
  result["ratios"] = ratios(result["methods"], rounds)
  return result


LLM_BLOCK = dict(vocab_size=256, hidden_size=576, intermediate_size=1536, num_layers=1,
                 num_heads=9, num_kv_heads=3)  # SmolLM2-135M's block shapes
LLM_BATCH = (4, 128)  # windows x tokens


def llm_block_case(seed: int = 0) -> tuple[Any, tuple[jax.Array, jax.Array], Any]:
  """A SmolLM2-135M-shaped block (random weights) on random data, and its step builder.

  Returns ``(linears, (x, y), make)``: the block's seven matrices, a batch of
  inputs and targets, and ``make(tx, dual_due=None) -> (jitted step, tx)`` where
  ``step(lin, opt_state, x, y) -> (lin, opt_state, loss)`` minimises the
  block-output MSE with ``tx`` (params and optimizer state donated; ``dual_due``
  goes to ``tx.update``).
  """
  from safe_optax.llm import model as model_lib
  from safe_optax.llm import block as block_lib

  config = model_lib.LlamaConfig(**LLM_BLOCK)
  block_params = model_lib.init_params(config, seed)["layers_0"]
  linears, norms = block_lib.split_block(block_params)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(*LLM_BATCH, config.hidden_size)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(*LLM_BATCH, config.hidden_size)), jnp.float32)
  block = model_lib.Block(config)

  def loss_fn(lin, x, y):
    out = block.apply({"params": block_lib.merge_block(lin, norms)}, x)
    return jnp.mean(jnp.square(out - y))

  def make(tx, dual_due=None):
    hint = {} if dual_due is None else {"dual_due": dual_due}

    def step(lin, opt_state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(lin, x, y)
      grad_fn = lambda p, _: jax.grad(loss_fn)(p, x, y)
      updates, opt_state = tx.update(grads, opt_state, lin, grad_fn=grad_fn, **hint)
      return optax.apply_updates(lin, updates), opt_state, loss
    return jax.jit(step, donate_argnums=(0, 1)), tx

  return linears, (x, y), make


def llm_block_transforms(dual_every: int = DUAL_EVERY) -> dict[str, optax.GradientTransformation]:
  """The block's SAFE transform with ``dual_every`` and with 2**30, and SAM + Adam alone."""
  from safe_optax.llm import block as block_lib
  from safe_optax.llm import prune_config

  cfg = {k: prune_config.PruneConfig("safe", dual_every=k) for k in (dual_every, 2**30)}
  return {f"safe_k{dual_every}": block_lib.safe_transform(cfg[dual_every], 1000),
          "safe_k_huge": block_lib.safe_transform(cfg[2**30], 1000),
          "sam_adam": optax.chain(safe_optax.sam_perturb(cfg[dual_every].rho),
                                  optax.adam(2e-4, 0.9, 0.95))}


def bench_llm_block(steps: int, seed: int = 0) -> dict[str, Any]:
  """Non-dual LLM block steps with the dual branch compiled in (K = 32, K = 2**30) and without."""
  linears, (x, y), make = llm_block_case(seed)
  runs = {}
  for name, tx in llm_block_transforms().items():
    step, tx = make(tx)
    lin = jax.tree.map(jnp.copy, linears)
    state = tx.init(lin)
    flops = flops(step.lower(lin, state, x, y).compile())
    lin, state, loss = step(lin, state, x, y)  # step 0 runs the first projection
    jax.block_until_ready(loss)
    runs[name] = {"step": step, "state": [lin, state], "count": 1, "times": [],
                  "xla_flops": flops}
  names = list(runs)
  loadavg = []
  for i in range(steps):
    for name in names[i % len(names):] + names[:i % len(names)]:
      run = runs[name]
      due = name == "safe_k32" and run["count"] % 32 == 0
      t0 = time.perf_counter()
      *run["state"], loss = run["step"](*run["state"], x, y)
      jax.block_until_ready((run["state"], loss))
      if not due:
        run["times"].append(time.perf_counter() - t0)
      run["count"] += 1
    loadavg.append(os.getloadavg()[0])
  out = {"config": LLM_BLOCK, "batch": LLM_BATCH, "steps": steps, "loadavg_per_step": loadavg,
         "methods": {n: {"xla_flops": r["xla_flops"], **summary(r["times"]),
                         "times_s": r["times"]} for n, r in runs.items()}}
  base = out["methods"]["sam_adam"]["median_ms"]
  out["ratios"] = {f"{n}/sam_adam": out["methods"][n]["median_ms"] / base
                   for n in ("safe_k32", "safe_k_huge")}
  print("\nLLM block (non-dual steps, ms median; XLA GFLOP estimate):")
  for n, e in out["methods"].items():
    print(f"  {n:12s} {e['median_ms']:9.1f} ms  {e['xla_flops'] / 1e9:9.1f} GFLOP")
  print("  " + "  ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items()))
  return out


MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 2 << 30


def fix_malloc_thresholds() -> None:
  """Fixed glibc thresholds, as ``MALLOC_MMAP_THRESHOLD_=1GiB MALLOC_TRIM_THRESHOLD_=2GiB``.

  XLA:CPU allocates a step's temporary buffer at every call. Above glibc's
  mmap threshold (adjusted at run time from earlier frees, so it differs from
  run to run) that is fresh pages from the kernel, and every page the step
  touches faults. Fixed thresholds keep such buffers on the reused heap (the
  MLP's 4.7 MB and the LLM block's 48 MB; ResNet-20's 297 MB still faults,
  76k pages a step, in benchmarks/perf/roofline.py).
  """
  libc = ctypes.CDLL(ctypes.util.find_library("c"))
  m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
  if not (libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)
          and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD_BYTES)):
    raise RuntimeError("mallopt failed: --fixed-malloc needs glibc")


def ratios(entries: dict[str, dict[str, Any]], rounds: int) -> dict[str, dict[str, float]]:
  out = {}
  for num, den in (("safe", "sam"), ("sam", "sgd"), ("admm", "sgd"), ("safe_nodual", "sam"),
                   ("sam", "optax_sam"), ("safe", "optax_sam"), ("safe_k8", "optax_sam"),
                   ("safe_nodual", "optax_sam"), ("safe_split", "optax_sam"),
                   ("safe_split", "safe"), ("safe_alone", "optax_sam"),
                   ("safe_alone", "safe_split")):
    if num not in entries or den not in entries:
      continue
    a, b = entries[num], entries[den]
    per_round = []
    for r in range(rounds):
      ta = [t for t, rr in zip(a["times_s"], a["round"]) if rr == r]
      tb = [t for t, rr in zip(b["times_s"], b["round"]) if rr == r]
      per_round.append(statistics.fmean(ta) / statistics.fmean(tb))
    out[f"{num}/{den}"] = {"median": a["median_ms"] / b["median_ms"],
                           "p25": a["p25_ms"] / b["p25_ms"],
                           "amortised_median": a.get("amortised_median_ms", a["median_ms"])
                           / b["median_ms"],
                           "mean": a["mean_ms"] / b["mean_ms"],
                           "cpu_median": a["cpu"]["median_ms"] / b["cpu"]["median_ms"],
                           "cpu_mean": a["cpu"]["mean_ms"] / b["cpu"]["mean_ms"],
                           "per_round_mean_ratio_median": statistics.median(per_round),
                           "per_round_mean_ratios": per_round}
  return out


def print_table(name: str, result: dict[str, Any]) -> None:
  print(f"\n{name}: step time (ms; wall, and process CPU time summed over threads)")
  print(f"  {'method':12s} {'median':>9s} {'mean':>9s} {'p10':>9s} {'p90':>9s} {'n':>5s}"
        f" {'dual median':>11s} {'cpu median':>10s} {'cpu mean':>9s} {'faults':>7s}"
        f" {'temp MB':>8s}")
  for method, e in result["methods"].items():
    dual = f"{e['dual_steps_median_ms']:11.2f}" if "dual_steps_median_ms" in e else " " * 11
    print(f"  {method:12s} {e['median_ms']:9.2f} {e['mean_ms']:9.2f} {e['p10_ms']:9.2f} "
          f"{e['p90_ms']:9.2f} {e['n']:5d} {dual} {e['cpu']['median_ms']:10.2f} "
          f"{e['cpu']['mean_ms']:9.2f} {e['page_faults_median']:7.0f} {e['temp_mb']:8.2f}")
  for key, r in result["ratios"].items():
    bar = BARS.get(key)
    verdict = ""
    if bar is not None:
      verdict = (f"  bar <= {bar}: median {'met' if r['median'] <= bar else 'NOT met'}, "
                 f"mean {'met' if r['mean'] <= bar else 'NOT met'}")
    print(f"  {key:16s} median {r['median']:.3f}  amortised {r['amortised_median']:.3f}  "
          f"p25 {r['p25']:.3f}  mean {r['mean']:.3f}  "
          f"per-round {r['per_round_mean_ratio_median']:.3f}  cpu median {r['cpu_median']:.3f}"
          f"  cpu mean {r['cpu_mean']:.3f}{verdict}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="mlp,resnet20x2")
  parser.add_argument("--methods", default="sgd,optax_sam,sam,safe,safe_k8",
                      help=f"comma list from {','.join(ALL_METHODS)}")
  parser.add_argument("--steps", default=None,
                      help="timed steps per method: N for all models, or mlp=128,resnet20x2=64")
  parser.add_argument("--block", type=int, default=DUAL_EVERY, help="steps per round-robin block")
  parser.add_argument("--warmup", type=int, default=None, help="warm-up steps after compile")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "step_overhead.json"))
  parser.add_argument("--fixed-malloc", action="store_true",
                      help="fix glibc's mmap and trim thresholds (see the module docstring)")
  parser.add_argument("--llm-block", type=int, default=0, metavar="STEPS",
                      help="also time STEPS interleaved non-dual LLM block steps (0: skip)")
  args = parser.parse_args()
  models = [m for m in args.models.split(",") if m]
  methods = args.methods.split(",")
  if unknown := set(models) - set(MODELS):
    parser.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
  if unknown := set(methods) - set(ALL_METHODS):
    parser.error(f"unknown methods {sorted(unknown)}; choose from {list(ALL_METHODS)}")
  steps = parse_steps(args.steps, models, DEFAULT_STEPS)

  if args.fixed_malloc:
    fix_malloc_thresholds()
  report: dict[str, Any] = {**run_record(), "batch": BATCH, "bars": BARS, "models": {},
                            "fixed_malloc": args.fixed_malloc}
  start = time.perf_counter()
  for name in models:
    warmup = DEFAULT_WARMUP[name] if args.warmup is None else args.warmup
    result = bench_model(name, methods, steps[name], args.block, warmup)
    report["models"][name] = result
    print_table(name, result)
  if args.llm_block:
    report["llm_block"] = bench_llm_block(args.llm_block)
  report["bars_met"] = {
      f"{name}:{key}:{stat}": r[stat] <= BARS[key]
      for name, res in report["models"].items() for key, r in res["ratios"].items()
      if key in BARS for stat in ("median", "mean", "amortised_median")}
  # A model not re-measured keeps its earlier result, marked with that run's command and date.
  if os.path.exists(args.out):
    with open(args.out) as f:
      earlier = json.load(f)
    kept = {name: {"command": earlier.get("command"), "date": earlier.get("date"), **res}
            for name, res in earlier.get("models", {}).items() if name not in report["models"]}
    kept.update({name: res for name, res in earlier.get("earlier_runs", {}).items()
                 if name not in report["models"] and name not in kept})
    if kept:
      report["earlier_runs"] = kept
  write_report(report, args.out, start)


if __name__ == "__main__":
  main()
