"""SAFE vs ADMM robustness table: clean / corrupted (sev 3, 5) / PGD accuracy and lambda_max.

Trains each (method, seed) with the vision trainer
(:func:`safe_optax.vision.train.train_and_evaluate`, final projection + BNT),
then runs :func:`safe_optax.vision.evaluation.evaluate_workdir` on it, and
writes one table (mean +- s.e. over seeds) to ``--out``. Finished runs and
corruption sets are reused from ``--workdir``.

With ``--validation N`` each method's lambda is first chosen on N held-out
training examples (:func:`safe_optax.vision.selection.select_hyperparameters`;
the test set is never looked at) over ``--safe-grid`` / ``--admm-grid``; the
output JSON records the selection and the report reads it. ``--chosen-from FILE``
takes the lambdas an earlier output chose instead (the same settings at another
budget: the longer run of the report's convergence rule), and records that
selection with the budget it was made at.

  python -m benchmarks.claims.robustness_mnist --preset mlp-mnist --data-dir ../shared/data/mnist \\
      --test-only-split 8000 2000 --epochs 20 --seeds 0 --out results/robustness_mnist
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Optional

from safe_optax.experiment import mean_se, versions
from safe_optax.vision import configs
from safe_optax.vision import evaluation
from safe_optax.vision import selection as selection_lib
from safe_optax.vision import sweeps
from safe_optax.vision import train
from safe_optax.vision import datasets
from safe_optax.vision import workdirs
from benchmarks import harness


def _cell(values: list[Optional[float]]) -> str:
  """Mean ± s.e. in percent over the finished runs; a diverged run (None) is counted beside it."""
  finished = [100 * v for v in values if v is not None]
  lost = f" ({len(values) - len(finished)} of {len(values)} diverged)" if len(finished) < len(values) else ""
  if not finished:
    return "diverged"
  mean, se = mean_se(finished)
  return (f"{mean:.2f}" if se is None else f"{mean:.2f} ± {se:.2f}") + lost


def table(evals: dict[str, list[dict[str, Any]]]) -> str:
  """Rows: methods; columns: clean, corrupted sev 3 / 5, PGD l_inf / l_2 (percent)."""
  columns = [("clean", lambda e: e["clean"]),
             ("corrupted sev 3", lambda e: e["corruptions"]["mean"]["3"]),
             ("corrupted sev 5", lambda e: e["corruptions"]["mean"]["5"]),
             ("PGD l_inf 1/255", lambda e: e["pgd-linf"]["adversarial"]),
             ("PGD l_2 3/255", lambda e: e["pgd-l2"]["adversarial"])]
  lines = ["| method | " + " | ".join(c for c, _ in columns) + " | lambda_max (support) |",
           "|---|" + "---|" * (len(columns) + 1)]
  for method, runs in evals.items():
    finished = [e for e in runs if "diverged" not in e]
    lam = mean_se([e["hessian"]["lambda_max_support"] for e in finished]) if finished else None
    lam_text = ("–" if lam is None else
                f"{lam[0]:.3g}" + ("" if lam[1] is None else f" ± {lam[1]:.2g}"))
    lines.append(f"| {method} | " + " | ".join(
        _cell([None if "diverged" in e else fn(e) for e in runs]) for _, fn in columns)
                 + f" | {lam_text} |")
  return "\n".join(lines)


def earlier_selection(path: str, base: configs.Config, args: argparse.Namespace,
                      per_method: dict[str, dict[str, Any]]
                      ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
  """An earlier output's selection, with the budget it was made at; or why it is not this run's."""
  earlier = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  selection = earlier.get("selection")
  if selection is None:
    return None, "it made no validation selection"
  if abs(earlier["sparsity"] - args.sparsity) > 1e-12:
    return None, f"it chose at sparsity {earlier['sparsity']:g}, not {args.sparsity:g}"
  problem = selection_lib.transfer_problem(earlier, selection, base, args.methods,
                                           [args.sparsity], per_method)
  if problem:
    return None, problem
  return {**selection, "epochs": earlier["config"]["epochs"], "file": path}, None


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="mlp-mnist", choices=sorted(configs.PRESETS))
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--test-only-split", type=int, nargs=2, default=None)
  parser.add_argument("--methods", nargs="+", default=["safe", "admm"])
  parser.add_argument("--sparsity", type=float, default=0.9)
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--warmup-epochs", type=int, default=1)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--corruption-subset", type=int, default=1000)
  parser.add_argument("--validation", type=int, default=None,
                      help="choose lambda on N held-out training examples (default: the "
                           "preset's lambdas, no selection)")
  parser.add_argument("--select-seeds", type=int, default=1)
  parser.add_argument("--safe-grid", type=float, nargs="+", default=None,
                      help="with --validation: lambdas tried for the SAFE family")
  parser.add_argument("--admm-grid", type=float, nargs="+", default=None,
                      help="with --validation: lambdas tried for ADMM")
  parser.add_argument("--chosen-from", default=None,
                      help="an earlier output JSON of this script whose validation selection "
                           "gives the lambdas (same preset, split and settings but the epochs)")
  parser.add_argument("--rescale-dual", action="store_true",
                      help="SAFE-family methods keep the unscaled dual while the penalty ramps "
                           "(safe_optax.safe(rescale_dual=True))")
  parser.add_argument("--workdir", default="/tmp/safe_optax_robustness")
  parser.add_argument("--out", default="results/robustness_mnist")
  args = parser.parse_args(argv)
  grids = {"safe": args.safe_grid, "admm": args.admm_grid}
  if args.chosen_from is not None and args.validation is not None:
    parser.error("--chosen-from takes an earlier selection: drop --validation and the grids")
  if args.validation is None and any(grids.values()):
    parser.error("--safe-grid / --admm-grid are chosen from on a validation split: pass "
                 "--validation N")
  if args.validation is not None:
    missing = [f"--{m}-grid" for m in ("safe", "admm") if m in args.methods and not grids[m]]
    if missing:
      parser.error(f"--validation chooses each method's lambda: give {' and '.join(missing)}")
  start = time.perf_counter()
  overrides = {"epochs": args.epochs, "warmup_epochs": args.warmup_epochs}
  if args.test_only_split:
    overrides["test_only_split"] = tuple(args.test_only_split)
  base = configs.get_config(args.preset, **overrides)
  per_method = selection_lib.rescaled_dual(args.methods, args.rescale_dual)
  selection = None
  if args.chosen_from is not None:
    selection, problem = earlier_selection(args.chosen_from, base, args, per_method)
    if problem:
      parser.error(f"--chosen-from {args.chosen_from}: {problem}")
  elif args.validation is not None:
    selection = selection_lib.select_hyperparameters(
        base, args.methods, [args.sparsity],
        {m: grids["admm" if m == "admm" else "safe"] for m in sweeps.PENALTY_METHODS},
        validation=args.validation, seeds=range(args.select_seeds),
        root=pathlib.Path(args.workdir) / "select", data_dir=args.data_dir,
        method_overrides=per_method)
  data = datasets.load_dataset(base, args.data_dir)
  evals: dict[str, list[dict[str, Any]]] = {}
  for method in args.methods:
    for seed in args.seeds:
      config = base.replace(method=method, sparsity=args.sparsity, seed=seed,
                            **per_method.get(method, {}),
                            **selection_lib.chosen_overrides(selection, method, args.sparsity))
      run_dir = (sweeps.run_dir(args.workdir, config) if selection is not None else
                 pathlib.Path(args.workdir) / f"{method}-s{args.sparsity:g}-seed{seed}")
      print(f"{method} seed {seed}", file=sys.stderr, flush=True)
      try:
        outcome = train.train_and_evaluate(config, run_dir, data_dir=args.data_dir,
                                           dataset=data, progress=True)
      except workdirs.TrainingDiverged as err:
        # A result (the report scores it as chance), not a crash: a rerun diverges again.
        print(f"  {err}", file=sys.stderr, flush=True)
        evals.setdefault(method, []).append({"config": configs.to_dict(config),
                                             "diverged": sweeps.divergence(err)})
        continue
      record = evaluation.evaluate_workdir(
          run_dir, data_dir=args.data_dir, dataset=data,
          corruption_subset=args.corruption_subset,
          cache_dir=pathlib.Path(args.workdir) / "corruptions")
      record["constraint_distance"] = sweeps.convergence(outcome.results)["constraint_distance"]
      evals.setdefault(method, []).append(record)
  markdown = table(evals)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python " + " ".join(sys.argv)
  stem = f"robustness_{args.preset}"
  harness.write_json(out / f"{stem}.json", {"command": command, "config": configs.to_dict(base), "sparsity": args.sparsity,
       "seeds": args.seeds, "selection": selection, "versions": versions(), "evals": evals, "wall_seconds": time.perf_counter() - start})
  (out / f"{stem}.md").write_text(
      f"Command: `{command}`\n\nAccuracy (%) of the sparse model after projection + BNT, "
      f"mean ± s.e. over seeds {args.seeds}; corruptions on the first "
      f"{args.corruption_subset} test images.\n\n{markdown}\n")
  print(markdown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
