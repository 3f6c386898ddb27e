r"""The ADMM dual step of SAFE: ``z = Proj(x + u)``, ``u = u + x - z``.

Shared by :func:`safe_optax.admm_penalty` and custom training loops, with the
resolution of a ``sparsity`` argument (a number, a schedule or SAFE-Multi's
set of choices) into the value used at one dual update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax

from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import NM
from safe_optax._structures import Structure

SparsityArg = Union[float, Sequence[float], optax.Schedule, None]


def sparsity_fn(sparsity: SparsityArg, structure: Structure) -> Callable[[Any, Any], Any]:
  """Validates the sparsity against a typed structure; returns ``(count, key) -> sparsity``.

  A number (or traced scalar) is constant; a sequence is SAFE-Multi's set,
  drawn uniformly at random with ``key``; a callable is a schedule.
  """
  if callable(sparsity):
    _structures.check_config(None if isinstance(structure, NM) else 0.5, structure)
    return lambda count, key: sparsity(count)
  if isinstance(sparsity, Sequence) and not isinstance(sparsity, (str, bytes)):
    if not sparsity:
      raise ValueError("`sparsity` as a set of choices (SAFE-Multi) must not be empty.")
    for choice in sparsity:
      _structures.check_config(choice, structure)
    choices = jnp.asarray(sparsity, jnp.float32)
    return lambda count, key: jax.random.choice(key, choices)
  _structures.check_config(sparsity, structure)
  return lambda count, key: sparsity


def in_unit_interval(sparsity: Any) -> Any:
  """Whether a (possibly traced) sparsity lies in ``[0, 1)``; NaN does not.

  ``None`` (N:M, whose sparsity is fixed by the structure) and Python numbers
  (checked at construction) are valid without any array work.
  """
  if sparsity is None or isinstance(sparsity, (int, float)):
    return True
  return (sparsity >= 0) & (sparsity < 1)


def dual_update(
    params: Any,
    u: Sequence[jax.Array],
    sparsity: Any,
    *,
    flags: tuple[bool, ...],
    first: jax.Array,
    structure: Structure = Global(),
    scores: Optional[Any] = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
  r"""One ADMM z/u step on the prunable leaves: ``z = Proj(x + u); u = u + x - z``.

  .. math::

    z \leftarrow \mathrm{Proj}(x + u), \qquad u \leftarrow u + x - z

  (``u`` unchanged when ``first``). The new ``z`` depends only on ``x + u``,
  so the old ``z`` is not an argument. :func:`admm_penalty` calls it every
  ``dual_every`` steps; it is public for custom training loops.

  Args:
    params: the full parameter tree ``x``.
    u: list of the prunable leaves' ``u``.
    sparsity: target sparsity (number or traced scalar; ``None`` for ``NM``).
    flags: prunable flags of ``params``' leaves.
    first: True at initialisation, where ``u`` stays 0 (``z0 = Proj(x0)``).
    structure: as in :func:`safe_optax.project_topk`.
    scores: optional list of scores for ``x + u`` (SAFE+).

  Returns:
    The new ``(z, u)`` lists.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import dual_update
    >>> params = {'b': jnp.ones(2), 'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> z, u = dual_update(params, [jnp.array([[0., 0.], [1., 0.]])], 0.5,
    ...                    flags=(False, True), first=jnp.array(False))
    >>> z[0]  # the 2 largest of |x + u| = [[4, 3], [1.2, 0.1]]
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)
    >>> u[0]  # u + x - z
    Array([[0. , 0. ],
           [1.2, 0.1]], dtype=float32)

  References:
    Boyd et al., `Distributed Optimization and Statistical Learning via the
    Alternating Direction Method of Multipliers
    <https://doi.org/10.1561/2200000016>`_, 2011 (scaled form, §3.1.1).
  """
  structure = _structures.check_structure(structure)
  x = _prunable.prunable_leaves(params, flags)
  v = [xi + ui for xi, ui in zip(x, u)]
  z_new, _ = _projection.project_topk(
      v, sparsity, structure=structure, scores=scores, prunable=[True] * len(v))
  u_new = [jnp.where(first, ui, ui + xi - zi) for xi, ui, zi in zip(x, u, z_new)]
  return list(z_new), u_new
