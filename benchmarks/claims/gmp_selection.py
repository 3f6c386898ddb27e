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
It writes a ``sweep.json``-shaped file whose ``selection`` records the grid,
the choice and whether it sits at an edge:

  python benchmarks/claims/gmp_selection.py \\
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


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sweep", required=True,
                      help="the committed sweep.json whose config and validation split select")
  parser.add_argument("--test-sweep", default=None,
                      help="the committed sweep.json whose config (budget) the test runs use")
  parser.add_argument("--end-grid", type=float, nargs="+", required=True)
  parser.add_argument("--sparsities", type=float, nargs="+", default=None,
                      help="only these of the test sweep's sparsities (default: all)")
  parser.add_argument("--select-only", action="store_true",
                      help="only the selection runs; the file records no test run")
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
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
  seeds = sorted({r["seed"] for r in tested["runs"]})
  base = configs.from_dict(committed["config"])
  test_base = configs.from_dict(tested["config"])
  sel = committed["selection"]
  selections, runs = [], []
  for sparsity in sparsities:
    selection = select_end(base.replace(sparsity=sparsity), args.end_grid, sel["seeds"],
                           sel["validation_examples"],
                           pathlib.Path(args.workdir) / "selection", args.data_dir)
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
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
  print(json.dumps({"chosen": {k: v for s in selections for k, v in s["chosen"].items()},
                    "test": [r["accuracy"] for r in runs]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
