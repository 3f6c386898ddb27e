"""Held-out block-level selection of SAFE / SAFE+'s step budget on SmolLM2-135M.

On one transformer block (block 0 by default; ``--block`` for another, whose
inputs are then the *dense* model's stream), WikiText-2 validation is split by
position: calibration windows come from its first 80 %, held-out windows from
the last 20 %. Each method prunes the block from the calibration windows
(:func:`safe_optax.llm.prune.prune_block`, as ``safe-optax-llm prune`` does)
and is scored by the held-out relative reconstruction error
``||f_pruned(X) - f_dense(X)||^2 / ||f_dense(X)||^2``. SAFE / SAFE+ settings
are chosen on that number only (never on perplexity).

Stages (each run is appended to the JSON as it finishes; a rerun skips done runs):

* ``grid``: SAFE+ and SAFE at 50 %, lr x lambda grid at 60 steps.
* ``long``: the best (lr, lambda) of ``grid`` per method at 250 steps.
* ``nm``: 2:4 at the best 60-step 50 % setting, 60 steps.
* ``limits``: what limits convergence: steps (120), calibration size
  (64 windows at 60 steps), a per-matrix relative learning rate
  (``lr_scale="rms"``).
* ``edge``: lr 1e-2 at 60 steps (the grid's best lr was its largest).
* ``edge-penalty``: the edge rule on lambda at 60 steps: a pick at an end of its
  grid gets the next decade beyond it, at the picked lr (twice at most).
* ``extra``: the limits at 250 steps (relative lr, 64 windows), relative lr
  0.1, SAFE at 250 steps, SAFE+ 2:4 at 250 steps.

  python -m benchmarks.claims.llm_block_selection [--block 0] [--stages grid long nm limits]
  python -m benchmarks.claims.llm_block_selection --figure-only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from safe_optax.llm import checkpoints
from safe_optax.llm import pipeline
from safe_optax.llm import data
from safe_optax.llm import model as model_lib
from safe_optax.llm import block
from safe_optax.llm import prune

ROOT = pathlib.Path(__file__).resolve().parents[2]
from benchmarks.claims import llm_results as run_results
from benchmarks import harness

OUT = ROOT / "results" / "llm_pruning"
SEQLEN = 128
CALIB_WINDOWS = 16
HELDOUT_WINDOWS = 16
CALIB_SEED, HELDOUT_SEED = 0, 1
SPLIT = 0.8
GRID_LR = (2e-4, 1e-3, 3e-3)
GRID_PENALTY = (1e-3, 1e-2)
SHORT, LONG = 60, 250
BASELINES = ("magnitude", "wanda", "sparsegpt")
STRUCTURES = {"50%": None, "2:4": (2, 4)}


@functools.lru_cache(maxsize=1)
def _validation_tokens() -> np.ndarray:
  tokenizer = checkpoints.load_tokenizer(run_results.gguf_path())
  return data.tokenize(tokenizer, data.read_text(run_results.CALIB))


def windows(calib_windows: int = CALIB_WINDOWS, seqlen: int = SEQLEN, seed: int = CALIB_SEED,
            held_out: tuple[int, int] = (HELDOUT_WINDOWS, SEQLEN)):
  """``(calibration, held_out)`` token windows from disjoint parts of WikiText-2 validation.

  ``held_out`` is ``(windows, seqlen)``, always drawn with ``HELDOUT_SEED``, so
  studies that vary the calibration windows or their seed score on one set.
  """
  tokens = _validation_tokens()
  cut = int(SPLIT * len(tokens))
  calib = data.calibration_windows(tokens[:cut], calib_windows, seqlen, seed)
  held = data.calibration_windows(tokens[cut:], *held_out, HELDOUT_SEED)
  return calib, held


def safe_config(method: str, nm, steps: int, lr: float, penalty: float, n: int,
                lr_scale: str = "none", grouping=None, seed: int = 0) -> prune.PruneConfig:
  """SAFE / SAFE+ with ``steps`` minibatch steps of 8 windows (whole epochs over ``n``)."""
  steps_per_epoch = n // 8
  epochs = max(1, round(steps / steps_per_epoch))
  # Warm-up ~7 % of the run, as the paper's 2 of 30 epochs.
  return prune.PruneConfig(method, sparsity=0.5, nm=nm, epochs=epochs,
                           warmup_epochs=max(1, round(epochs / 15)), learning_rate=lr,
                           penalty=penalty, dual_every=32, lr_scale=lr_scale,
                           grouping=grouping, seed=seed)


class Block:
  """One block's dense parameters, calibration / held-out inputs, targets and statistics."""

  def __init__(self, config, params, index, calib, held):
    self.config, self.index = config, index
    self.params = params[f"layers_{index}"]
    forward, self.forward_with_stats = block.block_fns(config, with_hessian=True)
    self.forward = forward
    model = model_lib.Llama(config)
    embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method=model_lib.Llama.embed))

    def stream(tokens):
      x = np.asarray(embed(params, jnp.asarray(tokens)))
      for i in range(index):
        x = np.asarray(forward(params[f"layers_{i}"], x))
      return x

    self.x_calib, self.x_held = stream(calib), stream(held)
    self.y_calib, self.stats = self._targets_and_stats()
    self.y_held = np.asarray(forward(self.params, self.x_held))

  def _targets_and_stats(self):
    outs, stats = [], None
    for part in block.chunks(self.x_calib.shape[0], 8):
      out, st = self.forward_with_stats(self.params, self.x_calib[part])
      outs.append(np.asarray(out))
      stats = st if stats is None else jax.tree.map(jnp.add, stats, st)
    return np.concatenate(outs), stats

  def error(self, block_params, x, y) -> float:
    out = np.asarray(self.forward(block_params, x), np.float64)
    return float(np.sum(np.square(out - y)) / np.sum(np.square(y.astype(np.float64))))

  def run(self, cfg: prune.PruneConfig) -> dict:
    start = time.perf_counter()
    pruned, info = prune.prune_block(self.config, self.params, self.x_calib, self.y_calib,
                                     self.stats, cfg)
    jax.block_until_ready(pruned)
    seconds = time.perf_counter() - start
    return {"held_out_error": self.error(pruned, self.x_held, self.y_held),
            "calibration_error": self.error(pruned, self.x_calib, self.y_calib),
            "seconds": seconds, "steps": info.get("steps", 0),
            "last_loss": (info.get("epoch_last_loss") or [None])[-1]}


def _key(method, structure, steps=0, lr=None, penalty=None, n=CALIB_WINDOWS, lr_scale="none"):
  if method in BASELINES:
    return f"{method}|{structure}|n{n}"
  return f"{method}|{structure}|steps{steps}|lr{lr:g}|lam{penalty:g}|n{n}|scale-{lr_scale}"


def best(runs, method, structure, steps=None, n=CALIB_WINDOWS, lr_scale="none", top=1):
  """The ``top`` SAFE runs (``top=None``: all) with the lowest held-out error (optionally at a
  step budget), best first."""
  pool = [r for r in runs.values() if r["method"] == method and r["structure"] == structure
          and r["n"] == n and r.get("lr_scale") == lr_scale
          and (steps is None or r["steps_requested"] == steps)]
  return sorted(pool, key=lambda r: r["held_out_error"])[:top]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--block", type=int, default=0)
  parser.add_argument("--stages", nargs="*", default=["grid", "long", "nm", "limits"],
                      choices=["grid", "long", "nm", "limits", "edge", "extra", "edge-penalty"])
  parser.add_argument("--figure-only", action="store_true")
  args = parser.parse_args()
  path = OUT / f"block_selection_block{args.block}.json"
  record = json.loads(path.read_text()) if path.exists() else {"runs": {}}
  if not args.figure_only:
    collect(args, path, record)
  figure(record, OUT / f"block_selection_block{args.block}.png")


def collect(args, path, record):
  runs = record["runs"]
  record.update({
      "description": __doc__.split("\n\n")[1].replace("\n", " "),
      "model": str(run_results.gguf_path()), "block": args.block,
      "block_inputs": "embeddings" if args.block == 0 else "dense stream",
      "calibration": {"text": str(run_results.CALIB), "split": f"first {SPLIT:.0%} of tokens",
                      "windows": CALIB_WINDOWS, "seqlen": SEQLEN, "seed": CALIB_SEED},
      "held_out": {"split": f"last {1 - SPLIT:.0%} of tokens", "windows": HELDOUT_WINDOWS,
                   "seqlen": SEQLEN, "seed": HELDOUT_SEED},
      "versions": pipeline.versions()})
  record.setdefault("commands", []).append(" ".join(["python"] + sys.argv))
  config, params = checkpoints.load_gguf(run_results.gguf_path())
  blocks = {}

  def block_for(n):
    if n not in blocks:
      calib, held = windows(n)
      blocks[n] = Block(config, params, args.block, calib, held)
    return blocks[n]

  def save():
    harness.write_json(path, record, indent=2)

  def do(method, structure, steps=0, lr=None, penalty=None, n=CALIB_WINDOWS, lr_scale="none"):
    key = _key(method, structure, steps, lr, penalty, n, lr_scale)
    if key in runs:
      return runs[key]
    nm = STRUCTURES[structure]
    if method in BASELINES:
      cfg = prune.PruneConfig(method, sparsity=0.5, nm=nm)
    else:
      cfg = safe_config(method, nm, steps, lr, penalty, n, lr_scale)
    load_before = os.getloadavg()[0]
    result = block_for(n).run(cfg)
    result.update(method=method, structure=structure, n=n, steps_requested=steps, lr=lr,
                  penalty=penalty, lr_scale=lr_scale, prune_config=dataclasses.asdict(cfg),
                  load_average=[load_before, os.getloadavg()[0]])
    runs[key] = result
    save()
    print(f"{key}: held-out {result['held_out_error']:.4f} calib "
          f"{result['calibration_error']:.4f} ({result['seconds']:.0f} s)", flush=True)
    return result

  for structure in STRUCTURES:
    for method in BASELINES:
      do(method, structure)
  safe_methods = ("safe-plus", "safe")
  if "grid" in args.stages:
    for method in safe_methods:
      for lr in GRID_LR:
        for penalty in GRID_PENALTY:
          do(method, "50%", SHORT, lr, penalty)
  if "long" in args.stages:
    for method in safe_methods:
      for r in best(runs, method, "50%", SHORT, top=1):
        do(method, "50%", LONG, r["lr"], r["penalty"])
  if "nm" in args.stages:
    for method in safe_methods:
      top = best(runs, method, "50%", SHORT)[0]
      do(method, "2:4", SHORT, top["lr"], top["penalty"])
  if "limits" in args.stages:
    top = best(runs, "safe-plus", "50%", SHORT)[0]
    do("safe-plus", "50%", 120, top["lr"], top["penalty"])
    for method in BASELINES:
      do(method, "50%", n=64)
    do("safe-plus", "50%", SHORT, top["lr"], top["penalty"], n=64)
    # Relative steps: a fraction of each matrix's RMS weight per step.
    for lr in (1e-2, 3e-2):
      do("safe-plus", "50%", SHORT, lr, top["penalty"], lr_scale="rms")
  if "edge" in args.stages:
    for method in safe_methods:
      top = best(runs, method, "50%", SHORT)[0]
      do(method, "50%", SHORT, 1e-2, top["penalty"])
  if "extra" in args.stages:
    top = best(runs, "safe-plus", "50%", SHORT)[0]
    do("safe-plus", "50%", SHORT, 1e-1, top["penalty"], lr_scale="rms")
    do("safe-plus", "50%", LONG, 3e-2, top["penalty"], lr_scale="rms")
    do("safe-plus", "50%", LONG, top["lr"], top["penalty"], n=64)
    do("safe-plus", "2:4", LONG, top["lr"], top["penalty"])
    safe_top = best(runs, "safe", "50%", SHORT)[0]
    do("safe", "50%", LONG, safe_top["lr"], safe_top["penalty"])
  if "edge-penalty" in args.stages:
    # The edge rule on lambda: a pick at an end of its grid gets the next decade beyond that
    # end, at the picked lr; again while the new value wins (at most two extensions).
    for method in safe_methods:
      for _ in range(2):
        pool = best(runs, method, "50%", SHORT, top=None)  # every 60-step run, best first
        top, tried = pool[0], sorted({r["penalty"] for r in pool})
        if top["penalty"] not in (tried[0], tried[-1]):
          break
        beyond = top["penalty"] / 10 if top["penalty"] == tried[0] else top["penalty"] * 10
        do(method, "50%", SHORT, top["lr"], beyond)
  # The best (lr, lambda) per method, structure and step budget, on held-out error only
  # (absolute lr, 16 calibration windows: the settings the full-model runs can use).
  record["selected"] = {}
  for m in safe_methods:
    for s in STRUCTURES:
      for steps in sorted({r["steps_requested"] for r in runs.values() if r["method"] == m}):
        top = best(runs, m, s, steps)
        if top:
          record["selected"][f"{m}|{s}|steps{steps}"] = {
              k: top[0][k] for k in ("lr", "penalty", "held_out_error")}
  save()


def figure(record, png):
  """Held-out error against SAFE / SAFE+ steps (best lr, lambda per budget); baselines flat."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  runs = record["runs"]
  fig = Figure(figsize=(9, 3.6))
  for ax, structure in zip(fig.subplots(1, 2), STRUCTURES):
    for method, color in (("magnitude", "C7"), ("wanda", "C2"), ("sparsegpt", "C1")):
      key = _key(method, structure)
      if key in runs:
        ax.axhline(runs[key]["held_out_error"], color=color, ls="--", label=method)
    series = (("safe-plus", CALIB_WINDOWS, "none", "C0", "o-", "safe-plus (best lr, lambda)"),
              ("safe", CALIB_WINDOWS, "none", "C3", "o-", "safe (best lr, lambda)"),
              ("safe-plus", CALIB_WINDOWS, "rms", "C9", "s:", "safe-plus, relative lr"),
              ("safe-plus", 64, "none", "C4", "^:", "safe-plus, 64 windows"))
    for method, n, scale, color, style, label in series:
      steps = sorted({r["steps_requested"] for r in runs.values()
                      if r["method"] == method and r["structure"] == structure
                      and r["n"] == n and r["lr_scale"] == scale})
      errs = [best(runs, method, structure, s, n=n, lr_scale=scale)[0]["held_out_error"]
              for s in steps]
      if steps:
        ax.plot(steps, errs, style, color=color, label=label)
    ax.set_xlim(0, 270)
    ax.set_yscale("log")
    ax.set_xlabel("SAFE steps per block (batch 8)")
    ax.set_title(f"block {record.get('block', 0)}, {structure}")
  fig.axes[0].set_ylabel("held-out relative error")
  fig.axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


if __name__ == "__main__":
  main()
