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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from safe_optax import _conv_layout
from safe_optax import _dual
from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _scores
from safe_optax import _schedules
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import Structure

SparsityArg = _dual.SparsityArg


class ADMMState(NamedTuple):
  """State of :func:`admm_penalty`."""

  count: jax.Array
  """Number of updates taken (int32)."""
  z: Any
  """Sparse target ``Proj(x + u)``; ``optax.MaskedNode()`` on non-prunable leaves."""
  u: Any
  """Scaled dual variable; ``optax.MaskedNode()`` on non-prunable leaves."""
  invalid_hyperparams: jax.Array
  """Number of updates with a hyperparameter out of range (int32).

  Python values are checked at construction; traced ones (from
  ``optax.inject_hyperparams`` or a schedule) can only be checked here, so an
  out-of-range value is ignored for that update and counted: a ``sparsity``
  outside ``[0, 1)`` (or NaN) or a ``dual_every < 1`` skips the dual update,
  keeping ``z`` and ``u``; a ``penalty`` (times the decoupled
  ``learning_rate``) that is negative or not finite counts as 0. An update
  called with ``dual_due=False`` when its dual update was due (and not
  already run by :func:`safe_optax.experimental.run_dual_update`) skips that update and is counted
  too. Check it is 0 after training.
  """
  dual_count: jax.Array
  """The update count at which the dual update last ran (int32; -1 before the first).

  It makes the dual update at a count run at most once, so
  :func:`safe_optax.experimental.run_dual_update` followed by a ``dual_due=False`` step equals one
  step that runs it.
  """


DUAL_ONLY = "only"
"""The ``dual_due`` value :func:`safe_optax.experimental.run_dual_update` passes: run only the dual update."""


class DecoupledADMMState(NamedTuple):
  """State of :func:`decoupled_admm_penalty`."""

  inner: Any
  """State of the wrapped base optimizer."""
  admm: ADMMState
  """State of the penalty and dual update."""


class _Core(NamedTuple):
  """What :func:`admm_penalty` and :func:`decoupled_admm_penalty` share."""

  init: Callable[[Any], ADMMState]
  step: Callable[..., tuple[ADMMState, Any]]


def _admm_core(sparsity, penalty, *, dual_every, penalty_schedule, total_steps, structure,
               scores, prunable, learning_rate, seed, rescale_dual=False) -> _Core:
  """Validates the configuration (at construction) and builds ``init`` and ``step``.

  ``step(state, params, gradient, grad_fn)`` runs the dual update when due
  (scoring with ``gradient``) and returns the new state and a function that
  adds the penalty ``scale * (x - z + u)`` to the prunable leaves of a tree.
  """
  get_sparsity = _dual.sparsity_fn(sparsity, structure)
  _prunable.check_prunable(prunable)
  _schedules.check_positive_int(dual_every, "dual_every")
  lam_fn = _schedules.penalty_schedule(penalty, penalty_schedule, total_steps)
  _warn_if_no_dual_update(total_steps, dual_every)
  saliency = _scores.check_saliency(scores)
  if learning_rate is not None and not callable(learning_rate):
    _schedules.check_nonnegative(learning_rate, "learning_rate")
  if not isinstance(rescale_dual, bool):
    raise TypeError(f"`rescale_dual` must be True or False, got {rescale_dual!r}.")
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params):
    # Only tree maps, so optax.tree.map_params and sharded params work; a
    # leafless tree (map_params' placeholder) yields an empty state.
    if jax.tree.leaves(params):
      flags = _prunable.leaf_flags(params, prunable)
      # Here, not at the first dual update, so the error names the parameter path.
      _projection.check_structure_fits(params, structure, prunable)
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

  def step(state, params, gradient, grad_fn, dual_due):
    if not (dual_due is None or isinstance(dual_due, bool)
            or (isinstance(dual_due, str) and dual_due == DUAL_ONLY)):
      raise ValueError(f"`dual_due` must be None, True or False (a Python bool known when "
                       f"tracing), got {dual_due!r}.")
    if dual_due == DUAL_ONLY and saliency is not None:
      raise ValueError(
          "run_dual_update runs the dual update without a gradient, but this admm_penalty "
          "scores with a saliency (`scores` set) that reads one: run the dual update "
          "inside the training step (dual_due=True or None) instead.")
    if params is None:
      raise ValueError("admm_penalty needs `params` in update(updates, state, params).")
    flags = _prunable.leaf_flags(params, prunable)
    x = _prunable.prunable_leaves(params, flags)
    z = _prunable.prunable_leaves(state.z, flags)
    u = _prunable.prunable_leaves(state.u, flags)
    count = state.count
    # Separate streams: SAFE-Multi's draw and the saliency's probes (OBD) must not
    # be functions of one key.
    draw_key, saliency_key = jax.random.split(jax.random.fold_in(base_key, count))
    sparsity_now = get_sparsity(count, draw_key)
    sparsity_ok = _dual.in_unit_interval(sparsity_now)
    lam_now = lam_fn(count)
    rate = 1.0
    if learning_rate is not None:  # the decoupled step's rate scales the penalty
      rate = learning_rate(count) if callable(learning_rate) else learning_rate
    lam = lam_now * rate
    penalty_ok = jnp.isfinite(lam) & (lam >= 0)
    # A traced dual_every < 1 (inject_hyperparams) would divide by zero below.
    every_ok = jnp.asarray(dual_every) >= 1
    every = jnp.maximum(dual_every, 1)

    def run_dual(z, u):
      if rescale_dual:
        # u is scaled by the penalty of the previous dual update; rescale it to
        # this one's so that the unscaled dual lambda * u carries over (Boyd et
        # al. 2011, §3.4.1). With lambda_t = 0 there is no dual force: u = 0.
        ratio = _ratio(lam_fn(jnp.maximum(count - every, 0)), lam_now)
        u = [(ui * ratio).astype(ui.dtype) for ui in u]
      scores_now = None
      if saliency is not None:
        inputs = _scores.SaliencyInputs(
            values=[xi + ui for xi, ui in zip(x, u)], params=params, updates=gradient,
            grad_fn=grad_fn, key=saliency_key, flags=flags,
        )
        scores_now = list(saliency(inputs))
      return _dual.dual_update(params, u, sparsity_now, flags=flags, first=count == 0,
                         structure=structure, scores=scores_now)

    # At most one dual update per count: run_dual_update may have run this one already.
    already_ran = state.dual_count == count
    due = (count % every == 0) & sparsity_ok & every_ok & jnp.logical_not(already_ran)
    if dual_due is False:
      # The caller said no dual update is due: the projection is not traced, so its
      # temporaries stay out of this program's buffer. A wrong hint skips the update
      # and is counted below.
      missed = due
    elif dual_due == DUAL_ONLY and isinstance(due, jax.core.Tracer):
      # A program of its own, called on dual steps: compute and select rather than
      # branch (a branch would only add the cond's operand and result copies).
      new_z, new_u = run_dual(z, u)
      z = [jnp.where(due, a, b) for a, b in zip(new_z, z)]
      u = [jnp.where(due, a, b) for a, b in zip(new_u, u)]
    elif isinstance(due, jax.core.Tracer):
      # A saliency may differentiate the model: keep its convolutions on
      # XLA:CPU's fast kernel inside the branch (see _conv_layout).
      dual = run_dual if saliency is None else _conv_layout.canonical_convs(run_dual)
      z, u = lax.cond(due, dual, lambda z, u: (list(z), list(u)), z, u)
    elif due:
      # Called eagerly: branch in Python, since an eager lax.cond recompiles every call.
      z, u = run_dual(z, u)
    lam = _valid_or_zero(lam)
    scale = lam if learning_rate is None else -lam
    if rescale_dual:
      # The dual force is lambda_d * u, lambda_d the penalty u was last scaled by
      # (this step's if a dual update just ran); the rest follows lambda_t.
      lam_d = _valid_or_zero(lam_fn(count - count % every) * rate)
      dual_scale = lam_d if learning_rate is None else -lam_d

    def add_penalty(updates):
      it = iter(zip(x, z, u))
      new_updates = []
      for g, flag in zip(jax.tree.leaves(updates, is_leaf=_prunable.is_masked), flags):
        if flag:
          xi, zi, ui = next(it)
          if rescale_dual:
            g = (g + scale * (xi - zi) + dual_scale * ui).astype(g.dtype)
          else:
            g = (g + scale * (xi - zi + ui)).astype(g.dtype)
        new_updates.append(g)
      return jax.tree.unflatten(jax.tree.structure(updates, is_leaf=_prunable.is_masked),
                                new_updates)

    dual_count = state.dual_count if dual_due is False else jnp.where(due, count,
                                                                       state.dual_count)
    if dual_due == DUAL_ONLY:
      # Only the dual update: the count, the hyperparameter check and the updates are
      # left to the training step that follows.
      return state._replace(z=_prunable.masked_tree(params, flags, z),
                            u=_prunable.masked_tree(params, flags, u),
                            dual_count=dual_count), lambda updates: updates
    valid = sparsity_ok & penalty_ok & every_ok
    if dual_due is False:
      valid = valid & jnp.logical_not(missed)
    new_state = ADMMState(
        count=optax.safe_increment(count),
        z=_prunable.masked_tree(params, flags, z),
        u=_prunable.masked_tree(params, flags, u),
        invalid_hyperparams=jnp.where(valid, state.invalid_hyperparams,
                                      optax.safe_increment(state.invalid_hyperparams)),
        dual_count=dual_count,
    )
    return new_state, add_penalty

  return _Core(init_fn, step)


def _warn_if_no_dual_update(total_steps: Any, dual_every: Any) -> None:
  """Warns when a run of ``total_steps`` never reaches a dual update after the first.

  The dual update runs at counts ``0, K, 2K, ...``; count 0 only sets
  ``z = Proj(x0)``, so with ``T <= K`` the dual ``u`` never moves. Traced
  values (``inject_hyperparams``) cannot be compared here.
  """
  concrete = all(isinstance(v, (int, np.integer)) or (
      isinstance(v, (jax.Array, np.ndarray)) and not isinstance(v, jax.core.Tracer))
                 for v in (total_steps, dual_every))
  if total_steps is None or not concrete or int(total_steps) > int(dual_every):
    return
  warnings.warn(
      f"total_steps={int(total_steps)} with dual_every={int(dual_every)}: the dual update "
      f"runs every {int(dual_every)} steps, so after the first step (z = Proj(x0)) no dual "
      "update happens in this run and u stays 0. Pass dual_every < total_steps.",
      UserWarning, stacklevel=4)


def _valid_or_zero(lam: jax.Array) -> jax.Array:
  """``lam``, or 0 where it is negative or not finite (an invalid penalty counts as 0)."""
  return jnp.where(jnp.isfinite(lam) & (lam >= 0), lam, jnp.zeros_like(lam))


def _ratio(previous: jax.Array, current: jax.Array) -> jax.Array:
  """``previous / current``, 0 where ``current`` is 0 or either is not a valid penalty."""
  valid = jnp.isfinite(previous) & jnp.isfinite(current) & (previous >= 0) & (current > 0)
  return jnp.where(valid, previous / jnp.where(valid, current, 1.0), 0.0)


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
    scores: SAFE+ saliency: ``None`` (magnitude) or a callable
      ``SaliencyInputs -> scores`` (:func:`safe_optax.snip_saliency`,
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
  core = _admm_core(
      sparsity, penalty, dual_every=dual_every, penalty_schedule=penalty_schedule,
      total_steps=total_steps, structure=_structures.check_structure(structure),
      scores=scores, prunable=prunable, learning_rate=learning_rate, seed=seed,
      rescale_dual=rescale_dual)

  def update_fn(updates, state, params=None, *, grad_fn=None, dual_due=None, **extra_args):
    del extra_args
    new_state, add_penalty = core.step(state, params, updates, grad_fn, dual_due)
    return add_penalty(updates), new_state

  return optax.GradientTransformationExtraArgs(core.init, update_fn)


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
  core = _admm_core(
      sparsity, penalty, dual_every=dual_every, penalty_schedule=penalty_schedule,
      total_steps=total_steps, structure=_structures.check_structure(structure),
      scores=scores, prunable=prunable, learning_rate=learning_rate, seed=seed,
      rescale_dual=rescale_dual)

  def init_fn(params):
    return DecoupledADMMState(inner=inner.init(params), admm=core.init(params))

  def update_fn(updates, state, params=None, *, grad_fn=None, dual_due=None, **extra_args):
    inner_updates, inner_state = inner.update(updates, state.inner, params, grad_fn=grad_fn,
                                              **extra_args)
    admm_state, add_penalty = core.step(state.admm, params, updates, grad_fn, dual_due)
    return add_penalty(inner_updates), DecoupledADMMState(inner=inner_state, admm=admm_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_dual_step(count: int, dual_every: int) -> bool:
  r"""Whether update number ``count`` of :func:`admm_penalty` runs the dual update.

  The transform decides this inside the program with a ``lax.cond``, so every
  step's compiled program carries the projection: XLA:CPU allocates the
  temporaries of both branches at every call (on a 266k-weight MLP, 4.7 MiB
  against 1.3 MiB, hundreds of page faults and about 20 % of a step on CPU),
  and the cond itself costs a few percent of an LLM block's step. A training
  loop that counts steps on the host can pass
  ``update(..., dual_due=is_dual_step(step, K))`` through a
  ``jax.jit(..., static_argnames="dual_due")`` step: two programs are
  compiled, and the one for the ``K - 1`` steps without a dual update has no
  projection. The results are the same bit for bit; a wrong
  ``dual_due=False`` skips that dual update and counts it in
  :attr:`ADMMState.invalid_hyperparams`. With a traced ``dual_every``
  (``optax.inject_hyperparams``) leave ``dual_due`` unset. On XLA:CPU, running
  the dual update as a program of its own (:func:`safe_optax.experimental.run_dual_update`) and the
  dual step with ``dual_due=False`` is faster still.

  Args:
    count: the transform's update count before this update (the number of
      ``update`` calls so far, a host int; 0 at the first step).
    dual_every: ``K``, as given to :func:`admm_penalty`.

  Returns:
    ``count % dual_every == 0``, as a Python bool.

  Raises:
    ValueError: ``count`` negative or ``dual_every`` < 1.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax
    >>> from safe_optax import admm_penalty
    >>> from safe_optax.experimental import is_dual_step
    >>> tx = optax.chain(admm_penalty(0.5, penalty=1.0, dual_every=2), optax.sgd(0.1))
    >>> @functools.partial(jax.jit, static_argnames="dual_due")
    ... def step(params, state, *, dual_due):
    ...   zero = jax.tree.map(jnp.zeros_like, params)
    ...   updates, state = tx.update(zero, state, params, dual_due=dual_due)
    ...   return optax.apply_updates(params, updates), state
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> state = tx.init(params)
    >>> for t in range(50):
    ...   params, state = step(params, state, dual_due=is_dual_step(t, 2))
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)
    >>> int(state[0].invalid_hyperparams)
    0
  """
  _schedules.check_positive_int(dual_every, "dual_every")
  if count < 0:
    raise ValueError(f"`count` must be a non-negative step count, got {count!r}.")
  return count % dual_every == 0


def run_dual_update(tx: optax.GradientTransformation, opt_state: Any, params: Any,
                    **extra_args: Any) -> Any:
  r"""Runs the dual update due at this step of every :func:`admm_penalty` in ``tx``, alone.

  Returns ``opt_state`` with ``z = Proj(x + u)`` and ``u = u + x - z`` done
  for this update count (where it is a dual step) and nothing else changed: no
  count advances, no other transform's state moves. The training step that
  follows, called with ``dual_due=False``, then skips the projection and
  finds this count's dual update done, so the pair equals one step that runs
  it, bit for bit. Jit it as a program of its own: on dual steps a loop runs

  .. code-block:: python

    if is_dual_step(t, K):
      opt_state = dual(opt_state, params)   # jax.jit(partial(run_dual_update, tx))
    params, opt_state = step(params, opt_state, batch, dual_due=False)

  On XLA:CPU a small MLP's fused dual step fell into a slow mode (4-6 ms
  instead of about 2 ms) in some processes; this program, undonated, then a
  plain step did not, in 12 of 12 (README, "Step overhead"). Do not donate
  its ``opt_state``: donated, the same program was slow in most calls. A
  count that is not a dual step, or whose dual update has already run, leaves
  ``opt_state`` as it is, so a second call is harmless.

  Only the magnitude-scored dual update (SAFE, ADMM, SAFE-SG, SAFE-Multi) can
  run alone; SAFE+'s saliency reads the step's gradient and is refused. Under
  ``optax.MultiSteps`` the transform counts accumulated steps: call it on the
  micro-step that ends an accumulation whose inner count is due (on other
  micro-steps it changes nothing).

  Args:
    tx: the optimizer holding the :func:`admm_penalty` (or
      :func:`decoupled_admm_penalty`), e.g. :func:`safe_optax.safe`.
    opt_state: its state before this step.
    params: the current parameters ``x``.
    **extra_args: passed to ``tx.update`` (a ``grad_fn`` is supplied when
      missing: SAM's transforms need one to trace, and their output is unused).

  Returns:
    The new optimizer state, with the structure of ``opt_state``. Undonated,
    a jitted call copies the state's unchanged leaves too (momentum, SAM's);
    a program that returns only the :class:`ADMMState` nodes avoids that
    (``safe_optax.vision.steps.dual_step`` does).

  Raises:
    ValueError: ``opt_state`` holds no :class:`ADMMState`, or an ADMM
      transform scores with a saliency.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax
    >>> from safe_optax import admm_penalty
    >>> from safe_optax.experimental import is_dual_step, run_dual_update
    >>> tx = optax.chain(admm_penalty(0.5, penalty=1.0, dual_every=2), optax.sgd(0.1))
    >>> dual = jax.jit(functools.partial(run_dual_update, tx))
    >>> @jax.jit
    ... def step(params, state):  # never holds the projection
    ...   updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params,
    ...                              dual_due=False)
    ...   return optax.apply_updates(params, updates), state
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> state = tx.init(params)
    >>> for t in range(50):
    ...   if is_dual_step(t, 2):
    ...     state = dual(state, params)
    ...   params, state = step(params, state)
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)
    >>> int(state[0].invalid_hyperparams)  # no dual update was missed
    0
  """
  is_admm = lambda node: isinstance(node, ADMMState)
  if not any(is_admm(node) for node in jax.tree.leaves(opt_state, is_leaf=is_admm)):
    raise ValueError("run_dual_update needs an optimizer state holding an ADMMState "
                     "(from admm_penalty, e.g. safe_optax.safe); found none in `opt_state`.")
  extra_args.setdefault("grad_fn", lambda p, _: jax.tree.map(jnp.zeros_like, p))
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, ran = tx.update(zeros, opt_state, params, dual_due=DUAL_ONLY, **extra_args)
  # Keep only the ADMM states' dual update; whatever else moved (momentum, SAM's
  # state) is dropped, and XLA removes the computation that fed it.
  return jax.tree.map(lambda old, new: new if is_admm(old) else old, opt_state, ran,
                      is_leaf=is_admm)


def find_admm_state(opt_state: Any) -> ADMMState:
  """Returns the (single) :class:`ADMMState` inside a nested optax state.

  Args:
    opt_state: the state of an optimizer that contains one
      :func:`admm_penalty` (e.g. of :func:`safe_optax.safe`).

  Returns:
    That transform's :class:`ADMMState` (``count``, ``z``, ``u``).

  Raises:
    ValueError: the state holds no ``ADMMState``, or more than one.

  Examples:
    >>> import jax.numpy as jnp, safe_optax
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1e-3)
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]]), 'b': jnp.ones(2)}
    >>> zero = {'w': jnp.zeros((2, 2)), 'b': jnp.zeros(2)}
    >>> _, state = tx.update(zero, tx.init(params), params)  # step 0 sets z = Proj(x0)
    >>> admm_state = safe_optax.find_admm_state(state)
    >>> int(admm_state.count), admm_state.z  # biases carry no z
    (1, {'b': MaskedNode(), 'w': Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)})
  """
  found = optax.tree.get_all_with_path(
      opt_state, ADMMState.__name__, filtering=lambda _, value: isinstance(value, ADMMState))
  if len(found) != 1:
    raise ValueError(f"expected exactly one ADMMState in the optimizer state, found {len(found)}.")
  return found[0][1]


def constraint_distance(params: Any, opt_state: Any) -> jax.Array:
  r"""``||x - z||_2`` over prunable leaves: how far the iterate is from its sparse target.

  .. math::

    \Big(\textstyle\sum_{\ell\ \mathrm{prunable}} \|x_\ell - z_\ell\|_2^2\Big)^{1/2}

  computed in float32. Worth logging during training: it shrinks as the
  penalty grows, and after :func:`safe_optax.finalize` the loss change is
  small when it is small.

  Args:
    params: the current parameters ``x``.
    opt_state: the optimizer state holding the :class:`ADMMState` of ``params``.

  Returns:
    A float32 scalar.

  Examples:
    >>> import jax.numpy as jnp, safe_optax
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1e-3)
    >>> _, state = tx.update({'w': jnp.zeros((2, 2))}, tx.init(params), params)
    >>> safe_optax.constraint_distance(params, state)  # z = Proj(x): sqrt(0.2**2 + 0.1**2)
    Array(0.2236068, dtype=float32)
  """
  state = find_admm_state(opt_state)
  pairs = [(x, z) for x, z in zip(jax.tree.leaves(params),
                                  jax.tree.leaves(state.z, is_leaf=_prunable.is_masked))
           if not _prunable.is_masked(z)]
  x, z = (optax.tree.cast([p[i] for p in pairs], jnp.float32) for i in (0, 1))
  return optax.tree.norm(optax.tree.sub(x, z))
