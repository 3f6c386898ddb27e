r"""Sharpness-aware gradients as optax transforms.

:func:`sam` turns the gradient at ``x`` into SAM's gradient at the ascent
point ``x + rho * g / ||g||`` and hands it to an inner transform, the way
``optax.contrib.sam`` takes an inner optimizer: whatever sits inside (a clip,
``optax.MultiSteps``, ``optax.apply_if_finite``, ``optax.masked``) sees SAM's
gradient by construction::

  safe_optax.sam(
      optax.chain(
          optax.clip_by_global_norm(max_norm),       # clips the SAM gradient
          optax.apply_if_finite(                     # counts a NaN from SAM's pass
              optax.MultiSteps(safe_optax.safe(..., rho=None), k),  # mean of k SAM grads
              max_consecutive_errors)),
      rho)

:func:`sam_perturb` is ``sam(optax.identity(), rho)``, for the first place of
an ``optax.chain``; :func:`add_projected_gradient` adds the gradient at the
projected point ``Proj(x)`` (SAFE+SG, CrAM+). All obtain gradients from the
``grad_fn(params, step)`` keyword argument of ``update``.

Their gradient pass replaces the incoming gradient, so a transform placed
*before* them in a chain only moves the ascent point, and a wrapper around
them would give SAM the wrong gradients or parameters. What is structural is
refused at ``init``: ``optax.MaskedNode`` placeholders in ``params`` (inside
``optax.masked`` / ``multi_transform``). The rest (a clip before them, a
``MultiSteps`` or ``apply_if_finite`` around them) cannot be seen from inside
the transform: put those inside :func:`sam`, as above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from safe_optax import _dual
from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _schedules
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import Structure

GradFn = Callable[[Any, int], Any]


def require_grad_fn(grad_fn: Optional[GradFn], name: str) -> GradFn:
  """``grad_fn``, or a ``ValueError`` saying how to pass it."""
  if grad_fn is None:
    raise ValueError(
        f"{name} needs `grad_fn`: call tx.update(grads, state, params, grad_fn=grad_fn) "
        "with grad_fn(params, step) returning the gradient of the same minibatch loss."
    )
  return grad_fn


def check_full_params(params: Any, name: str) -> None:
  """Raises ``ValueError`` when ``params`` hold ``optax.MaskedNode`` placeholders.

  A gradient pass needs every parameter, so inside ``optax.masked`` or
  ``optax.multi_transform`` (which hand the inner transform placeholders for
  the masked-out leaves) it would evaluate the loss at the wrong point.
  """
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  if any(isinstance(leaf, optax.MaskedNode) for leaf in leaves):
    raise ValueError(
        f"{name} inside optax.masked / optax.multi_transform: its grad_fn would get "
        "optax.MaskedNode placeholders instead of the masked-out parameters. Put the mask "
        "inside SAM instead: safe_optax.sam(optax.masked(safe_optax.safe(..., rho=None), "
        "mask), rho) (likewise with optax.multi_transform); or prune a subset with "
        "safe_optax.safe(..., prunable=mask).")


def ascent_point(
    params: Any,
    grads: Any,
    rho: Any,
    *,
    adaptive: bool = False,
    normalize: bool = True,
    eps: float = 1e-12,
) -> Any:
  r"""The ascent point ``x + e`` of SAM (shared by :func:`sam_perturb` and CrAM).

  ``e = rho * g / (||g||_2 + eps)`` with the norm over all leaves; ASAM's
  ``rho * x^2 g / (||x g||_2 + eps)`` with ``adaptive``; the unnormalised
  ``rho * g`` with ``normalize=False`` (CrAM's paper and code). The result
  keeps the dtypes of ``params``.
  """
  if adaptive:
    scaled = jax.tree.map(lambda g, x: g * jnp.abs(x).astype(g.dtype), grads, params)
    direction = jax.tree.map(lambda s, x: s * jnp.abs(x).astype(s.dtype), scaled, params)
    norm = optax.tree.norm(scaled)
  else:
    direction, norm = grads, optax.tree.norm(grads)
  scale = rho / (norm + eps) if normalize else rho
  return jax.tree.map(
      lambda x, d: (x + scale * d).astype(jnp.result_type(x)), params, direction
  )


class SAMState(NamedTuple):
  """State of :func:`sam` and :func:`sam_perturb`."""

  inner: Any
  """State of the inner transform (``optax.EmptyState()`` for :func:`sam_perturb`)."""
  invalid_hyperparams: jax.Array
  """Number of updates whose ``rho`` was negative or NaN (int32).

  A Python ``rho`` is checked at construction; a traced one (from
  ``optax.inject_hyperparams``) only here, so such an update uses ``rho = 0``
  (the plain gradient) and is counted. Check it is 0 after training.
  """


def sam(
    inner: optax.GradientTransformation,
    rho: float,
    *,
    adaptive: bool = False,
    eps: float = 1e-12,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""SAM around an inner transform: ``inner`` gets the gradient ``grad f(x + e)``.

  .. math::

    e = \rho \frac{g}{\|g\|_2 + \epsilon}
    \quad\text{or, adaptive (ASAM),}\quad
    e = \rho \frac{x^2 \odot g}{\|x \odot g\|_2 + \epsilon}

  where ``g`` is the incoming gradient at ``x`` and the norm runs over all
  leaves. The gradient at ``x + e`` comes from ``grad_fn(x + e, 0)``; the
  caller makes ``grad_fn`` use the same minibatch (and dropout key) as ``g``,
  and keeps the first pass's BatchNorm statistics. Like
  ``optax.contrib.sam``, the rest of the optimizer is the ``inner``
  argument, so a clip, ``optax.MultiSteps``, ``optax.apply_if_finite`` or
  ``optax.masked`` inside it sees SAM's gradient.

  Args:
    inner: the transform that receives SAM's gradient, e.g.
      ``optax.chain(optax.clip_by_global_norm(1.0), safe_optax.safe(..., rho=None))``.
      It gets ``params`` and every extra argument (``grad_fn`` included).
    rho: perturbation radius ``>= 0``. A traced value (``inject_hyperparams``)
      that is negative or NaN counts as 0 for that update and is counted in
      :attr:`SAMState.invalid_hyperparams`.
    adaptive: scale the perturbation by ``|x|`` (ASAM).
    eps: guards a zero gradient.
    axis_name: if set, ``pmean`` the perturbed gradient over this axis
      (for ``shard_map`` / ``pmap`` users; not needed with ``jax.jit`` sharding).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`SAMState`; ``update`` needs ``params`` and ``grad_fn``.

  Raises:
    ValueError: at construction, for ``rho`` or ``eps`` out of range; at
      ``init``, for ``optax.MaskedNode`` placeholders in ``params`` (SAM
      inside ``optax.masked``: put the mask inside SAM instead).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import sam
    >>> loss = lambda p: jnp.sum(p ** 4)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = sam(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), rho=0.5)
    >>> params = jnp.array([1.0, 0.0])
    >>> updates, _ = tx.update(grad_fn(params, 0), tx.init(params), params, grad_fn=grad_fn)
    >>> updates  # the gradient at [1.5, 0] is [13.5, 0]: clipped to norm 1, times -0.1
    Array([-0.1, -0. ], dtype=float32)

  References:
    Foret et al., `Sharpness-Aware Minimization for Efficiently Improving
    Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR 2021;
    Kwon et al., `ASAM <https://arxiv.org/abs/2102.11600>`_, ICML 2021.
  """
  _schedules.check_nonnegative(rho, "rho")
  _schedules.check_nonnegative(eps, "eps")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    check_full_params(params, "sam")
    return SAMState(inner=inner.init(params), invalid_hyperparams=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    grad_fn = require_grad_fn(grad_fn, "sam")
    if params is None:
      raise ValueError("sam needs `params` in update(updates, state, params).")
    # A Python rho was checked at construction; a traced one can only be checked here.
    rho_ok = jnp.isfinite(rho) & (jnp.asarray(rho) >= 0)
    rho_now = jnp.where(rho_ok, rho, 0.0)
    grads = grad_fn(ascent_point(params, updates, rho_now, adaptive=adaptive, eps=eps), 0)
    if axis_name is not None:
      grads = lax.pmean(grads, axis_name)
    new_updates, inner_state = inner.update(grads, state.inner, params, grad_fn=grad_fn,
                                            **extra_args)
    invalid = jnp.where(rho_ok, state.invalid_hyperparams,
                        optax.safe_increment(state.invalid_hyperparams))
    return new_updates, SAMState(inner=inner_state, invalid_hyperparams=invalid)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sam_perturb(
    rho: float,
    *,
    adaptive: bool = False,
    eps: float = 1e-12,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Replaces the gradient ``g`` by the SAM gradient ``grad f(x + e)``, in a chain.

  :func:`sam` with ``inner=optax.identity()``: the same perturbation, for
  the first place of an ``optax.chain``. A transform placed before it (a
  clip, say) only moves the ascent point, since the gradient at ``x + e``
  replaces its output; and ``optax.MultiSteps`` / ``optax.apply_if_finite``
  around it would average or check the wrong gradients. Neither can be seen
  from inside the transform, so it is not detected: clip after it, and put
  those wrappers inside :func:`sam` (or after ``sam_perturb`` in the chain).

  Args:
    rho, adaptive, eps, axis_name: as in :func:`sam`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`SAMState`; ``update`` needs ``params`` and ``grad_fn`` and
    ignores other extra arguments.

  Raises:
    ValueError: as :func:`sam`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import sam_perturb
    >>> loss = lambda p: jnp.sum(p ** 4)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = optax.chain(sam_perturb(rho=0.5), optax.sgd(0.1))
    >>> params = jnp.array([1.0, 0.0])
    >>> updates, _ = tx.update(grad_fn(params, 0), tx.init(params), params, grad_fn=grad_fn)
    >>> updates  # gradient at [1.5, 0], times -0.1
    Array([-1.35, -0.  ], dtype=float32)

  References:
    Foret et al., `Sharpness-Aware Minimization for Efficiently Improving
    Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR 2021.
  """
  return sam(optax.identity(), rho, adaptive=adaptive, eps=eps, axis_name=axis_name)


class AddProjectedGradientState(NamedTuple):
  """State of :func:`add_projected_gradient`."""

  count: jax.Array
  """Number of updates taken (int32); keys the Multi draws."""


def add_projected_gradient(
    sparsity: Union[float, Sequence[float], optax.Schedule, None],
    *,
    structure: Structure = Global(),
    prunable: _prunable.Prunable = None,
    seed: int = 0,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Adds the gradient at the projected point: ``g + grad f(Proj(x))``.

  SAFE+SG (and CrAM+) add this "sparse gradient" so the dense iterate also
  trains the sparse model it will be pruned to. With a sequence of
  sparsities (the Multi variants) one is drawn at random at every step.

  Args:
    sparsity: as in :func:`admm_penalty`.
    structure, prunable: as in :func:`safe_optax.project_topk`.
    seed: seeds the Multi draws.
    axis_name: optional ``pmean`` axis for the extra gradient (shard_map users).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`AddProjectedGradientState`; ``update`` needs ``params`` and
    ``grad_fn`` (called with step 1).
    A traced sparsity outside ``[0, 1)`` adds nothing that step.

  Raises:
    ValueError: at ``init``, for ``optax.MaskedNode`` placeholders in
      ``params`` (as :func:`sam`), or when a prunable leaf cannot carry
      ``structure`` (naming its path).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from safe_optax import add_projected_gradient
    >>> grad_fn = lambda p, _: jax.grad(lambda p: jnp.sum(p ** 2))(p)
    >>> tx = add_projected_gradient(0.5)
    >>> params = jnp.array([[3., -1.], [0.5, -4.]])
    >>> updates, _ = tx.update(grad_fn(params, 0), tx.init(params), params, grad_fn=grad_fn)
    >>> updates  # 2x + 2 Proj(x), Proj(x) = [[3, 0], [0, -4]]
    Array([[ 12.,  -2.],
           [  1., -16.]], dtype=float32)

  References:
    Peste et al., `CrAM: A Compression-Aware Minimizer
    <https://arxiv.org/abs/2207.14200>`_, ICLR 2023; SAFE (ICML 2025), App. D.
  """
  structure = _structures.check_structure(structure)
  get_sparsity = _dual.sparsity_fn(sparsity, structure)
  _prunable.check_prunable(prunable)
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params):
    check_full_params(params, "add_projected_gradient")
    if jax.tree.leaves(params):
      _projection.check_structure_fits(params, structure, prunable)
    return AddProjectedGradientState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    del extra_args
    grad_fn = require_grad_fn(grad_fn, "add_projected_gradient")
    if params is None:
      raise ValueError("add_projected_gradient needs `params` in update(updates, state, params).")
    key = jax.random.fold_in(base_key, state.count)
    sparsity_now = get_sparsity(state.count, key)
    projected, _ = _projection.project_topk(
        params, sparsity_now, structure=structure, prunable=prunable)
    sparse_grads = grad_fn(projected, 1)
    if axis_name is not None:
      sparse_grads = lax.pmean(sparse_grads, axis_name)
    # A traced sparsity outside [0, 1) (inject_hyperparams) adds nothing; admm_penalty counts it.
    valid = _dual.in_unit_interval(sparsity_now)
    updates = jax.tree.map(
        lambda g, s: jnp.where(valid, g + s.astype(g.dtype), g), updates, sparse_grads)
    return updates, AddProjectedGradientState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
