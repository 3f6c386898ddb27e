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
``x -= eta_t * lambda_t * (x - z + u)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _scores
from safe_optax import _schedules

SparsityArg = Union[float, Sequence[float], optax.Schedule, None]


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
  ``learning_rate``) that is negative or not finite counts as 0. Check it is
  0 after training.
  """


def sparsity_fn(sparsity: SparsityArg, scope: Optional[str], structure: _projection.Structure):
  """Validates the projection config and returns ``(count, key) -> sparsity``.

  A number (or traced scalar) is constant; a sequence is SAFE-Multi's set,
  drawn uniformly at random at each dual update; a callable is a schedule.
  """
  if callable(sparsity):
    probe = None if isinstance(structure, _projection.NM) else 0.5
    _projection.check_config(probe, scope, structure)
    return lambda count, key: sparsity(count)
  if isinstance(sparsity, Sequence) and not isinstance(sparsity, (str, bytes)):
    if not sparsity:
      raise ValueError("`sparsity` as a set of choices (SAFE-Multi) must not be empty.")
    for choice in sparsity:
      _projection.check_config(choice, scope, structure)
    choices = jnp.asarray(sparsity, jnp.float32)
    return lambda count, key: jax.random.choice(key, choices)
  _projection.check_config(sparsity, scope, structure)
  return lambda count, key: sparsity


def _is_masked(node: Any) -> bool:
  return isinstance(node, optax.MaskedNode)


def _in_unit_interval(sparsity: Any) -> Any:
  """Whether a (possibly traced) sparsity lies in ``[0, 1)``; NaN does not.

  ``None`` (N:M, whose sparsity is fixed by the structure) and Python numbers
  (checked at construction) are valid without any array work.
  """
  if sparsity is None or isinstance(sparsity, (int, float)):
    return True
  return (sparsity >= 0) & (sparsity < 1)


def leaf_flags(params: Any, prunable: _prunable.Prunable) -> tuple[bool, ...]:
  """Prunable flags of ``params``' leaves, MaskedNode placeholders counted as leaves.

  Under ``optax.masked`` / ``optax.multi_transform`` the inner transform sees
  ``params`` with ``optax.MaskedNode`` in place of the masked-out leaves; they
  are never pruned, and counting them keeps the flags aligned with the state's
  ``z`` / ``u`` trees, which hold MaskedNode at every non-prunable leaf.
  """
  array_flags = iter(_prunable.resolve(params, prunable).flags)
  return tuple(False if _is_masked(leaf) else next(array_flags)
               for leaf in jax.tree.leaves(params, is_leaf=_is_masked))


def _prunable_leaves(tree: Any, flags: tuple[bool, ...]) -> list[Any]:
  """The prunable leaves of a params-shaped tree (MaskedNode placeholders count as leaves)."""
  leaves = jax.tree.leaves(tree, is_leaf=_is_masked)
  if len(leaves) != len(flags):
    raise ValueError(
        f"tree has {len(leaves)} leaves but the parameters have {len(flags)}; the state "
        "does not belong to these parameters."
    )
  return [leaf for leaf, flag in zip(leaves, flags) if flag]


def _masked_tree(params: Any, flags: tuple[bool, ...], values: Sequence[Any]) -> Any:
  """``params``-shaped tree with ``values`` on prunable leaves, MaskedNode elsewhere."""
  it = iter(values)
  leaves = [next(it) if flag else optax.MaskedNode() for flag in flags]
  return jax.tree.unflatten(jax.tree.structure(params, is_leaf=_is_masked), leaves)


def dual_update(
    params: Any,
    z: Sequence[jax.Array],
    u: Sequence[jax.Array],
    sparsity: Any,
    *,
    flags: tuple[bool, ...],
    first: jax.Array,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    scores: Optional[Any] = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
  r"""One ADMM z/u step on the prunable leaves: ``z = Proj(x + u); u = u + x - z``.

  .. math::

    z \leftarrow \mathrm{Proj}(x + u), \qquad u \leftarrow u + x - z

  (``u`` unchanged when ``first``). :func:`admm_penalty` calls it every
  ``dual_every`` steps; it is public for custom training loops.

  Args:
    params: the full parameter tree ``x``.
    z, u: lists of the prunable leaves' ``z`` and ``u``.
    sparsity: target sparsity (number or traced scalar).
    flags: prunable flags of ``params``' leaves.
    first: True at initialisation, where ``u`` stays 0 (``z0 = Proj(x0)``).
    scope, structure: as in :func:`safe_optax.project_topk`.
    scores: optional list of scores for ``x + u`` (SAFE+).

  Returns:
    The new ``(z, u)`` lists.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import dual_update
    >>> params = {'b': jnp.ones(2), 'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> z, u = dual_update(params, [jnp.zeros((2, 2))], [jnp.array([[0., 0.], [1., 0.]])],
    ...                    0.5, flags=(False, True), first=jnp.array(False))
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
  del z
  x = _prunable_leaves(params, flags)
  v = [xi + ui for xi, ui in zip(x, u)]
  every = tuple(True for _ in v)
  z_new, _ = _projection.project_topk(
      v, sparsity, scope=scope, structure=structure, scores=scores, prunable=list(every)
  )
  u_new = [
      jnp.where(first, ui, ui + xi - zi) for xi, ui, zi in zip(x, u, z_new)
  ]
  return list(z_new), u_new


def admm_penalty(
    sparsity: SparsityArg,
    penalty: Union[float, optax.Schedule],
    *,
    dual_every: int = 32,
    penalty_schedule: Optional[str] = "constant",
    total_steps: Optional[int] = None,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    scores: Union[None, str, _scores.Saliency] = None,
    prunable: _prunable.Prunable = None,
    learning_rate: Optional[Union[float, optax.Schedule]] = None,
    seed: int = 0,
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
    scope, structure, prunable: as in :func:`safe_optax.project_topk`.
    scores: SAFE+ saliency: ``None``/``"magnitude"``, ``"snip"``, ``"obd"``,
      or a callable ``SaliencyInputs -> scores`` (e.g. :func:`wanda_saliency`).
    learning_rate: ``None`` to add the penalty to the gradient (place before
      the base optimizer); a number or schedule for the decoupled plain step
      (place after the base optimizer).
    seed: seeds SAFE-Multi draws and Hutchinson probes.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose state is
    :class:`ADMMState`. ``update`` needs ``params``; ``grad_fn`` is only used
    by the ``"obd"`` saliency; other extra arguments are ignored.

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
  get_sparsity = sparsity_fn(sparsity, scope, structure)
  _schedules.check_positive_int(dual_every, "dual_every")
  lam_fn = _schedules.penalty_schedule(penalty, penalty_schedule, total_steps)
  saliency = _scores.get_saliency(scores)
  if learning_rate is not None and not callable(learning_rate):
    _schedules.check_nonnegative(learning_rate, "learning_rate")
  base_key = jax.random.PRNGKey(seed)

  def init_fn(params):
    # Only tree maps, so optax.tree.map_params and sharded params work; a
    # leafless tree (map_params' placeholder) yields an empty state.
    if jax.tree.leaves(params):
      flags = leaf_flags(params, prunable)
      if structure is not None:
        # Here, not at the first dual update, so the error names the parameter path.
        _projection.check_structure_fits(params, structure, prunable)
    else:
      flags = ()
    x = _prunable_leaves(params, flags)
    return ADMMState(
        count=jnp.zeros([], jnp.int32),
        z=_masked_tree(params, flags, [jnp.array(xi) for xi in x]) if flags else params,
        u=_masked_tree(params, flags, [jnp.zeros_like(xi) for xi in x]) if flags else params,
        invalid_hyperparams=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None, *, grad_fn=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("admm_penalty needs `params` in update(updates, state, params).")
    flags = leaf_flags(params, prunable)
    z = _prunable_leaves(state.z, flags)
    u = _prunable_leaves(state.u, flags)
    count = state.count
    key = jax.random.fold_in(base_key, count)
    sparsity_now = get_sparsity(count, key)
    sparsity_ok = _in_unit_interval(sparsity_now)
    lam = lam_fn(count)
    if learning_rate is not None:  # the decoupled step's rate scales the penalty
      lam = lam * (learning_rate(count) if callable(learning_rate) else learning_rate)
    penalty_ok = jnp.isfinite(lam) & (lam >= 0)
    # A traced dual_every < 1 (inject_hyperparams) would divide by zero below.
    every_ok = jnp.asarray(dual_every) >= 1

    def run_dual(z, u):
      scores_now = None
      if saliency is not None:
        x = _prunable_leaves(params, flags)
        inputs = _scores.SaliencyInputs(
            values=[xi + ui for xi, ui in zip(x, u)], params=params, updates=updates,
            grad_fn=grad_fn, key=key, flags=flags,
        )
        scores_now = list(saliency(inputs))
      return dual_update(
          params, z, u, sparsity_now, flags=flags, first=count == 0,
          scope=scope, structure=structure, scores=scores_now,
      )

    due = (count % jnp.maximum(dual_every, 1) == 0) & sparsity_ok & every_ok
    if isinstance(due, jax.core.Tracer):
      z, u = lax.cond(due, run_dual, lambda z, u: (list(z), list(u)), z, u)
    elif due:
      # Called eagerly: branch in Python, since an eager lax.cond recompiles every call.
      z, u = run_dual(z, u)
    lam = jnp.where(penalty_ok, lam, jnp.zeros_like(lam))
    scale = lam if learning_rate is None else -lam
    it = iter(zip(_prunable_leaves(params, flags), z, u))
    new_updates = []
    for g, flag in zip(jax.tree.leaves(updates, is_leaf=_is_masked), flags):
      if flag:
        xi, zi, ui = next(it)
        g = (g + scale * (xi - zi + ui)).astype(g.dtype)
      new_updates.append(g)
    valid = sparsity_ok & penalty_ok & every_ok
    new_state = ADMMState(
        count=optax.safe_increment(count),
        z=_masked_tree(params, flags, z),
        u=_masked_tree(params, flags, u),
        invalid_hyperparams=jnp.where(valid, state.invalid_hyperparams,
                                      optax.safe_increment(state.invalid_hyperparams)),
    )
    updates_def = jax.tree.structure(updates, is_leaf=_is_masked)
    return jax.tree.unflatten(updates_def, new_updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ADMMState))
           if isinstance(s, ADMMState)]
  if len(found) != 1:
    raise ValueError(f"expected exactly one ADMMState in the optimizer state, found {len(found)}.")
  return found[0]


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
  z_leaves = jax.tree.leaves(state.z, is_leaf=_is_masked)
  sq = [jnp.sum(jnp.square(x.astype(jnp.float32) - z.astype(jnp.float32)))
        for x, z in zip(jax.tree.leaves(params), z_leaves)
        if not isinstance(z, optax.MaskedNode)]
  return jnp.sqrt(sum(sq))
