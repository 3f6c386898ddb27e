r"""Sharpness measures and loss landscapes for any parameter pytree and loss.

The paper's §4.1 evidence that SAFE finds *flat* sparse minima, made
measurable for any model:

* :func:`max_hessian_eigenvalue`: :math:`\lambda_{\max}` of the Hessian of the
  loss averaged over a fixed list of evaluation batches, by power iteration on
  Hessian-vector products (forward-over-reverse, ``jax.jvp`` of ``jax.grad``),
  run inside one ``lax.while_loop`` (no host round-trip per iteration) with a
  relative tolerance and an iteration cap;
* :func:`hessian_trace`: Hutchinson's estimate :math:`E_z[z^\top H z]`
  (reusing :func:`safe_optax.hutchinson_diagonal`);
* :func:`filter_normalized_direction`, :func:`loss_line` and
  :func:`loss_surface`: 1D and 2D loss landscapes along random
  filter-normalised directions (Li et al., 2018);
* :func:`plot_weight_histograms` / :func:`save_weight_histograms`: weight
  distributions (dense vs sparse), a PNG with matplotlib (imported only when
  called).

Conventions: ``loss_fn(params, batch) -> scalar`` is the mean loss of one
batch; ``batches`` is a non-empty sequence of batches with identical shapes
(every batch is a pytree of arrays), stacked once and scanned, so the averaged
Hessian is :math:`H = \frac{1}{B}\sum_b \nabla^2 \ell(\theta; b)` and memory
holds one batch at a time.

``support`` restricts everything to a subset of the weights, e.g. the kept
weights of a sparse model: a pytree of bools (or 0/1 arrays) shaped like
``params`` -- the keep masks of :func:`safe_optax.finalize` broadcast to the
full tree, see :func:`support_mask`. The restricted Hessian is
:math:`P H P` with :math:`P = \mathrm{diag}(\text{support})`, i.e. the Hessian
of the loss as a function of the kept weights only, pruned weights frozen at
zero (their eigenvalues are reported as 0).

Examples:
  The top eigenvalue of a quadratic with Hessian ``diag(4, 1)``:

  >>> import jax, jax.numpy as jnp
  >>> from safe_optax import flatness
  >>> loss_fn = lambda p, b: 0.5 * jnp.sum(b * p['w'] ** 2)
  >>> batches = [jnp.array([3., 1.]), jnp.array([5., 1.])]  # mean diag(4, 1)
  >>> params = {'w': jnp.ones(2)}
  >>> result = jax.jit(lambda p: flatness.max_hessian_eigenvalue(
  ...     loss_fn, p, batches, key=jax.random.PRNGKey(0)))(params)
  >>> round(float(result.eigenvalue), 4)
  4.0

References:
  Li, Xu, Taylor, Studer, Goldstein, `Visualizing the Loss Landscape of
  Neural Nets <https://arxiv.org/abs/1712.09913>`_, NeurIPS 2018.

  Yao, Gholami, Keutzer, Mahoney, `PyHessian: Neural Networks Through the
  Lens of the Hessian <https://arxiv.org/abs/1912.07145>`_, 2020.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from safe_optax import _prunable
from safe_optax import _scores

__all__ = (
    "PowerIterationResult",
    "filter_normalized_direction",
    "hessian_trace",
    "hessian_vector_product",
    "loss_line",
    "loss_surface",
    "max_hessian_eigenvalue",
    "mean_loss",
    "plot_weight_histograms",
    "save_weight_histograms",
    "support_mask",
)

LossFn = Callable[[Any, Any], jax.Array]
BIAS_MODES = ("zero", "weights")


class PowerIterationResult(NamedTuple):
  """What :func:`max_hessian_eigenvalue` returns."""

  eigenvalue: jax.Array
  """The Rayleigh quotient ``v^T H v`` of the last iterate (float32 scalar)."""
  eigenvector: Any
  """The last unit-norm iterate ``v`` (shaped like ``params``)."""
  num_iterations: jax.Array
  """Hessian-vector products taken (int32)."""
  converged: jax.Array
  """Whether the relative change of the eigenvalue fell below ``tol``."""


def _stack(batches: Sequence[Any]) -> Any:
  try:
    return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *batches)
  except (ValueError, TypeError) as err:
    raise ValueError(f"all `batches` must have the same structure and shapes: {err}") from err


def _prepare(batches: Sequence[Any]) -> Sequence[Any]:
  """Validates ``batches``; a loss that ignores its batch may pass ``[None]``."""
  if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence) or not batches:
    raise ValueError(
        "`batches` must be a non-empty sequence of batches (a list of pytrees of arrays "
        f"with identical shapes); got {type(batches).__name__}.")
  if all(b is None for b in batches):
    return [jnp.zeros(())] * len(batches)
  return batches


def support_mask(params: Any, keep_masks: Any = None, prunable: _prunable.Prunable = None) -> Any:
  """A bool pytree shaped like ``params``: the weights a sparse model keeps.

  Args:
    params: the parameter tree.
    keep_masks: the masks of :func:`safe_optax.finalize` / ``project_topk``
      (bool arrays on prunable leaves; other leaves are kept). ``None`` keeps
      the nonzero entries of prunable leaves (the support of a pruned model).
    prunable: which leaves are pruned (as in :func:`safe_optax.project_topk`).

  Returns:
    A pytree of bool arrays, ``True`` where the weight is free.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax.flatness import support_mask
    >>> support_mask({'w': jnp.array([[0., 2.], [3., 0.]]), 'b': jnp.zeros(2)})
    {'b': Array([ True,  True], dtype=bool), 'w': Array([[False,  True],
           [ True, False]], dtype=bool)}
  """
  resolved = _prunable.resolve(params, prunable)
  if keep_masks is None:
    masks = [leaf != 0 if flag else jnp.ones(jnp.shape(leaf), bool)
             for leaf, flag in zip(resolved.leaves, resolved.flags)]
  else:
    given = resolved.treedef.flatten_up_to(keep_masks)
    masks = [jnp.asarray(m, bool) if flag and m is not None else jnp.ones(jnp.shape(leaf), bool)
             for leaf, m, flag in zip(resolved.leaves, given, resolved.flags)]
  return jax.tree.unflatten(resolved.treedef, masks)


def _apply_support(tree: Any, support: Any) -> Any:
  if support is None:
    return tree
  return jax.tree.map(lambda x, m: jnp.where(m, x, jnp.zeros_like(x)), tree, support)


def mean_loss(loss_fn: LossFn, params: Any, batches: Sequence[Any]) -> jax.Array:
  """``(1/B) sum_b loss_fn(params, batch_b)`` by a scan over the stacked batches."""
  batches = _prepare(batches)
  stacked = _stack(batches)
  total = lax.scan(lambda acc, b: (acc + loss_fn(params, b), None), jnp.zeros((), jnp.float32),
                   stacked)[0]
  return total / len(batches)


def _mean_grad_fn(loss_fn: LossFn, params: Any, batches: Sequence[Any],
                  support: Any) -> Callable[[Any], Any]:
  """``p -> grad`` of the batch-averaged loss restricted to ``support``.

  With pruned weights frozen at their value in ``params`` (zero for a pruned
  model) the Hessian of ``p -> f(P p + (1 - P) params)`` is ``P H P``.
  """
  batches = _prepare(batches)
  stacked = _stack(batches)
  num = len(batches)

  def restricted(p, batch):
    if support is not None:
      p = jax.tree.map(lambda x, x0, m: jnp.where(m, x, x0), p, params, support)
    return loss_fn(p, batch)

  grad = jax.grad(restricted)

  def mean_grad(p):
    zeros = jax.tree.map(jnp.zeros_like, p)
    total = lax.scan(lambda acc, b: (jax.tree.map(jnp.add, acc, grad(p, b)), None),
                     zeros, stacked)[0]
    return jax.tree.map(lambda t: t / num, total)

  return mean_grad


def hessian_vector_product(loss_fn: LossFn, params: Any, batches: Sequence[Any], vector: Any,
                           *, support: Any = None) -> Any:
  r"""``H v`` of the batch-averaged loss (forward-over-reverse), optionally ``P H P v``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    params: where the Hessian is taken.
    batches: the evaluation batches (a non-empty sequence).
    vector: a pytree shaped like ``params``.
    support: optional bool pytree shaped like ``params`` (see module doc).

  Returns:
    A pytree shaped like ``params``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax.flatness import hessian_vector_product
    >>> loss_fn = lambda p, b: jnp.sum(b * p ** 3)  # Hessian diag(6 b p)
    >>> hessian_vector_product(loss_fn, jnp.array([1., 2.]), [jnp.ones(2)], jnp.ones(2))
    Array([ 6., 12.], dtype=float32)
  """
  mean_grad = _mean_grad_fn(loss_fn, params, batches, support)
  return jax.jvp(mean_grad, (params,), (_apply_support(vector, support),))[1]


def _vdot(a: Any, b: Any) -> jax.Array:
  return sum(jnp.vdot(x, y).real.astype(jnp.float32)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _normalize(tree: Any) -> Any:
  norm = jnp.sqrt(_vdot(tree, tree))
  # A zero vector stays zero (its Rayleigh quotient is then 0) instead of NaN.
  scale = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
  return jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree)


def _check_positive_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def max_hessian_eigenvalue(
    loss_fn: LossFn,
    params: Any,
    batches: Sequence[Any],
    *,
    key: jax.Array,
    tol: float = 1e-4,
    max_iterations: int = 100,
    support: Any = None,
) -> PowerIterationResult:
  r"""The largest Hessian eigenvalue by power iteration on Hessian-vector products.

  From a random Gaussian start :math:`v_0` (restricted to ``support``):

  .. math::
    w_k = H v_{k-1},\quad \lambda_k = v_{k-1}^\top w_k,\quad v_k = w_k / \|w_k\|

  until :math:`|\lambda_k - \lambda_{k-1}| \le \mathrm{tol}\,|\lambda_k|` or
  ``max_iterations`` products. ``H`` is the Hessian of the loss averaged over
  ``batches`` (``P H P`` with a ``support``). Power iteration converges to the
  eigenvalue of largest *magnitude*; at a trained minimum that is
  :math:`\lambda_{\max}`, the sharpness the SAFE paper reports. Each iteration
  costs one forward-over-reverse product per batch (about two gradients).

  The loop is a ``lax.while_loop``: the function is traceable, so jit the
  whole measurement once (``loss_fn`` must be a traceable function), passing
  ``batches`` as an argument of the jitted function rather than closing over
  them (closed-over arrays become constants of the compiled program).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (mean loss of one batch).
    params: where the Hessian is taken (e.g. the final sparse model).
    batches: fixed evaluation batches (non-empty sequence, equal shapes).
    key: PRNG key for the start vector.
    tol: relative tolerance on successive eigenvalue estimates (>= 0).
    max_iterations: cap on Hessian-vector products (positive int).
    support: optional bool pytree shaped like ``params``: measure the Hessian
      with respect to these weights only (see :func:`support_mask`).

  Returns:
    A :class:`PowerIterationResult`.

  Raises:
    ValueError: bad ``tol``, ``max_iterations`` or ``batches``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from safe_optax.flatness import max_hessian_eigenvalue
    >>> A = jnp.array([[2., 1.], [1., 2.]])  # eigenvalues 3 and 1
    >>> loss_fn = lambda p, _: 0.5 * p @ A @ p
    >>> result = max_hessian_eigenvalue(loss_fn, jnp.zeros(2), [None], key=jax.random.PRNGKey(1),
    ...                                 tol=1e-6)
    >>> round(float(result.eigenvalue), 4), bool(result.converged)
    (3.0, True)

  References:
    Yao et al., `PyHessian <https://arxiv.org/abs/1912.07145>`_, 2020 (the
    same estimator on a fixed batch set).
  """
  if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol >= 0:
    raise ValueError(f"`tol` must be a float >= 0, got {tol!r}.")
  _check_positive_int("max_iterations", max_iterations)
  mean_grad = _mean_grad_fn(loss_fn, params, batches, support)

  def hvp(v):
    return jax.jvp(mean_grad, (params,), (v,))[1]

  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  start = jax.tree.unflatten(treedef, [
      jax.random.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves)])
  start = _normalize(_apply_support(start, support))

  class Carry(NamedTuple):
    step: jax.Array
    vector: Any
    eigenvalue: jax.Array
    previous: jax.Array

  def done(c: Carry) -> jax.Array:
    return jnp.abs(c.eigenvalue - c.previous) <= tol * jnp.abs(c.eigenvalue)

  def cond(c: Carry) -> jax.Array:
    return (c.step < max_iterations) & ((c.step < 2) | ~done(c))

  def body(c: Carry) -> Carry:
    w = hvp(c.vector)
    eigenvalue = _vdot(c.vector, w)
    return Carry(c.step + 1, _normalize(w), eigenvalue, c.eigenvalue)

  init = Carry(jnp.zeros((), jnp.int32), start, jnp.zeros((), jnp.float32),
               jnp.full((), jnp.inf, jnp.float32))
  final = lax.while_loop(cond, body, init)
  converged = (final.step >= 2) & done(final)
  return PowerIterationResult(final.eigenvalue, final.vector, final.step, converged)


def hessian_trace(
    loss_fn: LossFn,
    params: Any,
    batches: Sequence[Any],
    *,
    key: jax.Array,
    num_probes: int = 100,
    support: Any = None,
) -> jax.Array:
  r"""Hutchinson's estimate of :math:`\mathrm{tr}(H)` (or :math:`\mathrm{tr}(PHP)`).

  :math:`\mathrm{tr}(H) \approx \frac{1}{m}\sum_{i=1}^m z_i^\top H z_i` with
  Rademacher probes :math:`z_i` (restricted to ``support``), through
  :func:`safe_optax.hutchinson_diagonal`. Exact for a diagonal Hessian.

  Args:
    loss_fn, params, batches, support: as in :func:`max_hessian_eigenvalue`.
    key: PRNG key for the probes.
    num_probes: ``m`` (positive int); the variance falls as ``1/m``.

  Returns:
    A float32 scalar.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from safe_optax.flatness import hessian_trace
    >>> loss_fn = lambda p, _: 0.5 * jnp.sum(jnp.array([4., 1., 2.]) * p ** 2)
    >>> float(hessian_trace(loss_fn, jnp.ones(3), [None], key=jax.random.PRNGKey(0),
    ...                     num_probes=3))
    7.0
  """
  _check_positive_int("num_probes", num_probes)
  mean_grad = _mean_grad_fn(loss_fn, params, batches, support)
  diagonal = _scores.hutchinson_diagonal(lambda p, _: mean_grad(p), params, key, num_probes)
  # Off the support the restricted Hessian has zero rows, so its diagonal
  # estimate is already 0 there; the mask only guards against -0/NaN noise.
  diagonal = _apply_support(diagonal, support)
  return sum(jnp.sum(d).astype(jnp.float32) for d in jax.tree.leaves(diagonal))


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
      out.append(_apply_support(d, mask))
      continue
    d = _apply_support(jax.random.normal(k, theta.shape, theta.dtype), mask)
    axes = tuple(range(theta.ndim - 1))
    d_norm = jnp.sqrt(jnp.sum(d * d, axis=axes, keepdims=True))
    theta_norm = jnp.sqrt(jnp.sum(_apply_support(theta, mask) ** 2, axis=axes, keepdims=True))
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


def plot_weight_histograms(
    ax: Any,
    named_params: Mapping[str, Any],
    *,
    prunable: _prunable.Prunable = None,
    bins: int = 100,
    value_range: Optional[tuple[float, float]] = None,
    title: str = "Prunable weights",
) -> None:
  """Draws overlaid histograms of the prunable weights of several models on ``ax``.

  One histogram per model (e.g. ``{'dense': ..., 'SAFE': ..., 'ADMM': ...}``),
  log-scaled counts so the exact zeros of a sparse model and the tails stay
  visible; the legend gives each model's fraction of zeros.

  Args:
    ax: a matplotlib ``Axes``.
    named_params: ``{label: params}``.
    prunable: which leaves are weights (default: ndim >= 2).
    bins: number of bins.
    value_range: histogram range; default: the range of all weights.
    title: axes title.
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  if not named_params:
    raise ValueError("`named_params` must name at least one model.")
  values = {}
  for label, params in named_params.items():
    resolved = _prunable.resolve(params, prunable)
    values[label] = np.concatenate([np.asarray(leaf, np.float32).ravel() for leaf, flag in
                                    zip(resolved.leaves, resolved.flags) if flag])
  if value_range is None:
    value_range = (min(float(v.min()) for v in values.values()),
                   max(float(v.max()) for v in values.values()))
  for label, v in values.items():
    ax.hist(v, bins=bins, range=value_range, histtype="step", log=True,
            label=f"{label} ({np.mean(v == 0):.0%} zeros)")
  ax.set_xlabel("weight value")
  ax.set_ylabel("count (log)")
  ax.set_title(title)
  ax.legend(fontsize="small")


def save_weight_histograms(named_params: Mapping[str, Any], path: os.PathLike,
                           **kwargs: Any) -> None:
  """Saves :func:`plot_weight_histograms` as an image (PNG); matplotlib is imported here.

  Args:
    named_params: ``{label: params}``.
    path: output file (``.png``).
    **kwargs: ``prunable``, ``bins``, ``value_range``, ``title`` of
      :func:`plot_weight_histograms`.
  """
  # A Figure object saves through its own Agg canvas: no pyplot, and the
  # caller's backend (a notebook's inline one) is left alone.
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(5, 3.5))
  plot_weight_histograms(fig.subplots(), named_params, **kwargs)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
