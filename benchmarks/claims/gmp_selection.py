"""GMP tuned as the penalty methods are: its schedule's end chosen on the same validation split.

The sweeps choose SAFE's and ADMM's lambda on held-out training images and
run GMP with its defaults. This script gives GMP the same effort: for a
committed ``sweep.json`` (its config, sparsities and validation split), each
value of ``--end-grid`` (the fraction of training at which GMP reaches the
target sparsity) is trained on the training images minus the validation
split and scored on it, per sparsity; the best value (the smaller on a tie)
is then run for every seed on the test set, at the budget of ``--test-sweep``
when given (the penalty methods' longer runs reuse the lambda chosen at the
selection budget in the same way), else at the selection sweep's. The update
interval stays the config's (declared fixed in ``benchmarks/claims/tuning.py``).
With ``--select-only`` no test run is made (the selections of every sparsity
first; a later call with the same ``--workdir`` reuses them for the test runs).
``--chosen-from EARLIER.json`` takes the ends an earlier output of this script
chose from the same validation runs instead of selecting again (a choice is
not remade on another machine, where floating point can order two close
values the other way): the test runs of the convergence check's other budget.
It writes a ``sweep.json``-shaped file whose ``selection`` records the grid,
the choice and whether it sits at an edge:

  python -m benchmarks.claims.gmp_selection \\
      --sweep results/sparse_set_995_small/sweep_60epochs.json --end-grid 0.5 0.75 0.9 \\
      --data-dir /usr/share/datasets/fashion-mnist --workdir /tmp/gmp_sel --out gmp.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Optional

import numpy as np

from safe_optax.experiment import versions
from safe_optax.vision import configs
from safe_optax.vision import sweeps
from benchmarks import harness

FIELD = "gmp_end_fraction"


def select_end(base: configs.Config, grid: list[float], seeds: list[int], validation: int,
               root: pathlib.Path, data_dir: str) -> dict[str, Any]:
  """Each end fraction scored by mean validation accuracy over ``seeds``; the best one chosen."""
  val_base = base.replace(validation=validation)
  rows = []
  for value in sorted(grid):
    runs = []
    for seed in seeds:
      config = val_base.replace(method="gmp", seed=seed, **{FIELD: value})
      # run_dir names a run by the settings sweeps vary, which do not include GMP's end.
      results = sweeps.run_or_load(config, sweeps.run_dir(root / f"end{value:g}", config),
                                   data=None, data_dir=data_dir)
      runs.append(sweeps.record(config, results))
    rows.append({"method": "gmp", "sparsity": base.sparsity, "field": FIELD, "value": value,
                 "validation_accuracy_mean": float(np.mean([r["accuracy"] for r in runs])),
                 "diverged": False, "runs": runs})
  best = max(rows, key=lambda r: (r["validation_accuracy_mean"], -r["value"]))["value"]
  return {"validation_examples": validation, "seeds": seeds,
          "criterion": "mean validation accuracy of the final sparse model", "grid": rows,
          "chosen": {f"gmp@{base.sparsity:g}": best}, "fields": {"gmp": FIELD}, "fixed": [],
          "at_grid_edge": [f"gmp@{base.sparsity:g}"] if best in (min(grid), max(grid)) else []}


def merge(selections: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
  """One selection record for several sparsities (each selected on its own)."""
  out = dict(selections[0], grid=[], chosen={}, at_grid_edge=[], epochs=epochs)
  for sel in selections:
    out["grid"] += sel["grid"]
    out["chosen"].update(sel["chosen"])
    out["at_grid_edge"] += sel["at_grid_edge"]
  return out


# Config fields that may differ between the selection's sweep and a test budget of the same settings.
# the fields a run's budget sets, beside its seed, sparsity and method: the claims' runs scale the
# warm-up with the epochs (LeNet-5's 60-epoch rows warm up for 2, its 30-epoch ones for 1), and an
# earlier output's config is its test runs' (the --test-sweep's budget), not its validation runs'
_BUDGET = ("epochs", "warmup_epochs", "eval_every", "seed", "sparsity", "method",
           "checkpoint_every", "log_every")


def earlier_problem(earlier: dict[str, Any], committed: dict[str, Any],
                    sparsities: list[float]) -> Optional[str]:
  """Why ``earlier`` (an output of this script) did not choose GMP's end from the validation runs
  of ``committed`` (the ``--sweep``) at every one of ``sparsities``; None if it did."""
  chosen = earlier.get("selection")
  if not chosen or not chosen.get("chosen"):
    return "it made no selection"
  sel = committed["selection"]
  if (chosen.get("epochs") != committed["config"]["epochs"]
      or chosen["validation_examples"] != sel["validation_examples"]
      or list(chosen["seeds"]) != list(sel["seeds"])):
    return ("it chose at another budget, validation split or selection seeds than the --sweep's "
            "validation runs")
  settings = [{k: v for k, v in configs.to_dict(configs.from_dict(c)).items() if k not in _BUDGET}
              for c in (earlier["config"], committed["config"])]
  if settings[0] != settings[1]:
    return "its settings differ from the --sweep's beyond the budget"
  missing = [s for s in sparsities if f"gmp@{s:g}" not in chosen["chosen"]]
  return f"it chose nothing at sparsities {missing}" if missing else None


def chosen_at(earlier: dict[str, Any], sparsity: float, file: str) -> dict[str, Any]:
  """``earlier``'s selection at one sparsity, in :func:`select_end`'s layout, naming its file."""
  sel = earlier["selection"]
  key = f"gmp@{sparsity:g}"
  return {**sel, "grid": [g for g in sel["grid"] if abs(g["sparsity"] - sparsity) < 1e-9],
          "chosen": {key: sel["chosen"][key]},
          "at_grid_edge": [k for k in sel["at_grid_edge"] if k == key], "file": file}


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sweep", required=True,
                      help="the committed sweep.json whose config and validation split select")
  parser.add_argument("--test-sweep", default=None,
                      help="the committed sweep.json whose config (budget) the test runs use")
  parser.add_argument("--end-grid", type=float, nargs="+", default=None,
                      help="the schedule ends scored on the validation split (or --chosen-from)")
  parser.add_argument("--sparsities", type=float, nargs="+", default=None,
                      help="only these of the test sweep's sparsities (default: all)")
  parser.add_argument("--chosen-from", default=None,
                      help="an earlier output of this script whose ends, chosen from the "
                           "--sweep's validation runs, the test runs use (no selection again)")
  parser.add_argument("--select-only", action="store_true",
                      help="only the selection runs; the file records no test run")
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  if (args.end_grid is None) == (args.chosen_from is None):
    parser.error("give --end-grid (select on the validation split) or --chosen-from (an earlier "
                 "selection), one of them")
  start = time.perf_counter()
  committed = json.loads(pathlib.Path(args.sweep).read_text(encoding="utf-8"))
  tested = (committed if args.test_sweep is None
            else json.loads(pathlib.Path(args.test_sweep).read_text(encoding="utf-8")))
  sparsities = sorted({r["sparsity"] for r in tested["runs"]})
  if args.sparsities is not None:
    missing = sorted(set(args.sparsities) - set(sparsities))
    if missing:
      parser.error(f"--sparsities {missing} are not among the test sweep's {sparsities}")
    sparsities = sorted(args.sparsities)
  earlier = None
  if args.chosen_from is not None:
    if args.select_only:
      parser.error("--chosen-from runs the test seeds of an earlier selection: drop --select-only")
    earlier = json.loads(pathlib.Path(args.chosen_from).read_text(encoding="utf-8"))
    problem = earlier_problem(earlier, committed, sparsities)
    if problem:
      parser.error(f"--chosen-from {args.chosen_from}: {problem}")
  seeds = sorted({r["seed"] for r in tested["runs"]})
  base = configs.from_dict(committed["config"])
  test_base = configs.from_dict(tested["config"])
  sel = committed["selection"]
  selections, runs = [], []
  for sparsity in sparsities:
    selection = (chosen_at(earlier, sparsity, args.chosen_from) if earlier is not None else
                 select_end(base.replace(sparsity=sparsity), args.end_grid, sel["seeds"],
                            sel["validation_examples"],
                            pathlib.Path(args.workdir) / "selection", args.data_dir))
    selections.append(selection)
    chosen = selection["chosen"][f"gmp@{sparsity:g}"]
    for seed in [] if args.select_only else seeds:
      config = test_base.replace(method="gmp", sparsity=sparsity, seed=seed, **{FIELD: chosen})
      folder = pathlib.Path(args.workdir) / f"test{test_base.epochs}ep-end{chosen:g}"
      results = sweeps.run_or_load(config, sweeps.run_dir(folder, config),
                                   data=None, data_dir=args.data_dir)
      runs.append({**sweeps.record(config, results), FIELD: chosen})
  out = {"command": "python " + " ".join(sys.argv),
         "config": configs.to_dict(test_base.replace(method="gmp")),
         "selection": merge(selections, base.epochs), "runs": runs, "versions": versions(),
         "wall_seconds": time.perf_counter() - start}
  harness.write_json(args.out, out)
  print(json.dumps({"chosen": {k: v for s in selections for k, v in s["chosen"].items()},
                    "test": [r["accuracy"] for r in runs]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
