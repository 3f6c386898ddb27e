"""Orbax checkpoints of a training state, for exact resume, readable by plain Orbax.

A checkpoint is one Orbax step folder of named items, one per field of the
state (a ``NamedTuple`` or a dict), so Orbax alone reads it back, without
safe_optax (``docs/checkpoints.md``):

* a field that is a nested dict of arrays (``params``) is a
  :class:`~orbax.checkpoint.args.StandardSave` item of that dict, as it is;
* the ``model_state`` field gives one such item per Flax collection
  (``batch_stats``), named after the collection;
* any other pytree (``opt_state``: optax ``NamedTuple`` states, tuples,
  ``MaskedNode`` placeholders) is stored as a nested dict keyed by each leaf's
  path (:func:`encode`): a ``NamedTuple`` field by its name, a tuple or list
  entry by its index, a dict entry by its key; nodes without leaves
  (``optax.MaskedNode``, ``EmptyState``) have no entry, and an item without
  any leaf is not written;
* the trainer's epoch ``metrics`` are the item ``epoch_metrics`` (Orbax's
  manager keeps the name ``metrics`` for itself);
* a field that is a single (small) array, ``step`` and ``rng``, is a
  :class:`~orbax.checkpoint.args.JsonSave` number or nested list (exact for
  integers; the raw ``uint32`` key data for ``rng``);
* ``layout`` (JSON) names the format, the safe_optax version, each item's
  kind (``pytree`` or ``json``), the dtypes of the JSON ones, and each
  item's SHA-256 (:func:`digest`).

:meth:`Checkpointer.restore` recomputes every item's SHA-256 and refuses a
checkpoint whose bytes changed (a flipped bit restores silently in Orbax), or
that Orbax cannot read (a truncated data file, garbage metadata), with
:class:`CorruptCheckpoint`: one line naming the checkpoint and ``--restart``.

:meth:`Checkpointer.restore` reads the items back into a freshly built state
of the same configuration, every array with that state's sharding. A
folder that is not a checkpoint of this format (no ``layout`` item, or
another format or version in it) is refused with :class:`CorruptCheckpoint`.

A save is never left half-written by Ctrl-C: SIGINT is held back while orbax
writes and commits (the ``KeyboardInterrupt`` comes right after), and a save
that fails anyway removes its ``*.orbax-checkpoint-tmp*`` folder. Under
several processes every process calls :meth:`Checkpointer.save` and
:meth:`Checkpointer.restore`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import shutil
import signal
import threading
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

import safe_optax

_TMP_GLOB = "*.orbax-checkpoint-tmp*"
FORMAT = "safe_optax.vision.checkpoint"
FORMAT_VERSION = 3
"""The layout above; versions 1 and 2 (before safe_optax 0.1.0) are not read."""
LAYOUT_ITEM = "layout"
"""The JSON item naming the format and every other item's kind."""
COLLECTIONS_FIELD = "model_state"
"""The state field whose Flax collections are items of their own (``batch_stats``)."""
_RENAMED = {"metrics": "epoch_metrics"}
"""Fields stored under another item name (Orbax's manager keeps ``metrics`` for itself)."""

# An item's kind: how it is written and read.
_PYTREE, _JSON = "pytree", "json"


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


class CorruptCheckpoint(ValueError):
  """A checkpoint whose bytes changed since it was saved, or that cannot be read.

  Attributes:
    directory: the checkpoint's step folder.
  """

  def __init__(self, directory: os.PathLike, problem: str):
    super().__init__(f"checkpoint '{directory}' is damaged ({problem}); it cannot be resumed: "
                     "rerun with --restart (restart=True) to discard the run's checkpoints "
                     "and train from the start.")
    self.directory = pathlib.Path(directory)


def _host(leaf: Any) -> np.ndarray:
  """The whole value of ``leaf`` on this host (every process gets the same array)."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    if leaf.is_fully_replicated:
      return np.asarray(leaf.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(jax.device_get(leaf))


def digest(tree: Any) -> str:
  """SHA-256 of a pytree's leaves: each one's path, dtype, shape and bytes, in order.

  What a checkpoint records for each item at save and compares at restore.
  Under several processes every process must call it (a leaf split across
  processes is gathered).

  Examples:
    >>> import jax.numpy as jnp
    >>> digest({"w": jnp.zeros(2)}) == digest({"w": jnp.zeros(2)})
    True
    >>> digest({"w": jnp.zeros(2)}) == digest({"w": jnp.array([0.0, 1e-30])})
    False
  """
  sha = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    array = np.ascontiguousarray(_host(leaf))
    sha.update(f"{jax.tree_util.keystr(path)}|{array.dtype}|{array.shape}|".encode())
    sha.update(array.tobytes())
  return sha.hexdigest()


def _problem(err: BaseException) -> str:
  """The first line of an error from Orbax or TensorStore, cut short."""
  text = str(err).strip().splitlines()[0] if str(err).strip() else ""
  text = text.split(" See full TensorStore details")[0]  # the rest is a pybind repr
  text = text if len(text) <= 160 else text[:157] + "..."
  return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _key_names(path: tuple[Any, ...]) -> list[str]:
  return [jax.tree_util.keystr((entry,), simple=True) for entry in path]


def encode(tree: Any) -> dict[str, Any]:
  """``tree`` as a nested dict keyed by its leaves' paths (how ``opt_state`` is stored).

  A ``NamedTuple`` field is keyed by its name, a tuple or list entry by its
  index (as a string), a dict entry by its key; nodes without leaves
  (``optax.MaskedNode``, ``optax.EmptyState``, ``None``) leave no entry. A
  nested dict of arrays is its own encoding.

  Args:
    tree: a pytree whose root is a node (not a single array).

  Returns:
    The nested dict of ``tree``'s leaves.

  Raises:
    ValueError: two leaves' paths give the same keys (e.g. dict keys ``1``
      and ``'1'`` side by side).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> state = optax.sgd(0.1, momentum=0.9).init({"w": jnp.zeros(2)})
    >>> encode(state)
    {'0': {'trace': {'w': Array([0., 0.], dtype=float32)}}}
  """
  nested: dict[str, Any] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = _key_names(path)
    node = nested
    for key in keys[:-1]:
      node = node.setdefault(key, {})
      if not isinstance(node, dict):
        raise ValueError(f"two leaves of the state are both named '{'/'.join(keys)}'.")
    if keys[-1] in node:
      raise ValueError(f"two leaves of the state are both named '{'/'.join(keys)}'.")
    node[keys[-1]] = leaf
  return nested


def decode(nested: Mapping[str, Any], like: Any) -> Any:
  """The inverse of :func:`encode`: ``nested``'s leaves in the structure of ``like``.

  Args:
    nested: an encoded tree (as :func:`encode` returns, or Orbax restores).
    like: a tree of the structure to rebuild (its leaves are not used).

  Returns:
    A tree shaped like ``like`` with ``nested``'s leaves.

  Raises:
    KeyError: ``nested`` lacks a leaf of ``like`` (the message names it).
  """
  with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
  leaves = []
  for path, _ in with_path:
    node = nested
    for key in _key_names(path):
      if not isinstance(node, Mapping) or key not in node:
        raise KeyError(f"the checkpoint has no leaf '{'/'.join(_key_names(path))}'.")
      node = node[key]
    leaves.append(node)
  return jax.tree.unflatten(treedef, leaves)


def _fields(state: Any) -> dict[str, Any]:
  """The state's top-level fields by name (a ``NamedTuple``'s or a dict's)."""
  if hasattr(state, "_asdict"):
    return dict(state._asdict())
  if isinstance(state, Mapping):
    return dict(state)
  raise TypeError(f"a checkpointed state must be a NamedTuple or a dict of named fields, "
                  f"got {type(state).__name__}.")


def _dtype(x: Any) -> np.dtype:
  return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _kind(value: Any) -> Optional[str]:
  """How a field is stored; ``None``: nothing to store (no leaves)."""
  if not jax.tree.leaves(value):
    return None
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(value)):  # a single array
    return _JSON
  return _PYTREE


def _items(state: Any) -> dict[str, Any]:
  """The state's named items: each field, the collections of ``model_state`` apart."""
  items: dict[str, Any] = {}
  for name, value in _fields(state).items():
    group = dict(value) if name == COLLECTIONS_FIELD else {_RENAMED.get(name, name): value}
    for item, tree in group.items():
      if item in items or item == LAYOUT_ITEM:
        raise ValueError(f"the state has two checkpoint items named '{item}' (a field and "
                         f"a collection of '{COLLECTIONS_FIELD}', or '{LAYOUT_ITEM}').")
      items[item] = tree
  return {name: tree for name, tree in items.items() if _kind(tree) is not None}


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _save_args(tree: Any) -> ocp.args.CheckpointArgs:
  if _kind(tree) == _JSON:
    return ocp.args.JsonSave(np.asarray(tree).tolist())
  return ocp.args.StandardSave(encode(tree))


def _saved(tree: Any) -> Any:
  """What is written of an item: a JSON item as the host array its list came from."""
  return np.asarray(tree) if _kind(tree) == _JSON else tree


def _restore_args(like: Any) -> ocp.args.CheckpointArgs:
  if _kind(like) == _JSON:
    return ocp.args.JsonRestore()
  return ocp.args.StandardRestore(encode(jax.tree.map(_abstract, like)))


def _from_restored(restored: Any, like: Any) -> Any:
  if _kind(like) == _JSON:
    return jax.device_put(np.asarray(restored, _dtype(like)), getattr(like, "sharding", None))
  return decode(restored, like)


class Checkpointer:
  """Saves / restores a state under ``directory`` (one Orbax step per save).

  The state is a ``NamedTuple`` or a dict of named fields; each field is an
  Orbax item (see the module docstring).

  Args:
    directory: checkpoint folder (created; a relative path is taken from the
      current directory, as Orbax needs absolute paths).
    max_to_keep: most recent checkpoints kept on disk.

  Examples:
    >>> import tempfile, jax.numpy as jnp
    >>> from safe_optax.vision.checkpoint import Checkpointer
    >>> ckpt = Checkpointer(tempfile.mkdtemp())
    >>> ckpt.save(3, {'params': {'w': jnp.arange(3.0)}, 'step': jnp.int32(3)})
    >>> ckpt.latest_step()
    3
    >>> ckpt.restore(3, {'params': {'w': jnp.zeros(3)}, 'step': jnp.int32(0)})['params']
    {'w': Array([0., 1., 2.], dtype=float32)}
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
    items = _items(state)
    layout = {"format": FORMAT, "version": FORMAT_VERSION,
              "safe_optax_version": safe_optax.__version__,
              "items": {name: _kind(tree) for name, tree in items.items()},
              "dtypes": {name: str(_dtype(tree)) for name, tree in items.items()
                         if _kind(tree) == _JSON},
              "sha256": {name: digest(_saved(tree)) for name, tree in items.items()}}
    args = ocp.args.Composite(**{name: _save_args(tree) for name, tree in items.items()},
                              **{LAYOUT_ITEM: ocp.args.JsonSave(layout)})
    with sigint_deferred():
      try:
        if step in self._manager.all_steps():
          self._manager.delete(step)
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
      except BaseException:
        for tmp in self._directory.glob(_TMP_GLOB):
          shutil.rmtree(tmp, ignore_errors=True)
        raise

  def restore(self, step: int, like: Any) -> Any:
    """Checkpoint ``step`` as a state shaped (and sharded) like ``like``.

    Args:
      step: a step of :meth:`latest_step`'s folder.
      like: a freshly built state of the run's configuration.

    Returns:
      The saved state, each array with the sharding of ``like``'s.

    Raises:
      CorruptCheckpoint: an item's SHA-256 differs from the one saved, or
        Orbax cannot read the checkpoint.
    """
    folder = self._directory / str(step)
    if not (folder / LAYOUT_ITEM).is_dir():
      raise CorruptCheckpoint(folder, f"no '{LAYOUT_ITEM}' item: not a checkpoint of "
                              f"{FORMAT} version {FORMAT_VERSION}")
    items = _items(like)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          **{name: _restore_args(tree) for name, tree in items.items()},
          **{LAYOUT_ITEM: ocp.args.JsonRestore()}))
      layout = restored[LAYOUT_ITEM]
      values = {name: _from_restored(restored[name], tree) for name, tree in items.items()}
    except Exception as err:  # TensorStore, JSON and Orbax errors alike: the files are bad
      raise CorruptCheckpoint(folder, _problem(err)) from err
    if (layout.get("format"), layout.get("version")) != (FORMAT, FORMAT_VERSION):
      raise CorruptCheckpoint(folder, f"its layout says {layout.get('format')!r} version "
                              f"{layout.get('version')!r}, not {FORMAT} version {FORMAT_VERSION}")
    for name, value in values.items():
      if _kind(value) == _JSON:  # as saved, before the cast to the state's dtype
        value = np.asarray(restored[name], layout["dtypes"][name])
      if digest(value) != layout["sha256"].get(name):
        raise CorruptCheckpoint(folder, f"item '{name}' does not match its SHA-256")
    fields = {}
    for name, value in _fields(like).items():
      if name == COLLECTIONS_FIELD:
        fields[name] = type(value)({c: values.get(c, tree) for c, tree in value.items()})
      else:
        # A field without leaves (nothing saved) stays as built.
        fields[name] = values.get(_RENAMED.get(name, name), value)
    return type(like)(**fields) if hasattr(like, "_asdict") else type(like)(fields)

  def close(self) -> None:
    self._manager.close()
