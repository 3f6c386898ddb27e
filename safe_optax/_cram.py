r"""CrAM / CrAM+ (Peste et al., 2023): the gradient at the compressed ascent point.

A baseline of the SAFE paper (§4.4) in the shape of :func:`safe_optax.sam_perturb`:
it replaces the incoming gradient, so it goes first in an ``optax.chain``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from safe_optax import _dual
from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _sam
from safe_optax import _schedules
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import Structure


class CramState(NamedTuple):
  """State of :func:`cram`."""

  count: jax.Array
  """Number of updates taken (int32); keys the Multi draws."""


def cram(
    rho: float,
    sparsity: Union[float, Sequence[float], optax.Schedule, None],
    *,
    plus: bool = False,
    structure: Structure = Global(),
    prunable: _prunable.Prunable = None,
    eps: float = 1e-12,
    normalize: bool = True,
    sparse_grad: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""CrAM / CrAM+: the gradient at the compressed ascent point.

  .. math::

    \tilde x = C\!\left(x + \rho \frac{g}{\|g\|_2 + \epsilon}\right), \qquad
    g' = \nabla f(\tilde x) \quad (+\, g \text{ for CrAM+})

  where ``g`` is the incoming gradient at ``x`` and ``C`` the top-k magnitude
  projection :func:`safe_optax.project_topk` at ``sparsity`` (prunable leaves
  only). As in the paper, ``\nabla f(\tilde x)`` is applied to ``x`` as it is
  (a straight-through step: no derivative through ``C``). Place it first in
  the chain, like :func:`safe_optax.sam_perturb`, e.g.
  ``chain(cram(...), add_decayed_weights(wd), sgd(lr, momentum))``.

  Choices, against Peste et al. (2023): the paper's update (Eq. 3) and its
  code's default take the *unnormalised* ascent step ``x + rho * g`` (code:
  ``grad_norm=False``, ``rho=0.05``); here the SAM-normalised step is the
  default, so ``rho`` means what it means for SAM and SAFE, and
  ``normalize=False`` gives the paper's step. The perturbation covers every
  leaf (as both SAM and the CrAM code do); ``C`` prunes only prunable leaves,
  with an exact top-k (the code's percentile threshold may keep fewer on
  ties). The code's best CIFAR runs also mask the compressed-point gradient
  with ``C``'s mask on prunable leaves (``sparse_grad=True`` here) and use
  CrAM+ with a set of sparsities drawn at random every step (CrAM-Multi: pass
  a sequence as ``sparsity``).

  Args:
    rho: ascent radius ``>= 0``.
    sparsity: fraction pruned by ``C``, in ``[0, 1)``; a schedule; or a
      sequence of sparsities, one drawn uniformly at every step (Multi).
      ``None`` only for ``NM``.
    plus: CrAM+: add the incoming gradient ``g``.
    structure, prunable: ``C``'s sparsity set, as in
      :func:`safe_optax.project_topk` (default :class:`safe_optax.Global`).
    eps: guards a zero gradient in the normalisation.
    normalize: SAM's normalised ascent step (default) or the paper's ``rho * g``.
    sparse_grad: zero ``\nabla f(\tilde x)`` where ``C`` pruned (official code's
      ``sparse_grad``; the dense ``g`` of CrAM+ is not masked).
    seed: seeds the Multi draws.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`CramState`; ``update`` needs ``params`` and ``grad_fn(params, step)`` (called
    with step 0, the same minibatch as ``g``), and ignores other extras.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import cram
    >>> loss = lambda p: jnp.sum((p - jnp.array([[2., 0.5]])) ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> params = jnp.array([[1.0, 0.2]])
    >>> tx = cram(rho=0.0, sparsity=0.5)   # rho=0: the gradient at C(x) = [[1, 0]]
    >>> g, _ = tx.update(grad_fn(params, 0), tx.init(params), params, grad_fn=grad_fn)
    >>> g
    Array([[-2., -1.]], dtype=float32)
    >>> tx = cram(rho=0.0, sparsity=0.5, plus=True)   # plus the gradient at x
    >>> g, _ = tx.update(grad_fn(params, 0), tx.init(params), params, grad_fn=grad_fn)
    >>> g
    Array([[-4. , -1.6]], dtype=float32)

  References:
    Peste, Vladu, Kurtic, Lampert, Alistarh, `CrAM: A Compression-Aware
    Minimizer <https://arxiv.org/abs/2207.14200>`_, ICLR 2023.
  """
  _schedules.check_nonnegative(rho, "rho")
  _schedules.check_nonnegative(eps, "eps")
  structure = _structures.check_structure(structure)
  get_sparsity = _dual.sparsity_fn(sparsity, structure)
  _prunable.check_prunable(prunable)
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params):
    _sam.check_full_params(params, "cram")
    return CramState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    del extra_args
    grad_fn = _sam.require_grad_fn(grad_fn, "cram")
    if params is None:
      raise ValueError("cram needs `params` in update(updates, state, params).")
    perturbed = _sam.ascent_point(params, updates, rho, normalize=normalize, eps=eps)
    key = jax.random.fold_in(base_key, state.count)
    compressed, masks = _projection.project_topk(
        perturbed, get_sparsity(state.count, key), structure=structure, prunable=prunable)
    grads = grad_fn(compressed, 0)
    if sparse_grad:
      # Non-prunable leaves have all-True masks, so this masks prunable leaves only.
      grads = jax.tree.map(lambda gc, m: jnp.where(m, gc, jnp.zeros((), gc.dtype)),
                           grads, masks)
    if plus:
      grads = jax.tree.map(lambda gc, g: (gc + g.astype(gc.dtype)), grads, updates)
    grads = jax.tree.map(lambda gc, g: gc.astype(g.dtype), grads, updates)
    return grads, CramState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
