r"""Sharpness-aware gradients as optax transforms.

:func:`sam_perturb` turns the gradient at ``x`` into SAM's gradient at the
ascent point ``x + rho * g / ||g||``; :func:`add_projected_gradient` adds the
gradient at the projected point ``Proj(x)`` (SAFE+SG, CrAM+). Both obtain
gradients from the ``grad_fn(params, step)`` keyword argument of ``update``,
the convention of ``optax.contrib.sam``.

Their gradient pass replaces the incoming gradient, so they go **first** in
the chain, on all parameters, and the optax wrappers that must see the final
gradient go after them, around the rest::

  optax.chain(
      safe_optax.sam_perturb(rho),                 # (+ add_projected_gradient)
      optax.clip_by_global_norm(max_norm),         # clips the SAM gradient
      optax.apply_if_finite(                       # counts a NaN from SAM's pass
          optax.MultiSteps(safe_optax.safe(..., rho=None), k),  # mean of k SAM grads
          max_consecutive_errors),
  )

Inside ``optax.MultiSteps``, ``optax.apply_if_finite``, ``optax.masked`` or
``optax.multi_transform`` they would be silently wrong, so ``init`` raises;
after an optax clip in the same chain (which would clip nothing) the first
``update`` raises.
"""

from __future__ import annotations

import functools
import sys
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


def _require_grad_fn(grad_fn: Optional[GradFn], name: str) -> GradFn:
  if grad_fn is None:
    raise ValueError(
        f"{name} needs `grad_fn`: call tx.update(grads, state, params, grad_fn=grad_fn) "
        "with grad_fn(params, step) returning the gradient of the same minibatch loss."
    )
  return grad_fn


_RECIPE = (
    "optax.chain(safe_optax.sam_perturb(rho), {wrapper}(safe_optax.safe(..., rho=None), ...)) "
    "(for SAFE+SG add safe_optax.add_projected_gradient(sparsity) after sam_perturb)")


@functools.cache
def _wrapper_inits() -> dict[Any, tuple[str, str]]:
  """Code objects of the optax wrappers' ``init`` that cannot hold a gradient pass, with why."""
  return {
      optax.MultiSteps.init.__code__: (
          "optax.MultiSteps",
          "MultiSteps calls the inner update once every k micro-batches, with the mean "
          "gradient and the last micro-batch's grad_fn, so every other micro-batch would be "
          "dropped. Put it before the accumulation, so that each micro-batch gets its own SAM "
          "gradient and MultiSteps averages them"),
      optax.apply_if_finite(optax.identity(), 0).init.__code__: (
          "optax.apply_if_finite",
          "apply_if_finite checks only the gradient it receives, so a NaN or Inf from this "
          "transform's own gradient pass would not be counted and would reach the parameters "
          "and the state. Put it before the check"),
  }


def check_placement(params: Any, name: str) -> None:
  """Raises ``ValueError`` when a ``grad_fn`` transform is initialised inside a wrapper.

  Its gradient pass needs the full parameters and replaces the incoming
  gradient, so inside ``optax.masked`` / ``multi_transform`` (MaskedNode
  placeholders in ``params``), ``optax.MultiSteps`` or ``optax.apply_if_finite``
  (found among the calling frames) the result would be silently wrong.
  """
  masked = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  if any(isinstance(leaf, optax.MaskedNode) for leaf in masked):
    raise ValueError(
        f"{name} inside optax.masked / optax.multi_transform: its grad_fn would get "
        "optax.MaskedNode placeholders instead of the masked-out parameters. Put it before the "
        "mask, on all parameters: " + _RECIPE.format(wrapper="optax.masked")
        + " (likewise with optax.multi_transform); or prune a subset with "
        "safe_optax.safe(..., prunable=mask).")
  wrappers = _wrapper_inits()
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code in wrappers:
      wrapper, why = wrappers[frame.f_code]
      raise ValueError(f"{name} inside {wrapper}: {why}: " + _RECIPE.format(wrapper=wrapper) + ".")
    frame = frame.f_back


@functools.cache
def _clip_updates() -> dict[Any, str]:
  """Code objects of optax's clipping transforms' ``update``, with their names."""
  makers = {"optax.clip": optax.clip, "optax.clip_by_global_norm": optax.clip_by_global_norm,
            "optax.clip_by_block_rms": optax.clip_by_block_rms,
            "optax.adaptive_grad_clip": optax.adaptive_grad_clip}
  return {make(1.0).update.__code__: name for name, make in makers.items()}


def _clip_name(update: Callable[..., Any]) -> Optional[str]:
  """The clip an ``update`` function is (or wraps, as ``optax.chain`` wraps plain transforms)."""
  clips = _clip_updates()
  candidates = [update] + [cell.cell_contents.update for cell in update.__closure__ or ()
                           if isinstance(cell.cell_contents, optax.GradientTransformation)]
  for fn in candidates:
    name = clips.get(getattr(fn, "__code__", None))
    if name is not None:
      return name
  return None


def check_no_clip_before(name: str) -> None:
  """Raises ``ValueError`` when an optax clip ran before this transform in an ``optax.chain``.

  The gradient pass replaces the incoming (clipped) gradient, so such a clip
  clips nothing. The enclosing chains' ``update`` frames say which of their
  transforms already ran (``len(new_state)`` of them); read at trace time only.
  """
  chain_update = optax.chain(optax.identity()).update.__code__
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code is chain_update:
      done = frame.f_locals.get("update_fns", ())[:len(frame.f_locals.get("new_state", ()))]
      clip = next(filter(None, map(_clip_name, done)), None)
      if clip is not None:
        raise ValueError(
            f"{clip} placed before {name} in optax.chain clips nothing: {name}'s gradient "
            "pass replaces its output. Clip after it: optax.chain(safe_optax.sam_perturb(rho), "
            f"{clip}(...), ...), or pass max_grad_norm= to safe_optax.safe (and the other "
            "SAM aliases).")
    frame = frame.f_back


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


def sam_perturb(
    rho: float,
    *,
    adaptive: bool = False,
    eps: float = 1e-12,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Replaces the gradient ``g`` by the SAM gradient ``grad f(x + e)``.

  .. math::

    e = \rho \frac{g}{\|g\|_2 + \epsilon}
    \quad\text{or, adaptive (ASAM),}\quad
    e = \rho \frac{x^2 \odot g}{\|x \odot g\|_2 + \epsilon}

  where the norm runs over all leaves. The gradient at ``x + e`` comes from
  ``grad_fn(x + e, 0)``; the caller makes ``grad_fn`` use the same minibatch
  (and dropout key) as ``g``, and keeps the first pass's BatchNorm statistics.

  Args:
    rho: perturbation radius ``>= 0``.
    adaptive: scale the perturbation by ``|x|`` (ASAM).
    eps: guards a zero gradient.
    axis_name: if set, ``pmean`` the perturbed gradient over this axis
      (for ``shard_map`` / ``pmap`` users; not needed with ``jax.jit`` sharding).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn`` and ignores other extra arguments. Put it
    first in the chain: a transform before it (a clip, say) only changes the
    direction of ``e``, since the gradient at ``x + e`` replaces its output;
    clip after it.

  Raises:
    ValueError: at ``init``, inside ``optax.MultiSteps``,
      ``optax.apply_if_finite``, ``optax.masked`` or ``optax.multi_transform``
      (silently wrong there); the message gives the recipe
      ``optax.chain(sam_perturb(rho), wrapper(safe(..., rho=None)))``. At the
      first ``update``, after an optax clip earlier in the same chain.

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
    Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR 2021;
    Kwon et al., `ASAM <https://arxiv.org/abs/2102.11600>`_, ICML 2021.
  """
  _schedules.check_nonnegative(rho, "rho")
  _schedules.check_nonnegative(eps, "eps")

  def init_fn(params):
    check_placement(params, "sam_perturb")
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    del extra_args
    grad_fn = _require_grad_fn(grad_fn, "sam_perturb")
    check_no_clip_before("sam_perturb")
    if params is None:
      raise ValueError("sam_perturb needs `params` in update(updates, state, params).")
    grads = grad_fn(ascent_point(params, updates, rho, adaptive=adaptive, eps=eps), 0)
    if axis_name is not None:
      grads = lax.pmean(grads, axis_name)
    return grads, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    scope: Optional[str] = None,
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
    scope: deprecated, as in :func:`safe_optax.project_topk`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`AddProjectedGradientState`; ``update`` needs ``params`` and
    ``grad_fn`` (called with step 1).
    A traced sparsity outside ``[0, 1)`` adds nothing that step.

  Raises:
    ValueError: at ``init``, inside the wrappers :func:`sam_perturb` refuses,
      or when a prunable leaf cannot carry ``structure`` (naming its path).

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
  structure = _structures.resolve_structure(structure, scope)
  get_sparsity = _dual.sparsity_fn(sparsity, structure)
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params):
    check_placement(params, "add_projected_gradient")
    if jax.tree.leaves(params):
      _projection.check_structure_fits(params, structure, prunable)
    return AddProjectedGradientState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    del extra_args
    grad_fn = _require_grad_fn(grad_fn, "add_projected_gradient")
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
