"""Orbax checkpoints of a training state, for exact resume.

The state is saved as the flat list of its leaves (plus the step number), and
restored into the leaves of a freshly built state of the same configuration.
Going through leaves keeps optax's NamedTuple states (and their empty
``MaskedNode`` placeholders) out of orbax's tree handling, and restores every
array with the sharding of the fresh state.

A save is never left half-written by Ctrl-C: SIGINT is held back while orbax
writes and commits (the ``KeyboardInterrupt`` comes right after), and a save
that fails anyway removes its ``*.orbax-checkpoint-tmp*`` folder.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import threading
from typing import Any, Iterator, Optional

import jax
import orbax.checkpoint as ocp

_TMP_GLOB = "*.orbax-checkpoint-tmp*"


class Interrupted(KeyboardInterrupt):
  """A run stopped by Ctrl-C after saving its state (the rerun resumes from it).

  Attributes:
    step: the step of the saved checkpoint.
    directory: the checkpoint folder.
  """

  def __init__(self, step: int, directory: os.PathLike):
    super().__init__(step, str(directory))  # the constructor's arguments: picklable
    self.step = step
    self.directory = pathlib.Path(directory)

  def __str__(self) -> str:
    return f"interrupted at step {self.step}; checkpoint saved in {self.directory}"


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
  """Holds SIGINT back for the block, then delivers it to the previous handler.

  Around a checkpoint's write and commit, and around a training step that
  donates its input state (a ``KeyboardInterrupt`` between the dispatch and
  the rebinding would leave only deleted buffers to save).
  """
  if threading.current_thread() is not threading.main_thread():
    yield  # signals only reach the main thread; nothing to hold back here
    return
  received: list[int] = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
  if received:
    if callable(previous):
      previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
    elif previous == signal.SIG_DFL:
      raise KeyboardInterrupt


class Checkpointer:
  """Saves / restores a pytree state under ``directory`` (one orbax step per save).

  Args:
    directory: checkpoint folder (created).
    max_to_keep: most recent checkpoints kept on disk.

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> from safe_optax.vision.checkpoint import Checkpointer
    >>> ckpt = Checkpointer(tempfile.mkdtemp())
    >>> ckpt.save(3, {'w': jnp.arange(3.0), 'step': jnp.int32(3)})
    >>> ckpt.latest_step()
    3
    >>> ckpt.restore(3, {'w': jnp.zeros(3), 'step': jnp.int32(0)})['w']
    Array([0., 1., 2.], dtype=float32)
  """

  def __init__(self, directory: os.PathLike, max_to_keep: int = 2):
    # cleanup_tmp_directories: a save killed outright (SIGKILL, power loss)
    # leaves its temporary folder; the next run removes it.
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=True)
    self._directory = pathlib.Path(os.path.abspath(directory))
    self._manager = ocp.CheckpointManager(self._directory, options=options)

  def latest_step(self) -> Optional[int]:
    """The step of the newest checkpoint, or ``None``."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Writes ``state`` as checkpoint ``step`` (replacing one of the same step).

    Raises:
      KeyboardInterrupt: SIGINT arrived during the save; raised once the
        checkpoint is committed.
    """
    with sigint_deferred():
      try:
        if step in self._manager.all_steps():
          self._manager.delete(step)
        leaves = jax.tree.leaves(state)
        self._manager.save(step, args=ocp.args.StandardSave(leaves), force=True)
        self._manager.wait_until_finished()
      except BaseException:
        for tmp in self._directory.glob(_TMP_GLOB):
          shutil.rmtree(tmp, ignore_errors=True)
        raise

  def restore(self, step: int, like: Any) -> Any:
    """Checkpoint ``step`` as a tree shaped (and sharded) like ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return jax.tree.unflatten(treedef, list(restored))

  def close(self) -> None:
    self._manager.close()
