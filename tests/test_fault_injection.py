"""SIGKILL at random points: both CLIs resume to the uninterrupted result and never lose an export.

For each engine (``safe-optax-vision train`` on a tiny MNIST, and
``safe-optax-llm prune`` with SAFE+ on a tiny 4-block model), one
uninterrupted run gives the reference. Then ``SAFE_OPTAX_FAULT_RUNS`` child
processes (default 6; 20 or more for a thorough run), each forked from a server process that
has imported the CLI (and started no JAX backend), run the same command in one of two slots of
output folders and are killed with SIGKILL after a delay drawn by a seeded RNG,
uniform over the reference's working time (from the fork to
the exit, measured on a run that finds the compiled programs in JAX's cache
as the children do), so kills land in compilation, steps or blocks,
checkpoint saves and the final export alike. A child that finishes before
its delay counts too; its folder is then checked whole, and the vision run
is rerun once more (re-finishing a finished run rewrites its outputs) before
the slot moves to a new folder.

After every kill, a folder that claims to be finished (``results.json`` /
``report.json``) must hold the whole reference export: no finished output is
ever replaced by a part of one. Every folder, once finished (the last ones
by a run to completion), must equal the reference bit for bit: the vision
run's final checkpoint (the SHA-256 of every item), exported tensors, final
accuracies and per-epoch losses; the LLM export's tensors, header metadata
and per-block errors.
No temporary file (``*.tmp*``, Orbax's ``*orbax-checkpoint-tmp*``) is left.

Cost: one import of each engine, then 2 + runs + 2 forked children per engine, a few seconds
each (JAX's compilation cache in the test's folder spares the children the compiling).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import queue
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_vision_interrupt  # noqa: E402  (the tiny MNIST files)

pytestmark = pytest.mark.slow  # child processes killed at random moments

RUNS = int(os.environ.get("SAFE_OPTAX_FAULT_RUNS", "6"))
FOLDERS = 2

# One server process per engine imports the CLI once, then forks a child for each run: the
# children start where a fresh process would be after its imports (no JAX backend exists before
# the fork), without paying Python's and JAX's imports, about 5 s, each time. Protocol on the
# pipes: the server prints "ready"; each argv line (JSON) it is sent answers "pid N", then
# "exit S" when that child ends (-9 after SIGKILL). A child is reaped only when the next command
# comes, so the pid the test kills is never another process's.
_SERVER = textwrap.dedent("""
    import json, os, sys, threading, traceback
    if sys.argv[1] == "vision":
      from safe_optax.vision import cli, train  # noqa: F401
    else:
      from safe_optax.llm import cli, prune  # noqa: F401
    assert threading.active_count() == 1, threading.enumerate()  # forking a single thread
    log = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    print("ready", flush=True)
    previous = None
    for line in sys.stdin:
      if previous is not None:
        os.waitpid(previous, 0)  # reaped only now: until then a SIGKILL reaches it or its zombie
      pid = os.fork()
      if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(log, 2)
        code = 1
        try:
          code = cli.main(json.loads(line))
        except SystemExit as exit_:
          code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
          traceback.print_exc()
        finally:
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(code or 0)
      print(f"pid {pid}", flush=True)
      info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
      killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
      print(f"exit {-info.si_status if killed else info.si_status}", flush=True)
      previous = pid
    if previous is not None:
      os.waitpid(previous, 0)
""")


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
  return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JAX_PLATFORMS": "cpu",
          "HOME": str(tmp_path), "SAFE_OPTAX_CACHE": str(tmp_path / "cache"),
          "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
          "TF_CPP_MIN_LOG_LEVEL": "3",
          # Every child compiles the same programs: the first one's, from disk, save seconds.
          "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
          # The suite's compile mode (tests/conftest.py), as every other subprocess gets it.
          **{name: os.environ[name] for name in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")
             if name in os.environ}}


class _Server:
  """The ``_SERVER`` process of one engine: ``run`` forks a child for one command line."""

  def __init__(self, engine: str, env: dict[str, str], log: pathlib.Path):
    self._log = log
    self._process = subprocess.Popen([sys.executable, "-c", _SERVER, engine, str(log)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self._lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    assert self._next() == "ready", log.read_text()[-3000:]

  def _read(self) -> None:
    for line in self._process.stdout:
      self._lines.put(line.strip())
    self._lines.put("")  # the server ended

  def _next(self, timeout: float | None = None) -> str:
    return self._lines.get(timeout=timeout)

  def run(self, argv: list[str], kill_after: float | None = None) -> tuple[int | None, float]:
    """Runs ``argv`` in a fresh child; SIGKILLs it ``kill_after`` seconds after it starts.

    Returns:
      ``(exit status or None if killed, seconds from the start to the end)``.
    """
    self._process.stdin.write(json.dumps(argv) + "\n")
    self._process.stdin.flush()
    answer = self._next()
    assert answer.startswith("pid "), (answer, self._log.read_text()[-3000:])
    start = time.perf_counter()
    try:
      answer = self._next(timeout=kill_after)
    except queue.Empty:
      os.kill(int(answer.split()[1]), signal.SIGKILL)  # the child, or its zombie (not reaped)
      answer = self._next()
    assert answer.startswith("exit "), (answer, self._log.read_text()[-3000:])
    status = int(answer.split()[1])
    return (None if status == -signal.SIGKILL else status), time.perf_counter() - start

  def close(self) -> None:
    self._process.stdin.close()
    assert self._process.wait(timeout=60) == 0, self._log.read_text()[-3000:]


@pytest.fixture(name="server")
def _server_fixture():
  """``server(engine, env, log)`` starts that engine's server; all are closed at the end."""
  started = []

  def start(engine, env, log):
    started.append(_Server(engine, env, log))
    return started[-1]

  yield start
  for one in started:
    one.close()


def _no_temporary_files(folder: pathlib.Path) -> None:
  leftovers = [p for p in folder.rglob("*") if ".tmp" in p.name or "checkpoint-tmp" in p.name]
  assert not leftovers, leftovers


def _tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  return load_file(str(path))


def _assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _kill_and_resume(server, argv_for, log, check_finished, check_done, seed, *,
                     rerun_finished):
  """An uninterrupted warm run, the kills (each followed by the finished-output check), then
  the completing reruns.

  The runs go round ``FOLDERS`` slots, each working in its folder until that
  finishes (once more with ``rerun_finished``: a rerun that re-finishes a
  finished run, which must not leave a part of its outputs), then in a new one.
  """
  status, reference_seconds = server.run(argv_for("warm"))  # compiled: cached
  assert status == 0, log.read_text()[-3000:]
  check_done("warm")
  rng = np.random.default_rng(seed)
  folders, finishes, outcomes = list(range(FOLDERS)), {}, []
  for i in range(RUNS):
    slot = i % FOLDERS
    delay = float(rng.uniform(0.0, reference_seconds))
    status, _ = server.run(argv_for(folders[slot]), kill_after=delay)
    assert status in (None, 0), log.read_text()[-3000:]
    outcomes.append("killed" if status is None else "finished")
    check_finished(folders[slot])
    if status == 0:
      check_done(folders[slot])
      finishes[folders[slot]] = finishes.get(folders[slot], 0) + 1
      if finishes[folders[slot]] > int(rerun_finished):
        folders[slot] += FOLDERS
  # Not vacuous: most runs are cut short (a folder's later runs have less left to do).
  assert outcomes.count("killed") >= RUNS // 2, outcomes
  for folder in folders:
    status, _ = server.run(argv_for(folder))
    assert status == 0, log.read_text()[-3000:]
    check_done(folder)


def _vision_argv(data: pathlib.Path, workdir: pathlib.Path) -> list[str]:
  return ["train", "--preset", "mlp-mnist", "--data-dir", str(data), "--workdir", str(workdir),
          "--test-only-split", "48", "24", "--epochs", "3", "--batch-size", "16",
          "--warmup-epochs", "0", "--bnt-samples", "16", "--sparsity", "0.5", "--no-progress"]


def _vision_outcome(workdir: pathlib.Path) -> dict:
  """What must be bit-identical: the last checkpoint's item digests, the export, the numbers."""
  checkpoints = workdir / "checkpoints"
  last = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  layout = json.loads((checkpoints / str(last) / "layout" / "metadata").read_text())
  results = json.loads((workdir / "results.json").read_text())
  return {"step": last, "sha256": layout["sha256"], "final": results["final"],
          "losses": [(r["epoch"], r["train_loss"], r.get("test_accuracy"))
                     for r in results["history"]]}


def test_sigkill_the_vision_trainer_at_random_points(tmp_path, server):
  data = tmp_path / "mnist"
  data.mkdir()
  test_vision_interrupt._write_tiny_mnist(data)  # pylint: disable=protected-access
  log = tmp_path / "children.log"
  vision = server("vision", _env(tmp_path), log)
  reference = tmp_path / "reference"
  status, _ = vision.run(_vision_argv(data, reference))
  assert status == 0, log.read_text()[-3000:]
  want = _vision_outcome(reference)
  exports = ("sparse_params.safetensors", "masks.safetensors")
  want_tensors = {name: _tensors(reference / name) for name in exports}
  run = lambda folder: tmp_path / f"run{folder}"

  def check_finished(folder):
    if (run(folder) / "results.json").exists():
      assert _vision_outcome(run(folder))["final"] == want["final"]
      for name in exports:
        _assert_same_tensors(_tensors(run(folder) / name), want_tensors[name])

  def check_done(folder):
    assert _vision_outcome(run(folder)) == want
    check_finished(folder)
    _no_temporary_files(run(folder))

  _kill_and_resume(vision, lambda folder: _vision_argv(data, run(folder)), log,
                   check_finished, check_done, seed=0, rerun_finished=True)


def _llm_fixture(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  from safe_optax.llm import export
  from safe_optax.llm import model as model_lib
  import test_llm_cli  # noqa: E402  (the byte-level tokenizer)
  cfg = model_lib.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                              num_layers=4, num_heads=4, num_kv_heads=2)
  folder = export.save_safetensors(tmp_path / "tiny", cfg, model_lib.init_params(cfg),
                                        test_llm_cli._byte_tokenizer())  # pylint: disable=protected-access
  text = tmp_path / "calib.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  return folder, text


def _export(folder: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """``model.safetensors``'s tensors and header metadata (whose key order is not fixed)."""
  with safe_open(str(folder / "model.safetensors"), "np") as f:
    return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_sigkill_the_llm_pruner_at_random_points(tmp_path, server):
  model, text = _llm_fixture(tmp_path)
  log = tmp_path / "children.log"
  llm = server("llm", _env(tmp_path), log)
  argv = lambda out: ["prune", "--model", str(model), "--calib", str(text), "--nsamples", "4",
                      "--seqlen", "16", "--out", str(out), "--no-progress", "--method", "safe-plus",
                      "--epochs", "3", "--batch-size", "2", "--lr", "3e-3", "--dual-every", "2"]
  reference = tmp_path / "reference"
  status, _ = llm.run(argv(reference))
  assert status == 0, log.read_text()[-3000:]
  want_export = _export(reference)
  want_errors = [b["relative_error"]
                 for b in json.loads((reference / "report.json").read_text())["blocks"]]
  out = lambda folder: tmp_path / f"out{folder}"

  def check_finished(folder):
    if (out(folder) / "report.json").exists():
      report = json.loads((out(folder) / "report.json").read_text())
      assert [b["relative_error"] for b in report["blocks"]] == want_errors
      got = _export(out(folder))
      assert got[1] == want_export[1]
      _assert_same_tensors(got[0], want_export[0])
      for name in ("config.json", "sparsity.json", "tokenizer.json"):
        json.loads((out(folder) / name).read_text())

  def check_done(folder):
    check_finished(folder)
    assert (out(folder) / "report.json").exists()
    assert not (out(folder) / "prune_state").exists()
    _no_temporary_files(out(folder))

  # A rerun of a finished export prunes nothing (tests/test_llm_cli_errors.py).
  _kill_and_resume(llm, lambda folder: argv(out(folder)), log, check_finished,
                   check_done, seed=1, rerun_finished=False)
