"""Ctrl-C during a vision run: the save finishes, one line is printed, the exit is 130, a rerun resumes.

The child process is ``safe-optax-vision train`` on a tiny MNIST (idx files of
48 + 24 images, ``--test-only-split``). It sends itself SIGINT from inside
orbax's commit of the first checkpoint (the temporary folder exists, the
rename has not happened), which is when an interrupt used to leave a
``*.orbax-checkpoint-tmp*`` folder and a flood of tracebacks.
"""

from __future__ import annotations

import gzip
import pathlib
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from safe_optax.vision import checkpoint as checkpoint_lib

_CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys, time
    from orbax.checkpoint._src.path import atomicity

    fired = []

    def interrupting(finalize):
      async def wrapper(self, *args, **kwargs):
        if os.environ.get("INTERRUPT_IN_SAVE") and not fired:
          fired.append(True)
          os.kill(os.getpid(), signal.SIGINT)
          await asyncio.sleep(0.3)  # the signal lands while the tmp folder exists
        return await finalize(self, *args, **kwargs)
      return wrapper

    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
      cls.finalize = interrupting(cls.finalize)

    from safe_optax.vision import cli
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.fixture(autouse=True)
def _python_sigint_handler():
  """Ctrl-C as in a terminal, whatever an earlier test left behind.

  Some other test in the suite (a kernel or subprocess launcher) leaves SIGINT
  ignored in the pytest process; an ignored SIGINT is inherited by children
  and keeps Python from installing its KeyboardInterrupt handler. Setting
  Python's handler here gives this test and its subprocesses (where it becomes
  the default disposition on exec) the terminal's behaviour.
  """
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def _write_tiny_mnist(directory: pathlib.Path) -> None:
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 10, 72).astype(np.uint8)
  images = (20 * labels[:, None, None] + rng.integers(0, 40, (72, 28, 28))).astype(np.uint8)
  for name, array in (("t10k-images-idx3-ubyte", images), ("t10k-labels-idx1-ubyte", labels)):
    header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(directory / f"{name}.gz", "wb") as f:
      f.write(header + array.tobytes())


def _train(tmp_path: pathlib.Path, *, interrupt: bool) -> subprocess.CompletedProcess:
  data, workdir = tmp_path / "mnist", tmp_path / "run"
  data.mkdir(exist_ok=True)
  _write_tiny_mnist(data)
  env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path),
         "SAFE_OPTAX_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "ignore"}
  if interrupt:
    env["INTERRUPT_IN_SAVE"] = "1"
  argv = ["train", "--preset", "mlp-mnist", "--data-dir", str(data), "--workdir", str(workdir),
          "--test-only-split", "48", "24", "--epochs", "2", "--batch-size", "16",
          "--warmup-epochs", "0", "--bnt-samples", "16", "--sparsity", "0.5", "--no-progress"]
  return subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True,
                        env=env, timeout=600, check=False)


@pytest.mark.slow
def test_sigint_during_a_checkpoint_save_exits_130_with_one_line_and_resumes(tmp_path):
  first = _train(tmp_path, interrupt=True)
  checkpoints = tmp_path / "run" / "checkpoints"
  err_lines = [line for line in first.stderr.splitlines() if line.strip()]
  assert first.returncode == 130, first.stderr[-3000:]
  assert "Traceback" not in first.stderr, first.stderr[-3000:]
  assert len(err_lines) <= 3, first.stderr
  # The epoch-1 checkpoint (3 steps of 16 images) was committed, not abandoned.
  assert err_lines[-1] == (f"safe-optax-vision train: interrupted at step 3; checkpoint saved "
                           f"in {checkpoints}; rerun the same command to resume"), first.stderr
  assert not list(checkpoints.glob("*orbax-checkpoint-tmp*"))
  assert checkpoint_lib.Checkpointer(checkpoints).latest_step() == 3
  assert not (tmp_path / "run" / "results.json").exists()

  second = _train(tmp_path, interrupt=False)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resuming from step 3 of 6" in second.stderr
  assert (tmp_path / "run" / "results.json").is_file()
  assert not list(checkpoints.glob("*orbax-checkpoint-tmp*"))


def test_checkpointer_defers_sigint_until_the_save_is_committed(tmp_path, monkeypatch):
  """In-process: the interrupt surfaces after the save, which is complete on disk."""
  import asyncio
  import os
  import jax.numpy as jnp
  from orbax.checkpoint._src.path import atomicity

  def interrupting(finalize):
    async def wrapper(self, *args, **kwargs):
      os.kill(os.getpid(), signal.SIGINT)
      await asyncio.sleep(0.2)
      return await finalize(self, *args, **kwargs)
    return wrapper

  for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    monkeypatch.setattr(cls, "finalize", interrupting(cls.finalize))
  ckpt = checkpoint_lib.Checkpointer(tmp_path)
  with pytest.raises(KeyboardInterrupt):
    ckpt.save(5, {"w": jnp.arange(4.0)})
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
  assert not list(tmp_path.glob("*orbax-checkpoint-tmp*"))
  monkeypatch.undo()
  fresh = checkpoint_lib.Checkpointer(tmp_path)
  assert fresh.latest_step() == 5
  np.testing.assert_array_equal(fresh.restore(5, {"w": jnp.zeros(4)})["w"], np.arange(4.0))


@pytest.mark.parametrize("command", ["train", "sweep"])
@pytest.mark.parametrize("raised, said", [
    (checkpoint_lib.Interrupted(7, "/runs/x/checkpoints"),
     "interrupted at step 7; checkpoint saved in /runs/x/checkpoints; "
     "rerun the same command to resume"),
    (KeyboardInterrupt(), "interrupted; rerun the same command to resume"),  # before any save
])
def test_cli_turns_ctrl_c_into_one_line_and_exit_130(tmp_path, monkeypatch, capsys, command,
                                                     raised, said):
  from safe_optax.vision import cli
  from safe_optax.vision import train as train_lib

  def interrupted(*args, **kwargs):
    raise raised

  monkeypatch.setattr(train_lib, "train_and_evaluate", interrupted)
  _write_tiny_mnist(tmp_path)
  argv = [command, "--preset", "mlp-mnist", "--data-dir", str(tmp_path), "--workdir",
          str(tmp_path / "run"), "--test-only-split", "48", "24", "--no-progress"]
  argv += ["--methods", "safe", "--sparsities", "0.5", "--seeds", "0"] if command == "sweep" else []
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 130
  assert err.splitlines()[-1] == f"safe-optax-vision {command}: {said}"
  # The sweep announces each run on stderr before it starts (two lines).
  assert "Traceback" not in err and len(err.splitlines()) <= 3, err
