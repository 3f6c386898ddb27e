r"""The ADMM penalty and dual update of SAFE, as one optax transform.

SAFE splits ``x = z`` with ``z`` sparse and keeps a scaled dual ``u``:

.. math::

  g &\leftarrow g + \lambda_t (x - z + u)  \quad \text{(prunable leaves)} \\
  z &\leftarrow \mathrm{Proj}(x + u), \quad u \leftarrow u + x - z
     \quad \text{every } K \text{ steps}

with ``z0 = Proj(x0)`` and ``u0 = 0``. The official code updates ``z, u``
after the x-step of step ``t`` when ``(t + 1) % K == 0``; this transform runs
the same update lazily at the start of step ``t`` when ``t % K == 0, t > 0``,
on the current params (the same iterate), so it needs no call outside
``update`` and no knowledge of the base optimizer's final update.

Place :func:`admm_penalty` *before* the base optimizer (default, as the
official code: the penalty goes through momentum / Adam), or *after* it with
``learning_rate`` set for the paper's decoupled step
``x -= eta_t * lambda_t * (x - z + u)``; :func:`decoupled_admm_penalty` wraps
the base optimizer for that step, so SAFE+'s scores still see the gradient.

Eager and jitted calls run the same code: the dual update is a ``lax.cond``
whose branch is built once per tree structure (and constant sparsity), so an
eager call compiles it once too. The state and what reads it live in
``_admm_state.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from safe_optax import _conv_layout
from safe_optax import _dual
from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _scores
from safe_optax import _schedules
from safe_optax import _structures
from safe_optax._admm_state import DUAL_ONLY
from safe_optax._admm_state import ADMMState
from safe_optax._admm_state import DecoupledADMMState
from safe_optax._structures import Global
from safe_optax._structures import Structure

SparsityArg = _dual.SparsityArg


class _Config(NamedTuple):
  """The checked, static configuration shared by the ADMM transforms."""

  get_sparsity: Callable[[Any, Any], Any]
  lam_fn: optax.Schedule
  dual_every: Any
  structure: Structure
  prunable: _prunable.Prunable
  saliency: Optional[Callable[[_scores.SaliencyInputs], Any]]
  learning_rate: Optional[Union[float, optax.Schedule]]
  rescale_dual: bool
  base_key: jax.Array


def _config(sparsity, penalty, *, dual_every, penalty_schedule, total_steps, structure,
            scores, prunable, learning_rate, seed, rescale_dual) -> _Config:
  """Validates the configuration at construction; every error names its argument."""
  get_sparsity = _dual.sparsity_fn(sparsity, _structures.check_structure(structure))
  _prunable.check_prunable(prunable)
  _schedules.check_positive_int(dual_every, "dual_every")
  lam_fn = _schedules.penalty_schedule(penalty, penalty_schedule, total_steps)
  _schedules.warn_if_no_dual_update(total_steps, dual_every)
  if learning_rate is not None and not callable(learning_rate):
    _schedules.check_nonnegative(learning_rate, "learning_rate")
  if not isinstance(rescale_dual, bool):
    raise TypeError(f"`rescale_dual` must be True or False, got {rescale_dual!r}.")
  return _Config(get_sparsity, lam_fn, dual_every, structure, prunable,
                 _scores.check_saliency(scores), learning_rate, rescale_dual,
                 jax.random.PRNGKey(seed))


def _init(config: _Config, params: Any) -> ADMMState:
  """``z0 = x0`` and ``u0 = 0`` on the prunable leaves (``Proj`` runs at count 0)."""
  # Only tree maps, so optax.tree.map_params and sharded params work; a
  # leafless tree (map_params' placeholder) yields an empty state.
  if jax.tree.leaves(params):
    flags = _prunable.leaf_flags(params, config.prunable)
    # Here, not at the first dual update, so the error names the parameter path.
    _projection.check_structure_fits(params, config.structure, config.prunable)
  else:
    flags = ()
  x = _prunable.prunable_leaves(params, flags)
  return ADMMState(
      count=jnp.zeros([], jnp.int32),
      z=_prunable.masked_tree(params, flags, [jnp.array(xi) for xi in x]) if flags else params,
      u=_prunable.masked_tree(params, flags, [jnp.zeros_like(xi) for xi in x])
      if flags else params,
      invalid_hyperparams=jnp.zeros([], jnp.int32),
      dual_count=jnp.full([], -1, jnp.int32),
  )


def _dual_branch(config: _Config, flags: tuple[bool, ...], sparsity: Any,
                 grad_fn: Any) -> Callable[[dict], tuple[list, list]]:
  """The dual update as a function of its operands (``lax.cond``'s true branch).

  ``sparsity`` is the Python value when it is one (else ``None`` and the
  operand ``ops['sparsity']`` is used); everything else that changes between
  calls is an operand, so the same branch object serves every call.
  """
  def branch(ops):
    u = ops["u"]
    if config.rescale_dual:
      # u is scaled by the penalty of the previous dual update; rescale it to
      # this one's so that the unscaled dual lambda * u carries over (Boyd et
      # al. 2011, §3.4.1). With lambda_t = 0 there is no dual force: u = 0.
      u = [(ui * ops["ratio"]).astype(ui.dtype) for ui in u]
    scores_now = None
    if config.saliency is not None:
      x = _prunable.prunable_leaves(ops["params"], flags)
      scores_now = list(config.saliency(_scores.SaliencyInputs(
          values=[xi + ui for xi, ui in zip(x, u)], params=ops["params"],
          updates=ops["gradient"], grad_fn=grad_fn, key=ops["key"], flags=flags)))
    return _dual.dual_update(
        ops["params"], u, ops["sparsity"] if sparsity is None else sparsity, flags=flags,
        first=ops["count"] == 0, structure=config.structure, scores=scores_now)

  if config.saliency is not None:
    # A saliency may differentiate the model: keep its convolutions on
    # XLA:CPU's fast kernel inside the branch (see _conv_layout).
    return _conv_layout.canonical_convs(branch)
  return branch


def _keep(ops: dict) -> tuple[list, list]:
  return list(ops["z"]), list(ops["u"])


def _check_dual_due(dual_due: Any, config: _Config) -> None:
  if not (dual_due is None or isinstance(dual_due, bool)
          or (isinstance(dual_due, str) and dual_due == DUAL_ONLY)):
    raise ValueError(f"`dual_due` must be None, True or False (a Python bool known when "
                     f"tracing), got {dual_due!r}.")
  if dual_due == DUAL_ONLY and config.saliency is not None:
    raise ValueError(
        "run_dual_update runs the dual update without a gradient, but this admm_penalty "
        "scores with a saliency (`scores` set) that reads one: run the dual update "
        "inside the training step (dual_due=True or None) instead.")


def _step(config: _Config, branches: Callable[..., Any], state: ADMMState, params: Any,
          gradient: Any, grad_fn: Any, dual_due: Any) -> tuple[ADMMState, Callable[[Any], Any]]:
  """Runs the dual update when due (scoring with ``gradient``).

  Returns the new state and a function that adds the penalty
  ``scale * (x - z + u)`` to the prunable leaves of a tree.
  """
  _check_dual_due(dual_due, config)
  if params is None:
    raise ValueError("admm_penalty needs `params` in update(updates, state, params).")
  flags = _prunable.leaf_flags(params, config.prunable)
  x = _prunable.prunable_leaves(params, flags)
  z = _prunable.prunable_leaves(state.z, flags)
  u = _prunable.prunable_leaves(state.u, flags)
  count = state.count
  # Separate streams: SAFE-Multi's draw and the saliency's probes (OBD) must not
  # be functions of one key.
  draw_key, saliency_key = jax.random.split(jax.random.fold_in(config.base_key, count))
  sparsity_now = config.get_sparsity(count, draw_key)
  sparsity_ok = _dual.in_unit_interval(sparsity_now)
  lam_now = config.lam_fn(count)
  rate = 1.0
  if config.learning_rate is not None:  # the decoupled step's rate scales the penalty
    lr = config.learning_rate
    rate = lr(count) if callable(lr) else lr
  lam = lam_now * rate
  penalty_ok = jnp.isfinite(lam) & (lam >= 0)
  # A traced dual_every < 1 (inject_hyperparams) would divide by zero below.
  every_ok = jnp.asarray(config.dual_every) >= 1
  every = jnp.maximum(config.dual_every, 1)
  # At most one dual update per count: run_dual_update may have run this one already.
  already_ran = state.dual_count == count
  due = (count % every == 0) & sparsity_ok & every_ok & jnp.logical_not(already_ran)

  if dual_due is not False:
    static = sparsity_now if sparsity_now is None or isinstance(sparsity_now, (int, float)) \
        else None
    ops = dict(z=z, u=u, params=params, count=count,
               sparsity=None if static is not None else sparsity_now)
    if config.rescale_dual:
      previous = config.lam_fn(jnp.maximum(count - every, 0))
      ops["ratio"] = _schedules.penalty_ratio(previous, lam_now)
    if config.saliency is None:
      branch = branches(flags, static)
    else:  # grad_fn, a new Python function at every call, is part of the branch
      ops.update(gradient=gradient, key=saliency_key)
      branch = _dual_branch(config, flags, static, grad_fn)
    if dual_due == DUAL_ONLY:
      # A program of its own, called on dual steps: compute and select rather than
      # branch (a branch would only add the cond's operand and result copies).
      new_z, new_u = branch(ops)
      z = [jnp.where(due, a, b) for a, b in zip(new_z, z)]
      u = [jnp.where(due, a, b) for a, b in zip(new_u, u)]
    else:
      z, u = lax.cond(due, branch, _keep, ops)
  # dual_due=False: the caller said no dual update is due, so the projection is
  # not traced and its temporaries stay out of this program's buffer. A wrong
  # hint skips the update and is counted below.

  lam = _schedules.valid_or_zero(lam)
  scale = lam if config.learning_rate is None else -lam
  dual_scale = scale
  if config.rescale_dual:
    # The dual force is lambda_d * u, lambda_d the penalty u was last scaled by
    # (this step's if a dual update just ran); the rest follows lambda_t.
    lam_d = _schedules.valid_or_zero(config.lam_fn(count - count % every) * rate)
    dual_scale = lam_d if config.learning_rate is None else -lam_d

  def add_penalty(updates):
    it = iter(zip(x, z, u))
    new_updates = []
    for g, flag in zip(jax.tree.leaves(updates, is_leaf=_prunable.is_masked), flags):
      if flag:
        xi, zi, ui = next(it)
        if config.rescale_dual:
          g = (g + scale * (xi - zi) + dual_scale * ui).astype(g.dtype)
        else:
          g = (g + scale * (xi - zi + ui)).astype(g.dtype)
      new_updates.append(g)
    return jax.tree.unflatten(jax.tree.structure(updates, is_leaf=_prunable.is_masked),
                              new_updates)

  z_tree, u_tree = (_prunable.masked_tree(params, flags, t) for t in (z, u))
  if dual_due is False:
    return ADMMState(
        count=optax.safe_increment(count), z=z_tree, u=u_tree,
        invalid_hyperparams=_count_if(
            ~(sparsity_ok & penalty_ok & every_ok) | due, state.invalid_hyperparams),
        dual_count=state.dual_count), add_penalty
  dual_count = jnp.where(due, count, state.dual_count)
  if dual_due == DUAL_ONLY:
    # Only the dual update: the count, the hyperparameter check and the updates are
    # left to the training step that follows.
    return state._replace(z=z_tree, u=u_tree, dual_count=dual_count), lambda updates: updates
  return ADMMState(
      count=optax.safe_increment(count), z=z_tree, u=u_tree,
      invalid_hyperparams=_count_if(~(sparsity_ok & penalty_ok & every_ok),
                                    state.invalid_hyperparams),
      dual_count=dual_count), add_penalty


def _count_if(bad: jax.Array, counter: jax.Array) -> jax.Array:
  return jnp.where(bad, optax.safe_increment(counter), counter)


def _branch_cache(config: _Config) -> Callable[..., Any]:
  """One dual branch per (tree structure, constant sparsity), built on first use."""
  return functools.lru_cache(maxsize=16)(
      lambda flags, sparsity: _dual_branch(config, flags, sparsity, None))


def admm_penalty(
    sparsity: SparsityArg,
    penalty: Union[float, optax.Schedule],
    *,
    dual_every: int = 32,
    penalty_schedule: Optional[str] = "constant",
    total_steps: Optional[int] = None,
    structure: Structure = Global(),
    scores: Optional[_scores.Saliency] = None,
    prunable: _prunable.Prunable = None,
    learning_rate: Optional[Union[float, optax.Schedule]] = None,
    seed: int = 0,
    rescale_dual: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Adds SAFE's augmented-Lagrangian penalty and runs its dual update.

  At step ``t`` (counted by the transform): if ``t % dual_every == 0``,
  ``z = Proj(x + u)`` and, for ``t > 0``, ``u = u + x - z``; then on every
  prunable leaf the update becomes ``g + lambda_t * (x - z + u)`` (or
  ``g - eta_t * lambda_t * (x - z + u)`` with ``learning_rate``).

  Args:
    sparsity: fraction of prunable weights to zero, in ``[0, 1)``; a schedule
      ``step -> sparsity``; or a sequence of values for SAFE-Multi (one drawn
      at random at each dual update). ``None`` only with ``structure=NM(...)``.
    penalty: ``lambda >= 0``, or a schedule ``step -> lambda``.
    dual_every: ``K``, steps between dual updates.
    penalty_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` ramp to
      ``penalty`` over ``total_steps``.
    total_steps: ``T`` for the ramps.
    structure, prunable: the sparsity set, as in :func:`safe_optax.project_topk`
      (default :class:`safe_optax.Global`).
    scores: SAFE+ saliency: ``None`` (magnitude) or a
      :class:`safe_optax.Saliency` (:func:`safe_optax.snip_saliency`,
      :func:`safe_optax.obd_saliency`, :func:`safe_optax.wanda_saliency`).
      It sees the ``updates`` entering this transform as the gradient: placed
      after an optimizer (``learning_rate`` set), that is the optimizer's step,
      not the gradient; :func:`decoupled_admm_penalty` scores with the gradient.
    learning_rate: ``None`` to add the penalty to the gradient (place before
      the base optimizer); a number or schedule for the decoupled plain step
      (place after the base optimizer).
    seed: seeds SAFE-Multi draws and, independently, the saliency's key
      (Hutchinson probes).
    rescale_dual: keep the *unscaled* dual ``lambda * u`` when the penalty
      changes (a ramp or a schedule), as ADMM with a varying penalty parameter
      does (Boyd et al. 2011, §3.4.1): at each dual update ``u`` is multiplied
      by ``lambda_prev / lambda_t`` before ``z = Proj(x + u)``, and between
      updates the dual force stays ``lambda_prev * u``. ``False`` (default)
      is the paper's and the official code's update, which keeps ``u`` as is:
      under a ramp from 0, ``u`` then grows at full rate while the penalty is
      still near 0, and at extreme sparsity that can make training diverge
      (``docs/dual_rescaling.md``). With a constant penalty both are the same.
      A penalty of 0 at a dual update resets ``u`` (no dual force follows).

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is
    :class:`ADMMState`. ``update`` needs ``params``; ``grad_fn`` is only used
    by :func:`safe_optax.obd_saliency`; ``dual_due`` (a Python bool, see
    :func:`safe_optax.experimental.is_dual_step`) says whether this update's dual update is due, so
    that a step without it compiles without the projection (``False`` also
    after :func:`safe_optax.experimental.run_dual_update` ran this step's dual update apart); other
    extra arguments are ignored.

  Raises:
    ValueError, TypeError: at construction, for a configuration out of range
      (the message names the argument and the allowed values); at ``init``,
      for a prunable leaf that cannot carry ``structure`` (naming its path).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import admm_penalty
    >>> tx = optax.chain(admm_penalty(0.5, penalty=1.0, dual_every=2), optax.sgd(0.1))
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> zero = jax.tree.map(jnp.zeros_like, params)
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(zero, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> state = tx.init(params)
    >>> for _ in range(50):
    ...   params, state = step(params, state)
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (Algorithm 1).
  """
  config = _config(
      sparsity, penalty, dual_every=dual_every, penalty_schedule=penalty_schedule,
      total_steps=total_steps, structure=structure, scores=scores, prunable=prunable,
      learning_rate=learning_rate, seed=seed, rescale_dual=rescale_dual)
  branches = _branch_cache(config)

  def update_fn(updates, state, params=None, *, grad_fn=None, dual_due=None, **extra_args):
    del extra_args
    new_state, add_penalty = _step(config, branches, state, params, updates, grad_fn, dual_due)
    return add_penalty(updates), new_state

  return optax.GradientTransformationExtraArgs(functools.partial(_init, config), update_fn)


def decoupled_admm_penalty(
    inner: optax.GradientTransformation,
    sparsity: SparsityArg,
    penalty: Union[float, optax.Schedule],
    *,
    learning_rate: Union[float, optax.Schedule],
    dual_every: int = 32,
    penalty_schedule: Optional[str] = "constant",
    total_steps: Optional[int] = None,
    structure: Structure = Global(),
    scores: Optional[_scores.Saliency] = None,
    prunable: _prunable.Prunable = None,
    seed: int = 0,
    rescale_dual: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""The paper's decoupled penalty step after a base optimizer ``inner``.

  .. math::

    \Delta x = \mathrm{inner}(g) - \eta_t \lambda_t (x - z + u)

  with the dual update of :func:`admm_penalty` every ``dual_every`` steps.
  Unlike ``chain(inner, admm_penalty(..., learning_rate=lr))`` (the same
  step), SAFE+'s saliency scores with the gradient ``g`` entering ``inner``,
  not with ``inner``'s update (which a warm-up makes 0 at step 0).

  Args:
    inner: the base optimizer, e.g. ``chain(add_decayed_weights(wd), sgd(lr))``.
    sparsity, penalty: as in :func:`admm_penalty`.
    learning_rate: ``eta_t``, the rate of the plain penalty step (a number or
      schedule; usually the base optimizer's).
    dual_every, penalty_schedule, total_steps: as in :func:`admm_penalty`.
    structure, scores, prunable, seed, rescale_dual: as in :func:`admm_penalty`.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`DecoupledADMMState`; ``dual_due`` as in :func:`admm_penalty`;
    other extra arguments reach ``inner`` too.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import decoupled_admm_penalty
    >>> tx = decoupled_admm_penalty(optax.sgd(0.1), 0.5, 1.0, learning_rate=0.1, dual_every=2)
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> zero = jax.tree.map(jnp.zeros_like, params)
    >>> state = tx.init(params)
    >>> for _ in range(50):
    ...   updates, state = tx.update(zero, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (Algorithm 1, the x-step).
  """
  inner = optax.with_extra_args_support(inner)
  config = _config(
      sparsity, penalty, dual_every=dual_every, penalty_schedule=penalty_schedule,
      total_steps=total_steps, structure=structure, scores=scores, prunable=prunable,
      learning_rate=learning_rate, seed=seed, rescale_dual=rescale_dual)
  branches = _branch_cache(config)

  def init_fn(params):
    return DecoupledADMMState(inner=inner.init(params), admm=_init(config, params))

  def update_fn(updates, state, params=None, *, grad_fn=None, dual_due=None, **extra_args):
    inner_updates, inner_state = inner.update(updates, state.inner, params, grad_fn=grad_fn,
                                              **extra_args)
    admm_state, add_penalty = _step(config, branches, state.admm, params, updates, grad_fn,
                                    dual_due)
    return add_penalty(inner_updates), DecoupledADMMState(inner=inner_state, admm=admm_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
