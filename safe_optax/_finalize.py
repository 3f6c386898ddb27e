"""The final hard projection and the sparsity report."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import Structure


@dataclasses.dataclass(frozen=True)
class LeafSparsity:
  """Sparsity of one leaf (a row of :class:`SparsityReport`)."""

  path: str
  """Readable key path, e.g. ``'dense0/kernel'``."""
  shape: tuple[int, ...]
  """The leaf's shape."""
  size: int
  """Number of entries."""
  nonzero: int
  """Number of nonzero entries."""
  prunable: bool
  """Whether the leaf is pruned (counts toward :attr:`SparsityReport.sparsity`)."""

  @property
  def sparsity(self) -> float:
    """Fraction of zero entries, ``1 - nonzero / size`` (0 for an empty leaf)."""
    return 1.0 - self.nonzero / self.size if self.size else 0.0


@dataclasses.dataclass(frozen=True)
class SparsityReport:
  """Per-leaf and total sparsity of a parameter tree.

  ``sparsity`` is over prunable leaves (what the target refers to);
  ``overall_sparsity`` over every leaf. ``str(report)`` is a table with one
  row per leaf.
  """

  leaves: tuple[LeafSparsity, ...]
  """One :class:`LeafSparsity` per leaf, in flatten order."""

  @property
  def prunable_size(self) -> int:
    """Number of entries in prunable leaves."""
    return sum(leaf.size for leaf in self.leaves if leaf.prunable)

  @property
  def prunable_nonzero(self) -> int:
    """Number of nonzero entries in prunable leaves."""
    return sum(leaf.nonzero for leaf in self.leaves if leaf.prunable)

  @property
  def sparsity(self) -> float:
    """Fraction of zeros among prunable entries (what the target sparsity counts); 0 if none."""
    size = self.prunable_size
    return 1.0 - self.prunable_nonzero / size if size else 0.0

  @property
  def overall_sparsity(self) -> float:
    """Fraction of zeros among all entries, dense leaves included."""
    size = sum(leaf.size for leaf in self.leaves)
    return 1.0 - sum(leaf.nonzero for leaf in self.leaves) / size if size else 0.0

  def as_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
        "sparsity": self.sparsity,
        "overall_sparsity": self.overall_sparsity,
        "prunable_size": self.prunable_size,
        "prunable_nonzero": self.prunable_nonzero,
        "leaves": [dict(dataclasses.asdict(leaf), sparsity=leaf.sparsity) for leaf in self.leaves],
    }

  def __str__(self) -> str:
    width = max((len(leaf.path) for leaf in self.leaves), default=0)
    lines = [f"{'leaf':<{width}}  {'shape':>16}  {'nonzero':>10}  {'sparsity':>8}"]
    for leaf in self.leaves:
      mark = "" if leaf.prunable else "  (dense)"
      lines.append(f"{leaf.path:<{width}}  {str(leaf.shape):>16}  {leaf.nonzero:>10}  "
                   f"{leaf.sparsity:>8.4f}{mark}")
    lines.append(f"{'prunable total':<{width}}  {'':>16}  {self.prunable_nonzero:>10}  "
                 f"{self.sparsity:>8.4f}")
    return "\n".join(lines)


def sparsity_report(tree: Any, prunable: _prunable.Prunable = None) -> SparsityReport:
  """Counts nonzeros per leaf (on the host).

  Args:
    tree: pytree of arrays (parameters after :func:`finalize`, or any time).
    prunable: which leaves count as prunable, as in :func:`project_topk`
      (pass the rule used for training).

  Returns:
    A :class:`SparsityReport`. A tree without prunable leaves gets a report
    whose leaves are all dense and whose ``sparsity`` is 0.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import sparsity_report
    >>> report = sparsity_report({'w': jnp.array([[1., 0.], [0., 0.]]), 'b': jnp.ones(2)})
    >>> report.sparsity, report.overall_sparsity
    (0.75, 0.5)
    >>> sparsity_report({'b': jnp.array([1., 0.])}).sparsity  # nothing prunable
    0.0
    >>> print(report)
    leaf        shape     nonzero  sparsity
    b            (2,)           2    0.0000  (dense)
    w          (2, 2)           1    0.7500
    prunable total              1    0.7500
  """
  resolved = _prunable.resolve(tree, prunable, allow_none=True)
  leaves = []
  for leaf, flag, path in zip(resolved.leaves, resolved.flags, resolved.paths):
    array = np.asarray(jax.device_get(leaf))
    leaves.append(LeafSparsity(path, tuple(array.shape), int(array.size),
                               int(np.count_nonzero(array)), flag))
  return SparsityReport(tuple(leaves))


def finalize(
    params: Any,
    sparsity: Any = None,
    *,
    structure: Structure = Global(),
    scores: Any = None,
    prunable: _prunable.Prunable = None,
) -> tuple[Any, Any]:
  r"""The final hard projection ``x_final = Proj(x_T)`` of SAFE / SAFE+.

  .. math::

    x_\mathrm{final} = \arg\min_{\|z\|_0 \le d} (z - x_T)^\top P (z - x_T)

  with ``P = I`` by default (magnitude) or SAFE+'s saliency through
  ``scores``. Same arguments and result as :func:`project_topk`; pass the
  sparsity, structure and ``prunable`` used in training (one
  :class:`Projection` holds all three: ``finalize(params,
  **projection._asdict())``). Outside
  ``jit`` it raises ``RuntimeError`` when NaN reached the prunable weights
  or scores, instead of returning a NaN model.

  Args:
    params: the trained parameters ``x_T`` (not modified).
    sparsity: fraction of prunable entries to zero, in ``[0, 1)``
      (``None`` with ``structure=NM(...)``).
    structure: :class:`Global` (default), :class:`PerLeaf`,
      :class:`PerOutput` or :class:`NM`.
    scores: optional score tree (SAFE+, e.g. :func:`snip_scores`).
    prunable: which leaves are pruned, as in :func:`project_topk`.

  Returns:
    ``(sparse_params, keep_masks)``. Re-estimate BatchNorm statistics next.

  Raises:
    RuntimeError: NaN in the prunable weights or scores (outside ``jit``).
    ValueError, TypeError: as :func:`project_topk`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import finalize
    >>> params = {'w': jnp.array([[3., -1.], [0.5, -4.]]), 'b': jnp.array([1., 1.])}
    >>> sparse, masks = finalize(params, 0.5)
    >>> sparse['w'], masks['b']
    (Array([[ 3.,  0.],
           [ 0., -4.]], dtype=float32), Array([ True,  True], dtype=bool))

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (Algorithm 1, final projection).
  """
  sparse, masks = _projection.project_topk(
      params, sparsity, structure=_structures.check_structure(structure),
      scores=scores, prunable=prunable)
  leaves = jax.tree.leaves(sparse)
  if leaves and not isinstance(leaves[0], jax.core.Tracer):
    flags = _prunable.resolve(params, prunable).flags
    bad = [bool(np.isnan(np.asarray(leaf)).any()) for leaf, f in zip(leaves, flags) if f]
    if any(bad):
      raise RuntimeError("finalize: the parameters or scores contain NaN; the projection is NaN.")
  return sparse, masks
