"""Which leaves of a pytree are pruned: selection, validation and path names.

Works on any pytree (Linen dicts, NNX ``State``, tuples, custom nodes): the
selection is resolved once per tree structure into a tuple of static flags,
one per leaf in ``jax.tree_util`` flatten order. The transforms' states hold
``optax.MaskedNode`` at non-prunable leaves (``masked_tree``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

KeyPath = tuple[Any, ...]
Prunable = Union[None, Any, Callable[[KeyPath, Any], bool]]


class ResolvedLeaves(NamedTuple):
  """A flattened tree with its prunable flags (static) and readable paths."""

  leaves: list[Any]
  treedef: Any
  flags: tuple[bool, ...]
  paths: tuple[str, ...]


def default_prunable(path: KeyPath, leaf: Any) -> bool:
  """The default rule: floating-point leaves with ``ndim >= 2`` (kernels, matrices).

  Biases, normalisation scales and offsets, and scalars are left dense.

  Args:
    path: the leaf's ``jax.tree_util`` key path (unused by this rule; custom
      rules may use it, e.g. to keep embeddings dense).
    leaf: the leaf.

  Returns:
    Whether the leaf is pruned.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import default_prunable
    >>> default_prunable((), jnp.zeros((3, 4))), default_prunable((), jnp.zeros(4))
    (True, False)
  """
  del path
  return _is_floating(leaf) and jnp.ndim(leaf) >= 2


def _is_floating(leaf: Any) -> bool:
  return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


def path_str(path: KeyPath) -> str:
  """A readable name for a key path, e.g. ``'params/Dense_0/kernel'``."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  # NNX variables flatten through a trailing ``.value`` attribute.
  if len(parts) > 1 and parts[-1] == "value":
    parts.pop()
  return "/".join(parts) or "<root>"


def check_prunable(prunable: Any) -> Prunable:
  """Returns ``prunable`` if it is ``None``, a callable or a pytree of bools.

  Checked without the parameters, so the transforms refuse a wrong value at
  construction rather than read it as "prune everything" (``bool('kernel')``
  is True).

  Raises:
    TypeError: anything else, e.g. ``'kernel'`` or ``1``, naming the allowed values.
  """
  if prunable is None or callable(prunable):
    return prunable
  bad = [leaf for leaf in jax.tree.leaves(prunable)
         if not isinstance(leaf, (bool, np.bool_))
         and not (isinstance(leaf, (jax.Array, np.ndarray)) and leaf.dtype == bool
                  and leaf.ndim == 0)]
  if bad:
    raise TypeError(
        "`prunable` must be None (the default rule: floating leaves with ndim >= 2), a "
        "callable (key_path, leaf) -> bool, or a pytree of bools shaped like the "
        f"parameters (or a prefix of them); got {prunable!r}, whose leaf {bad[0]!r} is not "
        "a bool. To prune kernels only, pass e.g. "
        "lambda path, leaf: path[-1].key == 'kernel'.")
  return prunable


def _flags_from_tree(prunable: Any, tree: Any) -> list[bool]:
  """Broadcasts a bool pytree (the tree itself or a prefix of it) onto ``tree``'s leaves."""
  try:
    expanded = jax.tree.map(
        lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), prunable, tree
    )
  except (ValueError, TypeError) as err:
    raise ValueError(
        "`prunable` must be None, a callable (key_path, leaf) -> bool, or a pytree of "
        f"bools with the structure of the parameters (or a prefix of it): {err}"
    ) from err
  return jax.tree.leaves(expanded)


def resolve(tree: Any, prunable: Prunable = None, *, allow_none: bool = False) -> ResolvedLeaves:
  """Flattens ``tree`` and decides which leaves are prunable.

  Args:
    tree: any pytree of arrays.
    prunable: ``None`` for :func:`default_prunable`; a callable
      ``(key_path, leaf) -> bool``; or a pytree of bools shaped like ``tree``
      (or a prefix of it).
    allow_none: accept a selection of no leaf (reports); pruning needs one.

  Returns:
    A :class:`ResolvedLeaves`.

  Raises:
    TypeError: a leaf selected as prunable is not a floating-point array, or
      ``prunable`` is neither None, a callable nor a pytree of bools.
    ValueError: no leaf is prunable (unless ``allow_none``), or ``prunable``
      does not match ``tree``.
  """
  check_prunable(prunable)
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = tuple(path_str(p) for p, _ in with_path)
  leaves = [leaf for _, leaf in with_path]
  if prunable is None:
    flags = [default_prunable(p, leaf) for p, leaf in with_path]
  elif callable(prunable):
    flags = [bool(prunable(p, leaf)) for p, leaf in with_path]
  else:
    flags = _flags_from_tree(prunable, tree)
  for flag, leaf, name in zip(flags, leaves, paths):
    if flag and not _is_floating(leaf):
      dtype = getattr(leaf, "dtype", type(leaf).__name__)
      raise TypeError(
          f"leaf '{name}' is selected as prunable but has dtype {dtype}; only "
          "floating-point leaves can be pruned. Exclude it through `prunable`."
      )
  if not any(flags) and not allow_none:
    raise ValueError(
        f"no prunable leaves among {len(leaves)} leaves; the default selects floating "
        "leaves with ndim >= 2. Pass `prunable` (a bool pytree or a callable "
        "(key_path, leaf) -> bool) to choose them."
    )
  return ResolvedLeaves(leaves, treedef, tuple(flags), paths)


def prunable_mask(tree: Any, prunable: Prunable = None) -> Any:
  """The bool pytree (same structure as ``tree``) of leaves that are pruned.

  Args:
    tree: any pytree of arrays.
    prunable: ``None`` for :func:`default_prunable`; a callable
      ``(key_path, leaf) -> bool``; or a pytree of bools shaped like ``tree``
      (or a prefix of it).

  Returns:
    A pytree of Python bools with the structure of ``tree``.

  Raises:
    TypeError: a selected leaf is not a floating-point array.
    ValueError: no leaf is selected, or ``prunable`` does not match ``tree``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import prunable_mask
    >>> prunable_mask({'w': jnp.ones((2, 3)), 'b': jnp.ones(3)})
    {'b': False, 'w': True}
    >>> prunable_mask({'embed': jnp.ones((9, 3)), 'w': jnp.ones((3, 3))},
    ...               lambda path, leaf: path[0].key != 'embed')
    {'embed': False, 'w': True}
  """
  resolved = resolve(tree, prunable)
  return jax.tree.unflatten(resolved.treedef, list(resolved.flags))


# Trees seen inside optax.masked / optax.multi_transform hold optax.MaskedNode
# placeholders where leaves were masked out; the helpers below count them as
# leaves (never pruned), so flags stay aligned with the transforms' state trees,
# which hold a MaskedNode at every non-prunable leaf.


def is_masked(node: Any) -> bool:
  """Whether ``node`` is an ``optax.MaskedNode`` placeholder."""
  return isinstance(node, optax.MaskedNode)


def leaf_flags(params: Any, prunable: Prunable) -> tuple[bool, ...]:
  """Prunable flags of ``params``' leaves, MaskedNode placeholders counted as (dense) leaves."""
  array_flags = iter(resolve(params, prunable).flags)
  return tuple(False if is_masked(leaf) else next(array_flags)
               for leaf in jax.tree.leaves(params, is_leaf=is_masked))


def prunable_leaves(tree: Any, flags: tuple[bool, ...]) -> list[Any]:
  """The prunable leaves of a params-shaped tree (MaskedNode placeholders count as leaves).

  Raises:
    ValueError: ``tree`` does not have one leaf per flag.
  """
  leaves = jax.tree.leaves(tree, is_leaf=is_masked)
  if len(leaves) != len(flags):
    raise ValueError(
        f"tree has {len(leaves)} leaves but the parameters have {len(flags)}; the state "
        "does not belong to these parameters."
    )
  return [leaf for leaf, flag in zip(leaves, flags) if flag]


def masked_tree(params: Any, flags: tuple[bool, ...], values: Any) -> Any:
  """``params``-shaped tree with ``values`` on prunable leaves, MaskedNode elsewhere."""
  it = iter(values)
  leaves = [next(it) if flag else optax.MaskedNode() for flag in flags]
  return jax.tree.unflatten(jax.tree.structure(params, is_leaf=is_masked), leaves)
