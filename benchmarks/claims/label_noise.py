"""Label-noise harness in the layout of the paper's Table 3: SAFE vs ADMM under noisy labels.

For every noise ratio, sparsity, method and seed: train with the vision
trainer on symmetric label noise (every corrupted label moves to another
class, ``input_pipeline.symmetric_label_noise`` through the config's
``label_noise``), finalize + BNT, and report clean test accuracy. The table has
one row per (sparsity, noise ratio) and one column per method, mean ± s.e.
over seeds. Finished runs in ``--workdir`` are reused (a folder of other
settings is refused).

With ``--validation N`` each method's lambda is first chosen per noise ratio
and sparsity on N held-out training examples whose labels carry the same
noise (:func:`safe_optax.vision.selection_lib.select_hyperparameters`; the clean test set is
never looked at), over ``--safe-grid`` / ``--admm-grid``. ``--chosen-from FILE``
takes what an earlier output chose per noise ratio (lambda, and rho when it
chose one) for the same settings at another ``--epochs``: the other budget of
the report's convergence rule; the selection is recorded with the budget and
file it was made at.

  python -m benchmarks.claims.label_noise --preset mlp-mnist --data-dir ../shared/data/mnist \\
      --test-only-split 8000 2000 --noise 0.25 0.5 0.75 --sparsities 0.9 --epochs 20 \\
      --warmup-epochs 1 --batch-size 100 --seeds 0 1 2 --validation 2000 --out results/label_noise
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
from typing import Any, Callable, Optional

from safe_optax.experiment import mean_se, versions
from safe_optax.vision import configs
from safe_optax.vision import selection as selection_lib
from safe_optax.vision import sweeps
from safe_optax.vision import datasets
from benchmarks import harness


def table(runs: list[dict[str, Any]], methods: list[str]) -> str:
  """Table 3 layout: rows (sparsity, noise), columns methods, accuracy (%) mean ± s.e.

  Examples:
    >>> runs = [{"method": m, "sparsity": 0.9, "noise": 0.5, "seed": 0, "accuracy": a}
    ...         for m, a in (("safe", 0.8), ("admm", 0.6))]
    >>> print(table(runs, ["safe", "admm"]))
    | sparsity | noise | safe | admm |
    |---|---|---|---|
    | 90% | 50% | 80.00 | 60.00 |
  """
  keys = sorted({(r["sparsity"], r["noise"]) for r in runs})
  lines = ["| sparsity | noise | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
  for sparsity, noise in keys:
    cells = []
    for method in methods:
      values = [100 * r["accuracy"] for r in runs if r["method"] == method
                and r["sparsity"] == sparsity and r["noise"] == noise]
      if not values:
        cells.append("–")
        continue
      mean, se = mean_se(values)
      cells.append(f"{mean:.2f}" if se is None else f"{mean:.2f} ± {se:.2f}")
    lines.append(f"| {100 * sparsity:g}% | {100 * noise:g}% | " + " | ".join(cells) + " |")
  return "\n".join(lines)


DEFAULT_GRIDS = {"safe": [1e-3, 1e-2, 1e-1, 1.0], "admm": [1e-4, 1e-3, 1e-2, 1e-1]}


def penalty_grids(args: argparse.Namespace, parser: argparse.ArgumentParser
                  ) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
  """The lambda grids of the selection, and the fixed lambdas of a run without one.

  Without ``--validation`` nothing is selected, so a grid given on the command
  line must be a single lambda, which every run of those methods then uses; a
  longer grid is refused rather than silently ignored.
  """
  given = {"safe": args.safe_grid, "admm": args.admm_grid}
  grids = {m: (given["admm" if m == "admm" else "safe"]
               or DEFAULT_GRIDS["admm" if m == "admm" else "safe"])
           for m in sweeps.PENALTY_METHODS}
  fixed: dict[str, dict[str, float]] = {}
  if args.validation is None:
    for name, grid in given.items():
      if grid is not None and len(grid) != 1:
        parser.error(f"--{name}-grid has {len(grid)} values but nothing selects among them: "
                     "pass --validation N, or give one lambda to use for every run")
    for method in sweeps.PENALTY_METHODS:
      grid = given["admm" if method == "admm" else "safe"]
      if grid is not None:
        fixed[method] = {sweeps.penalty_field(method): grid[0]}
  return grids, fixed


def _earlier_selections(path: Optional[str], flag: str, noises: list[float],
                        parser: argparse.ArgumentParser,
                        problem: Callable[[dict[str, Any], dict[str, Any]], Optional[str]]
                        ) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
  """An earlier output (None without ``flag``) and its selection per noise ratio, each checked
  by ``problem(earlier, selection)``; a missing or mismatched one is a parser error naming
  ``flag``."""
  if path is None:
    return None
  earlier = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  selections = {}
  for noise in noises:
    selection = (earlier.get("selection") or {}).get(f"{noise:g}")
    why = (f"it has no selection at noise {noise:g}" if selection is None
           else problem(earlier, selection))
    if why:
      parser.error(f"{flag} {path}: {why}")
    selections[f"{noise:g}"] = selection
  return earlier, selections


def reused_selections(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      base: configs.Config, per_method: dict[str, dict[str, Any]]
                      ) -> Optional[dict[str, Any]]:
  """``--reuse-selection``'s selections by noise ratio (None without the flag), each checked
  to come from this run's selection runs; a mismatch is a parser error naming the flag."""
  found = _earlier_selections(
      args.reuse_selection, "--reuse-selection", args.noise, parser,
      lambda earlier, sel: selection_lib.reuse_problem(
          earlier, sel, base, args.methods, validation=args.validation,
          seeds=range(args.select_seeds), method_overrides=per_method))
  return None if found is None else found[0]["selection"]


def chosen_selections(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      base: configs.Config, per_method: dict[str, dict[str, Any]]
                      ) -> Optional[dict[str, Any]]:
  """``--chosen-from``'s selections by noise ratio, each with the budget and file it was made at
  (None without the flag); one made for other settings is a parser error naming the flag."""
  found = _earlier_selections(
      args.chosen_from, "--chosen-from", args.noise, parser,
      lambda earlier, sel: selection_lib.transfer_problem(earlier, sel, base, args.methods,
                                                          args.sparsities, per_method))
  if found is None:
    return None
  earlier, selections = found
  return {noise: {**sel, "epochs": earlier["config"]["epochs"], "file": args.chosen_from}
          for noise, sel in selections.items()}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="resnet20-cifar10", choices=sorted(configs.PRESETS))
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--test-only-split", type=int, nargs=2, default=None)
  parser.add_argument("--methods", nargs="+", default=["safe", "admm"])
  parser.add_argument("--noise", nargs="+", type=float, default=[0.25, 0.5, 0.75])
  parser.add_argument("--sparsities", nargs="+", type=float, default=[0.9])
  parser.add_argument("--epochs", type=int)
  parser.add_argument("--warmup-epochs", type=int)
  parser.add_argument("--batch-size", type=int)
  parser.add_argument("--train-subset", type=int)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--validation", type=int, default=None,
                      help="choose lambda on N held-out (equally noisy) training examples")
  parser.add_argument("--select-seeds", type=int, default=1)
  parser.add_argument("--safe-grid", type=float, nargs="+", default=None,
                      help="lambdas tried for SAFE-type methods with --validation (default "
                           f"{DEFAULT_GRIDS['safe']}); without --validation, one value: the "
                           "lambda every run uses")
  parser.add_argument("--admm-grid", type=float, nargs="+", default=None,
                      help=f"the same for ADMM (default {DEFAULT_GRIDS['admm']})")
  parser.add_argument("--rescale-dual", action="store_true",
                      help="SAFE-family methods keep the unscaled dual while the penalty ramps "
                           "(safe_optax.safe(rescale_dual=True)); ADMM is unchanged, so its runs "
                           "are shared with a run without it; outputs get a _rescaled suffix")
  parser.add_argument("--rho", type=float, default=None,
                      help="SAM radius of the SAFE family (default: the preset's); ADMM "
                           "takes no SAM step, so its runs are shared; outputs get a _rho<r> "
                           "suffix")
  parser.add_argument("--rho-grid", type=float, nargs="+", default=None,
                      help="with --validation: SAM radii tried for SAFE-type methods, each "
                           "with every lambda of --safe-grid; the best (rho, lambda) pair on the "
                           "noisy validation split is used (selection.select_with_rho); outputs get "
                           "a _rhogrid suffix")
  parser.add_argument("--reuse-selection", default=None,
                      help="with --validation: an earlier output JSON whose selection runs are "
                           "reused (same config, validation split and selection seeds, every "
                           "--noise in it): only the grid values it lacks are trained, the edge "
                           "rule's extensions (not with --rho-grid)")
  parser.add_argument("--chosen-from", default=None,
                      help="an earlier output JSON of this script whose selection per noise "
                           "ratio gives lambda (and rho, if it chose one): the same settings at "
                           "another --epochs, for the convergence rule")
  parser.add_argument("--workdir", default="/tmp/safe_optax_label_noise")
  parser.add_argument("--out", default="results/label_noise")
  return parser


def main(argv: Optional[list[str]] = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  for flag, values in (("--rho", [args.rho]), ("--rho-grid", args.rho_grid)):
    if any(v is not None and v < 0 for v in values or []):
      parser.error(f"{flag} must be SAM radii >= 0, got {values}")
  if args.rho_grid is not None and (args.validation is None or args.rho is not None):
    parser.error("--rho-grid selects on the validation split: pass --validation N, and not "
                 "--rho")
  if args.reuse_selection is not None and (args.validation is None or args.rho_grid is not None):
    parser.error("--reuse-selection extends a lambda selection: pass --validation N, and not "
                 "--rho-grid")
  if args.chosen_from is not None and (
      args.validation is not None or args.reuse_selection is not None
      or args.rho_grid is not None or args.safe_grid is not None or args.admm_grid is not None):
    parser.error("--chosen-from takes the values an earlier output chose: drop --validation, "
                 "--reuse-selection, --rho-grid and the lambda grids")
  start = time.perf_counter()
  overrides = {"epochs": args.epochs, "warmup_epochs": args.warmup_epochs,
               "batch_size": args.batch_size, "train_subset": args.train_subset}
  if args.test_only_split:
    overrides["test_only_split"] = tuple(args.test_only_split)
  base = configs.get_config(args.preset, **overrides)
  runs, selections = [], {}
  grids, fixed = penalty_grids(args, parser)
  per_method = selection_lib.rescaled_dual(args.methods, args.rescale_dual)
  if args.rho is not None:  # the SAFE family only: ADMM keeps its config and folders
    per_method = selection_lib.with_rho(per_method, args.methods, args.rho)
  earlier = reused_selections(args, parser, base, per_method)
  chosen = chosen_selections(args, parser, base, per_method)
  for noise in args.noise:
    noisy = base.replace(label_noise=noise)
    selection = None
    if chosen is not None:
      selection = selections[f"{noise:g}"] = chosen[f"{noise:g}"]
    elif earlier is not None:
      selection = selection_lib.extend_selection(
          noisy, earlier[f"{noise:g}"], args.methods, args.sparsities, grids,
          validation=args.validation, seeds=range(args.select_seeds),
          root=pathlib.Path(args.workdir) / "select", data_dir=args.data_dir,
          method_overrides=per_method)
      selections[f"{noise:g}"] = selection
    elif args.validation is not None:
      select = (selection_lib.select_hyperparameters if args.rho_grid is None else
                functools.partial(selection_lib.select_with_rho, rhos=args.rho_grid))
      selection = select(
          noisy, args.methods, args.sparsities, grids, validation=args.validation,
          seeds=range(args.select_seeds), root=pathlib.Path(args.workdir) / "select",
          data_dir=args.data_dir, method_overrides=per_method)
      selections[f"{noise:g}"] = selection
    data = datasets.load_dataset(noisy, args.data_dir)
    for sparsity in args.sparsities:
      for method in args.methods:
        for seed in args.seeds:
          config = noisy.replace(method=method, sparsity=sparsity, seed=seed,
                                 **per_method.get(method, {}),
                                 **selection_lib.chosen_overrides(selection, method, sparsity),
                                 **fixed.get(method, {}))
          results = sweeps.run_or_load(config, sweeps.run_dir(args.workdir, config), data=data,
                                       data_dir=args.data_dir, progress=True)
          runs.append({**sweeps.record(config, results),
                       "workdir": str(sweeps.run_dir(args.workdir, config))})
  markdown = table(runs, args.methods)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python " + " ".join(sys.argv)
  stem = (f"label_noise_{args.preset}" + ("_rescaled" if args.rescale_dual else "")
          + (f"_rho{args.rho:g}" if args.rho is not None else "")
          + ("_rhogrid" if args.rho_grid is not None else ""))
  harness.write_json(out / f"{stem}.json", {"command": command, "config": configs.to_dict(base), "selection": selections,
       "runs": runs,
       "versions": versions(), "wall_seconds": time.perf_counter() - start})
  listed = "".join(
      f"\n- noise {noise}: " + ", ".join(
          f"{k} {v:g}" + (f" (rho {sel['chosen_rho'][k]:g})" if k in sel.get("chosen_rho", {})
                          else "") for k, v in sel["chosen"].items())
      for noise, sel in selections.items())
  lambdas = ""
  if selections:
    first = next(iter(selections.values()))
    what = ("Lambda" if "rho_grid" not in first
            else f"Lambda and rho (from {first['rho_grid']})")
    where = (f" (chosen at {first['epochs']} epochs, `{first['file']}`)" if "file" in first
             else "")
    lambdas = (f"\n\n{what} chosen per noise ratio on {first['validation_examples']} held-out "
               f"training examples with equally noisy labels{where}:{listed}")
  (out / f"{stem}.md").write_text(
      f"Command: `{command}`\n\nClean test accuracy (%) after projection + BNT, trained on "
      f"symmetric label noise; mean ± s.e. over seeds {args.seeds}.\n\n{markdown}{lambdas}\n")
  print(markdown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
