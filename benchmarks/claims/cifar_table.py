"""Table 5 (CIFAR-10, ResNet-20x2) assembled across short GPU leases, in packs of seeds.

Each lease runs, in order:

1. ``benchmarks/perf/cifar_pack_throughput.py`` (its JSON is ``--throughput``):
   the measured step time of a pack of ``--pack`` runs;
2. this script: the table's cells (``--methods`` x ``--sparsities``, each a pack
   of the ``--seeds``) not yet in ``--table``, in order, :func:`plan`\\ ned
   against the time left before ``--deadline-s`` with that step time. With
   ``--layout auto`` (the default) a cell's seeds train as one pack, as lone
   runs one after another, or as lone runs in as many processes at once,
   whichever trains a cell from scratch soonest (:func:`cell_seconds`: the
   benchmark's step times, :func:`layout_seconds`, and ``--start-s`` plus
   ``--finish-s`` outside the steps, which lone runs pay in turn); a lone run is
   :func:`safe_optax.vision.train.train_and_evaluate`, which checkpoints every
   epoch, and ``processes`` starts one ``--layout lone`` child of this script
   per seed and merges the runs they finish. Each pack
   is trained by :func:`safe_optax.vision.packing.train_packed` in
   ``--runs/<method>-s<sparsity>-seed<seed>`` (the ``sweep`` command's folders),
   checkpointing every ``--checkpoint-seconds`` (a lease cut short loses at
   most about that much) and stopping with a checkpoint at the deadline; the
   next lease resumes it from those checkpoints (``--bundle DIR`` packs what
   the unfinished runs need into parts a device call can return,
   ``--resume-from DIR`` unpacks them on the next machine);
3. after every finished pack, :func:`merge` adds its runs to ``--table``
   (``results/cifar10_resnet20x2/table5.json``): per run the sweep record
   (accuracy after the final projection and BNT, seed, epochs, device), per
   cell the seeds, the epoch budget and mean +- s.e.; a run of another budget
   or config replaces none of a different key.

The step time of SAFE (SAM's two passes) bounds ADMM's and GMP's (one pass),
so the plan errs on the safe side for them.

Usage (from the repository root on the GPU machine, after the benchmark)::

  python -m benchmarks.claims.cifar_table --data-dir DATA --runs RUNS \\
      --throughput benchmarks/perf/results/cifar_pack_throughput_gpu.json \\
      --table results/cifar10_resnet20x2/table5.json --deadline-s 600
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import pathlib
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from typing import Any, Optional

REPO = pathlib.Path(__file__).resolve().parents[2]
from safe_optax import experiment
from safe_optax.vision import configs
from safe_optax.vision import sweeps
from benchmarks import harness

PRESET = "resnet20x2-cifar10"
MODEL = "resnet20x2"
LAYOUTS = ("pack", "lone", "processes")


def step_seconds(throughput: dict[str, Any], model: str, dtype: str, runs: int,
                 conv_impl: str = "xla") -> float:
  """Seconds of one packed step (dual updates averaged in) of ``runs`` runs, as measured.

  The cell of ``runs`` runs, else the smallest measured pack above it, else
  the largest below scaled up linearly (a pack's step grows at most that fast).

  Raises:
    ValueError: the benchmark has no cell of ``model`` and ``dtype``.

  Examples:
    >>> bench = {"cells": [{"model": "m", "dtype": "float32", "runs": r, "mean_step_ms": ms}
    ...                    for r, ms in ((1, 10.0), (6, 30.0))]}
    >>> step_seconds(bench, "m", "float32", 6), step_seconds(bench, "m", "float32", 3)
    (0.03, 0.03)
    >>> round(step_seconds(bench, "m", "float32", 9), 6)
    0.045
  """
  cells = _seconds_by_runs(_packs(throughput, model, dtype, conv_impl))
  if not cells:
    raise ValueError(f"the throughput JSON has no measured cell of model {model!r}, dtype "
                     f"{dtype!r}, conv_impl {conv_impl!r}; run "
                     "python -m benchmarks.perf.cifar_pack_throughput first.")
  above = [r for r in cells if r >= runs]
  if above:
    return cells[min(above)]
  largest = max(cells)
  return cells[largest] * runs / largest


def read_throughput(paths: Sequence[str], batch: int) -> dict[str, Any]:
  """The cells of ``cifar_pack_throughput.py``'s JSONs at ``paths``, together, in the order
  given (where two files measure the same cell, the later one counts: pass the newest last),
  leaving out the files measured at another ``--batch`` than the table's runs (a lone run at
  batch 2048 is not a lone run of the table); a CPU dry run (any batch) is kept as the check
  it is."""
  cells = []
  for path in paths:
    report = json.loads(pathlib.Path(path).read_text())
    measured = report.get("settings", {}).get("batch", batch)
    if measured != batch and not report.get("dry_run"):
      print(f"--throughput {path}: measured at batch {measured}, not the runs' {batch}: "
            "left out", flush=True)
      continue
    cells += report["cells"]
  return {"cells": cells}


def _cells(throughput: dict[str, Any], model: str, dtype: str, conv_impl: str,
           layout: str) -> list[dict[str, Any]]:
  """The measured cells of ``model``, ``dtype``, ``conv_impl`` (files older than the flag:
  ``xla``) and ``layout`` (``pack`` or ``processes``)."""
  return [c for c in throughput["cells"] if c.get("model") == model and c.get("dtype") == dtype
          and c.get("conv_impl", "xla") == conv_impl and "mean_step_ms" in c
          and c.get("layout", "pack") == layout]


def _seconds_by_runs(cells: Sequence[dict[str, Any]]) -> dict[int, float]:
  """Seconds of one step per run count of ``cells``; where several cells measured the same
  count (files of several leases), the last one read counts (:func:`read_throughput`).

  Examples:
    >>> _seconds_by_runs([{"runs": 1, "mean_step_ms": 9.0}, {"runs": 1, "mean_step_ms": 8.0}])
    {1: 0.008}
  """
  return {c["runs"]: c["mean_step_ms"] / 1e3 for c in cells}


def _packs(throughput: dict[str, Any], model: str, dtype: str,
           conv_impl: str = "xla") -> list[dict[str, Any]]:
  """The measured pack cells (not ``--processes`` ones) of ``model``, ``dtype``, ``conv_impl``."""
  return _cells(throughput, model, dtype, conv_impl, "pack")


def layout_seconds(throughput: dict[str, Any], model: str, dtype: str, runs: int,
                   mps: bool = False, conv_impl: str = "xla") -> dict[str, float]:
  """Seconds to move all ``runs`` runs of a cell one step on, per layout measured.

  ``pack``: one step of the pack of ``runs`` (:func:`step_seconds`); ``lone``:
  ``runs`` steps of the lone program, the runs trained one after another, where
  the benchmark measured the lone program (its pack of one); ``processes``:
  the span of one step of ``runs`` lone runs in as many processes at once,
  where a ``--processes`` cell of at least ``runs`` was measured with the MPS
  daemon running as it does now (``mps``) or not.

  Examples:
    >>> bench = {"cells": [{"model": "m", "dtype": "float32", "runs": r, "mean_step_ms": ms}
    ...                    for r, ms in ((1, 10.0), (3, 50.0))]}
    >>> layout_seconds(bench, "m", "float32", 3)
    {'pack': 0.05, 'lone': 0.03}
    >>> bench["cells"].append({"model": "m", "dtype": "float32", "runs": 3, "mean_step_ms": 20.0,
    ...                        "layout": "processes", "mps_daemon": True})
    >>> layout_seconds(bench, "m", "float32", 3, mps=True)["processes"]
    0.02
    >>> sorted(layout_seconds(bench, "m", "float32", 3, mps=False))  # measured under MPS only
    ['lone', 'pack']
  """
  seconds = {"pack": step_seconds(throughput, model, dtype, runs, conv_impl)}
  lone = _seconds_by_runs(_packs(throughput, model, dtype, conv_impl)).get(1)
  if lone is not None:
    seconds["lone"] = runs * lone
  processes = _seconds_by_runs(
      [c for c in _cells(throughput, model, dtype, conv_impl, "processes")
       if c["runs"] >= runs and bool(c.get("mps_daemon")) == mps])
  if processes:
    seconds["processes"] = processes[min(processes)]
  return seconds


def cell_seconds(seconds: dict[str, float], steps: int, runs: int,
                 overhead_s: float) -> dict[str, float]:
  """Seconds to train a cell of ``runs`` runs of ``steps`` steps, per layout of ``seconds``
  (:func:`layout_seconds`), with ``overhead_s`` per pack or lone run outside its steps
  (lone runs pay it in turn, a pack or processes once).

  Examples:
    >>> cell_seconds({"pack": 0.05, "lone": 0.03}, 100, 3, 10.0)  # a short run: the pack
    {'pack': 15.0, 'lone': 33.0}
    >>> cell_seconds({"pack": 0.05, "lone": 0.03}, 10_000, 3, 10.0)
    {'pack': 510.0, 'lone': 330.0}
  """
  return {name: per_step * steps + overhead_s * in_turn(name, runs)
          for name, per_step in seconds.items()}


def in_turn(layout: str, runs: int) -> int:
  """How many times a cell of ``runs`` runs pays a run's start and finish: lone runs one
  after another each pay them, a pack or processes at once pay them once."""
  return runs if layout == "lone" else 1


def choose_layout(seconds: dict[str, float], layout: str) -> str:
  """``layout``, or for ``auto`` the measured layout that takes the runs on fastest.

  Examples:
    >>> choose_layout({"pack": 0.05, "lone": 0.03}, "auto"), choose_layout({"pack": 0.05}, "auto")
    ('lone', 'pack')
    >>> choose_layout({"pack": 0.05}, "lone")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --layout lone: the throughput JSON has no lone-program cell (pack of 1) ...
  """
  if layout not in ("auto", *LAYOUTS):
    raise ValueError(f"--layout must be one of {['auto', *LAYOUTS]}, got {layout!r}")
  if layout == "auto":
    return min(seconds, key=seconds.get)
  if layout not in seconds:
    what = {"lone": "lone-program cell (pack of 1)",
            "processes": "--processes cell of at least this many runs, with the MPS daemon "
                         "running as it is now or not,"}[layout]
    raise ValueError(f"--layout {layout}: the throughput JSON has no {what} of this model and "
                     f"dtype; measured: {sorted(seconds)}")
  return layout


def plan(packs: Sequence[dict[str, Any]], seconds_per_step: float, budget_s: float,
         finish_s: float, start_s: float = 0.0) -> list[dict[str, Any]]:
  """The packs to train in ``budget_s`` seconds, in order, each with its expected seconds.

  Args:
    packs: ``{"steps_left": int, ...}`` per pack, in the table's order.
    seconds_per_step: one packed step, measured.
    budget_s: seconds left in the lease.
    finish_s: seconds a finished pack spends after its last step (final
      projection, BNT, evaluation and files of each run).
    start_s: seconds a pack spends before its first step (compiling its
      programs, a child's data, restoring a checkpoint).

  Returns:
    The packs that finish in the budget, each with ``expected_s`` and
    ``finishes=True``, then at most one more that starts and is stopped at the
    deadline (``finishes=False``, resumed by the next lease) when more than a
    minute of steps is left for it after its start.

  Examples:
    >>> [p["finishes"] for p in plan([{"steps_left": 100}] * 3, 1.0, 250, 10)]
    [True, True]
    >>> [p["finishes"] for p in plan([{"steps_left": 100}] * 3, 1.0, 300, 10)]
    [True, True, False]
    >>> [p["finishes"] for p in plan([{"steps_left": 100}] * 3, 1.0, 300, 10, start_s=30)]
    [True, True]
  """
  chosen, left = [], budget_s
  for pack in packs:
    need = start_s + pack["steps_left"] * seconds_per_step + finish_s
    if need <= left:
      chosen.append({**pack, "expected_s": need, "finishes": True})
      left -= need
      continue
    if left - start_s > 60:
      chosen.append({**pack, "expected_s": left, "finishes": False})
    break
  return chosen


def run_name(method: str, sparsity: float, seed: int) -> str:
  """The folder of a run, as the ``sweep`` command names it."""
  return f"{method}-s{sparsity:g}-seed{seed}"


def merge(table: dict[str, Any], finished: Sequence[dict[str, Any]],
          sparsities: Sequence[float]) -> dict[str, Any]:
  """``table`` with the run records ``finished`` added (a record of the same run replaces its
  old one), and its cells recomputed.

  Args:
    table: ``{"runs": {name: record}, ...}`` (``{}`` for a new table).
    finished: :func:`safe_optax.vision.sweeps.record` dicts with ``name``,
      ``epochs`` and ``device``.
    sparsities: the table's columns.

  Returns:
    ``{"runs", "cells", "markdown"}``: per cell (method, sparsity) the seeds,
    the epoch budgets of its runs and the mean +- s.e. of the accuracy.

  Examples:
    >>> rec = lambda seed, acc: {"name": f"safe-s0.9-seed{seed}", "method": "safe",
    ...                          "sparsity": 0.9, "seed": seed, "accuracy": acc, "epochs": 200}
    >>> t = merge({}, [rec(0, 0.9)], [0.9])
    >>> t = merge(t, [rec(1, 0.92), rec(0, 0.94)], [0.9])
    >>> [(c["seeds"], c["epochs"], round(c["accuracy_mean"], 2)) for c in t["cells"]]
    [([0, 1], [200], 0.93)]
  """
  runs = dict(table.get("runs", {}))
  for record in finished:
    runs[record["name"]] = record
  ordered = [runs[k] for k in sorted(runs)]
  summary = sweeps.summarize(ordered, sparsities)
  for cell in summary["rows"]:
    members = [r for r in ordered if r["method"] == cell["method"] and (
        cell["method"] == "dense" or math.isclose(r["sparsity"], cell["sparsity"]))]
    cell["epochs"] = sorted({r["epochs"] for r in members})
  return {"runs": runs, "cells": summary["rows"], "markdown": summary["markdown"]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
  """Per cell in both tables, accuracy ``a - b`` (points) paired by seed, under the report's rules.

  For two tables of the same runs in two settings (float32 and bfloat16, say):
  the mean and s.e. of the per-seed differences, and the evidence report's
  verdict on them (``level``: within ``HOLD_SE`` standard errors, that is,
  within seed noise).

  Examples:
    >>> rec = lambda seed, acc: {"method": "safe", "sparsity": 0.9, "seed": seed, "accuracy": acc}
    >>> a = {"runs": {str(s): rec(s, v) for s, v in enumerate((0.900, 0.910, 0.905))}}
    >>> b = {"runs": {str(s): rec(s, v) for s, v in enumerate((0.902, 0.906, 0.906))}}
    >>> [(r["seeds"], round(r["difference_mean"], 2), r["verdict"]) for r in compare(a, b)]
    [([0, 1, 2], 0.03, 'level')]
  """
  from benchmarks import report  # pylint: disable=import-outside-toplevel
  def by_cell(table):
    cells: dict[tuple[str, float], dict[int, float]] = {}
    for r in table.get("runs", {}).values():
      cells.setdefault((r["method"], round(r["sparsity"], 6)), {})[r["seed"]] = 100 * r["accuracy"]
    return cells
  cells_a, cells_b = by_cell(a), by_cell(b)
  rows = []
  for key in sorted(set(cells_a) & set(cells_b)):
    seeds = sorted(set(cells_a[key]) & set(cells_b[key]))
    if not seeds:
      continue
    diffs = report.paired(cells_a[key], cells_b[key])
    st = report.stat(diffs)
    rows.append({"method": key[0], "sparsity": key[1], "seeds": seeds,
                 "a_mean": report.stat([cells_a[key][s] for s in seeds]).mean,
                 "b_mean": report.stat([cells_b[key][s] for s in seeds]).mean,
                 "difference_mean": st.mean, "difference_se": st.se,
                 "verdict": report.verdict(diffs)})
  return rows


BUNDLE = "runs_bundle"
PART_BYTES = 15 * 2**20  # under the 16 MiB a device call returns per file


def bundle_runs(root: pathlib.Path, names: Sequence[str], out: pathlib.Path,
                part_bytes: int = PART_BYTES) -> Optional[dict[str, Any]]:
  """Packs what the unfinished runs ``names`` under ``root`` need to resume into ``out``.

  Per run: ``config.json``, ``metrics.jsonl`` and the newest checkpoint step
  (the folder ``checkpoints/<step>``; older steps are left out). The tar.gz is
  cut into parts of at most ``part_bytes`` (``runs_bundle.part00``, ...), and
  ``runs_bundle.json`` lists the parts with their SHA-256 and the runs with
  their steps. Runs with no folder are skipped; ``None`` when none is left.
  """
  steps = {}
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for name in names:
      folder = root / name
      if not folder.is_dir():
        continue
      numbered = [int(p.name) for p in (folder / "checkpoints").glob("*") if p.name.isdigit()]
      steps[name] = max(numbered) if numbered else None
      for item in ("config.json", "metrics.jsonl"):
        if (folder / item).exists():
          tar.add(folder / item, arcname=f"{name}/{item}")
      if numbered:
        tar.add(folder / "checkpoints" / str(steps[name]),
                arcname=f"{name}/checkpoints/{steps[name]}")
  if not steps:
    return None
  data = buffer.getvalue()
  out.mkdir(parents=True, exist_ok=True)
  parts = []
  for i, start in enumerate(range(0, len(data), part_bytes)):
    chunk = data[start:start + part_bytes]
    (out / f"{BUNDLE}.part{i:02d}").write_bytes(chunk)
    parts.append({"name": f"{BUNDLE}.part{i:02d}", "bytes": len(chunk),
                  "sha256": hashlib.sha256(chunk).hexdigest()})
  manifest = {"parts": parts, "steps": steps}
  harness.write_json(out / f"{BUNDLE}.json", manifest)
  return manifest


def unbundle_runs(source: pathlib.Path, root: pathlib.Path) -> dict[str, Any]:
  """Unpacks :func:`bundle_runs`'s parts in ``source`` into ``root`` (their runs resume there).

  Raises:
    ValueError: a part is missing or its SHA-256 differs (the message names it),
      or a run's folder under ``root`` already holds a newer checkpoint.
  """
  manifest_path = source / f"{BUNDLE}.json"
  if not manifest_path.exists():
    raise ValueError(f"--resume-from: no {BUNDLE}.json in {source}")
  manifest = json.loads(manifest_path.read_text())
  chunks = []
  for part in manifest["parts"]:
    path = source / part["name"]
    if not path.exists():
      raise ValueError(f"--resume-from: part {part['name']} is missing from {source}")
    chunk = path.read_bytes()
    if hashlib.sha256(chunk).hexdigest() != part["sha256"]:
      raise ValueError(f"--resume-from: part {part['name']} does not match its SHA-256")
    chunks.append(chunk)
  for name, step in manifest["steps"].items():
    here = sweeps.checkpoint_step(root / name)
    if here is not None and step is not None and here > step:
      raise ValueError(f"--resume-from: {root / name} already holds step {here}, newer than "
                       f"the bundle's {step}")
  root.mkdir(parents=True, exist_ok=True)
  with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r:gz") as tar:
    harness.extract_tar(tar, root, "--resume-from: the bundle")
  return manifest


def _deadline_guard(deadline: float):
  def on_step(step: int) -> None:
    del step
    if time.monotonic() > deadline:
      raise KeyboardInterrupt
  return on_step


def main(argv: Optional[list[str]] = None) -> None:
  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import checkpoint as checkpoint_lib
  from safe_optax.vision import datasets
  from safe_optax.vision import input_pipeline
  from safe_optax.vision import packing
  from safe_optax.vision import train as train_lib
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data-dir")
  parser.add_argument("--runs", help="run folders (kept between leases)")
  parser.add_argument("--table", default="results/cifar10_resnet20x2/table5.json")
  parser.add_argument("--throughput", nargs="+",
                      help="cifar_pack_throughput.py's JSON (several: their cells together; "
                           "where two measure the same cell, the later one counts: pass the "
                           "newest last)")
  parser.add_argument("--deadline-s", type=float)
  parser.add_argument("--finish-s", type=float, default=60.0,
                      help="seconds a pack (a lone run) spends after its last step")
  parser.add_argument("--start-s", type=float, default=30.0,
                      help="seconds a pack (a lone run) spends before its first step: compiling, "
                           "a child's data (what a run spent outside its steps: its wall_seconds "
                           "against steady_images_per_second, e.g. in benchmarks/perf/results/"
                           "leases/2026-11-28_h200_table_safe_bfloat16_partial.json)")
  parser.add_argument("--methods", nargs="+", default=["safe", "admm", "gmp"])
  parser.add_argument("--sparsities", nargs="+", type=float, default=[0.9])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--epochs", type=int, default=None, help="default: the preset's (200)")
  parser.add_argument("--dtype", default="float32", choices=configs.DTYPES)
  parser.add_argument("--conv-impl", default="xla", choices=configs.CONV_IMPLS,
                      help="the models' convolutions; the plan reads that conv_impl's cells")
  parser.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS],
                      help="a cell's seeds as one pack, as lone runs one after another, or as "
                           "lone runs in as many processes at once; auto: whichever trains a "
                           "cell soonest by the throughput JSON, --start-s and --finish-s")
  parser.add_argument("--checkpoint-seconds", type=float, default=60.0)
  parser.add_argument("--resume-from", type=pathlib.Path, default=None,
                      help="a folder with an earlier lease's --bundle parts: unpacked into "
                           "--runs first")
  parser.add_argument("--bundle", type=pathlib.Path, default=None,
                      help="at the end, pack what the unfinished runs need to resume into this "
                           "folder (parts under 16 MiB, for a device call to return)")
  parser.add_argument("--train-subset", type=int, default=None, help="CPU dry runs only")
  parser.add_argument("--test-subset", type=int, default=None, help="CPU dry runs only")
  parser.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("A", "B"), default=None,
                      help="only compare two table JSONs (A - B per cell, paired by seed); "
                           "trains nothing")
  args = parser.parse_args(argv)
  if args.compare is not None:
    rows = compare(*(json.loads(path.read_text()) for path in args.compare))
    print(json.dumps(rows, indent=1))
    return
  missing = [f"--{k.replace('_', '-')}" for k in ("data_dir", "runs", "throughput", "deadline_s")
             if getattr(args, k) is None]
  if missing:
    parser.error(f"the following arguments are required to train: {', '.join(missing)}")
  for flag in ("start_s", "finish_s"):
    if getattr(args, flag) < 0:
      parser.error(f"--{flag.replace('_', '-')} must be >= 0 seconds, got {getattr(args, flag)}")
  base = configs.get_config(PRESET, epochs=args.epochs, dtype=args.dtype,
                            conv_impl=args.conv_impl,
                            train_subset=args.train_subset, test_subset=args.test_subset,
                            bnt_samples=min(10_000, args.train_subset or 10_000))
  # the layout before the data: a --layout the benchmark did not measure fails at once
  from benchmarks.perf.cifar_pack_throughput import mps_daemon_running, share_device
  throughput = read_throughput(args.throughput, base.batch_size)
  seconds = layout_seconds(throughput, MODEL, args.dtype, len(args.seeds),
                           mps=mps_daemon_running(), conv_impl=args.conv_impl)
  layout = choose_layout(seconds, args.layout)  # refuses an unmeasured --layout at once
  if "processes" in (seconds if args.layout == "auto" else [layout]):
    share_device(len(args.seeds))  # before this process first uses the device (versions, data)
  start = time.monotonic()
  deadline = start + args.deadline_s
  table_path = pathlib.Path(args.table)
  table = json.loads(table_path.read_text()) if table_path.exists() else {}
  root = pathlib.Path(args.runs)
  if args.resume_from is not None:
    print(f"resuming {unbundle_runs(args.resume_from, root)['steps']}", flush=True)
  data = datasets.load_dataset(base, args.data_dir)
  spe = input_pipeline.num_batches(len(data.train_labels), base.batch_size)
  if args.layout == "auto":  # the layout that trains a cell from scratch soonest, start included
    layout = choose_layout(cell_seconds(seconds, base.epochs * spe, len(args.seeds),
                                        args.start_s + args.finish_s), "auto")
  finished_runs = table.get("runs", {})
  packs = []
  for s in args.sparsities:
    for method in args.methods:
      names = [run_name(method, s, seed) for seed in args.seeds]
      if all(n in finished_runs for n in names):
        continue
      done = [sweeps.checkpoint_step(root / n) or 0 for n in names]
      # a pack's runs are at one step; lone runs each at their own, one after another, or
      # all at once in processes (the furthest behind sets the time)
      left = [base.epochs * spe - d for n, d in zip(names, done) if n not in finished_runs]
      steps_left = {"pack": base.epochs * spe - done[0], "lone": sum(left),
                    "processes": max(left)}[layout]
      packs.append({"method": method, "sparsity": s, "names": names, "steps_left": steps_left})
  per_step = seconds["lone"] / len(args.seeds) if layout == "lone" else seconds[layout]
  each = in_turn(layout, len(args.seeds))
  chosen = plan(packs, per_step, deadline - time.monotonic(), args.finish_s * each,
                args.start_s * each)
  print(json.dumps({"layout": layout, "seconds_per_step_of_all_runs": seconds,
                    "seconds_per_step": per_step, "plan": chosen}, indent=1), flush=True)
  device = experiment.versions()["device_kind"]
  for pack in chosen:
    runs = [base.replace(method=pack["method"], sparsity=pack["sparsity"], seed=seed)
            for seed in args.seeds]
    if layout == "processes":
      if time.monotonic() > deadline:
        break
      table = _train_in_processes(args, pack, root, table, table_path, deadline)
      continue
    try:
      if layout == "pack":
        outcomes = packing.train_packed(runs, [root / n for n in pack["names"]], data=data,
                                        checkpoint_seconds=args.checkpoint_seconds,
                                        on_step=_deadline_guard(deadline))
        table = _write(table, table_path, [_record(c, o, n, device) for c, o, n in
                                           zip(runs, outcomes, pack["names"])], args.sparsities)
        continue
      for config, name in zip(runs, pack["names"]):
        if name in table.get("runs", {}):
          continue
        # a lone run checkpoints every epoch and where the deadline stops it
        outcome = train_lib.train_and_evaluate(config, root / name, data_dir=args.data_dir,
                                               dataset=data, on_step=_deadline_guard(deadline))
        table = _write(table, table_path, [_record(config, outcome, name, device)],
                       args.sparsities)
    except checkpoint_lib.Interrupted as stopped:
      print(f"deadline: {pack['method']}@{pack['sparsity']:g} stopped, {stopped}", flush=True)
      break
  if args.bundle is not None:
    unfinished = [n for pack in packs for n in pack["names"] if n not in table.get("runs", {})]
    manifest = bundle_runs(root, unfinished, args.bundle)
    print(f"bundled {manifest['steps'] if manifest else 'nothing'} into {args.bundle}",
          flush=True)


def _child_command(args: argparse.Namespace, pack: dict[str, Any], seed: int, table: pathlib.Path,
                   seconds_left: float) -> list[str]:
  """This script for one seed of ``pack`` as a lone run (``--layout lone``), into ``table``."""
  command = [sys.executable, "-m", __spec__.name, "--layout", "lone",
             "--data-dir", str(args.data_dir), "--runs", str(args.runs), "--table", str(table),
             "--throughput", *map(str, args.throughput), "--dtype", args.dtype,
             "--conv-impl", args.conv_impl,
             "--methods", pack["method"], "--sparsities", repr(pack["sparsity"]),
             "--seeds", str(seed), "--deadline-s", f"{seconds_left:.1f}",
             "--finish-s", repr(args.finish_s), "--start-s", repr(args.start_s),
             "--checkpoint-seconds", repr(args.checkpoint_seconds)]
  for flag, value in (("--epochs", args.epochs), ("--train-subset", args.train_subset),
                      ("--test-subset", args.test_subset)):
    if value is not None:
      command += [flag, str(value)]
  return command


def _start_child(command: list[str], log: Any, env: dict[str, str]) -> subprocess.Popen:
  return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def _train_in_processes(args: argparse.Namespace, pack: dict[str, Any], root: pathlib.Path,
                        table: dict[str, Any], table_path: pathlib.Path,
                        deadline: float) -> dict[str, Any]:
  """The runs of ``pack`` not yet in ``table``, each a lone run in its own process, at once.

  Each child writes its run's record to ``<run>/lone_table.json`` (its log to
  ``<run>/child.log``) and stops with a checkpoint at the deadline; the
  records of the runs that finished are merged into ``table``. The children
  share the device as ``cifar_pack_throughput.share_device`` says (each may
  grow to 0.9 / N of its memory; none preallocates).

  Raises:
    RuntimeError: a child failed (after the others' runs were merged); the
      message names its run and ends with its log.
  """
  todo = [(seed, name) for seed, name in zip(args.seeds, pack["names"])
          if name not in table.get("runs", {})]
  from benchmarks.perf.cifar_pack_throughput import share_device  # pylint: disable=import-outside-toplevel
  env = share_device(max(1, len(todo)))
  children = []
  for seed, name in todo:
    (root / name).mkdir(parents=True, exist_ok=True)
    part = root / name / "lone_table.json"
    part.unlink(missing_ok=True)
    log = open(root / name / "child.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
    command = _child_command(args, pack, seed, part, deadline - time.monotonic())
    children.append((name, part, log, _start_child(command, log, env)))
  failed = []
  for name, part, log, child in children:
    child.wait()
    log.close()
    if child.returncode != 0:
      failed.append(f"{name} (rc {child.returncode}):\n"
                    + (root / name / "child.log").read_text(encoding="utf-8")[-3000:])
    elif part.exists():  # none when the deadline stopped it (it resumes from its checkpoint)
      finished = list(json.loads(part.read_text())["runs"].values())
      table = _write(table, table_path, finished, args.sparsities)
  if failed:
    raise RuntimeError("--layout processes: a child failed: " + "\n".join(failed))
  return table


def _record(config: Any, outcome: Any, name: str, device: str) -> dict[str, Any]:
  return {**sweeps.record(config, outcome.results), "name": name, "epochs": config.epochs,
          "device": device, "dtype": config.dtype}


def _write(table: dict[str, Any], path: pathlib.Path, finished: list[dict[str, Any]],
           sparsities: Sequence[float]) -> dict[str, Any]:
  """Merges ``finished`` into the table and writes it at once (a lease may end any moment)."""
  table = merge(table, finished, sparsities)
  table["versions"] = experiment.versions()
  harness.write_json(path, table)
  print(table["markdown"], flush=True)
  return table


if __name__ == "__main__":
  main()
