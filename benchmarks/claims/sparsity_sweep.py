"""Accuracy against sparsity (the shape of the paper's §5.2 tables) with validated lambdas.

One command per claim: for a vision preset (e.g. ``mlp-fashion-mnist``),

1. **selection** on a validation split carved from the training data
   (``--validation`` examples, seeded by the preset's ``data_seed``; the test
   set is never looked at): every penalty method (``safe``, ``safe-plus``,
   ``safe-sg``, ``safe-multi`` over ``--safe-grid``; ``admm`` over
   ``--admm-grid``) is trained at every sparsity with every lambda for
   ``--select-seeds`` seeds, and the lambda with the best mean validation
   accuracy of the final sparse model is kept, per method and sparsity;
   with ``--cram-grid``, CrAM / CrAM+'s SAM radius ``rho`` is chosen the same
   way (without it they keep the preset's rho); with ``--rho-grid`` the SAFE
   family's rho is chosen jointly with its lambda
   (:func:`safe_optax.vision.selection_lib.select_with_rho`);
2. **final runs**: every method x sparsity x seed on the full training split
   with the chosen lambdas, evaluated on the test set;
3. ``sweep.json`` (every run, the selection, convergence diagnostics and
   versions), ``table.md`` and ``accuracy_vs_sparsity.png`` in ``--out``.

Methods without a lambda (``dense``, ``magnitude``, ``gmp``, ``imp-sam``,
``cram``, ``cram-plus``) keep the preset's settings. Convergence is reported
per (method, sparsity): the final training loss, its relative change over
the last 10 % of epochs, ``||x - z||`` of the ADMM-type methods and the
accuracy the final projection costs (dense iterate minus sparse model).

``--reuse-selection`` takes the selection runs of an earlier ``sweep.json``
(same config, validation split and selection seeds) and trains only the grid
values it lacks: the edge rule's extensions of a committed grid.
``--select-only`` stops after the selection (``sweep.json`` records no final run).

Every run is :func:`safe_optax.vision.train.train_and_evaluate` in its own
sub-folder of ``--workdir`` (:mod:`safe_optax.vision.sweeps`); a finished run
is read back after checking that its recorded config is the one asked for,
so an interrupted sweep continues where it stopped.

  python -m benchmarks.claims.sparsity_sweep --preset mlp-fashion-mnist \\
      --data-dir /usr/share/datasets/fashion-mnist --methods dense safe admm gmp magnitude \\
      --sparsities 0.9 0.95 0.98 0.99 0.995 --epochs 30 --workdir /tmp/fmnist \\
      --out /tmp/fmnist_mlp
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time
from typing import Any, Optional

import numpy as np

from safe_optax.experiment import mean_se, versions
from safe_optax import methods
from safe_optax.vision import configs
from safe_optax.vision import selection as selection_lib
from safe_optax.vision import sweeps
from safe_optax.vision import datasets
from safe_optax.vision import workdirs
from benchmarks import harness


def reuse_problem(base: configs.Config, args: argparse.Namespace) -> Optional[str]:
  """Why ``--reuse-selection``'s runs are not this sweep's selection runs (None: they are)."""
  earlier = json.loads(pathlib.Path(args.reuse_selection).read_text(encoding="utf-8"))
  problem = selection_lib.reuse_problem(
      earlier, earlier["selection"], base, args.methods, validation=args.validation,
      seeds=range(args.select_seeds),
      method_overrides=selection_lib.rescaled_dual(args.methods, args.rescale_dual))
  return problem and f"--reuse-selection {args.reuse_selection}: {problem}"


def select(base: configs.Config, args: argparse.Namespace) -> dict[str, Any]:
  """The validation accuracy of every (method, sparsity, value[, rho]); the best choices."""
  grids = {m: (args.admm_grid if m == "admm" else args.safe_grid) for m in sweeps.PENALTY_METHODS}
  if args.cram_grid:
    grids.update({m: args.cram_grid for m in sweeps.TUNED_METHODS
                  if m not in sweeps.PENALTY_METHODS})
  if args.reuse_selection:
    earlier = json.loads(pathlib.Path(args.reuse_selection).read_text(encoding="utf-8"))
    return selection_lib.extend_selection(
        base, earlier["selection"], args.methods, args.sparsities, grids,
        validation=args.validation, seeds=range(args.select_seeds),
        root=pathlib.Path(args.workdir) / "select", data_dir=args.data_dir,
        progress=args.progress,
        method_overrides=selection_lib.rescaled_dual(args.methods, args.rescale_dual))
  select_fn = (selection_lib.select_hyperparameters if args.rho_grid is None else
               functools.partial(selection_lib.select_with_rho, rhos=args.rho_grid))
  return select_fn(base, args.methods, args.sparsities, grids, validation=args.validation,
                   seeds=range(args.select_seeds), root=pathlib.Path(args.workdir) / "select",
                   data_dir=args.data_dir, progress=args.progress,
                   method_overrides=selection_lib.rescaled_dual(args.methods, args.rescale_dual))


def summarize_convergence(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
  for r in runs:
    groups.setdefault((r["method"], r["sparsity"]), []).append(r)
  out = []
  for (method, s), group in groups.items():
    row: dict[str, Any] = {"method": method, "sparsity": s}
    for key in ("final_train_loss", "loss_change_last_tenth", "constraint_distance",
                "distance_to_projection", "projection_cost", "penalty", "rho"):
      values = [r[key] for r in group if r.get(key) is not None]
      if values:
        row[key] = float(np.mean(values))
    out.append(row)
  return out


def plot(runs: list[dict[str, Any]], sparsities: list[float], title: str,
         path: pathlib.Path) -> None:
  """Test accuracy (mean ± s.e.) against sparsity, one line per method."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(11, 4.5))
  ax_acc, ax_cost = fig.subplots(1, 2)
  xs = np.arange(len(sparsities))
  for i, method in enumerate(dict.fromkeys(r["method"] for r in runs)):
    means, ses, costs = [], [], []
    for s in sparsities:
      group = [r for r in runs if r["method"] == method and (
          method == "dense" or math.isclose(r["sparsity"], s))]
      finished = [100 * r["accuracy"] for r in group if r["accuracy"] is not None]
      mean, se = mean_se(finished) if finished else (np.nan, None)
      means.append(mean)
      ses.append(se or 0.0)
      cost = [100 * r["projection_cost"] for r in group if r.get("projection_cost") is not None]
      costs.append(np.mean(cost) if cost else np.nan)
    style = "--" if method == "dense" else "-"
    ax_acc.errorbar(xs, means, yerr=ses, label=method, linestyle=style, marker="o",
                    capsize=3, color=f"C{i}")
    if method != "dense":
      ax_cost.plot(xs, costs, marker="o", label=method, color=f"C{i}")
  for ax in (ax_acc, ax_cost):
    ax.set_xticks(xs, [f"{100 * s:g}%" for s in sparsities])
    ax.set_xlabel("sparsity")
    ax.grid(alpha=0.3)
  ax_acc.set_ylabel("test accuracy (%)")
  ax_acc.set_title("after the final projection (mean ± s.e.)")
  ax_acc.legend(fontsize=8)
  ax_cost.set_ylabel("dense iterate − sparse model (points)")
  ax_cost.set_title("accuracy lost by the final projection")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def convergence_table(rows: list[dict[str, Any]]) -> str:
  def fmt(value, spec):
    return "–" if value is None else format(value, spec)

  lines = ["| method | sparsity | lambda | rho | final train loss | loss change, last 10 % of "
           "epochs | ‖x − z‖ | ‖x − Proj x‖ | projection cost (points) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['method']} | {100 * r['sparsity']:g}% | {fmt(r.get('penalty'), 'g')} | "
        f"{fmt(r.get('rho'), 'g')} | "
        f"{fmt(r.get('final_train_loss'), '.4f')} | {fmt(r.get('loss_change_last_tenth'), '.4f')} "
        f"| {fmt(r.get('constraint_distance'), '.3g')} | "
        f"{fmt(r.get('distance_to_projection'), '.3g')} | "
        f"{fmt(100 * r['projection_cost'] if 'projection_cost' in r else None, '.2f')} |")
  return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", required=True, choices=sorted(configs.PRESETS))
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--methods", nargs="+", choices=configs.METHODS, required=True)
  parser.add_argument("--sparsities", nargs="+", type=float, required=True)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--epochs", type=int)
  parser.add_argument("--warmup-epochs", type=int)
  parser.add_argument("--batch-size", type=int)
  parser.add_argument("--eval-every", type=int)
  parser.add_argument("--train-subset", type=int, default=None,
                      help="train on this many training examples (seeded sample); the "
                           "validation split is carved from them (default: all)")
  parser.add_argument("--test-subset", type=int, default=None,
                      help="evaluate on this many test examples (default: all)")
  parser.add_argument("--imp-every-epochs", type=int, default=None,
                      help="IMP+SAM: epochs between prune rounds (default: the preset's); "
                           "it is part of every run's config, so runs of other methods are "
                           "not shared with a sweep without it")
  parser.add_argument("--structure", choices=configs.STRUCTURES, default=None,
                      help="sparsity set of every pruning method (part of each run's folder "
                           "name): " + "; ".join(
                               f"{k}: {v}" for k, v in methods.STRUCTURE_HELP.items()))
  parser.add_argument("--validation", type=int, default=10_000)
  parser.add_argument("--select-seeds", type=int, default=1)
  parser.add_argument("--safe-grid", type=float, nargs="+", default=[0.01, 0.1, 1.0])
  parser.add_argument("--admm-grid", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1])
  parser.add_argument("--cram-grid", type=float, nargs="+", default=None,
                      help="SAM radii rho tried for CrAM / CrAM+ on the validation split "
                           "(default: no selection, the preset's rho)")
  parser.add_argument("--rho-grid", type=float, nargs="+", default=None,
                      help="SAM radii tried for the SAFE family, each with every lambda of "
                           "--safe-grid; the best pair on the validation split is used "
                           "(default: the preset's rho)")
  parser.add_argument("--reuse-selection", default=None,
                      help="a sweep.json whose selection runs are reused (same config, "
                           "validation split and selection seeds): only the grid values it "
                           "lacks are trained (λ and --cram-grid; not with --rho-grid)")
  parser.add_argument("--select-only", action="store_true",
                      help="stop after the selection: sweep.json records no final run")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--progress", action="store_true")
  parser.add_argument("--rescale-dual", action="store_true",
                      help="SAFE-family methods keep the unscaled dual while the penalty ramps "
                           "(safe_optax.safe(rescale_dual=True)); other methods are unchanged, "
                           "so their runs are shared with a sweep without it")
  args = parser.parse_args(argv)
  for s in args.sparsities:
    if not 0.0 < s < 1.0:
      parser.error(f"--sparsities must lie in (0, 1), got {s}")
  for flag, values in (("--cram-grid", args.cram_grid), ("--rho-grid", args.rho_grid)):
    if values is not None and min(values) < 0:
      parser.error(f"{flag} must be SAM radii >= 0, got {values}")
  if args.rho_grid is not None and args.reuse_selection:
    parser.error("--reuse-selection reuses the lambda and CrAM rho grids only, not --rho-grid")
  start = time.perf_counter()
  try:
    base = configs.get_config(args.preset, epochs=args.epochs, warmup_epochs=args.warmup_epochs,
                              batch_size=args.batch_size, eval_every=args.eval_every,
                              train_subset=args.train_subset, test_subset=args.test_subset,
                              imp_every_epochs=args.imp_every_epochs,
                              structure=args.structure)
    base.replace(validation=args.validation)  # validation < train_subset, checked up front
  except ValueError as err:
    parser.error(str(err))
  problem = reuse_problem(base, args) if args.reuse_selection else None
  if problem:
    parser.error(problem)
  selection = select(base, args)
  if args.select_only:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"command": "python " + " ".join(sys.argv), "config": configs.to_dict(base),
               "selection": selection, "runs": [], "versions": versions(),
               "wall_seconds": time.perf_counter() - start}
    harness.write_json(out / "sweep.json", summary)
    print(json.dumps({"chosen": selection["chosen"], "at_grid_edge": selection["at_grid_edge"]}))
    return 0
  data = datasets.load_dataset(base, args.data_dir)
  root = pathlib.Path(args.workdir) / "final"
  runs = []
  rescaled = selection_lib.rescaled_dual(args.methods, args.rescale_dual)
  for method in args.methods:
    for s in ([0.0] if method == "dense" else args.sparsities):
      for seed in args.seeds:
        # A dense run has no sparsity set: it is shared with sweeps of either structure.
        config = base.replace(method=method, sparsity=s, seed=seed,
                              structure="global" if method == "dense" else None,
                              **rescaled.get(method, {}),
                              **selection_lib.chosen_overrides(selection, method, s))
        try:
          results = sweeps.run_or_load(config, sweeps.run_dir(root, config), data=data,
                                       data_dir=args.data_dir, progress=args.progress)
        except workdirs.TrainingDiverged as err:
          # A test run that diverges is a result (the report scores it as chance), not a crash
          # that loses the sweep: a rerun would diverge at the same step again.
          print(f"  {err}", file=sys.stderr, flush=True)
          runs.append(sweeps.diverged_record(config, err))
          continue
        runs.append(sweeps.record(config, results))
  table = sweeps.summarize(runs, args.sparsities)
  rows = summarize_convergence(runs)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  subset = "" if base.train_subset is None else f" on {base.train_subset} training examples"
  tested = "" if base.test_subset is None else f", tested on {base.test_subset} test examples"
  if base.structure != "global":
    tested += f", sparsity set `{base.structure}` ({methods.STRUCTURE_HELP[base.structure]})"
  title = (f"{args.preset}, {base.epochs} epochs{subset}, seeds {args.seeds}; lambda chosen on "
           f"{args.validation} validation examples")
  plot(runs, args.sparsities, title, out / "accuracy_vs_sparsity.png")
  summary = {"command": "python " + " ".join(sys.argv), "config": configs.to_dict(base),
             "selection": selection, "runs": runs, "table": table["rows"],
             "convergence": rows, "versions": versions(),
             "wall_seconds": time.perf_counter() - start}
  harness.write_json(out / "sweep.json", summary)
  fields = selection.get("fields", {})
  pair_rho = selection.get("chosen_rho", {})
  chosen = ", ".join(f"{k} {'rho ' if fields.get(k.split('@')[0]) == 'rho' else ''}{v:g}"
                     + (f" (rho {pair_rho[k]:g})" if k in pair_rho else "")
                     for k, v in selection["chosen"].items())
  if selection.get("fixed"):
    chosen += (f". Given, not selected (a one-value grid, no validation run): "
               f"{', '.join(selection['fixed'])}")
  if selection.get("at_grid_edge"):
    chosen += (f". At an end of its grid (the optimum may lie outside): "
               f"{', '.join(selection['at_grid_edge'])}")
  if args.rescale_dual:
    chosen += (". SAFE-family runs use `rescale_dual=True` (the unscaled dual is kept while the "
               "penalty ramps; not the paper's update)")
  markdown = (f"Command: `{summary['command']}`\n\nTest accuracy (%) after the final projection "
              f"(and BNT), mean ± s.e. over seeds {args.seeds}; preset `{args.preset}`, "
              f"{base.epochs} epochs{subset}{tested}.\n\n{table['markdown']}\n\n"
              f"Lambda (rho for CrAM) chosen on {args.validation} held-out training examples: "
              f"{chosen}.\n\nConvergence (means over seeds):\n\n{convergence_table(rows)}\n")
  (out / "table.md").write_text(markdown, encoding="utf-8")
  print(markdown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
