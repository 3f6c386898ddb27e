"""Pruning one LLaMA-2-7B-shaped block on this machine: time per step, peak memory, extrapolation.

A one-block LLaMA with LLaMA-2-7B's block shapes (hidden 4,096, MLP 11,008,
32 heads of 128, random normal(0.02) weights, a 256-token vocabulary since
only the block is pruned) goes through the engine (``prune.prune_model``) with
SAFE, SAFE+ and SparseGPT at 50 %. Each method runs in its own process so its
peak resident memory (``VmHWM`` of ``/proc/self/status``, which counts what
XLA allocates, unlike ``tracemalloc``) is its own.

After a discarded warm-up run, SAFE and SAFE+ run twice, for ``--steps`` A
and B optimizer steps (one minibatch of every calibration window per step);
the time per step is the
difference of the two block times over B - A, which cancels what both runs
share (compilation, the target and statistics passes, the final projection).
The rest of a run (A steps' time taken out) is the fixed cost.

Extrapolated to the paper's budget (128 windows of 2,048 tokens, batch 8,
30 epochs: 480 steps a block, SAFE paper Table "Wall-clock time", app.
"Wall-clock Time"; /work/shared/SPEC.md §3 LLM: SAFE 310.7 s, SparseGPT
15.8 s a LLaMA-2-7B block on an A6000), assuming time linear in tokens:

* SAFE / SAFE+: 480 x step time x (8 x 2,048) / tokens a step, plus the fixed
  cost: as measured (a low end: its compilation and final projection do not
  grow with tokens) up to scaled by (128 x 2,048) / calibration tokens (a high
  end: its target, statistics and error passes do);
* SparseGPT: runs on ``--sparsegpt-windows`` W and 2W windows; the difference
  is the cost of W windows' passes (forward, Hessian sums, the error pass), the
  rest (the seven OBS solves, which do not grow with tokens) is fixed; the
  passes are scaled to 128 x 2,048 tokens. One window's passes are small next
  to the solves on this CPU, so W is large (32 by default) for the
  difference to stand above the run-to-run noise; where it does not (the
  2W-window run is not slower), the file says so and extrapolates nothing.

Linear in tokens understates attention at longer windows (its score matrix
grows as the window squared), so with windows shorter than 2,048 the
extrapolation is a lower bound. The run is heavy on a 2-core CPU: few steps,
one short window. The longer run must be slower than the shorter by at least
``NOISE`` (10 %) of the shorter, else the file says the difference is noise
and extrapolates nothing for that method. Prints a table and writes JSON with
versions and the command after every method (a run stopped part-way keeps the
methods it finished); on an accelerator each method also records the device's
peak allocation.
``--methods`` naming some of the methods reruns those and keeps the others'
results in ``--out``; each method's entry records the command, date and load
average that measured it.

  python -m benchmarks.perf.llm_7b_block --windows 1 --seqlen 256 --steps 1,5
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from benchmarks import harness

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "results" / "llm_7b_block.json"
METHODS = ("safe", "safe-plus", "sparsegpt")
# The longer run must be this much slower than the shorter one (relative) for the
# difference to be taken as work rather than run-to-run noise (compilation, the host).
NOISE = 0.1
SHAPE = {"hidden_size": 4096, "intermediate_size": 11008, "num_heads": 32, "num_kv_heads": 32}
PAPER = {"source": "SAFE (ICML 2025) appendix 'Wall-clock Time', table tab:pruning_time "
                   "(/work/shared/paper/safe_icml2025.tex; /work/shared/SPEC.md section 3, LLM)",
         "device": "NVIDIA A6000", "safe_s": 310.68, "sparsegpt_s": 15.82,
         "windows": 128, "seqlen": 2048, "batch": 8, "epochs": 30}


def peak_rss_mib() -> float:
  """``VmHWM``: the highest resident set of this process so far (MiB)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def peak_device_mib() -> float | None:
  """The accelerator's highest allocation so far (MiB); ``None`` where the backend keeps no
  count (the CPU, whose allocations ``peak_rss_mib`` already counts)."""
  import jax  # pylint: disable=import-outside-toplevel
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**20


def worker(method: str, windows: int, seqlen: int, steps: list[int]) -> dict:
  """One method in this process: block seconds per run, peak memory."""
  from safe_optax.llm import model, prune  # pylint: disable=import-outside-toplevel
  config = model.LlamaConfig(vocab_size=256, num_layers=1, **SHAPE)
  params = model.init_params(config)
  rng = np.random.default_rng(0)
  after_init = peak_rss_mib()
  runs = []
  # SAFE / SAFE+: A and B steps on W windows; SparseGPT: W and 2W windows.
  layouts = ([(count, windows) for count in steps] if method != "sparsegpt"
             else [(None, windows), (None, 2 * windows)])
  # A first, discarded run compiles what later runs share (the eager ops, the OBS
  # solves), so that the two measured runs pay the same compilation.
  for run, (count, n) in enumerate([layouts[0]] + layouts):
    extra = {} if count is None else {"epochs": count, "warmup_epochs": 0,
                                      "batch_size": windows}
    # The warm-up's other seed keeps its compiled SAFE step out of the measured runs' cache.
    cfg = prune.PruneConfig(method, sparsity=0.5, seed=1 if run == 0 else 0, **extra)
    calibration = rng.integers(0, 256, (n, seqlen))
    start = time.perf_counter()
    _, report = prune.prune_model(config, params, calibration, cfg, progress=False)
    runs.append({"steps": count, "windows": n, "block_s": report["blocks"][0]["seconds"],
                 "wall_s": time.perf_counter() - start,
                 "relative_error": report["blocks"][0]["relative_error"]})
  warmup = runs.pop(0)
  kernels = sum(int(np.prod(leaf.shape)) for leaf in
                __import__("jax").tree.leaves(params["layers_0"]) if leaf.ndim == 2)
  return {"method": method, "runs": runs, "warmup_run": warmup, "kernel_weights": kernels,
          "peak_rss_after_init_mib": after_init, "peak_rss_mib": peak_rss_mib(),
          "peak_device_mib": peak_device_mib()}


def extrapolate(result: dict, windows: int, seqlen: int) -> dict:
  tokens = windows * seqlen
  paper_tokens = PAPER["windows"] * PAPER["seqlen"]
  paper_steps = PAPER["epochs"] * PAPER["windows"] // PAPER["batch"]
  runs = result["runs"]
  if result["method"] == "sparsegpt":
    (w1, t1), (w2, t2) = [(r["windows"], r["block_s"]) for r in runs[:2]]
    per_window = (t2 - t1) / (w2 - w1)
    if t2 - t1 < NOISE * t1:
      # The 2W-window run was not slower by more than the run-to-run noise.
      return {"passes_per_window_s": None, "paper_budget_block_s": None,
              "paper_s": PAPER["sparsegpt_s"],
              "note": f"the {w2}-window run took {t2:.1f} s, the {w1}-window run {t1:.1f} s: the "
                      "difference is noise, not the passes; rerun with more windows "
                      "(--sparsegpt-windows)"}
    fixed = t1 - w1 * per_window
    block = fixed + per_window * paper_tokens / seqlen
    return {"passes_per_window_s": per_window, "fixed_s": fixed,
            "paper_budget_block_s": [block, block], "paper_s": PAPER["sparsegpt_s"],
            "ratio_to_paper": [block / PAPER["sparsegpt_s"]] * 2}
  (a, ta), (b, tb) = [(r["steps"], r["block_s"]) for r in runs[:2]]
  step = (tb - ta) / (b - a)
  if tb - ta < NOISE * ta:
    # The B-step run was not slower by more than the run-to-run noise.
    return {"step_s": None, "paper_budget_block_s": None, "paper_s": PAPER["safe_s"],
            "note": f"the {b}-step run took {tb:.1f} s, the {a}-step run {ta:.1f} s: the "
                    "difference is noise, not a step; rerun with more steps (--steps)"}
  fixed = ta - a * step
  paper_step = step * PAPER["batch"] * PAPER["seqlen"] / tokens
  steps_s = paper_steps * paper_step
  low, high = steps_s + fixed, steps_s + fixed * paper_tokens / tokens
  return {"step_s": step, "fixed_s": fixed, "tokens_per_step": tokens,
          "paper_step_s": paper_step, "paper_steps": paper_steps,
          "paper_budget_block_s": [low, high], "paper_s": PAPER["safe_s"],
          "ratio_to_paper": [low / PAPER["safe_s"], high / PAPER["safe_s"]]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--windows", type=int, default=1, help="calibration windows (one batch)")
  parser.add_argument("--seqlen", type=int, default=256, help="tokens a window")
  parser.add_argument("--steps", default="1,5", help="the two step counts A,B of SAFE/SAFE+")
  parser.add_argument("--sparsegpt-windows", type=int, default=32,
                      help="SparseGPT's W: it runs on W and 2W windows")
  parser.add_argument("--methods", default="safe,safe-plus,sparsegpt",
                      help="a comma list; the others' results already in --out are kept")
  parser.add_argument("--out", default=str(OUT))
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--extrapolate-only", action="store_true",
                      help="recompute the extrapolations of --out's measurements, measure nothing")
  args = parser.parse_args()
  steps = [int(s) for s in args.steps.split(",")]
  if len(steps) != 2 or not 0 < steps[0] < steps[1]:
    parser.error(f"--steps must be two step counts A,B with 0 < A < B, got {args.steps!r}")
  if args.sparsegpt_windows < 1:
    parser.error(f"--sparsegpt-windows must be a window count >= 1, got {args.sparsegpt_windows}")
  if args.worker:
    print(json.dumps(worker(args.worker, args.windows, args.seqlen, steps)))
    return
  if args.extrapolate_only:
    report = json.loads(pathlib.Path(args.out).read_text())
    for result in report["methods"].values():
      result["extrapolation"] = extrapolate(result, report["windows"], report["seqlen"])
    report["extrapolated_by"] = harness.run_record()["command"]
    harness.write_json(args.out, report)
    _table(report)
    return
  start = time.perf_counter()
  record = harness.run_record()
  report = {**record, "shape": SHAPE, "windows": args.windows, "seqlen": args.seqlen,
            "steps": steps, "paper": PAPER, "methods": {}}
  kept = _kept_methods(pathlib.Path(args.out), report, args.methods.split(","))
  measured: dict[str, dict] = {}
  for method in args.methods.split(","):
    windows = args.sparsegpt_windows if method == "sparsegpt" else args.windows
    proc = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--worker", method, "--windows", str(windows),
         "--seqlen", str(args.seqlen), "--steps", args.steps],
        capture_output=True, text=True, check=False, cwd=HERE.parents[1])
    if proc.returncode != 0:
      raise SystemExit(f"{method} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["extrapolation"] = extrapolate(result, windows, args.seqlen)
    result["measured_by"] = {"command": record["command"], "date": record["date"],
                             "loadavg_start": record["cpu"]["loadavg_start"],
                             "loadavg_end": os.getloadavg()}
    measured[method] = result
    print(f"{method}: {json.dumps(result['extrapolation'])}", flush=True)
    # Written after every method, so that a run stopped part-way keeps what it measured.
    report["methods"] = {m: measured.get(m) or kept[m] for m in METHODS
                         if m in measured or m in kept}
    harness.write_report(report, args.out, start)
  _table(report)


def _kept_methods(out: pathlib.Path, report: dict, methods: list[str]) -> dict:
  """The methods not rerun, from ``out`` when it measured the same block the same way."""
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    raise SystemExit(f"--methods: {unknown} not among {list(METHODS)}")
  if not out.exists() or set(methods) == set(METHODS):
    return {}
  old = json.loads(out.read_text())
  same = ("shape", "windows", "seqlen", "steps", "backend", "devices")
  if any(old.get(key) != report[key] for key in same):
    raise SystemExit(f"{out} measured another setting ({ {k: old.get(k) for k in same} }); "
                     "rerun every method or write to another --out")
  kept = {m: r for m, r in old["methods"].items() if m not in methods}
  for result in kept.values():  # measured by the file's whole run: its header says how
    result.setdefault("measured_by", {"command": old["command"], "date": old["date"],
                                      "loadavg_start": old["cpu"]["loadavg_start"],
                                      "loadavg_end": old["cpu"]["loadavg_end"]})
  return kept


def _table(report: dict) -> None:
  print(f"\n{'method':10s} {'peak MiB':>9s} {'dev MiB':>8s} {'s/step':>8s} "
        f"{'block s (paper budget)':>24s} {'paper s':>8s}")
  for method, result in report["methods"].items():
    ex = result["extrapolation"]
    step = ex.get("step_s")
    if ex["paper_budget_block_s"] is None:
      block = "n/a (noise)"
    else:
      low, high = ex["paper_budget_block_s"]
      block = f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
    device = result.get("peak_device_mib")
    print(f"{method:10s} {result['peak_rss_mib']:9.0f} "
          f"{'-' if device is None else f'{device:.0f}':>8s} "
          f"{'-' if step is None else f'{step:.2f}':>8s} {block:>24s} {ex['paper_s']:8.1f}")


if __name__ == "__main__":
  main()
