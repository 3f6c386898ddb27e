"""The paper's dual update against ``rescale_dual=True`` under the cosine penalty ramp.

SAFE keeps a *scaled* dual ``u`` (the multiplier divided by ``lambda``) and
ramps ``lambda`` from 0. The paper's update adds ``x - z`` to ``u`` at every
dual update whatever ``lambda_t`` is, so early in the ramp, while the penalty
barely acts, the ``u`` of pruned weights grows at full rate; at extreme
sparsity (almost every weight pruned) the support of ``z = Proj(x + u)`` then
turns over at each update and the growing penalty pulls ``x`` towards the
large ``z``. ``rescale_dual=True`` keeps the unscaled multiplier ``lambda * u``
across changes of ``lambda`` (Boyd et al. 2011, §3.4.1).

For each penalty, variant and seed this trains SAFE with the vision trainer
(same data, same seed, same lambda; only the dual update differs) and writes
``dual_rescaling.json`` (every run: accuracy of the final sparse model, its
convergence and per-epoch history), ``table.md`` and ``dual_rescaling.png``
(training loss and ``||x - z||`` per epoch) in ``--out``. Finished runs in
``--workdir`` are reused. The lambdas are fixed here, not chosen: this
isolates the dual update; ``sparsity_sweep.py --rescale-dual`` compares the
methods with lambdas chosen on a validation split.

  python -m benchmarks.claims.dual_rescaling --preset mlp-fashion-mnist \\
      --data-dir /usr/share/datasets/fashion-mnist --sparsity 0.995 --penalties 0.1 1 \\
      --epochs 20 --warmup-epochs 2 --train-subset 8000 --test-subset 2000 \\
      --seeds 0 1 2 3 4 --workdir /tmp/dual_rescaling --out results/dual_rescaling
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any, Optional

import numpy as np

from safe_optax.experiment import mean_se, versions
from safe_optax.vision import configs
from safe_optax.vision import sweeps
from safe_optax.vision import datasets
from safe_optax.vision import workdirs
from benchmarks import harness

VARIANTS = {"paper": False, "rescaled": True}
"""Label -> ``rescale_dual``."""


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
  """Every (penalty, variant, seed): the sweep record plus the per-epoch history."""
  base = configs.get_config(args.preset, method="safe", sparsity=args.sparsity,
                            epochs=args.epochs, warmup_epochs=args.warmup_epochs,
                            train_subset=args.train_subset, test_subset=args.test_subset,
                            eval_every=args.epochs)
  data = datasets.load_dataset(base, args.data_dir)
  runs = []
  for lam in args.penalties:
    for label, rescale in VARIANTS.items():
      for seed in args.seeds:
        config = base.replace(penalty=lam, rescale_dual=rescale, seed=seed)
        workdir = sweeps.run_dir(pathlib.Path(args.workdir), config)
        try:
          results = sweeps.run_or_load(config, workdir, data=data, data_dir=args.data_dir,
                                       progress=args.progress)
        except workdirs.TrainingDiverged as err:
          runs.append({**sweeps.diverged_record(config, err), "variant": label})
          continue
        record = sweeps.record(config, results)
        record.update(variant=label, history=[
            {k: h.get(k) for k in ("epoch", "train_loss", "distance_to_z", "mask_churn")}
            for h in results["history"]])
        runs.append(record)
  return runs


def table(runs: list[dict[str, Any]]) -> str:
  """One row per (lambda, variant): accuracy, ``||x - z||``, final loss, diverged runs."""
  lines = ["| lambda | dual update | sparse test accuracy (%) | ‖x − z‖ at the end "
           "| final train loss | diverged |", "|---|---|---|---|---|---|"]
  for lam in sorted({r["penalty"] for r in runs}):
    for label in VARIANTS:
      group = [r for r in runs if r["penalty"] == lam and r["variant"] == label]
      done = [r for r in group if r.get("accuracy") is not None]
      if not group:
        continue
      cells = []
      for key, scale, spec in (("accuracy", 100, ".2f"), ("constraint_distance", 1, ".3g"),
                               ("final_train_loss", 1, ".4f")):
        if done:
          mean, se = mean_se([scale * r[key] for r in done])
          cells.append(format(mean, spec) + ("" if se is None else " ± " + format(se, spec)))
        else:
          cells.append("–")
      lines.append(f"| {lam:g} | {label} | " + " | ".join(cells)
                   + f" | {len(group) - len(done)} of {len(group)} |")
  return "\n".join(lines)


def plot(runs: list[dict[str, Any]], title: str, path: pathlib.Path) -> None:
  """Training loss and ``||x - z||`` per epoch (mean over seeds), one line per lambda and variant."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(11, 4.2))
  ax_loss, ax_dist = fig.subplots(1, 2)
  for i, lam in enumerate(sorted({r["penalty"] for r in runs})):
    for label, style in zip(VARIANTS, ("--", "-")):
      group = [r for r in runs if r["penalty"] == lam and r["variant"] == label and "history" in r]
      if not group:
        continue
      for ax, key in ((ax_loss, "train_loss"), (ax_dist, "distance_to_z")):
        curves = np.asarray([[h[key] for h in r["history"]] for r in group], np.float64)
        ax.plot(np.arange(1, curves.shape[1] + 1), curves.mean(0), style, color=f"C{i}",
                label=f"lambda {lam:g}, {label}")
  ax_loss.set_ylabel("training loss")
  ax_dist.set_ylabel("‖x − z‖")
  ax_loss.set_yscale("log")
  ax_dist.set_yscale("log")
  for ax in (ax_loss, ax_dist):
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)
  ax_loss.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", required=True, choices=sorted(configs.PRESETS))
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--sparsity", type=float, required=True)
  parser.add_argument("--penalties", type=float, nargs="+", required=True)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--epochs", type=int, required=True)
  parser.add_argument("--warmup-epochs", type=int)
  parser.add_argument("--train-subset", type=int)
  parser.add_argument("--test-subset", type=int)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--progress", action="store_true")
  args = parser.parse_args(argv)
  if not 0.0 < args.sparsity < 1.0:
    parser.error(f"--sparsity must lie in (0, 1), got {args.sparsity}")
  start = time.perf_counter()
  runs = run_all(args)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  title = (f"SAFE, {args.preset} at {100 * args.sparsity:g}% sparsity, {args.epochs} epochs, "
           f"seeds {args.seeds}:\nthe paper's dual update (dashed) vs rescale_dual (solid)")
  plot(runs, title, out / "dual_rescaling.png")
  markdown = (f"Command: `python {' '.join(sys.argv)}`\n\n{title.replace(chr(10), ' ')}. Sparse test accuracy after the "
              f"final projection and BNT, mean ± s.e. over seeds; lambdas fixed (not chosen).\n\n"
              f"{table(runs)}\n")
  summary = {"command": "python " + " ".join(sys.argv), "args": vars(args), "runs": runs,
             "table": table(runs), "versions": versions(),
             "wall_seconds": time.perf_counter() - start}
  harness.write_json(out / "dual_rescaling.json", summary)
  (out / "table.md").write_text(markdown, encoding="utf-8")
  print(markdown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
