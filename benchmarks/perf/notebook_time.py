"""Each notebook's time on the test's budget, compiled both ways the test suite can compile.

``tests/test_notebooks.py`` runs every notebook in ``notebooks/`` in a fresh kernel
with ``SAFE_OPTAX_NOTEBOOK_BUDGET=ci``. The suite compiles in a fast mode
(``JAX_DISABLE_MOST_OPTIMIZATIONS=1``, ``tests/conftest.py``): cheaper to compile,
slower to run. A notebook bound by execution runs faster compiled as a user's run
is; the test's ``XLA_OPTIMIZED`` names those, from this table.

For every notebook, the two modes run one after the other (fast first), each in
its own kernel, so both see the same machine load; the table gives each mode's
whole-notebook seconds, their ratio, and the slowest cell of each.

  python -m benchmarks.perf.notebook_time                       # every notebook
  python -m benchmarks.perf.notebook_time --notebooks llm_pruning.ipynb

Data sets come through ``safe_optax.data_paths`` (``SAFE_OPTAX_DATA``), as in the test.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import nbclient
import nbformat

from benchmarks import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "perf" / "results" / "notebook_time.json"
MODES = {"fast": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}, "optimized": {}}
BUDGET_ENV = {"SAFE_OPTAX_NOTEBOOK_BUDGET": "ci", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


def time_notebook(path: pathlib.Path, mode: str) -> tuple[dict, nbformat.NotebookNode]:
  """Runs ``path`` in a fresh kernel in ``mode``; (seconds per code cell and in all, the
  executed notebook; the file is not rewritten)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
  env.update(BUDGET_ENV, **MODES[mode])
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  cells = []
  start = time.perf_counter()
  with client.setup_kernel(env=env):
    for index, cell in enumerate(nb.cells):
      if cell.cell_type == "code":
        cell_start = time.perf_counter()
        client.execute_cell(cell, index)
        cells.append({"cell": index, "seconds": time.perf_counter() - cell_start})
  return {"notebook": path.name, "mode": mode, "seconds": time.perf_counter() - start,
          "cells": cells}, nb


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  names = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
  parser.add_argument("--notebooks", nargs="+", choices=names, default=names)
  parser.add_argument("--out", default=str(OUT))
  args = parser.parse_args()
  start = time.perf_counter()
  report = {"benchmark": "notebook_time", **harness.run_record(), "budget": "ci", "rows": []}
  print(f"{'notebook':>20} {'fast s':>8} {'optimized s':>12} {'opt/fast':>9}  slowest cells")
  for name in args.notebooks:
    runs = {mode: time_notebook(ROOT / "notebooks" / name, mode)[0] for mode in MODES}
    report["rows"].extend(runs.values())
    fast, optimized = runs["fast"]["seconds"], runs["optimized"]["seconds"]
    slowest = {m: max(r["cells"], key=lambda c: c["seconds"]) for m, r in runs.items()}
    print(f"{name:>20} {fast:>8.1f} {optimized:>12.1f} {optimized / fast:>8.2f}x  " +
          ", ".join(f"{m} cell {c['cell']} {c['seconds']:.0f} s" for m, c in slowest.items()),
          flush=True)
  harness.write_report(report, args.out, start)


if __name__ == "__main__":
  main()
