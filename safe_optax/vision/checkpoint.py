"""Orbax checkpoints of a training state, for exact resume.

The state is saved as the flat list of its leaves (plus the step number), and
restored into the leaves of a freshly built state of the same configuration.
Going through leaves keeps optax's NamedTuple states (and their empty
``MaskedNode`` placeholders) out of orbax's tree handling, and restores every
array with the sharding of the fresh state.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


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
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  def latest_step(self) -> Optional[int]:
    """The step of the newest checkpoint, or ``None``."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    """Writes ``state`` as checkpoint ``step`` (replacing one of the same step)."""
    if step in self._manager.all_steps():
      self._manager.delete(step)
    leaves = jax.tree.leaves(state)
    self._manager.save(step, args=ocp.args.StandardSave(leaves), force=True)
    self._manager.wait_until_finished()

  def restore(self, step: int, like: Any) -> Any:
    """Checkpoint ``step`` as a tree shaped (and sharded) like ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return jax.tree.unflatten(treedef, list(restored))

  def close(self) -> None:
    self._manager.close()
