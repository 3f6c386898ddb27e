"""The final hard projection and the sparsity report."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from safe_optax import _projection
from safe_optax import _prunable


@dataclasses.dataclass(frozen=True)
class LeafSparsity:
  """Sparsity of one leaf."""

  path: str
  shape: tuple[int, ...]
  size: int
  nonzero: int
  prunable: bool

  @property
  def sparsity(self) -> float:
    return 1.0 - self.nonzero / self.size if self.size else 0.0


@dataclasses.dataclass(frozen=True)
class SparsityReport:
  """Per-leaf and total sparsity of a parameter tree.

  ``sparsity`` is over prunable leaves (what the target refers to);
  ``overall_sparsity`` over every leaf.
  """

  leaves: tuple[LeafSparsity, ...]

  @property
  def prunable_size(self) -> int:
    return sum(leaf.size for leaf in self.leaves if leaf.prunable)

  @property
  def prunable_nonzero(self) -> int:
    return sum(leaf.nonzero for leaf in self.leaves if leaf.prunable)

  @property
  def sparsity(self) -> float:
    return 1.0 - self.prunable_nonzero / self.prunable_size

  @property
  def overall_sparsity(self) -> float:
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
    width = max(len(leaf.path) for leaf in self.leaves)
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

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import sparsity_report
    >>> report = sparsity_report({'w': jnp.array([[1., 0.], [0., 0.]]), 'b': jnp.ones(2)})
    >>> report.sparsity
    0.75
  """
  resolved = _prunable.resolve(tree, prunable)
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
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    scores: Any = None,
    prunable: _prunable.Prunable = None,
) -> tuple[Any, Any]:
  """The final hard projection ``x_final = Proj(x_T)`` of SAFE / SAFE+.

  Same arguments and result as :func:`project_topk` (pass SAFE+'s score tree
  as ``scores``). Outside ``jit`` it raises ``RuntimeError`` when NaN reached
  the prunable weights or scores, instead of returning a NaN model.

  Returns:
    ``(sparse_params, keep_masks)``. Re-estimate BatchNorm statistics next.
  """
  sparse, masks = _projection.project_topk(
      params, sparsity, scope=scope, structure=structure, scores=scores, prunable=prunable
  )
  leaves = jax.tree.leaves(sparse)
  if leaves and not isinstance(leaves[0], jax.core.Tracer):
    flags = _prunable.resolve(params, prunable).flags
    bad = [bool(np.isnan(np.asarray(leaf)).any()) for leaf, f in zip(leaves, flags) if f]
    if any(bad):
      raise RuntimeError("finalize: the parameters or scores contain NaN; the projection is NaN.")
  return sparse, masks
