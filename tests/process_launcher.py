"""Launching a worker script as N processes on localhost (gloo); not a test module.

Shared by tests/test_distributed.py and tests/test_vision_distributed.py.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Optional

from safe_optax import distributed

TIMEOUT = 150  # seconds for a whole launch; a hung peer fails the test instead of CI


def free_port() -> int:
  """A TCP port nobody listens on right now (for the coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
  """This environment, the package importable, no inherited launch variables."""
  env = dict(os.environ)
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
               distributed.ENV_PROCESS_ID):
    env.pop(name, None)
  env.update(extra or {})
  return env


def launch(worker: os.PathLike, num_processes: int, *args: str, timeout: float = TIMEOUT,
           env: Optional[dict[str, str]] = None) -> float:
  """Runs ``worker`` as ``num_processes`` processes; returns the wall time.

  Processes of a multi-process launch get ``--coordinator 127.0.0.1:PORT
  --num-processes N --process-id I`` after ``args``. Fails fast: as soon as
  one process exits with an error, the others are killed and the error is
  reported (a peer waiting in a collective would otherwise hang); every
  process is killed on the way out, whatever happens.
  """
  start = time.monotonic()
  if num_processes == 1:
    commands = [[sys.executable, str(worker), *args]]
  else:
    port = free_port()
    commands = [[sys.executable, str(worker), *args, "--coordinator", f"127.0.0.1:{port}",
                 "--num-processes", str(num_processes), "--process-id", str(i)]
                for i in range(num_processes)]
  procs = [subprocess.Popen(c, env=worker_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for c in commands]
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i = failed[0]
        raise RuntimeError(f"process {i} of {num_processes} exited with {codes[i]}:\n"
                           f"{procs[i].stdout.read()[-3000:]}")
      if all(c == 0 for c in codes):
        return time.monotonic() - start
      if time.monotonic() - start > timeout:
        raise TimeoutError(f"{num_processes} processes still running after {timeout} s")
      time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
      p.stdout.close()


def forced_devices_flags(devices: int) -> str:
  """``XLA_FLAGS`` for ``devices`` forced CPU devices in one process.

  A collective on forced host devices waits for every device's thread; on a
  loaded 2-core machine one can start late, and XLA's default 40 s
  termination timeout can then kill a run that would finish. Tests allow
  120 s: long enough for a late thread, short enough that a run whose thread
  never arrives (a deadlock seen with 8 devices on 2 busy cores) fails soon.
  """
  return " ".join([*_other_xla_flags(), f"--xla_force_host_platform_device_count={devices}",
                   "--xla_cpu_collective_call_terminate_timeout_seconds=120"])


def _other_xla_flags() -> list[str]:
  """This process's ``XLA_FLAGS`` but its device count and collective timeout (the suite's
  compile flags, tests/conftest.py, stay with every child)."""
  ours = ("--xla_force_host_platform_device_count", "--xla_cpu_collective_call_terminate_timeout")
  return [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(ours)]
