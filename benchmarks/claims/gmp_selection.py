"""GMP tuned as the penalty methods are: its schedule's end chosen on the same validation split.

The sweeps choose SAFE's and ADMM's lambda on held-out training images and
run GMP with its defaults. This script gives GMP the same effort: for a
committed ``sweep.json`` (its config, sparsity and validation split), each
value of ``--end-grid`` (the fraction of training at which GMP reaches the
target sparsity) is trained on the training images minus the validation
split and scored on it; the best value (the smaller on a tie) is then run
for every seed on the test set. It writes a ``sweep.json``-shaped file whose
``selection`` records the grid, the choice and whether it sits at an edge:

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


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sweep", required=True, help="the committed sweep.json to match")
  parser.add_argument("--end-grid", type=float, nargs="+", required=True)
  parser.add_argument("--data-dir", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  committed = json.loads(pathlib.Path(args.sweep).read_text(encoding="utf-8"))
  sparsity, = {r["sparsity"] for r in committed["runs"]}
  seeds = sorted({r["seed"] for r in committed["runs"]})
  base = configs.from_dict(committed["config"]).replace(sparsity=sparsity)
  sel = committed["selection"]
  selection = select_end(base, args.end_grid, sel["seeds"], sel["validation_examples"],
                         pathlib.Path(args.workdir) / "selection", args.data_dir)
  chosen = selection["chosen"][f"gmp@{sparsity:g}"]
  runs = []
  for seed in seeds:
    config = base.replace(method="gmp", seed=seed, **{FIELD: chosen})
    results = sweeps.run_or_load(config, sweeps.run_dir(pathlib.Path(args.workdir), config),
                                 data=None, data_dir=args.data_dir)
    runs.append({**sweeps.record(config, results), FIELD: chosen})
  out = {"command": "python " + " ".join(sys.argv),
         "config": configs.to_dict(base.replace(method="gmp", **{FIELD: chosen})),
         "selection": selection, "runs": runs, "versions": versions(),
         "wall_seconds": time.perf_counter() - start}
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
  print(json.dumps({"chosen": chosen, "test": [r["accuracy"] for r in runs]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
