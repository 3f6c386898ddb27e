r"""Loss landscapes along filter-normalised random directions (Li et al., 2018).

The landscape half of :mod:`safe_optax.flatness`: :func:`filter_normalized_direction`
draws a direction scaled filter by filter to the weights, :func:`loss_line`
and :func:`loss_surface` evaluate the batch-averaged loss along one or two
directions.

References:
  Li, Xu, Taylor, Studer, Goldstein, `Visualizing the Loss Landscape of
  Neural Nets <https://arxiv.org/abs/1712.09913>`_, NeurIPS 2018.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from safe_optax._hessian import LossFn, apply_support, mean_loss

BIAS_MODES = ("zero", "weights")


def filter_normalized_direction(
    key: jax.Array,
    params: Any,
    *,
    support: Any = None,
    vectors: str = "zero",
) -> Any:
  r"""A random Gaussian direction, filter-normalised as in Li et al. (2018).

  For every *filter* (the slice of a weight with ndim >= 2 at one index of
  its **last** axis: a Flax ``Dense`` kernel ``(in, out)`` or ``Conv`` kernel
  ``(h, w, in, out)`` has one filter per output unit / channel, the same
  filters as PyTorch's first axis), the direction ``d`` is rescaled to the
  norm of the weights:

  .. math::
    d_{f} \leftarrow \frac{d_{f}}{\|d_{f}\|}\,\|\theta_{f}\|

  Leaves with ``ndim <= 1`` (biases, BatchNorm scales and offsets) follow Li
  et al.'s ``ignore='biasbn'`` default: ``vectors="zero"`` gives them a zero
  direction; ``vectors="weights"`` uses a copy of the weights (their other
  option). With ``support`` the direction is zero off the support and the
  normalisation uses the kept entries only (``||theta_f||`` of a pruned
  filter counts only kept weights anyway); a filter with no kept weight, or
  all-zero weights, gets a zero direction.

  Args:
    key: PRNG key.
    params: the weights the direction is normalised to.
    support: optional bool pytree shaped like ``params``.
    vectors: ``"zero"`` or ``"weights"``, for leaves with ``ndim <= 1``.

  Returns:
    A pytree shaped like ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from safe_optax.flatness import filter_normalized_direction
    >>> params = {'w': jnp.array([[3., 0.], [4., 1.]]), 'b': jnp.ones(2)}
    >>> d = filter_normalized_direction(jax.random.PRNGKey(0), params)
    >>> jnp.linalg.norm(d['w'], axis=0).round(4)  # per output unit: ||theta_f|| = 5, 1
    Array([5., 1.], dtype=float32)
    >>> d['b']
    Array([0., 0.], dtype=float32)
  """
  if vectors not in BIAS_MODES:
    raise ValueError(f"`vectors` must be one of {BIAS_MODES}, got {vectors!r}.")
  leaves, treedef = jax.tree.flatten(params)
  masks = [None] * len(leaves) if support is None else treedef.flatten_up_to(support)
  keys = jax.random.split(key, len(leaves))
  out = []
  for k, theta, mask in zip(keys, leaves, masks):
    theta = jnp.asarray(theta)
    if theta.ndim <= 1:
      d = theta if vectors == "weights" else jnp.zeros_like(theta)
      out.append(apply_support(d, mask))
      continue
    d = apply_support(jax.random.normal(k, theta.shape, theta.dtype), mask)
    axes = tuple(range(theta.ndim - 1))
    d_norm = jnp.sqrt(jnp.sum(d * d, axis=axes, keepdims=True))
    theta_norm = jnp.sqrt(jnp.sum(apply_support(theta, mask) ** 2, axis=axes, keepdims=True))
    scale = jnp.where(d_norm > 0, theta_norm / jnp.where(d_norm > 0, d_norm, 1.0), 0.0)
    out.append(d * scale)
  return jax.tree.unflatten(treedef, out)


def _shift(params: Any, directions: Sequence[Any], coords: jax.Array) -> Any:
  shifted = params
  for c, d in zip(coords, directions):
    shifted = jax.tree.map(lambda p, x, c=c: p + (c * x).astype(p.dtype), shifted, d)
  return shifted


def loss_line(loss_fn: LossFn, params: Any, batches: Sequence[Any], direction: Any,
              alphas: jax.Array) -> jax.Array:
  r"""1D landscape: :math:`L(\alpha) = \bar f(\theta + \alpha d)` for each ``alpha``.

  With ``direction = other_params - params`` and ``alphas`` in ``[0, 1]`` this
  is the linear interpolation between two models (Goodfellow et al., 2015).

  Args:
    loss_fn, params, batches: as in :func:`max_hessian_eigenvalue`.
    direction: pytree shaped like ``params`` (e.g.
      :func:`filter_normalized_direction`).
    alphas: 1-D array of step lengths.

  Returns:
    The batch-averaged loss at each ``alpha``, shape ``alphas.shape``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax.flatness import loss_line
    >>> loss_fn = lambda p, b: jnp.sum((p - b) ** 2)
    >>> loss_line(loss_fn, jnp.zeros(2), [jnp.zeros(2)], jnp.ones(2), jnp.array([-1., 0., 2.]))
    Array([2., 0., 8.], dtype=float32)
  """
  alphas = jnp.asarray(alphas, jnp.float32)
  if alphas.ndim != 1:
    raise ValueError(f"`alphas` must be 1-D, got shape {alphas.shape}.")
  return lax.map(lambda a: mean_loss(loss_fn, _shift(params, [direction], a[None]), batches),
                 alphas)


def loss_surface(loss_fn: LossFn, params: Any, batches: Sequence[Any],
                 directions: tuple[Any, Any], xs: jax.Array, ys: jax.Array) -> jax.Array:
  r"""2D landscape: :math:`L(x, y) = \bar f(\theta + x d_1 + y d_2)` on a grid.

  Args:
    loss_fn, params, batches: as in :func:`max_hessian_eigenvalue`.
    directions: two pytrees shaped like ``params``.
    xs, ys: 1-D coordinate arrays along ``d_1`` and ``d_2``.

  Returns:
    Array of shape ``(len(ys), len(xs))`` (rows follow ``ys``, as
    ``matplotlib.contour(xs, ys, Z)`` expects).

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax.flatness import loss_surface
    >>> loss_fn = lambda p, _: p[0] ** 2 + 4 * p[1] ** 2
    >>> loss_surface(loss_fn, jnp.zeros(2), [jnp.zeros(())], (jnp.array([1., 0.]),
    ...              jnp.array([0., 1.])), jnp.array([0., 1.]), jnp.array([-1., 0., 1.]))
    Array([[4., 5.],
           [0., 1.],
           [4., 5.]], dtype=float32)
  """
  if len(directions) != 2:
    raise ValueError(f"`directions` must be a pair of pytrees, got {len(directions)}.")
  xs, ys = jnp.asarray(xs, jnp.float32), jnp.asarray(ys, jnp.float32)
  if xs.ndim != 1 or ys.ndim != 1:
    raise ValueError(f"`xs` and `ys` must be 1-D, got shapes {xs.shape} and {ys.shape}.")
  grid = jnp.stack(jnp.meshgrid(xs, ys), axis=-1).reshape(-1, 2)
  values = lax.map(lambda c: mean_loss(loss_fn, _shift(params, directions, c), batches), grid)
  return values.reshape(len(ys), len(xs))
