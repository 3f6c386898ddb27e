"""The resumable state of a block-by-block pruning run, in a folder.

:func:`safe_optax.llm.prune.prune_model` saves each pruned block, the pruned
stream and the report entries here as soon as a block is done, and continues
a saved run from its next block.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util


class PruneState:
  """A resumable pruning run in a folder.

  ``state.json`` holds the run's identity and the report entries of the
  finished blocks; ``block_<i>.npz`` each pruned block; ``stream_<k>.npz`` the
  pruned stream after ``k`` blocks (the inputs of block ``k``). Files are
  written under temporary names and renamed, and ``state.json`` is written
  last, so an interruption at any point leaves the last finished block
  loadable.
  """

  def __init__(self, folder: os.PathLike, identity: dict[str, Any]):
    self.folder = pathlib.Path(folder)
    self.identity = identity
    saved = self._read()
    if saved is None:
      self.folder.mkdir(parents=True, exist_ok=True)
      self._saved_blocks: list[dict[str, Any]] = []
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
    self.resumed_blocks = len(self._saved_blocks)

  def _read(self) -> Optional[dict[str, Any]]:
    file = self.folder / "state.json"
    return json.loads(file.read_text()) if file.exists() else None

  def blocks(self) -> list[dict[str, Any]]:
    """Report entries of the blocks already pruned, in order."""
    return [dict(entry) for entry in self._saved_blocks]

  def load_block(self, index: int, like: dict[str, Any]) -> dict[str, Any]:
    """Block ``index``'s pruned parameters, in the dtypes of ``like`` (its dense parameters)."""
    with np.load(self.folder / f"block_{index}.npz") as arrays:
      flat = {tuple(k.split("/")): arrays[k] for k in arrays.files}
    loaded = traverse_util.unflatten_dict(flat)
    return jax.tree.map(lambda a, ref: jnp.asarray(a, dtype=jnp.asarray(ref).dtype), loaded, like)

  def load_stream(self, count: int) -> np.ndarray:
    with np.load(self.folder / f"stream_{count}.npz") as arrays:
      return np.array(arrays["x"], np.float32)

  def save(self, block: dict[str, Any], stream: np.ndarray, blocks: list[dict[str, Any]]) -> None:
    """Saves the newest block of ``blocks``, the stream after it, then the entries."""
    index, count = blocks[-1]["block"], len(blocks)
    flat = traverse_util.flatten_dict(block, sep="/")
    # numpy cannot store bfloat16; float32 holds it exactly and load_block casts back.
    self._write_npz(f"block_{index}.npz", {k: _savable(v) for k, v in flat.items()})
    self._write_npz(f"stream_{count}.npz", {"x": stream})
    tmp = self.folder / "state.json.tmp"
    tmp.write_text(json.dumps({"identity": self.identity, "blocks": blocks}, indent=1) + "\n")
    tmp.replace(self.folder / "state.json")
    stale = self.folder / f"stream_{count - 1}.npz"
    if stale.exists():
      stale.unlink()

  def _write_npz(self, name: str, arrays: dict[str, np.ndarray]) -> None:
    tmp = self.folder / f"{name}.tmp.npz"
    np.savez(tmp, **arrays)
    tmp.replace(self.folder / name)


def _savable(leaf: Any) -> np.ndarray:
  array = np.asarray(leaf)
  return array if array.dtype.kind in "fiu" else array.astype(np.float32)
