"""The resumable state of a block-by-block pruning run, in a folder.

:func:`safe_optax.llm.prune.prune_model` saves each pruned block, the pruned
stream and the report entries here as soon as a block is done, and continues
a saved run from its next block.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import zipfile
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from safe_optax import experiment

STATE_FILE = "state.json"


class CorruptPruneState(ValueError):
  """A saved pruning state whose files changed since they were written, or cannot be read."""

  def __init__(self, folder: os.PathLike, problem: str):
    super().__init__(f"the saved pruning state in '{folder}' is damaged ({problem}); it cannot "
                     "be resumed: rerun with --restart to discard it and prune from the start.")
    self.folder = pathlib.Path(folder)


def file_sha256(path: os.PathLike) -> str:
  """SHA-256 of a file's bytes, read in 16 MiB pieces."""
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    for piece in iter(lambda: f.read(1 << 24), b""):
      sha.update(piece)
  return sha.hexdigest()


class PruneState:
  """A resumable pruning run in a folder.

  ``state.json`` holds the run's identity, the report entries of the
  finished blocks and the SHA-256 of every array file; ``block_<i>.npz``
  each pruned block; ``stream_<k>.npz`` the pruned stream after ``k`` blocks
  (the inputs of block ``k``). Files are written under temporary names and
  renamed (:func:`safe_optax.experiment.atomic_write`), and ``state.json`` is
  written last, so an interruption at any point, SIGKILL included, leaves the
  last finished block loadable; a temporary file a killed run left behind is
  removed when the folder is opened. A file whose bytes differ from its
  recorded SHA-256, or a ``state.json`` that does not parse, is refused with
  :class:`CorruptPruneState` (naming ``--restart``) instead of being resumed.
  """

  def __init__(self, folder: os.PathLike, identity: dict[str, Any]):
    self.folder = pathlib.Path(folder)
    self.identity = identity
    saved = self._read()
    if saved is None:
      self.folder.mkdir(parents=True, exist_ok=True)
      self._saved_blocks: list[dict[str, Any]] = []
      self._sha256: dict[str, str] = {}
    else:
      old = saved["identity"]
      differing = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
      if differing:
        details = "; ".join(f"{k}: saved {old.get(k)!r}, now {identity.get(k)!r}"
                            for k in differing)
        raise ValueError(
            f"'{self.folder}' holds a pruning run with different arguments ({details}). "
            f"Rerun with the saved arguments to continue it, or start over "
            f"(safe-optax-llm prune --restart, or delete the folder).")
      self._saved_blocks = saved["blocks"]
      self._sha256 = saved["sha256"]
    for leftover in self.folder.glob(f"*{experiment.TMP_MARK}*"):
      leftover.unlink()
    self.resumed_blocks = len(self._saved_blocks)

  def _read(self) -> Optional[dict[str, Any]]:
    file = self.folder / STATE_FILE
    if not file.exists():
      return None
    try:
      saved = json.loads(file.read_text())
      if not (isinstance(saved["identity"], dict) and isinstance(saved["blocks"], list)
              and isinstance(saved["sha256"], dict)):
        raise TypeError("identity, blocks or sha256 of the wrong type")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
      raise CorruptPruneState(self.folder, f"{STATE_FILE} does not parse: {err}") from err
    return saved

  def blocks(self) -> list[dict[str, Any]]:
    """Report entries of the blocks already pruned, in order."""
    return [dict(entry) for entry in self._saved_blocks]

  def load_block(self, index: int, like: dict[str, Any]) -> dict[str, Any]:
    """Block ``index``'s pruned parameters, in the dtypes of ``like`` (its dense parameters)."""
    arrays = self._load(f"block_{index}.npz")
    loaded = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in arrays.items()})
    return jax.tree.map(lambda a, ref: jnp.asarray(a, dtype=jnp.asarray(ref).dtype), loaded, like)

  def load_stream(self, count: int) -> np.ndarray:
    """The pruned stream after ``count`` blocks (block ``count``'s inputs), float32."""
    return np.array(self._load(f"stream_{count}.npz")["x"], np.float32)

  def _load(self, name: str) -> dict[str, np.ndarray]:
    """The arrays of ``name``, after checking its SHA-256 against ``state.json``."""
    path = self.folder / name
    if not path.is_file():
      raise CorruptPruneState(self.folder, f"{name} is missing")
    if file_sha256(path) != self._sha256.get(name):
      raise CorruptPruneState(self.folder, f"{name} does not match its SHA-256")
    try:
      with np.load(path) as arrays:
        return {k: arrays[k] for k in arrays.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
      raise CorruptPruneState(self.folder, f"{name} cannot be read: {err}") from err

  def save(self, block: dict[str, Any], stream: np.ndarray, blocks: list[dict[str, Any]]) -> None:
    """Saves the newest block of ``blocks``, the stream after it, then the entries."""
    index, count = blocks[-1]["block"], len(blocks)
    flat = traverse_util.flatten_dict(block, sep="/")
    # numpy cannot store bfloat16; float32 holds it exactly and load_block casts back.
    self._write_npz(f"block_{index}.npz", {k: _savable(v) for k, v in flat.items()})
    self._write_npz(f"stream_{count}.npz", {"x": stream})
    self._sha256.pop(f"stream_{count - 1}.npz", None)
    with experiment.atomic_write(self.folder / STATE_FILE) as tmp:
      tmp.write_text(json.dumps({"identity": self.identity, "blocks": blocks,
                                 "sha256": self._sha256}, indent=1) + "\n")
    stale = self.folder / f"stream_{count - 1}.npz"
    if stale.exists():
      stale.unlink()

  def _write_npz(self, name: str, arrays: dict[str, np.ndarray]) -> None:
    with experiment.atomic_write(self.folder / name) as tmp:
      np.savez(tmp, **arrays)
      self._sha256[name] = file_sha256(tmp)


def _savable(leaf: Any) -> np.ndarray:
  array = np.asarray(leaf)
  return array if array.dtype.kind in "fiu" else array.astype(np.float32)
