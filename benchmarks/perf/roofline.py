"""How close SAFE's training steps come to this CPU's matmul throughput (a roofline).

The roof: the GFLOP/s of large float32 ``jnp.dot`` products (``--matmul-chain``
products of ``--matmul-sizes`` square matrices in one call, ``2 n**3`` FLOPs
each, the best size on a short trial kept), timed in the same interleaved
rounds as the steps, so machine load affects roof and steps alike. The steps, each
jitted whole (forward, backward, SAM's second gradient, the optimizer):

* ``llm_safe``: the SAFE step of a SmolLM2-135M-shaped LLaMA block (random
  weights, 576 / 1536, 9 heads, 3 KV heads, 4 x 128 tokens, block-output MSE;
  ``sam_perturb -> admm_penalty -> adam`` from :mod:`safe_optax.llm.block`,
  ``dual_every`` 32), timed on steps without a dual update;
* ``llm_safe_no_branch``: the same step compiled without the dual update's
  ``lax.cond`` (traced with ``admm_penalty``'s ``dual_due=False``, so the
  program is the non-dual step and nothing else), run at every step;
* ``llm_safe_split``: the step as :mod:`safe_optax.llm.block` runs it, two
  programs picked by the host's step counter (``admm_penalty``'s
  ``dual_due``): its non-dual steps run the program traced with
  ``dual_due=False``, which holds no projection;
* ``llm_sam_adam``: SAM + Adam without the penalty (no ADMM at all);
* ``resnet20_safe``: SAFE (``safe(0.1, 0.9, penalty=1e-3, dual_every=32)``)
  on ResNet-20 (:mod:`safe_optax.vision`), batch 128 of 32x32x3, non-dual steps.

Per step: XLA's cost-analysis FLOPs of the compiled program, median seconds,
achieved GFLOP/s and the fraction of the matmul roof. XLA counts both
branches of a ``cond``, so a SAFE step's estimate includes its projection
branch; the achieved rate of the non-dual steps is therefore also given with
the FLOPs of the step compiled without the branch ("net"). The same-program
check: ``llm_safe`` against ``llm_safe_no_branch`` and ``llm_safe_split``
(time, page faults, XLA's temporary buffer), interleaved one step at a time
with the matmul and the other steps in a random order each round (a fixed
rotation ran the first LLM case right after the matmul in most rounds),
medians over ``--rounds`` and, since the load of a shared machine drifts
between rounds, medians of the per-round ratios ("paired"). The three SAFE
programs have the same 48 MiB temporary buffer (XLA reuses the forward and
backward passes' space for the projection), so on this model the cond's cost
is not the allocator's.

Page faults per call are recorded: XLA:CPU allocates each call's temporary
buffer (and the matmul library its packing buffers) afresh, and with glibc's
adaptive mmap threshold those can be new pages every call (tens of thousands
of faults for the 2048 matmul chain or the ResNet step; the LLM block's
48 MiB is above the 32 MiB cap of glibc's adaptive threshold, so every LLM
case, SAM + Adam included, faults 12,335 pages a call). ``--fixed-malloc``
(:func:`step_overhead.fix_malloc_thresholds`) keeps them on the reused heap
(not ResNet-20's 297 MB buffer, which still faults).

Results go to ``benchmarks/perf/results/roofline.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.perf import _common
import safe_optax
from benchmarks.perf import step_overhead
from safe_optax.vision import resnet20

VISION_BATCH = 128


class Case:
  """One jitted step (or the matmul) with its state, timings and page faults."""

  def __init__(self, name: str, call: Callable[[], Any], flops: float, temp_mb: float,
               skip: Callable[[], bool] = lambda: False, net_flops: float | None = None):
    self.name, self.call, self.flops, self.temp_mb, self.skip = name, call, flops, temp_mb, skip
    # FLOPs of the program a timed call runs: without the untaken dual branch.
    self.net_flops = flops if net_flops is None else net_flops
    self.program: Any = None  # the compiled step, where other cases reuse it
    self.times: list[float] = []
    self.faults: list[int] = []
    self.rounds: list[int] = []  # the round of each timed call, to pair cases

  def run(self, round_index: int) -> None:
    skip = self.skip()  # decided before the call: the call advances the step count
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _, elapsed = harness.timed(self.call)
    if not skip:
      self.times.append(elapsed)
      self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
      self.rounds.append(round_index)


def _stateful(step: Callable[..., Any], state: list[Any], data: tuple[Any, ...],
              n_out_state: int) -> Callable[[], Any]:
  """A call running ``step(*state, *data)`` and keeping the first ``n_out_state`` outputs."""
  def call():
    out = step(*state, *data)
    state[:] = out[:n_out_state]
    return out
  return call


def _memory_mb(compiled: Any) -> float:
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def matmul_case(sizes: list[int], chain: int, reps: int = 3) -> Case:
  """``chain`` float32 ``jnp.dot`` products of ``n x n`` matrices in one call, best ``n``.

  Chained in one jitted loop so the output buffer (allocated, and page-faulted,
  at every call) is amortised over ``chain`` products; each product is scaled
  by ``1 / sqrt(n)`` to keep the values bounded.
  """
  best = None
  for n in sizes:
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / np.sqrt(n)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    products = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda _, c: jnp.dot(c, b), a))
    jax.block_until_ready(products(a, b))
    t = min(harness.timed(products, a, b)[1] for _ in range(reps))
    rate = chain * 2 * n**3 / t
    print(f"  matmul {n}x{n} x {chain}: {rate / 1e9:.1f} GFLOP/s (best of {reps})", flush=True)
    if best is None or rate > best[0]:
      best = (rate, n, functools.partial(products, a, b))
  _, n, call = best
  return Case(f"matmul_{n}x{chain}", call, chain * 2.0 * n**3, 0.0)


def llm_cases(dual_every: int) -> list[Case]:
  linears, data, make = step_overhead.llm_block_case()
  transforms = step_overhead.llm_block_transforms(dual_every)
  safe = transforms[f"safe_k{dual_every}"]
  variants = {"llm_safe": (safe, None), "llm_safe_no_branch": (safe, False),
              "llm_safe_split": (safe, False), "llm_sam_adam": (transforms["sam_adam"], None)}
  cases = {}
  for name, (tx, dual_due) in variants.items():
    step, tx = make(tx, dual_due)
    lin = jax.tree.map(jnp.copy, linears)
    opt_state = tx.init(lin)
    compiled = step.lower(lin, opt_state, *data).compile()
    dual_step = compiled
    if name == "llm_safe_split":
      # As safe_optax.llm.block runs it: the host's counter picks the program with
      # the projection (the default one) at the dual steps (not timed).
      dual_step = cases["llm_safe"].program
    state = list(dual_step(lin, opt_state, *data)[:2])  # step 0: the first projection
    count = [1]
    if dual_step is not compiled:  # run the non-dual program once too, before timing it
      state = list(compiled(*state, *data)[:2])
      count = [2]
    has_dual = name.startswith("llm_safe") and name != "llm_safe_no_branch"
    due = functools.partial(_dual_due, has_dual, count, dual_every)
    call = _stateful(lambda *a, c=compiled, d=dual_step, due=due: (d if due() else c)(*a),
                     state, data, 2)
    cases[name] = Case(name, _counting(call, count), harness.flops(compiled),
                       _memory_mb(compiled), skip=due)
    cases[name].program = compiled
  cases["llm_safe"].net_flops = cases["llm_safe_no_branch"].flops
  return list(cases.values())


def _counting(call: Callable[[], Any], count: list[int]) -> Callable[[], Any]:
  def counted():
    out = call()
    count[0] += 1
    return out
  return counted


def _dual_due(has_dual: bool, count: list[int], dual_every: int) -> bool:
  return has_dual and count[0] % dual_every == 0


def vision_case(dual_every: int) -> Case:
  model = resnet20(num_classes=10)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(VISION_BATCH, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, size=VISION_BATCH), jnp.int32)
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(0), x)
  model_state, params = flax.core.pop(variables, "params")
  tx = safe_optax.safe(0.1, 0.9, penalty=1e-3, total_steps=10000, dual_every=dual_every,
                       weight_decay=1e-4)
  opt_state = tx.init(params)
  with without_dual_branch():
    net_flops = harness.flops(_common.make_step(model.apply, tx, True).lower(
        params, model_state, opt_state, (x, y)).compile())
  step = _common.make_step(model.apply, tx, True)
  compiled = step.lower(params, model_state, opt_state, (x, y)).compile()
  state = list(compiled(params, model_state, opt_state, (x, y))[:3])
  count = [1]
  call = _counting(_stateful(compiled, state, ((x, y),), 3), count)
  return Case("resnet20_safe", call, harness.flops(compiled), _memory_mb(compiled),
              skip=functools.partial(_dual_due, True, count, dual_every), net_flops=net_flops)


def paired_ratio(a: Case, b: Case) -> float:
  """Median over the rounds both cases timed of ``a``'s time / ``b``'s."""
  times_b = dict(zip(b.rounds, b.times))
  return statistics.median(t / times_b[r] for r, t in zip(a.rounds, a.times) if r in times_b)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--matmul-sizes", default="1024,2048")
  parser.add_argument("--matmul-chain", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=30,
                      help="interleaved rounds (one call of every case each)")
  parser.add_argument("--dual-every", type=int, default=_common.DUAL_EVERY)
  parser.add_argument("--no-vision", action="store_true",
                      help="leave out the ResNet-20 step (the LLM block's checks only)")
  parser.add_argument("--fixed-malloc", action="store_true",
                      help="fix glibc's mmap / trim thresholds (see step_overhead.py)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "roofline.json"))
  args = parser.parse_args()
  if args.fixed_malloc:
    step_overhead.fix_malloc_thresholds()
  start = time.perf_counter()
  report: dict[str, Any] = {**harness.run_record(), "fixed_malloc": args.fixed_malloc,
                            "dual_every": args.dual_every, "llm_config": step_overhead.LLM_BLOCK,
                            "llm_batch": step_overhead.LLM_BATCH, "vision_batch": VISION_BATCH}
  print("compiling", flush=True)
  roof = matmul_case([int(n) for n in args.matmul_sizes.split(",")], args.matmul_chain)
  cases = [roof, *llm_cases(args.dual_every)]
  if not args.no_vision:
    cases.append(vision_case(args.dual_every))
  # A random order each round: a rotation keeps each case behind the same one (the
  # matmul, which leaves the caches cold, before the first LLM case), a bias of its own.
  order_rng = np.random.default_rng(0)
  for r in range(args.rounds):
    for i in order_rng.permutation(len(cases)):
      cases[i].run(r)
  roof_rate = roof.flops / statistics.median(roof.times)
  rows = []
  print(f"\n{'case':>20} {'GFLOP':>9} {'net GFLOP':>9} {'ms':>9} {'GFLOP/s':>8} {'net':>7}"
        f" {'of roof':>7} {'faults':>7} {'temp MB':>8}")
  for case in cases:
    seconds = statistics.median(case.times)
    net = case.net_flops
    row = {"case": case.name, "xla_flops": case.flops, "net_flops": net,
           "median_s": seconds, "gflops_per_s": case.flops / seconds / 1e9,
           "net_gflops_per_s": net / seconds / 1e9, "fraction_of_roof": net / seconds / roof_rate,
           "page_faults_median": statistics.median(case.faults), "temp_mb": case.temp_mb,
           "n": len(case.times), "times_s": case.times}
    rows.append(row)
    print(f"{case.name:>20} {case.flops / 1e9:9.2f} {net / 1e9:9.2f} {1e3 * seconds:9.2f}"
          f" {row['gflops_per_s']:8.1f} {row['net_gflops_per_s']:7.1f}"
          f" {100 * row['fraction_of_roof']:6.1f}% {row['page_faults_median']:7.0f}"
          f" {case.temp_mb:8.1f}")
  by_name = {row["case"]: row for row in rows}
  by_case = {case.name: case for case in cases}
  branch = {
      "non_dual_over_no_branch": by_name["llm_safe"]["median_s"]
      / by_name["llm_safe_no_branch"]["median_s"],
      "safe_over_sam_adam": by_name["llm_safe"]["median_s"] / by_name["llm_sam_adam"]["median_s"],
      "no_branch_over_sam_adam": by_name["llm_safe_no_branch"]["median_s"]
      / by_name["llm_sam_adam"]["median_s"],
      "split_over_no_branch": by_name["llm_safe_split"]["median_s"]
      / by_name["llm_safe_no_branch"]["median_s"],
      "non_dual_over_split": by_name["llm_safe"]["median_s"]
      / by_name["llm_safe_split"]["median_s"],
      "split_over_sam_adam": by_name["llm_safe_split"]["median_s"]
      / by_name["llm_sam_adam"]["median_s"],
      # Medians of the per-round ratios: the two calls of a round ran back to back,
      # so a change of the machine's load between rounds cancels.
      "paired": {f"{a}/{b}": paired_ratio(by_case[a], by_case[b]) for a, b in (
          ("llm_safe", "llm_safe_no_branch"), ("llm_safe", "llm_safe_split"),
          ("llm_safe_split", "llm_safe_no_branch"), ("llm_safe_split", "llm_sam_adam"),
          ("llm_safe_no_branch", "llm_sam_adam"))},
      "flops_with_branch": by_name["llm_safe"]["xla_flops"],
      "flops_without_branch": by_name["llm_safe_no_branch"]["xla_flops"],
  }
  print(f"\nLLM non-dual step / same step without the dual branch: "
        f"{branch['non_dual_over_no_branch']:.3f}; split (dual_due=False) / without the "
        f"branch: {branch['split_over_no_branch']:.3f}; XLA FLOPs with the branch "
        f"{branch['flops_with_branch'] / 1e9:.2f} G, without {branch['flops_without_branch'] / 1e9:.2f} G")
  print("paired (median of per-round ratios): " + "  ".join(
      f"{k} {v:.3f}" for k, v in branch["paired"].items()))
  report |= {"roof_gflops_per_s": roof_rate / 1e9, "rounds": args.rounds, "rows": rows,
             "dual_branch": branch}
  harness.write_report(report, args.out, start)


if __name__ == "__main__":
  main()
