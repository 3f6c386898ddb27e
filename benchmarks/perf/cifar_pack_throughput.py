"""Throughput of packed vision runs: one run, then 3, 6, 9, 15 runs as one vmapped program.

The programs are the trainer's own: ``safe_optax.vision.programs.build_programs``
of the preset (``resnet20x2-cifar10``, ``vgg19-cifar10``) with ``--method``
(SAFE by default) at batch ``--batch``, and for ``N`` runs
``safe_optax.vision.packing.packed_programs`` (``jax.vmap`` of that step over a
run axis, what ``safe-optax-vision sweep --pack N`` runs). Pack size 1 is the
lone run's own jitted step (today's trainer), not a vmap of one.

For each model, dtype (``float32``; ``bfloat16`` compute with float32 weights
and optimizer state) and pack size: the median of ``--steps`` plain steps
(after ``--warmup``), the median of ``--dual-steps`` dual programs (the
ADMM-type methods' projection and dual update, one step in ``dual_every``),
the step of an average ``dual_every`` window, images/s per run and for the
pack, and the FLOP/s achieved: XLA's cost analysis of the plain step as
lowered, before the backend's passes (``jitted.lower(...).cost_analysis()``),
over its median time. The lowered count is the same on every backend. The
compiled program's count (``flops_per_step_compiled``) is kept as well, but on
a GPU it leaves out the convolutions that XLA hands to cuDNN (on the H200 it
counted a small fraction of a ResNet step), so it is not the FLOP/s.
``--recount-flops FILE`` recounts an earlier measurement's FLOPs this way on
this machine and rewrites its FLOP/s, saying so in the file. Inputs are
random CIFAR-shaped uint8 batches (one per run), so the input
pipeline is not timed; augmentation is (it runs inside the step).

``--processes N ...``: the other way to share one device, measured side by
side with the packs: N lone runs, each in its own process, compiled and warmed
up, then stepped together after a barrier (table rows ``Np``). Their
throughput is all their images over the span from the first timed step's start
to the last one's end. Without NVIDIA's MPS daemon (``nvidia-cuda-mps-control
-d``) the processes' kernels take turns on the GPU; with it they can run at
once. The cell records whether the daemon ran (table rows ``Nmps``).

``--deadline-s``: cells not started before it are skipped, and the JSON is
rewritten after every cell, so a lease cut short keeps what it measured.
``--dry-run``: batch 8, two steps, packs 1 and 3, for checking on a CPU; its
JSON says ``"dry_run": true`` and measures nothing about a GPU.

Usage (first thing on a GPU lease)::

  python -m benchmarks.perf.cifar_pack_throughput --deadline-s 300 \\
      --out benchmarks/perf/results/cifar_pack_throughput_gpu.json

Recounting the committed H200 file's FLOPs (on any machine)::

  python -m benchmarks.perf.cifar_pack_throughput \\
      --recount-flops benchmarks/perf/results/cifar_pack_throughput_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from benchmarks.harness import flops, run_record, summary, timed, write_json, write_report
from safe_optax.vision import configs
from safe_optax.vision import packing
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import steps as steps_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRESETS = {"resnet20x2": "resnet20x2-cifar10", "vgg19": "vgg19-cifar10"}
NUM_TRAIN, IMAGE = 50_000, (32, 32, 3)


class Step(NamedTuple):
  """The plain step of a cell, lowered (not compiled), with what running it needs."""
  lowered: Any
  lower_s: float
  state: Any
  images: np.ndarray
  labels: np.ndarray
  dual: Any


def lowered_step(config: configs.Config, runs: int) -> Step:
  """The plain step of ``runs`` runs of ``config`` (1: the lone program; more: the packed one)."""
  programs = programs_lib.build_programs(config, NUM_TRAIN, 10, IMAGE)
  rng = np.random.default_rng(0)
  shape = ((config.batch_size,) if runs == 1 else (runs, config.batch_size))
  images = rng.integers(0, 256, shape + IMAGE, dtype=np.uint8)
  labels = rng.integers(0, 10, shape, dtype=np.int32)
  states = [programs.init(jax.random.PRNGKey(i)) for i in range(runs)]
  if runs == 1:
    state, train, dual = states[0], programs.train, programs.dual
  else:
    state = jax.device_put(packing.stack(states), programs.replicated)
    train, dual = packing.packed_programs(programs)
  del states
  due = programs_lib.plan(programs, config, 1)[1]  # a step without the dual update
  start = time.perf_counter()
  lowered = train.lower(state, images, labels, dual_due=due)
  return Step(lowered, time.perf_counter() - start, state, images, labels, dual)


def bench(config: configs.Config, runs: int, steps: int, warmup: int, dual_steps: int,
          barrier: Optional[Callable[[], None]] = None) -> dict[str, Any]:
  """One cell: ``runs`` runs of ``config`` (1: the lone program; more: the packed one).

  ``barrier``, where given, is called after compiling and warming up, before the
  timed steps (the processes of a ``--processes`` cell start their steps together).
  """
  step = lowered_step(config, runs)
  start = time.perf_counter()
  compiled = step.lowered.compile()
  compile_s = step.lower_s + time.perf_counter() - start
  state, images, labels, dual = step.state, step.images, step.labels, step.dual
  step_flops = flops(step.lowered)
  for _ in range(warmup):
    state, _ = timed(compiled, state, images, labels)
  if barrier is not None:
    barrier()
  times, began = [], time.time()
  for _ in range(steps):
    state, seconds = timed(compiled, state, images, labels)
    times.append(seconds)
  plain = summary(times)
  cell = {"runs": runs, "compile_s": compile_s, "plain_step": plain, "flops_per_step": step_flops,
          "flops_per_step_compiled": flops(compiled), "timed_from": began,
          "timed_to": time.time()}
  step_ms = plain["median_ms"]
  if dual is not None and dual_steps:
    dual_times = []
    for i in range(1 + dual_steps):
      out, seconds = timed(dual, state)
      state = steps_lib.with_dual_step(state, out)
      if i:
        dual_times.append(seconds)
    cell["dual_program"] = summary(dual_times)
    step_ms += cell["dual_program"]["median_ms"] / config.dual_every
  cell["mean_step_ms"] = step_ms
  cell["images_per_second_per_run"] = 1e3 * config.batch_size / step_ms
  cell["images_per_second"] = runs * cell["images_per_second_per_run"]
  cell["flops_per_second"] = step_flops / (1e-3 * plain["median_ms"]) if step_flops else None
  cell["epoch_s"] = step_ms * 1e-3 * -(-NUM_TRAIN // config.batch_size)
  return cell


def file_barrier(folder: str, name: str, count: int, timeout_s: float = 900.0
                 ) -> Callable[[], None]:
  """A barrier of ``count`` processes through ``folder``: each marks itself ready and waits
  for the others' marks."""
  def wait() -> None:
    pathlib.Path(folder, f"ready_{name}").touch()
    deadline = time.time() + timeout_s
    while len(list(pathlib.Path(folder).glob("ready_*"))) < count:
      if time.time() > deadline:
        raise TimeoutError(f"{count} processes did not all reach the barrier in {timeout_s} s")
      time.sleep(0.005)
  return wait


MPS_CONTROL = "nvidia-cuda-mps-control"


def mps_daemon_running(proc: pathlib.Path = pathlib.Path("/proc")) -> bool:
  """Whether an NVIDIA MPS control daemon runs here (kernels of different processes then
  share the GPU at once instead of taking turns): a process whose program is
  ``nvidia-cuda-mps-control``, read from each ``/proc/PID/cmdline``.

  Not ``pgrep -x``: Linux keeps 15 characters of a process name, so that never
  matched, and the 2026-11-28 lease recorded cells measured under MPS as without it.
  """
  for entry in proc.iterdir():
    if not entry.name.isdigit():
      continue
    try:
      program = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:  # the process ended, or is not ours to read
      continue
    if os.path.basename(program.decode(errors="replace")) == MPS_CONTROL:
      return True
  return False


PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def share_device(count: int) -> dict[str, str]:
  """The environment of ``count`` child processes that share this process's device.

  This process and its children stop preallocating
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, unless set): XLA's GPU client
  otherwise takes 75 % of the device's memory when a process starts, and on the
  second H200 lease a parent that had timed its own lone run left its children
  too little (``CUDA_ERROR_OUT_OF_MEMORY`` while they autotuned). Each child
  may grow to 0.9 / ``count`` of the device's memory
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set). XLA reads both when a
  process first uses its device, so call this before then (``main`` does).
  """
  if count < 1:
    raise ValueError(f"count must be >= 1, got {count}")
  os.environ.setdefault(PREALLOCATE, "false")
  env = dict(os.environ)
  env.setdefault(MEM_FRACTION, f"{0.9 / count:.4f}")
  return env


def concurrent_cell(args: argparse.Namespace, model: str, dtype: str, count: int,
                    conv_impl: str = "xla") -> dict[str, Any]:
  """``count`` lone runs, each in its own process on the same device, timed together.

  Each process compiles and warms up its lone step, waits at a barrier, then
  runs ``--steps`` steps; the throughput is all processes' images over the
  span from the first timed step's start to the last one's end, so time the
  processes did not overlap counts against them. The dual program is not
  timed here. Each child's share of the device memory is :func:`share_device`'s.
  """
  env = share_device(count)
  with tempfile.TemporaryDirectory() as folder:
    command = [sys.executable, "-m", __spec__.name, "--models", model, "--dtypes", dtype,
               "--conv-impls", conv_impl,
               "--method", args.method, "--sparsity", str(args.sparsity), "--batch",
               str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--barrier", folder, "--barrier-count", str(count)]
    procs = [subprocess.Popen(command + ["--child", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(count)]
    outs = [proc.communicate() for proc in procs]
  for proc, (_, err) in zip(procs, outs):
    if proc.returncode != 0:
      raise RuntimeError(f"a --processes {count} child failed (rc {proc.returncode}):\n"
                         f"{err[-3000:]}")
  children = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  span = max(c["timed_to"] for c in children) - min(c["timed_from"] for c in children)
  images = count * args.batch * args.steps
  step_flops = children[0]["flops_per_step"]
  return {"model": model, "dtype": dtype, "conv_impl": conv_impl, "runs": count,
          "layout": "processes",
          "mps_daemon": mps_daemon_running(), "span_s": span,
          "compile_s": max(c["compile_s"] for c in children),
          "mean_step_ms": 1e3 * span / args.steps,
          "images_per_second": images / span, "images_per_second_per_run": images / span / count,
          "flops_per_step": None if step_flops is None else count * step_flops,
          "flops_per_second": None if step_flops is None else count * step_flops * args.steps / span,
          "dual_program": "not timed", "children": children}


def with_speedups(report: dict[str, Any]) -> dict[str, Any]:
  """Adds to every measured cell its images/s over the same model's lone float32 run's.

  Examples:
    >>> r = with_speedups({"cells": [
    ...     {"model": "m", "dtype": "float32", "runs": 1, "images_per_second": 100.0},
    ...     {"model": "m", "dtype": "bfloat16", "runs": 3, "images_per_second": 250.0},
    ...     {"model": "m", "dtype": "float32", "runs": 6, "skipped": "past --deadline-s"}]})
    >>> [c.get("speedup_vs_lone_float32") for c in r["cells"]]
    [1.0, 2.5, None]
  """
  lone: dict[str, float] = {}
  # the lone program run as today (not a ``--processes 1`` child) where the file has it
  for cell in sorted(report["cells"], key=lambda c: c.get("layout") == "processes"):
    if (cell["runs"] == 1 and cell["dtype"] == "float32" and "images_per_second" in cell
        and cell.get("conv_impl", "xla") == "xla"):
      lone.setdefault(cell["model"], cell["images_per_second"])
  for cell in report["cells"]:
    if "images_per_second" in cell and cell["model"] in lone:
      cell["speedup_vs_lone_float32"] = cell["images_per_second"] / lone[cell["model"]]
  return report


HEADER = (f"{'model':>10} {'dtype':>8} {'runs':>4} {'step ms':>8} {'img/s/run':>10} "
          f"{'img/s':>9} {'x lone32':>8} {'TFLOP/s':>8} {'compile s':>9} {'conv':>6}")


def row(cell: dict[str, Any]) -> str:
  """One cell as a line of the printed table."""
  if "skipped" in cell:
    return f"{cell['model']:>10} {cell['dtype']:>8} {cell['runs']:>4}   {cell['skipped']}"
  tflops = cell["flops_per_second"] / 1e12 if cell.get("flops_per_second") else float("nan")
  speedup = cell.get("speedup_vs_lone_float32") or float("nan")
  runs = str(cell["runs"])
  if cell.get("layout") == "processes":
    runs += "mps" if cell.get("mps_daemon") else "p"
  return (f"{cell['model']:>10} {cell['dtype']:>8} {runs:>4} {cell['mean_step_ms']:8.2f} "
          f"{cell['images_per_second_per_run']:10.0f} {cell['images_per_second']:9.0f} "
          f"{speedup:8.2f} {tflops:8.2f} {cell['compile_s']:9.1f} "
          f"{cell.get('conv_impl', 'xla'):>6}")


def show(paths: list[str]) -> dict[str, Any]:
  """Prints the cells of ``paths`` as one table, each row naming its file, under the first
  file's device and the paths.

  The speed-ups are recomputed over the first lone float32 run (XLA's
  convolutions) among all the files, in their order, so that cells from calls
  that measured no lone run of their own (under MPS, say) get one too. Ratios
  across files are across calls: give the files of one lease.
  """
  merged: dict[str, Any] = {"cells": []}
  for path in paths:
    with open(path) as f:
      report = json.load(f)
    for cell in report["cells"]:
      merged["cells"].append({**cell, "file": os.path.basename(path)})
    merged.setdefault("device_kind", report.get("device_kind"))
  with_speedups(merged)
  print(f"{merged['device_kind']}: {', '.join(paths)}")
  print(HEADER + "  file")
  for cell in merged["cells"]:
    print(f"{row(cell)}  {cell['file']}")
  return merged


def recount_flops(path: str) -> dict[str, Any]:
  """Recounts the FLOPs of ``path``'s measured cells from the lowered step, on this machine.

  The measured times stay; ``flops_per_step`` and ``flops_per_second`` are
  replaced, the file's earlier count is kept as ``flops_per_step_compiled``
  (files written before this count was kept had only the compiled one), and
  ``flops_recounted`` says how and where. The settings (method, sparsity,
  batch) are the file's.
  """
  with open(path) as f:
    report = json.load(f)
  settings = report["settings"]
  for cell in report["cells"]:
    if "plain_step" not in cell:
      continue
    config = configs.get_config(PRESETS[cell["model"]], method=settings["method"],
                                sparsity=settings["sparsity"], batch_size=settings["batch"],
                                dtype=cell["dtype"], conv_impl=cell.get("conv_impl", "xla"))
    recounted = flops(lowered_step(config, cell["runs"]).lowered)
    cell.setdefault("flops_per_step_compiled", cell["flops_per_step"])
    cell["flops_per_step"] = recounted
    cell["flops_per_second"] = recounted / (1e-3 * cell["plain_step"]["median_ms"]) if recounted else None
  record = run_record()
  report["flops_recounted"] = {
      "command": record["command"], "date": record["date"], "backend": record["backend"],
      "versions": record["versions"],
      "how": "cost analysis of the plain step as lowered (jitted.lower(...).cost_analysis()), "
             "before any backend pass, so the count is the measuring device's; the measured "
             "times are unchanged"}
  with_speedups(report)
  write_json(path, report)
  return report


def measure_cells(args: argparse.Namespace, report: dict[str, Any], model: str, dtype: str,
                  conv_impl: str, start: float) -> None:
  """The pack cells, then the ``--processes`` cells, of one model, dtype and conv_impl."""
  config = configs.get_config(PRESETS[model], method=args.method, sparsity=args.sparsity,
                              batch_size=args.batch, dtype=dtype, conv_impl=conv_impl)
  key = {"model": model, "dtype": dtype, "conv_impl": conv_impl}
  for layout, counts in (("pack", args.packs), ("processes", args.processes)):
    for runs in counts:
      if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
        report["cells"].append({**key, "runs": runs, "skipped": "past --deadline-s",
                                **({"layout": "processes"} if layout == "processes" else {})})
        continue
      report["cells"].append(
          {**key, **bench(config, runs, args.steps, args.warmup, args.dual_steps)}
          if layout == "pack" else concurrent_cell(args, model, dtype, runs, conv_impl))
      with_speedups(report)
      print(row(report["cells"][-1]), flush=True)
      write_report(report, args.out, start)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS))
  parser.add_argument("--dtypes", nargs="+", default=list(configs.DTYPES), choices=configs.DTYPES)
  parser.add_argument("--packs", nargs="*", type=int, default=[1, 3, 6, 9, 15],
                      help="pack sizes (one vmapped program each); none: no pack cells")
  parser.add_argument("--processes", nargs="*", type=int, default=[],
                      help="counts of lone runs in as many processes on the device at once "
                           "(table rows 'Np'); start an MPS daemon first for their kernels "
                           "to run at once")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--barrier-count", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--conv-impls", nargs="+", default=["xla"], choices=configs.CONV_IMPLS,
                      help="how the models compute convolutions, one set of cells each (im2col: "
                           "a packed step batches matmuls instead of grouped convolutions)")
  parser.add_argument("--method", default="safe", choices=configs.METHODS)
  parser.add_argument("--sparsity", type=float, default=0.9)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--dual-steps", type=int, default=3)
  parser.add_argument("--deadline-s", type=float, default=None)
  parser.add_argument("--dry-run", action="store_true",
                      help="batch 8, 2 steps, packs 1 and 3: a CPU check, not a measurement")
  parser.add_argument("--recount-flops", metavar="FILE", default=None,
                      help="recount FILE's FLOPs from the lowered steps and rewrite its FLOP/s; "
                           "measures nothing")
  parser.add_argument("--show", nargs="+", metavar="FILE", default=None,
                      help="print the cells of measured JSONs (speed-ups over the first lone "
                           "float32 run among them); measures nothing")
  parser.add_argument("--out", default="benchmarks/perf/results/cifar_pack_throughput.json")
  args = parser.parse_args(argv)
  if args.show:
    missing = [path for path in args.show if not os.path.isfile(path)]
    if missing:
      parser.error(f"--show: no such file: {', '.join(missing)}")
    show(args.show)
    return
  if args.recount_flops:
    report = recount_flops(args.recount_flops)
    print(f"{report['device_kind']} ({report['platform']}), FLOPs recounted on "
          f"{report['flops_recounted']['backend']}")
    print(HEADER)
    for cell in report["cells"]:
      print(row(cell))
    return
  if args.child is not None:  # one process of a --processes cell: its lone run, as JSON
    config = configs.get_config(PRESETS[args.models[0]], method=args.method,
                                sparsity=args.sparsity, batch_size=args.batch,
                                dtype=args.dtypes[0], conv_impl=args.conv_impls[0])
    barrier = file_barrier(args.barrier, args.child, args.barrier_count)
    print(json.dumps(bench(config, 1, args.steps, args.warmup, 0, barrier)))
    return
  if any(n < 1 for n in args.packs + args.processes):
    parser.error(f"--packs and --processes take counts >= 1, got {args.packs} and "
                 f"{args.processes}")
  if args.processes:  # before this process first uses the device: its lone cells share it
    share_device(max(args.processes))
  if args.dry_run:
    args.batch, args.steps, args.warmup, args.dual_steps = 8, 2, 1, 1
    args.packs = [n for n in args.packs if n <= 3]
  start = time.perf_counter()
  device = jax.devices()[0]
  report = {**run_record(), "dry_run": args.dry_run,
            "device_kind": device.device_kind, "platform": device.platform,
            "settings": {k: v for k, v in vars(args).items()
                         if k not in ("out", "recount_flops", "child", "barrier",
                                      "barrier_count")},
            "cells": []}
  print(f"{device.device_kind} ({device.platform}){'  DRY RUN' if args.dry_run else ''}")
  print(HEADER)
  for model in args.models:
    for dtype in args.dtypes:
      for conv_impl in args.conv_impls:
        measure_cells(args, report, model, dtype, conv_impl, start)
  # the cells skipped after the last measured one are in the file too
  write_report(report, args.out, start)


if __name__ == "__main__":
  main()
