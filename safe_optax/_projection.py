"""Exact projection of a pytree onto a sparsity set (hard thresholding).

``project_topk`` keeps exactly the requested number of entries with the largest
scores (``|v|`` by default, or any SAFE+ saliency) and zeroes the rest, within
the groups the structure (``_structures.py``) names:

* :class:`Global`: one threshold over all prunable leaves (default);
* :class:`PerLeaf`: the same sparsity in every leaf;
* :class:`NM`: ``n`` kept in every group of ``m`` consecutive entries along
  the reduction axis (2:4, 4:8 hardware sparsity);
* :class:`PerOutput`: the same sparsity within every output unit (Wanda's
  per-row grouping);
* :class:`ERK`: a per-leaf count from the leaf's shape (Erdős–Rényi-Kernel),
  the same total as :class:`Global`.

The global threshold is found by radix selection on the float bit patterns
(see ``_select.py``), never by sorting the concatenated model.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from safe_optax import _counts
from safe_optax import _prunable
from safe_optax import _select
from safe_optax import _structures
from safe_optax._structures import ERK
from safe_optax._structures import NM
from safe_optax._structures import Global
from safe_optax._structures import PerLeaf
from safe_optax._structures import PerOutput
from safe_optax._structures import Structure


def _check_structure(shape: tuple[int, ...], structure: Structure, name: str) -> None:
  """Raises ``ValueError`` when a leaf cannot carry ``structure``."""
  if not isinstance(structure, (NM, PerOutput)):
    return
  axis = structure.axis
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"leaf '{name}' of shape {shape} has no axis {axis} for {structure}.")
  if isinstance(structure, NM) and shape[axis] % structure.m:
    raise ValueError(
        f"leaf '{name}' has {shape[axis]} entries along axis {axis}, not divisible by "
        f"m={structure.m} for {structure}; exclude it through `prunable`."
    )


def check_structure_fits(tree: Any, structure: Structure,
                         prunable: _prunable.Prunable = None) -> None:
  """Raises ``ValueError``, naming the leaf's path, when a prunable leaf cannot carry ``structure``."""
  if not isinstance(structure, (NM, PerOutput)):
    return  # any leaf carries an unstructured sparsity
  resolved = _prunable.resolve(tree, prunable)
  for leaf, flag, path in zip(resolved.leaves, resolved.flags, resolved.paths):
    if flag:
      _check_structure(jnp.shape(leaf), structure, path)


def _to_groups(x: jax.Array, structure: Structure) -> jax.Array:
  """Reshapes a leaf into ``(groups, group_size)`` rows for structured selection."""
  axis = structure.axis
  if isinstance(structure, NM):
    return jnp.moveaxis(x, axis, -1).reshape(-1, structure.m)
  return jnp.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)


def _from_groups(mask: jax.Array, shape: tuple[int, ...], structure: Structure) -> jax.Array:
  axis = structure.axis % len(shape)
  if isinstance(structure, NM):
    moved = shape[:axis] + shape[axis + 1:] + (shape[axis],)
    return jnp.moveaxis(mask.reshape(moved), -1, axis)
  moved = (shape[axis],) + shape[:axis] + shape[axis + 1:]
  return jnp.moveaxis(mask.reshape(moved), 0, axis)


def _keep_counts(shapes, sparsity, structure):
  """Entries to keep per selection group, computed outside the kernel.

  Python sparsities give exact decimal counts here, so the jitted kernel takes
  counts as data and never recompiles when the sparsity changes.
  """
  if isinstance(structure, NM):
    return [jnp.int32(structure.n)] * len(shapes)
  if isinstance(structure, ERK):
    return [jnp.asarray(k, jnp.int32)
            for k in _counts.erk_keep_counts(shapes, sparsity, structure.power_scale)]
  sizes = [int(np.prod(shape)) for shape in shapes]
  if isinstance(structure, Global):
    sizes = [sum(sizes)]
  elif isinstance(structure, PerOutput):
    sizes = [size // shape[structure.axis] for size, shape in zip(sizes, shapes)]
  return [jnp.asarray(_counts.num_keep(size, sparsity), jnp.int32) for size in sizes]


@functools.partial(jax.jit, static_argnames=("structure",))
def _project_leaves(leaves, score_leaves, counts, *, structure):
  """Projects the prunable leaves; ``counts`` holds the keep count of each group."""
  # Scores are all given or all |v| (project_topk checks), so one key map serves every leaf.
  by_magnitude = all(score is None for score in score_leaves)
  ranked = leaves if by_magnitude else score_leaves
  key_fn = _select.magnitude_keys if by_magnitude else _select.order_keys
  if isinstance(structure, Global):
    masks, _ = _select.topk_masks(ranked, counts[0], key_fn=key_fn)
  elif isinstance(structure, (PerLeaf, ERK)):
    masks = [_select.topk_masks([x], k, key_fn=key_fn)[0][0] for x, k in zip(ranked, counts)]
  else:
    masks = [
        _from_groups(_select.group_topk_mask(_to_groups(key_fn(x), structure), k), x.shape,
                     structure)
        for x, k in zip(ranked, counts)
    ]

  projected = [_project_leaf(leaf, score, mask)
               for leaf, score, mask in zip(leaves, score_leaves, masks)]
  return projected, masks


@jax.jit
def _project_leaf(leaf: jax.Array, score: Optional[jax.Array], mask: jax.Array) -> jax.Array:
  """``leaf`` where ``mask``, else 0; NaN wherever the value or its score is NaN.

  A NaN shows at its own entry, kept or not: never hidden (the loss and
  finalize see it) and never spread over the rest of its group. Jitted on its
  own, as ``_select``'s leaf masks: traced and lowered once per leaf shape and
  dtype, not once per leaf (XLA inlines it and fuses it with the mask).
  """
  bad = lax.ne(leaf, leaf)
  if score is not None:
    bad = lax.bitwise_or(bad, lax.ne(score, score))
  kept = lax.select(mask, leaf, lax.full(leaf.shape, 0, leaf.dtype))
  return lax.select(bad, lax.full(leaf.shape, jnp.nan, leaf.dtype), kept)


def project_topk(
    tree: Any,
    sparsity: Any = None,
    *,
    structure: Structure = Global(),
    scores: Any = None,
    prunable: _prunable.Prunable = None,
) -> tuple[Any, Any]:
  r"""Projects ``tree`` onto the set of trees with the requested sparsity.

  Solves :math:`\arg\min_{\|z\|_0 \le d} \|z - v\|_P^2` for diagonal ``P``:
  keeps the ``d`` entries with the largest score (``|v|`` when ``scores`` is
  None, i.e. ``P = I``; pass ``sqrt(P) * |v|`` for SAFE+) and zeroes the rest.
  Exactly ``n - floor(sparsity * n)`` entries are kept per group (``n`` the
  prunable entry count of the group), whatever the ties: among equal scores
  the earlier entry (flatten order, then row-major) is kept.

  NaN: a NaN prunable value or score is NaN at its own entry of the
  projection (kept or not), so the failure is never hidden; it ranks highest
  (a NaN score, or a NaN value without ``scores``, takes one of the kept
  slots), every other entry is projected as usual, and the masks hold exactly
  the requested count. :func:`finalize` raises on it outside ``jit``.

  Args:
    tree: pytree of arrays (Linen params, NNX ``State``, tuples, ...). Not modified.
    sparsity: fraction of prunable entries to zero, in ``[0, 1)``. May be a
      traced scalar (schedules, ``optax.inject_hyperparams``). ``None`` or
      ``1 - n/m`` for :class:`NM`.
    structure: the groups whose entries compete: :class:`Global` (default,
      one threshold across all prunable leaves), :class:`PerLeaf` (the same
      sparsity in every leaf), :class:`ERK` (a per-leaf sparsity from the
      shapes, the same total as :class:`Global`), :class:`PerOutput` or :class:`NM`.
    scores: optional pytree shaped like ``tree`` with the ranking score of each
      prunable entry (higher is kept); other leaves may be ``None``.
    prunable: which leaves are pruned: ``None`` (floating leaves with
      ``ndim >= 2``), a bool pytree, or a callable ``(key_path, leaf) -> bool``.

  Returns:
    ``(projected_tree, keep_masks)``: the projected tree (same structure and
    dtypes; non-prunable leaves returned as they are) and a pytree of bool
    masks (all ``True`` for non-prunable leaves).

  Raises:
    TypeError: ``structure`` is not one of the five structures.
    ValueError: a sparsity outside ``[0, 1)`` (or missing, or contradicting
      ``NM``), a leaf that cannot carry ``structure`` (naming its path), or
      ``scores`` not shaped like the prunable leaves.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import project_topk
    >>> params = {'w': jnp.array([[3., -1.], [0.5, -4.]]), 'b': jnp.array([9., 9.])}
    >>> sparse, masks = project_topk(params, 0.5)
    >>> sparse['w']
    Array([[ 3.,  0.],
           [ 0., -4.]], dtype=float32)
    >>> sparse['b'], masks['w'].sum()
    (Array([9., 9.], dtype=float32), Array(2, dtype=int32))

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (§3.4, generalized projection).
  """
  structure = _structures.check_config(
      sparsity, _structures.check_structure(structure))
  resolved = _prunable.resolve(tree, prunable)
  if scores is None:
    score_leaves = [None] * len(resolved.leaves)
  else:
    try:
      score_leaves = resolved.treedef.flatten_up_to(scores)
    except (ValueError, TypeError) as err:
      raise ValueError(f"`scores` must have the structure of the tree: {err}") from err
    for i, (flag, leaf, score) in enumerate(zip(resolved.flags, resolved.leaves, score_leaves)):
      if not flag:
        score_leaves[i] = None
      elif score is None or jnp.shape(score) != jnp.shape(leaf):
        raise ValueError(
            f"`scores` for prunable leaf '{resolved.paths[i]}' must have shape "
            f"{jnp.shape(leaf)}, got {None if score is None else jnp.shape(score)}."
        )
  pruned = [i for i, flag in enumerate(resolved.flags) if flag]
  for i in pruned:
    _check_structure(jnp.shape(resolved.leaves[i]), structure, resolved.paths[i])
  counts = _keep_counts([jnp.shape(resolved.leaves[i]) for i in pruned], sparsity, structure)
  sparse_leaves, sparse_masks = _project_leaves(
      [resolved.leaves[i] for i in pruned], [score_leaves[i] for i in pruned], counts,
      structure=structure,
  )
  # Non-prunable leaves never enter the kernel: returned as they are, dtype included.
  projected = list(resolved.leaves)
  masks = [jnp.ones(jnp.shape(leaf), bool) for leaf in resolved.leaves]
  for i, leaf, mask in zip(pruned, sparse_leaves, sparse_masks):
    projected[i], masks[i] = leaf, mask
  return (jax.tree.unflatten(resolved.treedef, projected),
          jax.tree.unflatten(resolved.treedef, masks))
