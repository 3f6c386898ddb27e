"""Where a split SAFE dual step's extra time goes (MLP 784-300-100-10, batch 128, K = 32).

``safe_split`` in ``step_overhead.py`` runs two programs picked by the host:
``dual_due=False`` for 31 steps of 32 and ``dual_due=True`` (the program with
the dual update's ``lax.cond``) for the 32nd. This script times, one round per
dual period and all in one process:

* ``plain``: the 31 non-dual steps (median);
* ``dual``: the dual step as training runs it, right after 31 plain steps;
* ``dual_again``: the dual program again right away on a copy of the state
  whose ADMM count is due (warm code and caches; the projection runs);
* ``dual_not_donated``: the dual step's program compiled without donating the
  state, on a copy whose count is due, right after a plain step;
* ``cond_false``: the dual program on a copy whose count is not due (the
  cond's branch not taken: the program switch and its buffer, no projection);
* ``plain_after``: the plain program on a copy, right after those;
* ``dual_update``: the dual update alone (``safe_optax.dual_update`` on the
  MLP's kernels, jitted), right after a plain step;
* ``dual_program``: ``safe_optax.experimental.run_dual_update`` jitted (the program the
  vision trainer runs before a dual step) on the optimizer state the plain
  step before it returned (its count is not due: the projection runs and is
  not selected, so the state keeps its values); ``dual_program_donated`` the
  same with that state donated (``donate_argnums``); the two alternate in
  order, each right after a plain step;
* ``optax_sam``: ``optax.contrib.sam`` as in ``step_overhead.py``, 32 steps a round.

For each: wall ms (median over rounds), minor page faults per call
(``ru_minflt``) and XLA's temporary buffer size. ``--fixed-malloc`` fixes
glibc's thresholds (``step_overhead.fix_malloc_thresholds``) to separate the
allocator's faults from compute.

Run: ``python dual_step_breakdown.py --rounds 24 [--fixed-malloc]``; results go
to ``benchmarks/perf/results/dual_step_breakdown.json`` (``--out``).
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

import safe_optax
from benchmarks.perf._common import DUAL_EVERY, make_step
from benchmarks.harness import run_record, timed, write_report
from safe_optax.vision import MLP
from benchmarks.perf.step_overhead import BATCH, fix_malloc_thresholds, make_method, temp_mb


def _set_admm_count(opt_state: Any, count: int) -> Any:
  """A copy of ``opt_state`` with every ADMM count set to ``count`` (other leaves copied)."""
  def fix(s):
    if isinstance(s, safe_optax.ADMMState):  # and no dual update run at that count yet
      return s._replace(count=jnp.int32(count), dual_count=jnp.int32(-1))
    return s
  state = jax.tree.map(fix, opt_state, is_leaf=lambda s: isinstance(s, safe_optax.ADMMState))
  return jax.tree.map(jnp.copy, state)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, int]:
  f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  out, seconds = timed(fn)
  return out, seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=24)
  parser.add_argument("--fixed-malloc", action="store_true")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "dual_step_breakdown.json"))
  args = parser.parse_args()
  if args.fixed_malloc:
    fix_malloc_thresholds()
  start = time.perf_counter()
  model = MLP()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(BATCH, 28, 28, 1)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, size=BATCH), jnp.int32)
  batch = (x, y)
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(0), x)
  model_state, params = flax.core.pop(variables, "params")

  tx, _ = make_method("safe_split")
  programs = {due: make_step(model.apply, tx, True, dual_due=due) for due in (False, True)}
  dual_kept = make_step(model.apply, tx, True, dual_due=True, donate=False)
  state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, model_state), tx.init(params)]
  sam_tx, _ = make_method("optax_sam")
  sam_step = make_step(model.apply, sam_tx, True)
  sam_state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, model_state),
               sam_tx.init(params)]
  flags = tuple(len(p) and p[-1].key == "kernel"
                for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
  kernels = [l for l, f in zip(jax.tree.leaves(params), flags) if f]

  @jax.jit
  def dual_only(p, u):
    return safe_optax.dual_update(p, u, 0.9, flags=flags, first=jnp.bool_(False))

  us = [0.01 * jnp.ones_like(k) for k in kernels]
  dual_program = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx))
  dual_donated = jax.jit(functools.partial(safe_optax.experimental.run_dual_update, tx), donate_argnums=0)
  temps = {"plain": temp_mb(programs[False], *state, batch),
           "dual": temp_mb(programs[True], *state, batch),
           "dual_update": temp_mb(dual_only, params, us),
           "dual_program": temp_mb(dual_program, state[2], params),
           "dual_program_donated": temp_mb(dual_donated, state[2], params),
           "optax_sam": temp_mb(sam_step, *sam_state, batch)}
  count = 0
  for _ in range(2 * DUAL_EVERY + 1):  # compile and warm up
    *state, _ = programs[count % DUAL_EVERY == 0](*state, batch)
    *sam_state, _ = sam_step(*sam_state, batch)
    count += 1
  jax.block_until_ready((dual_only(params, us), dual_program(state[2], params),
                         dual_donated(jax.tree.map(jnp.copy, state[2]), params)))
  cases = ("plain", "dual", "dual_again", "dual_not_donated", "cond_false", "plain_after",
           "dual_update", "dual_program", "dual_program_donated", "optax_sam")
  times: dict[str, list[float]] = {c: [] for c in cases}
  faults: dict[str, list[int]] = {c: [] for c in cases}
  loads = []

  def record(case, fn):
    out, t, f = _timed(fn)
    times[case].append(t)
    faults[case].append(f)
    return out

  for r in range(args.rounds):
    while count % DUAL_EVERY:
      *state, _ = record("plain", lambda: programs[False](*state, batch))
      count += 1
    if r % 2:  # SAM's block before or after SAFE's, alternately
      for _ in range(DUAL_EVERY):
        *sam_state, _ = record("optax_sam", lambda: sam_step(*sam_state, batch))
    *state, _ = record("dual", lambda: programs[True](*state, batch))
    count += 1
    due = _set_admm_count(state[2], count - 1)
    kept_state = [jax.tree.map(jnp.copy, s) for s in (*state[:2], due)]
    copy = [jax.tree.map(jnp.copy, s) for s in state[:2]]
    record("dual_again", lambda: programs[True](*copy, due, batch))
    copy = [jax.tree.map(jnp.copy, s) for s in state]
    record("cond_false", lambda: programs[True](*copy, batch))
    copy = [jax.tree.map(jnp.copy, s) for s in state]
    record("plain_after", lambda: programs[False](*copy, batch))
    *state, _ = record("plain", lambda: programs[False](*state, batch))
    count += 1
    record("dual_update", lambda: dual_only(state[0], us))
    *state, _ = record("plain", lambda: programs[False](*state, batch))
    count += 1
    record("dual_not_donated", lambda: dual_kept(*kept_state, batch))
    *state, _ = record("plain", lambda: programs[False](*state, batch))
    count += 1
    # Alternate which of the two runs right after a plain step.
    for case in (("dual_program", "dual_program_donated") if r % 2 else
                 ("dual_program_donated", "dual_program")):
      # On the live state the last plain step produced (its count is not due, so the
      # projection runs and its result is not selected: the state keeps its values).
      if case == "dual_program":
        record(case, lambda: dual_program(state[2], state[0]))
      else:
        state[2] = record(case, lambda: dual_donated(state[2], state[0]))
      *state, _ = record("plain", lambda: programs[False](*state, batch))
      count += 1
    if not r % 2:
      for _ in range(DUAL_EVERY):
        *sam_state, _ = record("optax_sam", lambda: sam_step(*sam_state, batch))
    loads.append(os.getloadavg()[0])
    print(f"round {r + 1}/{args.rounds} load {loads[-1]:.1f} " + " ".join(
        f"{c}={1e3 * statistics.median(times[c]):.2f}" for c in cases), flush=True)

  result = {c: {"median_ms": 1e3 * statistics.median(times[c]),
                "p25_ms": 1e3 * float(np.percentile(times[c], 25)),
                "faults_median": statistics.median(faults[c]), "n": len(times[c]),
                "temp_mib": temps.get(c, temps["dual"] if c in ("dual_again", "cond_false",
                                                                 "dual_not_donated")
                                      else temps["plain"]),
                "times_s": times[c], "faults": faults[c]} for c in cases}
  plain = result["plain"]["median_ms"]
  print(f"\n{'case':12s} {'median ms':>10s} {'p25 ms':>8s} {'- plain':>8s} {'faults':>7s} "
        f"{'temp MiB':>9s}")
  for c, e in result.items():
    print(f"{c:12s} {e['median_ms']:10.2f} {e['p25_ms']:8.2f} {e['median_ms'] - plain:8.2f} "
          f"{e['faults_median']:7.0f} {e['temp_mib']:9.2f}")
  amortised = ((DUAL_EVERY - 1) * plain + result["dual"]["median_ms"]) / DUAL_EVERY
  ratio = amortised / result["optax_sam"]["median_ms"]
  print(f"amortised split step {amortised:.2f} ms, / optax_sam {ratio:.3f}")
  write_report({**run_record(), "fixed_malloc": args.fixed_malloc, "rounds": args.rounds,
                "loadavg_per_round": loads, "temp_mib": temps, "cases": result,
                "amortised_ms": amortised, "amortised_over_optax_sam": ratio},
               args.out, start)


if __name__ == "__main__":
  main()
