r"""Hessian measures of any loss over a list of batches: lambda_max, trace, Hv, the support.

The sharpness half of :mod:`safe_optax.flatness` (where its conventions for
``loss_fn``, ``batches`` and ``support`` are described):
:func:`max_hessian_eigenvalue` (power iteration on Hessian-vector products),
:func:`hessian_trace` (Hutchinson), the building blocks
:func:`hessian_vector_product` and :func:`mean_loss`, and
:func:`support_mask`, the kept weights of a sparse model.

Two ways to run the Hessian-vector products, with the same arithmetic:

* called outside ``jax.jit`` (concrete arrays), the loops over iterations,
  probes and batches run in Python around one jitted program, "add ``H_b v``
  of one batch to a running sum" (compiled once per ``loss_fn`` and shapes,
  cached); one scalar per power iteration comes back to the host;
* called inside ``jax.jit`` (traced arrays), they are ``lax.while_loop`` /
  ``lax.fori_loop`` / ``lax.scan`` loops, so the whole measurement is one
  program (:func:`hessian_trace` with up to four probes unrolls its probe loop, as
  :func:`safe_optax.hutchinson_diagonal` does).

XLA:CPU rewrites a convolution whose dimension order its Eigen kernel
cannot take (the kernel-gradient and input-gradient convolutions of the
backward pass) only in a program's top-level computation
(``ConvCanonicalization`` walks the entry computation alone), so inside a
loop body they would fall back to a naive loop nest, 20-60x slower
(jax-ml/jax#12868). The loop bodies here therefore go through
:func:`safe_optax.experimental.canonical_convs`, which does that rewrite in JAX
(``benchmarks/perf/eval_speed.py`` times both ways).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from safe_optax import _conv_layout
from safe_optax import _prunable
from safe_optax import _schedules
from safe_optax import _scores

LossFn = Callable[[Any, Any], jax.Array]


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


def apply_support(tree: Any, support: Any) -> Any:
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


def _restricted_grad(loss_fn: LossFn, params: Any, support: Any) -> Callable[[Any, Any], Any]:
  """``(p, batch) -> grad`` of one batch's loss restricted to ``support``.

  With pruned weights frozen at their value in ``params`` (zero for a pruned
  model) the Hessian of ``p -> f(P p + (1 - P) params)`` is ``P H P``.
  """
  def restricted(p, batch):
    if support is not None:
      p = jax.tree.map(lambda x, x0, m: jnp.where(m, x, x0), p, params, support)
    return loss_fn(p, batch)

  return jax.grad(restricted)


def _mean_grad_fn(loss_fn: LossFn, params: Any, batches: Sequence[Any],
                  support: Any) -> Callable[[Any], Any]:
  """``p -> grad`` of the batch-averaged loss restricted to ``support`` (a ``lax.scan``)."""
  batches = _prepare(batches)
  stacked = _stack(batches)
  num = len(batches)
  grad = _restricted_grad(loss_fn, params, support)

  def mean_grad(p):
    zeros = jax.tree.map(jnp.zeros_like, p)
    total = lax.scan(lambda acc, b: (jax.tree.map(jnp.add, acc, grad(p, b)), None),
                     zeros, stacked)[0]
    return jax.tree.map(lambda t: t / num, total)

  # The scan's body holds the backward convolutions (see the module notes).
  return _conv_layout.canonical_convs(mean_grad)


@functools.lru_cache(maxsize=8)
def _add_hvp_program(loss_fn: LossFn) -> Callable[..., Any]:
  """``(total, params, support, vector, batch) -> total + H_b v``, jitted once per ``loss_fn``.

  Cached (a few entries, like the vision trainer's programs) so the repeated
  calls of a measurement, and measurements of one ``loss_fn`` at several
  points, reuse the compiled program; the running sum is donated.
  """
  def add_hvp(total, params, support, vector, batch):
    grad = _restricted_grad(loss_fn, params, support)
    hv = jax.jvp(lambda p: grad(p, batch), (params,), (vector,))[1]
    return jax.tree.map(jnp.add, total, hv)

  return jax.jit(add_hvp, donate_argnums=0)


def _device_batches(batches: Sequence[Any]) -> list[Any]:
  """The validated batches, on the device once (not one host transfer per product)."""
  batches = _prepare(batches)
  jax.eval_shape(_stack, batches)  # the same checks and errors as the stacked path, no copy
  return [jax.device_put(b) for b in batches]


def _summed_hvp(loss_fn: LossFn, params: Any, batches: list[Any], support: Any,
                vector: Any) -> Any:
  """``sum_b H_b v`` by one jitted product per batch (the Python loop of the eager path)."""
  add_hvp = _scores.cached_program(_add_hvp_program, loss_fn)
  total = jax.tree.map(jnp.zeros_like, params)
  for batch in batches:
    total = add_hvp(total, params, support, vector, batch)
  return total


def hessian_vector_product(loss_fn: LossFn, params: Any, batches: Sequence[Any], vector: Any,
                           *, support: Any = None) -> Any:
  r"""``H v`` of the batch-averaged loss (forward-over-reverse), optionally ``P H P v``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    params: where the Hessian is taken.
    batches: the evaluation batches (a non-empty sequence).
    vector: a pytree shaped like ``params``.
    support: optional bool pytree shaped like ``params`` (see :mod:`safe_optax.flatness`).

  Returns:
    A pytree shaped like ``params``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax.flatness import hessian_vector_product
    >>> loss_fn = lambda p, b: jnp.sum(b * p ** 3)  # Hessian diag(6 b p)
    >>> hessian_vector_product(loss_fn, jnp.array([1., 2.]), [jnp.ones(2)], jnp.ones(2))
    Array([ 6., 12.], dtype=float32)
  """
  vector = apply_support(vector, support)
  if _scores.is_traced(params, batches, vector, support):
    mean_grad = _mean_grad_fn(loss_fn, params, batches, support)
    return jax.jvp(mean_grad, (params,), (vector,))[1]
  batches = _device_batches(batches)
  params, support = jax.device_put((params, support))
  total = _summed_hvp(loss_fn, params, batches, support, vector)
  return jax.tree.map(lambda t: t / len(batches), total)


def _vdot(a: Any, b: Any) -> jax.Array:
  return sum(jnp.vdot(x, y).real.astype(jnp.float32)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _normalize(tree: Any) -> Any:
  norm = jnp.sqrt(_vdot(tree, tree))
  # A zero vector stays zero (its Rayleigh quotient is then 0) instead of NaN.
  scale = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
  return jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree)


def _power_update(vector: Any, product: Any, previous: jax.Array,
                  tol: float) -> tuple[jax.Array, Any, jax.Array]:
  """One power-iteration update from ``w = H v``: ``(v^T w, w / |w|, converged)``.

  ``converged``: the relative change from ``previous`` is at most ``tol``.
  """
  eigenvalue = _vdot(vector, product)
  done = jnp.abs(eigenvalue - previous) <= tol * jnp.abs(eigenvalue)
  return eigenvalue, _normalize(product), done


@functools.partial(jax.jit, static_argnums=(3, 4))
def _eager_power_update(vector: Any, total: Any, previous: jax.Array, num: int,
                        tol: float) -> tuple[jax.Array, Any, jax.Array]:
  """:func:`_power_update` of the batch mean ``total / num`` (one program per iteration)."""
  return _power_update(vector, jax.tree.map(lambda t: t / num, total), previous, tol)


def _start_vector(key: jax.Array, params: Any, support: Any) -> Any:
  """A unit Gaussian vector shaped like ``params``, zero off ``support``."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  start = jax.tree.unflatten(treedef, [
      jax.random.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves)])
  return _normalize(apply_support(start, support))


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

  Called with concrete arrays, the iterations run in Python around one
  jitted product per batch (compiled once per ``loss_fn``, kept for later
  calls), reading one scalar per iteration back to decide whether to stop.
  Called inside ``jax.jit`` (``loss_fn`` must then be traceable), the loop
  is one ``lax.while_loop`` (its convolutions through
  :func:`safe_optax.experimental.canonical_convs`, see the module notes); pass
  ``batches`` as an argument of the jitted function rather than closing
  over them (closed-over arrays become constants of the compiled program).
  Both give the same result up to float rounding.

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
  _schedules.check_positive_int(max_iterations, "max_iterations")
  tol = float(tol)
  if not _scores.is_traced(params, batches, key, support):
    return _eager_power_iteration(loss_fn, params, batches, key, tol, max_iterations, support)
  mean_grad = _mean_grad_fn(loss_fn, params, batches, support)

  class Carry(NamedTuple):
    step: jax.Array
    vector: Any
    eigenvalue: jax.Array
    converged: jax.Array

  def cond(c: Carry) -> jax.Array:
    return (c.step < max_iterations) & ((c.step < 2) | ~c.converged)

  def body(c: Carry) -> Carry:
    w = jax.jvp(mean_grad, (params,), (c.vector,))[1]
    eigenvalue, vector, done = _power_update(c.vector, w, c.eigenvalue, tol)
    return Carry(c.step + 1, vector, eigenvalue, done)

  init = Carry(jnp.zeros((), jnp.int32), _start_vector(key, params, support),
               jnp.zeros((), jnp.float32), jnp.zeros((), bool))
  final = lax.while_loop(cond, _conv_layout.canonical_convs(body), init)
  return PowerIterationResult(final.eigenvalue, final.vector, final.step,
                              (final.step >= 2) & final.converged)


def _eager_power_iteration(loss_fn: LossFn, params: Any, batches: Sequence[Any],
                           key: jax.Array, tol: float, max_iterations: int,
                           support: Any) -> PowerIterationResult:
  """:func:`max_hessian_eigenvalue`'s loop in Python over jitted products (concrete inputs)."""
  batches = _device_batches(batches)
  params, support = jax.device_put((params, support))  # once, not per product
  vector = _start_vector(key, params, support)
  eigenvalue = jnp.zeros((), jnp.float32)
  step, converged = 0, False
  while step < max_iterations and (step < 2 or not converged):
    total = _summed_hvp(loss_fn, params, batches, support, vector)
    eigenvalue, vector, done = _eager_power_update(vector, total, eigenvalue, len(batches), tol)
    step += 1
    converged = bool(done)  # the one host read of an iteration
  return PowerIterationResult(eigenvalue, vector, jnp.asarray(step, jnp.int32),
                              jnp.asarray(step >= 2 and converged))


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
  :func:`safe_optax.hutchinson_diagonal` inside ``jax.jit``, or the same
  probes and sums in a Python loop over jitted products when called with
  concrete arrays (as :func:`max_hessian_eigenvalue`). Exact for a diagonal
  Hessian.

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
  _schedules.check_positive_int(num_probes, "num_probes")
  if _scores.is_traced(params, batches, key, support):
    mean_grad = _mean_grad_fn(loss_fn, params, batches, support)
    diagonal = _scores.hutchinson_diagonal(lambda p, _: mean_grad(p), params, key, num_probes)
  else:
    diagonal = _eager_hutchinson_diagonal(loss_fn, params, batches, key, num_probes, support)
  # Off the support the restricted Hessian has zero rows, so its diagonal
  # estimate is already 0 there; the mask only guards against -0/NaN noise.
  diagonal = apply_support(diagonal, support)
  return sum(jnp.sum(d).astype(jnp.float32) for d in jax.tree.leaves(diagonal))


@functools.partial(jax.jit, static_argnums=3, donate_argnums=0)
def _add_probe(total: Any, probe: Any, product_sum: Any, num: int) -> Any:
  """``total + z * (H z)`` with ``H z`` the batch mean ``product_sum / num``."""
  return optax.tree.add(total, optax.tree.mul(probe, jax.tree.map(lambda t: t / num,
                                                                  product_sum)))


def _eager_hutchinson_diagonal(loss_fn: LossFn, params: Any, batches: Sequence[Any],
                               key: jax.Array, num_probes: int, support: Any) -> Any:
  """:func:`safe_optax.hutchinson_diagonal` of the mean Hessian, probe by probe in Python."""
  batches = _device_batches(batches)
  params, support = jax.device_put((params, support))  # once, not per product

  def add_probe(total: Any, probe: Any) -> Any:
    product_sum = _summed_hvp(loss_fn, params, batches, support, probe)
    return _add_probe(total, probe, product_sum, len(batches))

  return _scores.probe_mean(add_probe, params, key, num_probes, loop=False)
