"""The one harness of the benchmarks: timing, FLOP counts, the run record and atomic JSON output.

Every script under ``benchmarks/`` times with :func:`timed` / :func:`time_calls`,
counts FLOPs with :func:`flops`, heads its JSON with :func:`run_record` and
writes it with :func:`write_json` (or :func:`write_report`, which adds the wall
time and the load average at the end).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
from typing import Any, Callable, Optional

import jax

from safe_optax.experiment import versions

ROOT = pathlib.Path(__file__).resolve().parents[1]


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
  """``fn(*args)`` once, waited on with ``block_until_ready``: (its output, seconds)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


def time_calls(fn: Callable[..., Any], *args: Any, warmup: int = 1,
               repeats: int = 5) -> list[float]:
  """Seconds of ``repeats`` calls of ``fn(*args)`` after ``warmup`` untimed ones."""
  for _ in range(warmup):
    timed(fn, *args)
  return [timed(fn, *args)[1] for _ in range(repeats)]


def summary(times: list[float]) -> dict[str, float]:
  """Median, mean, p10 / p90, min, max of call times (seconds in, milliseconds out)."""
  ms = sorted(1e3 * t for t in times)
  return {"n": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
          "p10_ms": ms[len(ms) // 10], "p90_ms": ms[(9 * len(ms)) // 10],
          "min_ms": ms[0], "max_ms": ms[-1]}


def flops(stage: Any, *args: Any) -> Optional[float]:
  """XLA's FLOP count of a program; ``None`` where the backend gives none.

  ``stage``: a lowered or compiled program (``jitted.lower(...)``, before the
  backend's passes, or ``.compile()``, after them); or a jitted function, then
  compiled for ``args`` (sharing the jit cache).
  """
  if args or not hasattr(stage, "cost_analysis"):
    stage = stage.lower(*args).compile()
  try:
    cost = stage.cost_analysis()
  except NotImplementedError:
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None


def command() -> str:
  """This process's command line, as it was typed (``python -m benchmarks.x ...``)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
  return shlex.join(head + sys.argv[1:])


def git_commit() -> Optional[str]:
  """The checkout's commit (``None`` outside a git checkout), ``+dirty`` with local changes."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+dirty" if dirty else "")


def run_record(*packages: str) -> dict[str, Any]:
  """The header of every results JSON: command, date, commit, versions, machine, devices.

  ``packages``: further distributions to record (:func:`safe_optax.experiment.versions`).
  """
  found = versions(*packages)
  return {
      "command": command(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "git_commit": git_commit(),
      "versions": found,
      "cpu": {"model": found["cpu_model"], "cpu_count": os.cpu_count(),
              "machine": platform.machine(), "loadavg_start": os.getloadavg()},
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }


def write_json(path: str | os.PathLike[str], data: Any, indent: int = 1) -> pathlib.Path:
  """Writes ``data`` as JSON atomically: a reader sees the old file or the whole new one."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")
  os.replace(tmp, path)
  return path


def write_report(report: dict[str, Any], out: str | os.PathLike[str], start: float) -> None:
  """Adds the end load average and the wall time since ``start``, writes ``out``, says where."""
  report["cpu"]["loadavg_end"] = os.getloadavg()
  report["total_wall_s"] = time.perf_counter() - start
  write_json(out, report)
  print(f"\nwrote {out} ({report['total_wall_s']:.0f} s; load average "
        f"{report['cpu']['loadavg_start'][0]:.1f} -> {report['cpu']['loadavg_end'][0]:.1f})")


def extract_tar(tar: tarfile.TarFile, root: pathlib.Path, what: str) -> None:
  """Extracts ``tar`` into ``root``, refusing members that would land outside it.

  Python's ``data`` filter where it exists (3.11.4+); before it, the same refusal by hand of
  links, devices, absolute paths and ``..``. ``what`` names the archive in the error.
  """
  if hasattr(tarfile, "data_filter"):
    tar.extractall(root, filter="data")
    return
  unsafe = [m.name for m in tar.getmembers() if not (m.isfile() or m.isdir())
            or m.name.startswith("/") or ".." in pathlib.PurePosixPath(m.name).parts]
  if unsafe:
    raise ValueError(f"{what} holds unsafe members {unsafe[:3]}")
  tar.extractall(root)  # noqa: S202  (members checked above)
