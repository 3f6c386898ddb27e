"""Typed descriptions of the sparsity set: which entries compete for the kept slots.

Four small, hashable NamedTuples (after JaxPruner's ``sparsity_types``):

* :class:`Global`: one threshold over all prunable leaves (default; vision);
* :class:`PerLeaf`: the same sparsity in every prunable leaf (LLM);
* :class:`PerOutput`: the same sparsity within every output unit (Wanda's rows);
* :class:`NM`: ``n`` kept in every ``m`` consecutive entries (2:4 hardware sparsity);
* :class:`ERK`: a per-leaf sparsity from the leaf's shape (Erdős–Rényi-Kernel),
  the same total as :class:`Global`.

:class:`Projection` bundles a sparsity, a structure and a ``prunable`` rule
into one value that can be built once from a config and passed around.

Two structures compare equal only when they have the same type and fields
(``Global() != PerLeaf()``, though both are empty tuples), so they are safe
static arguments of ``jax.jit``.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from safe_optax import _prunable


class _Typed:
  """Equality and hash that include the type, so empty structures differ."""

  __slots__ = ()

  def __eq__(self, other: Any) -> bool:
    return type(self) is type(other) and tuple.__eq__(self, other)

  def __ne__(self, other: Any) -> bool:
    return not self == other

  def __hash__(self) -> int:
    return hash((type(self).__name__,) + tuple(self))


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_axis(axis: Any, name: str) -> None:
  if not _is_int(axis):
    raise ValueError(f"{name} `axis` must be an int, got {axis!r}.")


def _check_nm(n: Any, m: Any, axis: Any) -> None:
  if not (_is_int(n) and _is_int(m) and 1 <= n <= m):
    raise ValueError(f"NM(n, m) needs integers with 1 <= n <= m, got n={n}, m={m}.")
  if not _is_int(axis):
    raise ValueError(f"NM `axis` must be an int (the reduction axis, e.g. -2), got {axis!r}.")


class _GlobalFields(NamedTuple):
  pass


class Global(_Typed, _GlobalFields):
  """Unstructured sparsity with one threshold across all prunable leaves (the default).

  Layers end up with different sparsities: the vision setting of the paper.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import Global, project_topk
    >>> tree = {'a': jnp.array([[1., 2.]]), 'b': jnp.array([[3., 4.]])}
    >>> project_topk(tree, 0.5, structure=Global())[0]  # the 2 largest of all 4
    {'a': Array([[0., 0.]], dtype=float32), 'b': Array([[3., 4.]], dtype=float32)}
  """

  __slots__ = ()


class _PerLeafFields(NamedTuple):
  pass


class PerLeaf(_Typed, _PerLeafFields):
  """Unstructured sparsity with the same fraction pruned in every prunable leaf.

  The LLM setting (one threshold per matrix).

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import PerLeaf, project_topk
    >>> tree = {'a': jnp.array([[1., 2.]]), 'b': jnp.array([[3., 4.]])}
    >>> project_topk(tree, 0.5, structure=PerLeaf())[0]  # the largest of each leaf
    {'a': Array([[0., 2.]], dtype=float32), 'b': Array([[0., 4.]], dtype=float32)}
  """

  __slots__ = ()


class _PerOutputFields(NamedTuple):
  axis: int = -1


class PerOutput(_Typed, _PerOutputFields):
  """Unstructured sparsity with the same fraction kept in every output unit.

  Each group is every entry sharing one index along ``axis`` (the output axis,
  ``-1`` for Flax kernels): Wanda's per-output-row comparison group.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import PerOutput, project_topk
    >>> w = jnp.array([[1., 4.], [2., 3.]])  # (in, out): columns are output units
    >>> project_topk({'w': w}, 0.5, structure=PerOutput())[0]['w']
    Array([[0., 4.],
           [2., 0.]], dtype=float32)
  """

  __slots__ = ()

  def __new__(cls, axis: int = -1) -> "PerOutput":
    _check_axis(axis, "PerOutput")
    return super().__new__(cls, axis)


class _NMFields(NamedTuple):
  n: int
  m: int
  axis: int = -2


class NM(_Typed, _NMFields):
  """N:M semi-structured sparsity: keep ``n`` of every ``m`` consecutive entries.

  Groups run along ``axis``, the reduction (input) axis: ``-2`` is ``in`` for a
  Flax ``Dense`` kernel ``(in, out)`` and for a conv kernel ``(h, w, in, out)``.
  Checked when built: ``NM(3, 2)`` raises ``ValueError``. Whether each
  prunable leaf's ``axis`` is divisible by ``m`` is checked by the
  transforms' ``init`` (and by :func:`project_topk`), naming the leaf.

  Examples:
    >>> from safe_optax import NM
    >>> NM(2, 4)
    NM(n=2, m=4, axis=-2)
    >>> NM(3, 2)
    Traceback (most recent call last):
    ...
    ValueError: NM(n, m) needs integers with 1 <= n <= m, got n=3, m=2.
  """

  __slots__ = ()

  def __new__(cls, n: int, m: int, axis: int = -2) -> "NM":
    _check_nm(n, m, axis)
    return super().__new__(cls, n, m, axis)


def check_power_scale(power_scale: Any) -> float:
  """``power_scale`` as a float; raises unless it is a finite real ``>= 0``."""
  if isinstance(power_scale, bool) or not isinstance(power_scale, numbers.Real):
    raise TypeError(f"ERK `power_scale` must be a finite real number >= 0, got {power_scale!r}.")
  if not (np.isfinite(power_scale) and power_scale >= 0):
    raise ValueError(f"ERK `power_scale` must be a finite real number >= 0, got {power_scale!r}.")
  return float(power_scale)


class _ERKFields(NamedTuple):
  power_scale: float = 1.0


class ERK(_Typed, _ERKFields):
  r"""Unstructured sparsity allocated across leaves by shape (Erdős–Rényi-Kernel).

  The kept entries of all prunable leaves add up to the same number as
  :class:`Global`'s, but each leaf gets its own count, fixed by its shape: a
  leaf of shape ``(d_1, ..., d_r)`` and size ``n`` keeps a fraction
  ``eps * ((d_1 + ... + d_r) / n) ** power_scale`` of its entries, one ``eps``
  for the model, and a leaf whose fraction would pass 1 stays dense (the
  allocation of RigL, Evci et al. 2020, used by JaxPruner and most
  sparse-training code). Small layers (the output layer, the first conv)
  stay denser than large ones, so no layer is emptied at extreme sparsity,
  which :class:`Global` can do at initialisation (magnitudes are set by each
  layer's fan-in). Inside a leaf the largest scores are kept, as with
  :class:`PerLeaf`. The counts are :func:`safe_optax.erk_keep_counts`.

  Attributes:
    power_scale: exponent of the raw density; ``1`` is ERK, ``0`` the uniform
      allocation (:class:`PerLeaf`'s fractions, rounded to the same total).

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import ERK, project_topk
    >>> tree = {'big': jnp.ones((40, 30)), 'small': jnp.ones((30, 2))}
    >>> masks = project_topk(tree, 0.9, structure=ERK())[1]
    >>> int(masks['big'].sum()), int(masks['small'].sum())   # 126 kept in all: 7 % and 67 %
    (86, 40)
    >>> ERK(-1.0)
    Traceback (most recent call last):
    ...
    ValueError: ERK `power_scale` must be a finite real number >= 0, got -1.0.

  References:
    Evci, Gale, Menick, Castro, Elsen, `Rigging the Lottery: Making All
    Tickets Winners <https://arxiv.org/abs/1911.11134>`_, ICML 2020.
  """

  __slots__ = ()

  def __new__(cls, power_scale: float = 1.0) -> "ERK":
    return super().__new__(cls, check_power_scale(power_scale))


Structure = Union[Global, PerLeaf, PerOutput, NM, ERK]
STRUCTURES = (Global, PerLeaf, PerOutput, NM, ERK)
_ALLOWED = "Global(), PerLeaf(), PerOutput(axis), NM(n, m, axis) or ERK(power_scale)"


def validate_sparsity(sparsity: Any, name: str = "sparsity") -> None:
  """Raises for a concrete sparsity outside ``[0, 1)``; tracers pass.

  Raises:
    TypeError: not a real scalar.
    ValueError: outside ``[0, 1)``.
  """
  if isinstance(sparsity, jax.core.Tracer):
    return
  if isinstance(sparsity, bool):
    raise TypeError(f"`{name}` must be a real number in [0, 1), got {sparsity!r}.")
  if isinstance(sparsity, (numbers.Real, jax.Array, np.ndarray)) and jnp.ndim(sparsity) == 0:
    value = float(sparsity)
    if not 0.0 <= value < 1.0:
      raise ValueError(f"`{name}` must be in [0, 1), got {value}.")
    return
  raise TypeError(f"`{name}` must be a real number in [0, 1), got {sparsity!r}.")


def check_structure(structure: Any) -> Structure:
  """Returns ``structure`` if it is one of :data:`STRUCTURES`.

  Raises:
    TypeError: anything else (``None`` and strings included), naming the
      allowed structures.
  """
  if not isinstance(structure, STRUCTURES):
    raise TypeError(f"`structure` must be one of {_ALLOWED}, got {structure!r}.")
  return structure


def check_config(sparsity: Any, structure: Structure) -> Structure:
  """Validates a sparsity against a typed structure at construction time; returns it.

  Args:
    sparsity: fraction to prune (unstructured and :class:`PerOutput`), or
      ``None`` / ``1 - n/m`` for :class:`NM`. Tracers pass.
    structure: one of :data:`STRUCTURES`.

  Returns:
    ``structure``, checked.

  Raises:
    TypeError: ``structure`` is not a structure, or ``sparsity`` not a number.
    ValueError: ``sparsity`` outside ``[0, 1)``, missing, or contradicting ``NM``.
  """
  if not isinstance(structure, STRUCTURES):
    raise TypeError(f"`structure` must be one of {_ALLOWED}, got {structure!r}.")
  if isinstance(structure, NM):
    n, m = structure.n, structure.m
    _check_nm(n, m, structure.axis)  # NM._replace bypasses the check in NM()
    if sparsity is not None:
      validate_sparsity(sparsity)
      if not isinstance(sparsity, jax.core.Tracer) and abs(float(sparsity) - (1 - n / m)) > 1e-6:
        raise ValueError(
            f"`sparsity`={float(sparsity)} contradicts NM({n}, {m}), which prunes "
            f"{1 - n / m:g}; pass sparsity=None or {1 - n / m:g}."
        )
    return structure
  if sparsity is None:
    raise ValueError("`sparsity` is required unless `structure` is NM(n, m).")
  validate_sparsity(sparsity)
  if isinstance(structure, PerOutput):
    _check_axis(structure.axis, "PerOutput")  # PerOutput._replace bypasses the check
  if isinstance(structure, ERK):
    check_power_scale(structure.power_scale)  # so does ERK._replace
  return structure


class _ProjectionFields(NamedTuple):
  sparsity: Any
  structure: Structure = Global()
  prunable: _prunable.Prunable = None


class Projection(_ProjectionFields):
  """One sparsity set: how much is pruned, in which groups, and which leaves.

  Build it once (from a config, say) and pass its fields on: ``project_topk``
  and ``finalize`` take it as keywords (``**projection._asdict()``), the
  transforms as ``(projection.sparsity, structure=projection.structure,
  prunable=projection.prunable)``. Checked when built, like the transforms.

  Attributes:
    sparsity: fraction of prunable entries to zero, in ``[0, 1)``; ``None``
      (or ``1 - n/m``) with :class:`NM`.
    structure: :class:`Global` (default), :class:`PerLeaf`,
      :class:`PerOutput` or :class:`NM`.
    prunable: which leaves are pruned, as in :func:`project_topk`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import PerLeaf, Projection, finalize
    >>> projection = Projection(0.5, PerLeaf())
    >>> params = {'a': jnp.array([[1., 2.]]), 'b': jnp.array([[3., 4.]])}
    >>> finalize(params, **projection._asdict())[0]
    {'a': Array([[0., 2.]], dtype=float32), 'b': Array([[0., 4.]], dtype=float32)}
    >>> Projection(0.3, structure='per_leaf')
    Traceback (most recent call last):
    ...
    TypeError: `structure` must be one of Global(), PerLeaf(), PerOutput(axis), NM(n, m, axis) or ERK(power_scale), got 'per_leaf'.
  """

  __slots__ = ()

  def __new__(cls, sparsity: Any, structure: Structure = Global(),
              prunable: _prunable.Prunable = None) -> "Projection":
    check_config(sparsity, structure)
    return super().__new__(cls, sparsity, structure, prunable)
