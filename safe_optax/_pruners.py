r"""Magnitude-pruning baselines of the SAFE paper as optax transforms: GMP, IMP+SAM, one-shot.

* :func:`polynomial_sparsity`: Zhu & Gupta's gradual sparsity schedule
  (cubic for GMP, linear or cubic steps for IMP-style pruning every N epochs).
* :func:`magnitude_pruning`: placed **last** in an ``optax.chain``, turns the
  update into one whose result is the magnitude-projected parameters, with a
  keep mask recomputed every ``update_every`` steps and held in between. One
  transform covers one-shot magnitude pruning, GMP and (after
  :func:`safe_optax.sam_perturb`) IMP+SAM.

CrAM, the SAM-shaped baseline, is in ``_cram.py``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from safe_optax import _dual
from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _schedules
from safe_optax import _scores
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import Structure


def _check_step(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
    raise ValueError(f"`{name}` must be an int >= 0, got {value!r}.")
  return int(value)


def _check_fraction(value: Any, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) \
      or not 0.0 <= float(value) < 1.0:
    raise ValueError(f"`{name}` must be a real number in [0, 1), got {value!r}.")
  return float(value)


def polynomial_sparsity(
    final_sparsity: float,
    *,
    begin_step: int,
    end_step: int,
    initial_sparsity: float = 0.0,
    power: float = 3,
    update_every: int = 1,
) -> optax.Schedule:
  r"""Zhu & Gupta's gradual pruning schedule ``step -> sparsity``.

  .. math::

    s_t = s_f + (s_i - s_f) \left(1 - \frac{\tau_t - t_0}{t_1 - t_0}\right)^{p}

  with :math:`\tau_t = t_0` before ``begin_step``, :math:`t_1` from
  ``end_step`` on, and in between :math:`\tau_t = t_0 + \Delta \lfloor (t -
  t_0) / \Delta \rfloor` for ``update_every`` :math:`\Delta`: the sparsity is
  constant between updates at ``begin_step + k * update_every`` and jumps to
  ``final_sparsity`` at ``end_step``. ``power=3`` is GMP's cubic ramp;
  ``power=1`` with ``update_every = N * steps_per_epoch`` is IMP's "prune
  every N epochs, linear increase". Pair it with
  ``magnitude_pruning(update_every=...)`` on the same grid (``begin_step`` a
  multiple of the pruner's ``update_every``), so masks change exactly when the
  sparsity does.

  Args:
    final_sparsity: :math:`s_f \in [0, 1)`, reached at ``end_step``.
    begin_step: :math:`t_0 \ge 0`, the first step of the ramp.
    end_step: :math:`t_1 > t_0`.
    initial_sparsity: :math:`s_i \in [0, s_f]`, held until ``begin_step``.
    power: the exponent :math:`p > 0`.
    update_every: :math:`\Delta \ge 1`, steps between changes of the value.

  Returns:
    An ``optax.Schedule`` returning a float32 scalar; jit-friendly (traced
    steps work), exactly ``float32(initial_sparsity)`` up to ``begin_step``
    and ``float32(final_sparsity)`` from ``end_step`` on.

  Examples:
    >>> from safe_optax import polynomial_sparsity
    >>> schedule = polynomial_sparsity(0.9, begin_step=0, end_step=100)
    >>> [round(float(schedule(t)), 4) for t in (0, 50, 100, 1000)]
    [0.0, 0.7875, 0.9, 0.9]
    >>> steps = polynomial_sparsity(0.8, begin_step=10, end_step=50, power=1, update_every=20)
    >>> [round(float(steps(t)), 4) for t in (9, 10, 29, 30, 49, 50)]
    [0.0, 0.0, 0.0, 0.4, 0.4, 0.8]

  References:
    Zhu & Gupta, `To prune, or not to prune: exploring the efficacy of pruning
    for model compression <https://arxiv.org/abs/1710.01878>`_, 2017, Eq. (1).
  """
  final = _check_fraction(final_sparsity, "final_sparsity")
  initial = _check_fraction(initial_sparsity, "initial_sparsity")
  if initial > final:
    raise ValueError(
        f"`initial_sparsity` ({initial}) must not exceed `final_sparsity` ({final}).")
  begin = _check_step(begin_step, "begin_step")
  end = _check_step(end_step, "end_step")
  if end <= begin:
    raise ValueError(f"`end_step` ({end}) must be greater than `begin_step` ({begin}).")
  if isinstance(power, bool) or not isinstance(power, numbers.Real) \
      or not (math.isfinite(power) and power > 0):
    raise ValueError(f"`power` must be a finite number > 0, got {power!r}.")
  _schedules.check_positive_int(update_every, "update_every")
  every = int(update_every)

  def schedule(step):
    # int32 arithmetic for the grid, so large step counts stay exact.
    t = jnp.clip(jnp.asarray(step, jnp.int32), begin, end)
    on_grid = begin + ((t - begin) // every) * every
    tau = jnp.where(t >= end, end, on_grid)
    remaining = 1.0 - (tau - begin).astype(jnp.float32) / jnp.float32(end - begin)
    # An integer power is a product (lax.integer_pow): the same bits eager and jitted.
    ramp = remaining ** int(power) if float(power).is_integer() else remaining ** float(power)
    value = final + (initial - final) * ramp
    # Constants at both ends, so the values there are bit-exact float32(initial /
    # final_sparsity) (exact keep counts), and a clip so float rounding near the
    # ends cannot break monotonicity by an ulp.
    value = jnp.clip(value.astype(jnp.float32), jnp.float32(initial), jnp.float32(final))
    value = jnp.where(tau <= begin, jnp.float32(initial), value)
    return jnp.where(t >= end, jnp.float32(final), value)

  return schedule


class MagnitudePruningState(NamedTuple):
  """State of :func:`magnitude_pruning`."""

  count: jax.Array
  """Number of updates taken (int32)."""
  masks: Any
  """Keep masks (bool) of the prunable leaves; ``optax.MaskedNode()`` on the others."""


def _sparsity_fn(sparsity: Any, structure: Structure, name: str) -> Callable[[jax.Array], Any]:
  if isinstance(sparsity, Sequence) and not isinstance(sparsity, (str, bytes)):
    raise TypeError(
        f"{name}: `sparsity` must be a number in [0, 1) or a schedule step -> sparsity, "
        f"got the sequence {sparsity!r}.")
  get = _dual.sparsity_fn(sparsity, structure)
  return lambda count: get(count, None)


def _maybe_cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
                operand: Any) -> Any:
  """``lax.cond`` under tracing; a Python branch when called eagerly (no per-call compile)."""
  if isinstance(pred, jax.core.Tracer):
    return lax.cond(pred, true_fn, false_fn, operand)
  return true_fn(operand) if pred else false_fn(operand)


def magnitude_pruning(
    sparsity: Union[float, optax.Schedule, None],
    *,
    update_every: int = 1,
    structure: Structure = Global(),
    scores: Optional[_scores.Saliency] = None,
    prunable: _prunable.Prunable = None,
    update_until: Optional[int] = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Magnitude pruning with a persistent mask, as the last link of an ``optax.chain``.

  With incoming updates ``u`` and params ``x``, on every prunable leaf

  .. math::

    m_t &= \mathrm{TopK}(x + u,\ s(t)) \quad \text{if } t \bmod \Delta = 0,
      \quad m_t = m_{t-1} \text{ otherwise} \\
    u' &= m_t \odot u - (1 - m_t) \odot x

  so ``optax.apply_updates(x, u')`` is ``m_t * (x + u)``: the step of the
  optimizer before it, then the projection. Pruned weights are exactly 0
  after every step, the mask is held between updates (``t`` counts this
  transform's updates, from 0). Non-prunable leaves pass through unchanged.

  * one-shot magnitude pruning: a constant ``sparsity`` and ``update_every``
    beyond the run (the mask of step 0 is kept), or a schedule that jumps
    once (e.g. ``optax.piecewise_constant_schedule``);
  * GMP: ``polynomial_sparsity(s, ..., power=3)`` and ``update_every`` the
    mask period (the final masks from ``end_step`` on: ``update_until``);
  * IMP+SAM: ``chain(sam_perturb(rho), ..., sgd, magnitude_pruning(...))``
    with ``polynomial_sparsity(..., power=1 or 3, update_every=N * epoch)``.

  Args:
    sparsity: fraction of prunable weights to zero, in ``[0, 1)``, or a
      schedule ``step -> sparsity`` (evaluated at mask updates only). May be
      traced: with ``optax.inject_hyperparams`` and low-precision params pass
      ``hyperparam_dtype=jnp.float32`` (bf16 would round 0.9 to 0.8984).
      ``None`` only for ``NM``.
    update_every: :math:`\Delta \ge 1`, steps between mask updates.
    structure, prunable: as in :func:`safe_optax.project_topk` (default
      :class:`safe_optax.Global`).
    scores: ranking at mask updates: ``None`` (magnitude, ``|x + u|``) or a
      :class:`safe_optax.Saliency` as in
      :func:`safe_optax.admm_penalty`. The saliency sees ``values = x + u``
      and ``updates = u``, the *optimizer's* update (a scaled, momentum-averaged
      gradient placed after SGD); :func:`safe_optax.obd_saliency` needs ``grad_fn``.
    update_until: if set, no mask update after this step (the mask of the
      last update before it is kept for good), e.g. GMP's ``end_step``.
    seed: seeds the saliency's key (Hutchinson probes of OBD, or a
      callable that draws); pass the run's seed.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`MagnitudePruningState`; ``update`` needs ``params`` and ignores
    unrelated extra arguments.

  Examples:
    GMP on a toy problem: the mask follows the cubic schedule, then holds.

    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import magnitude_pruning, polynomial_sparsity
    >>> target = jnp.array([[4., -3.], [0.2, 0.1]])
    >>> loss = lambda p: jnp.sum((p['w'] - target) ** 2)
    >>> schedule = polynomial_sparsity(0.5, begin_step=0, end_step=20, update_every=5)
    >>> tx = optax.chain(optax.sgd(0.1), magnitude_pruning(schedule, update_every=5))
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(jax.grad(loss)(params), state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> params, state = {'w': jnp.zeros((2, 2))}, tx.init({'w': jnp.zeros((2, 2))})
    >>> for _ in range(40):
    ...   params, state = step(params, state)
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)

  References:
    Zhu & Gupta, `To prune, or not to prune <https://arxiv.org/abs/1710.01878>`_,
    2017; Na et al., `Train Flat, Then Compress
    <https://arxiv.org/abs/2205.12694>`_, 2022 (IMP+SAM).
  """
  structure = _structures.check_structure(structure)
  get_sparsity = _sparsity_fn(sparsity, structure, "magnitude_pruning")
  _prunable.check_prunable(prunable)
  _schedules.check_positive_int(update_every, "update_every")
  if update_until is not None:
    _check_step(update_until, "update_until")
  saliency = _scores.check_saliency(scores)
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params):
    # Only tree maps (optax.tree.map_params, sharding); a leafless tree (map_params'
    # placeholder) gives an empty state.
    flags = _prunable.resolve(params, prunable).flags if jax.tree.leaves(params) else ()
    masks = [jnp.ones(jnp.shape(x), bool) for x in _prunable.prunable_leaves(params, flags)]
    return MagnitudePruningState(
        count=jnp.zeros([], jnp.int32),
        masks=_prunable.masked_tree(params, flags, masks) if flags else params,
    )

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("magnitude_pruning needs `params` in update(updates, state, params).")
    flags = _prunable.resolve(params, prunable).flags
    x = _prunable.prunable_leaves(params, flags)
    u = _prunable.prunable_leaves(updates, flags)
    count = state.count

    def new_masks(old_masks):
      del old_masks
      # x + u rounded to the params' dtype: exactly what apply_updates produces.
      values = [jnp.asarray(xi + ui).astype(xi.dtype) for xi, ui in zip(x, u)]
      scores_now = None
      if saliency is not None:
        scores_now = list(saliency(_scores.SaliencyInputs(
            values=values, params=params, updates=updates, grad_fn=grad_fn,
            key=jax.random.fold_in(base_key, count), flags=flags)))
      _, masks = _projection.project_topk(
          values, get_sparsity(count), structure=structure, scores=scores_now,
          prunable=[True] * len(values))
      return list(masks)

    due = count % update_every == 0
    if update_until is not None:
      due = due & (count <= update_until)
    masks = _maybe_cond(due, new_masks, list, _prunable.prunable_leaves(state.masks, flags))
    it = iter(zip(x, masks))
    new_updates = []
    for g, flag in zip(jax.tree.leaves(updates), flags):
      if flag:
        xi, mi = next(it)
        # -x cancels the weight exactly in apply_updates, so pruned weights are 0.0.
        g = jnp.where(mi, g, -xi.astype(g.dtype))
      new_updates.append(g)
    new_state = MagnitudePruningState(
        count=optax.safe_increment(count), masks=_prunable.masked_tree(params, flags, masks))
    return jax.tree.unflatten(jax.tree.structure(updates), new_updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
