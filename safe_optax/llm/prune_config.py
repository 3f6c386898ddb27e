"""The configuration of a block-wise LLM pruning run (:class:`PruneConfig`).

Methods, comparison groups and step-size options; :meth:`PruneConfig.projection`
turns a configuration into the core's typed sparsity set.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import safe_optax

METHODS = ("magnitude", "wanda", "sparsegpt", "safe", "safe-plus")
GROUPINGS = ("per_matrix", "per_row")
LR_SCALES = ("none", "rms")


@dataclasses.dataclass(frozen=True)
class PruneConfig:
  """What to prune and how; defaults are the paper's (§4.2, App. C).

  Attributes:
    method: one of ``METHODS``.
    sparsity: fraction of each matrix pruned (unstructured); ignored with ``nm``.
    nm: ``(n, m)`` to keep ``n`` of every ``m`` consecutive inputs (2:4, 4:8).
    grouping: where unstructured scores compete, ``"per_matrix"`` or
      ``"per_row"`` (each output row keeps the same count); ``None`` is
      per row for Wanda / SAFE+ and per matrix for magnitude / SAFE.
    epochs, batch_size, learning_rate, warmup_epochs, rho, penalty,
    dual_every: SAFE / SAFE+ (Adam betas 0.9 / 0.95, no weight decay,
      linear warm-up then linear decay to 0, constant ``lambda``).
    lr_scale: ``"none"`` (the paper: every matrix steps by ``learning_rate``)
      or ``"rms"``: each matrix's Adam step is multiplied by the RMS of its
      dense weights, so ``learning_rate`` is relative (a fraction of the
      matrix's typical weight per step). Adam moves a weight by at most about
      the learning rate per step, so an absolute rate tuned for a 7B model's
      weights can be too small to move a small model's weights far.
    blocksize, percdamp: SparseGPT's lazy batch width and damping.
    chunk: windows per forward call when computing targets and statistics.
    seed: shuffles SAFE's minibatches.
  """

  method: str
  sparsity: float = 0.5
  nm: Optional[tuple[int, int]] = None
  grouping: Optional[str] = None
  epochs: int = 30
  batch_size: int = 8
  learning_rate: float = 2e-4
  warmup_epochs: int = 2
  rho: float = 2e-4
  penalty: float = 1e-3
  dual_every: int = 32
  lr_scale: str = "none"
  blocksize: int = 128
  percdamp: float = 0.01
  chunk: int = 8
  seed: int = 0

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"`method` must be one of {METHODS}, got {self.method!r}.")
    if self.nm is not None:
      n, m = self.nm
      if not (isinstance(n, int) and isinstance(m, int) and 1 <= n < m):
        raise ValueError(f"`nm` must be (n, m) integers with 1 <= n < m, got {self.nm!r}.")
    elif not 0.0 <= self.sparsity < 1.0:
      raise ValueError(f"`sparsity` must be in [0, 1), got {self.sparsity}.")
    if self.grouping is not None:
      if self.grouping not in GROUPINGS:
        raise ValueError(f"`grouping` must be one of {GROUPINGS} or None, got {self.grouping!r}.")
      if self.nm is not None or self.method == "sparsegpt":
        raise ValueError("`grouping` applies to unstructured magnitude / wanda / safe / "
                         "safe-plus; N:M and SparseGPT choose their own groups.")
    for name in ("epochs", "batch_size", "dual_every", "blocksize", "chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if self.lr_scale not in LR_SCALES:
      raise ValueError(f"`lr_scale` must be one of {LR_SCALES}, got {self.lr_scale!r}.")
    if not isinstance(self.warmup_epochs, int) or self.warmup_epochs < 0:
      raise ValueError(f"`warmup_epochs` must be an int >= 0, got {self.warmup_epochs!r}.")
    for name in ("learning_rate", "rho", "penalty", "percdamp"):
      if getattr(self, name) < 0:
        raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")

  @property
  def target_sparsity(self) -> float:
    """The fraction of each matrix pruned: ``1 - N/M`` with ``nm``, else ``sparsity``."""
    return 1.0 - self.nm[0] / self.nm[1] if self.nm else self.sparsity

  @property
  def per_row(self) -> bool:
    """Whether unstructured scores compete within each output row."""
    if self.grouping is None:
      return self.method in ("wanda", "safe-plus")
    return self.grouping == "per_row"

  def projection(self) -> safe_optax.Projection:
    """The sparsity set of this config: N:M, per output row, or per matrix.

    ``project_topk`` and ``finalize`` take it as ``**projection._asdict()``.

    Examples:
      >>> from safe_optax.llm.prune import PruneConfig
      >>> PruneConfig("magnitude").projection()
      Projection(sparsity=0.5, structure=PerLeaf(), prunable=None)
      >>> PruneConfig("wanda", nm=(2, 4)).projection().structure
      NM(n=2, m=4, axis=-2)
    """
    if self.nm is not None:
      return safe_optax.Projection(None, safe_optax.NM(*self.nm))
    if self.per_row:
      return safe_optax.Projection(self.sparsity, safe_optax.PerOutput())
    return safe_optax.Projection(self.sparsity, safe_optax.PerLeaf())
