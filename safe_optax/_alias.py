"""Ready-made optimizers in optax's style: SAFE, SAFE+, ADMM and the paper's variants.

Each alias is an ``optax.chain`` of this package's transforms and optax's
SGD, as in the official recipe::

  sam_perturb(rho) -> [add_projected_gradient] -> [clip_by_global_norm(max_grad_norm)]
  -> admm_penalty -> add_decayed_weights(weight_decay) -> sgd(learning_rate, momentum)

With ``decoupled_penalty=True`` the penalty moves after SGD as the paper's
plain step ``x -= eta_t * lambda_t * (x - z + u)``. Call ``update`` with
``params`` and ``grad_fn`` (the SAM aliases need it; ``admm`` does not).
``rho=None`` leaves SAM out, for ``optax.chain(sam_perturb(rho), wrapper(alias))``
with ``optax.MultiSteps`` / ``apply_if_finite`` / ``masked`` (see ``_sam.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import optax

from safe_optax import _admm
from safe_optax import _projection
from safe_optax import _prunable
from safe_optax import _sam
from safe_optax import _schedules
from safe_optax import _scores


def _pruning_chain(
    learning_rate, sparsity, *, penalty, penalty_schedule, total_steps, rho, dual_every,
    momentum, nesterov, weight_decay, scope, structure, prunable, scores, decoupled_penalty,
    sparse_gradient, adaptive, max_grad_norm, seed,
) -> optax.GradientTransformationExtraArgs:
  """The shared chain behind every alias (each alias passes its own arguments on)."""
  penalty_tx = _admm.admm_penalty(
      sparsity, penalty, dual_every=dual_every, penalty_schedule=penalty_schedule,
      total_steps=total_steps, scope=scope, structure=structure, scores=scores,
      prunable=prunable, learning_rate=learning_rate if decoupled_penalty else None, seed=seed,
  )
  head = []
  if rho is not None:
    head.append(_sam.sam_perturb(rho, adaptive=adaptive))
  if sparse_gradient:
    head.append(_sam.add_projected_gradient(
        sparsity, scope=scope, structure=structure, prunable=prunable, seed=seed))
  if max_grad_norm is not None:
    # After the gradient passes (which replace the incoming gradient), before the penalty.
    _schedules.check_nonnegative(max_grad_norm, "max_grad_norm")
    head.append(optax.clip_by_global_norm(max_grad_norm))
  base = [
      optax.add_decayed_weights(weight_decay),
      optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov),
  ]
  body = base + [penalty_tx] if decoupled_penalty else [penalty_tx] + base
  return optax.chain(*head, *body)


def safe(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: Union[float, Sequence[float], optax.Schedule, None],
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    prunable: _prunable.Prunable = None,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""SAFE: sharpness-aware ADMM pruning with SGD (Lee et al., ICML 2025).

  Each step: SAM gradient :math:`g = \nabla f(x + \rho \nabla f / \|\nabla f\|)`,
  plus the penalty :math:`\lambda_t (x - z + u)` on prunable leaves, plus
  weight decay, through SGD with momentum; every ``dual_every`` steps
  :math:`z = \mathrm{Proj}(x + u),\ u \mathrel{+}= x - z`. Finish with
  :func:`safe_optax.finalize`.

  Args:
    learning_rate: SGD step size (number or optax schedule).
    sparsity: target fraction of zeros among prunable weights (or a schedule,
      or a set of choices for SAFE-Multi).
    penalty: ``lambda`` (or a schedule).
    penalty_schedule: ``"cosine"`` (vision default), ``"linear"`` or
      ``"constant"``; ``None`` when ``penalty`` is a schedule.
    total_steps: training steps ``T``, required by the ramps.
    rho: SAM radius; ``None`` leaves SAM out, to put
      :func:`safe_optax.sam_perturb` before an optax wrapper:
      ``optax.chain(sam_perturb(rho), optax.MultiSteps(safe(..., rho=None), k))``
      (``MultiSteps``, ``apply_if_finite``, ``masked`` and ``multi_transform``
      refuse to wrap SAM itself).
    dual_every: ``K``, steps between dual updates.
    momentum, nesterov: SGD momentum.
    weight_decay: L2 weight decay added to the gradient (all leaves).
    scope, structure, prunable: the sparsity set (see :func:`project_topk`).
    adaptive: ASAM perturbation.
    max_grad_norm: if set, clip the loss gradient (the SAM gradient) to this
      global norm, before the penalty and weight decay are added. An optax clip
      placed *before* the alias in an ``optax.chain`` would clip nothing (SAM's
      gradient replaces its output), so the first ``update`` raises on it.
    decoupled_penalty: apply the penalty as a plain step after SGD (paper)
      instead of through momentum (official code, default).
    seed: seeds SAFE-Multi draws.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn(params, step)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> loss = lambda p: jnp.sum((p['w'] - jnp.array([[3., 0.1], [0.2, -2.]])) ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = safe_optax.safe(0.1, 0.5, penalty=1.0, total_steps=200, dual_every=4)
    >>> params = {'w': jnp.zeros((2, 2))}
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
    ...   return optax.apply_updates(params, updates), state
    >>> state = tx.init(params)
    >>> for _ in range(200):
    ...   params, state = step(params, state)
    >>> sparse, masks = safe_optax.finalize(params, 0.5)
    >>> masks['w']
    Array([[ True, False],
           [False,  True]], dtype=bool)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025.
  """
  return _pruning_chain(**locals(), scores=None, sparse_gradient=False)


def safe_plus(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: Union[float, Sequence[float], optax.Schedule, None],
    *,
    penalty: Union[float, optax.Schedule],
    scores: Union[str, _scores.Saliency] = "snip",
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    prunable: _prunable.Prunable = None,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""SAFE+: SAFE with the generalized projection ``Proj^P`` (saliency scores).

  As :func:`safe`, but the dual update projects with a diagonal metric ``P``,

  .. math::

    z = \arg\min_{\|z\|_0 \le d} (z - v)^\top P (z - v), \quad v = x + u,

  i.e. it keeps the entries of ``v`` with the largest saliency
  :math:`\sqrt{P_{ii}}\,|v_i|`. Finalize with the same scores.

  Args:
    learning_rate, sparsity, penalty: as in :func:`safe`.
    scores: ``"snip"`` (``|g * v|``, ``g`` the gradient entering the penalty,
      i.e. the SAM gradient), ``"obd"`` (Hutchinson Hessian diagonal, one
      probe per dual update; costs a Hessian-vector product then),
      ``"magnitude"`` (plain SAFE), or a callable ``SaliencyInputs -> scores``
      such as :func:`safe_optax.wanda_saliency`.
    penalty_schedule, total_steps, rho, dual_every: as in :func:`safe`.
    momentum, nesterov, weight_decay: as in :func:`safe`.
    scope, structure, prunable: as in :func:`safe`.
    adaptive, max_grad_norm, decoupled_penalty, seed: as in :func:`safe`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn(params, step)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> loss = lambda p: jnp.sum((p['w'] - jnp.array([[3., 0.1], [0.2, -2.]])) ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = safe_optax.safe_plus(0.1, 0.5, penalty=1.0, scores='snip', total_steps=100,
    ...                           dual_every=4)
    >>> params = {'w': jnp.zeros((2, 2))}
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
    ...   return optax.apply_updates(params, updates), state
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...   params, state = step(params, state)
    >>> safe_optax.find_admm_state(state).z['w'] != 0  # the SNIP-projected target
    Array([[ True, False],
           [False,  True]], dtype=bool)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (§3.4, SAFE+).
  """
  return _pruning_chain(**locals(), sparse_gradient=False)


def admm(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: Union[float, Sequence[float], optax.Schedule, None],
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "constant",
    total_steps: Optional[int] = None,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    prunable: _prunable.Prunable = None,
    scores: Union[None, str, _scores.Saliency] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""ADMM pruning (Zhang et al., 2018): SAFE without SAM, constant penalty by default.

  Each step adds :math:`\lambda_t (x - z + u)` to the gradient of the
  prunable leaves, then weight decay and SGD with momentum; every
  ``dual_every`` steps :math:`z = \mathrm{Proj}(x + u),\ u \mathrel{+}= x - z`.
  Finish with :func:`safe_optax.finalize`.

  Args:
    learning_rate, sparsity, penalty: as in :func:`safe`.
    penalty_schedule: ``"constant"`` (default), ``"linear"`` or
      ``"cosine"``; ``None`` when ``penalty`` is a schedule.
    total_steps, dual_every: as in :func:`safe`.
    momentum, nesterov, weight_decay: as in :func:`safe`.
    scope, structure, prunable: as in :func:`safe`.
    decoupled_penalty, seed: as in :func:`safe`.
    scores: optional SAFE+-style saliency for the projection, as in
      :func:`safe_plus` (``None``: magnitude).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params``, and ``grad_fn`` only with ``scores="obd"``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> loss = lambda p: jnp.sum((p['w'] - jnp.array([[3., 0.1], [0.2, -2.]])) ** 2)
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=0.5, dual_every=4)
    >>> params = {'w': jnp.zeros((2, 2))}
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(jax.grad(loss)(params), state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...   params, state = step(params, state)
    >>> jnp.round(params['w'], 1)  # the penalty pulled the small entries to 0
    Array([[ 3.,  0.],
           [ 0., -2.]], dtype=float32)

  References:
    Zhang et al., `A Systematic DNN Weight Pruning Framework using Alternating
    Direction Method of Multipliers <https://arxiv.org/abs/1804.03294>`_, ECCV 2018.
  """
  return _pruning_chain(**locals(), rho=None, sparse_gradient=False, adaptive=False,
                        max_grad_norm=None)


def safe_sg(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: Union[float, Sequence[float], optax.Schedule, None],
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    prunable: _prunable.Prunable = None,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""SAFE+SG: SAFE whose x-step also adds ``grad f(Proj(x))`` (paper App. D).

  The x-step gradient is
  :math:`\nabla f(x + \rho g/\|g\|) + \nabla f(\mathrm{Proj}(x)) + \lambda_t (x - z + u)`,
  so the dense iterate also trains the sparse model it will be pruned to.
  Costs a third gradient per step; ``grad_fn`` is called with step 1 for it.

  Args:
    learning_rate, penalty: as in :func:`safe`.
    sparsity: as in :func:`safe`; a sequence gives SAFE+SG,Multi.
    penalty_schedule, total_steps, rho, dual_every: as in :func:`safe`.
    momentum, nesterov, weight_decay: as in :func:`safe`.
    scope, structure, prunable: as in :func:`safe`.
    adaptive, max_grad_norm, decoupled_penalty, seed: as in :func:`safe`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn(params, step)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> loss = lambda p: jnp.sum((p['w'] - jnp.array([[3., 0.1], [0.2, -2.]])) ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = safe_optax.safe_sg(0.1, 0.5, penalty=1.0, total_steps=100, dual_every=4)
    >>> params = {'w': jnp.zeros((2, 2))}
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
    ...   return optax.apply_updates(params, updates), state
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...   params, state = step(params, state)
    >>> safe_optax.finalize(params, 0.5)[1]['w']
    Array([[ True, False],
           [False,  True]], dtype=bool)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (App. D); Peste et al., `CrAM: A Compression-Aware
    Minimizer <https://arxiv.org/abs/2207.14200>`_, ICLR 2023.
  """
  return _pruning_chain(**locals(), scores=None, sparse_gradient=True)


def safe_multi(
    learning_rate: optax.ScalarOrSchedule,
    sparsity_choices: Sequence[float],
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scope: Optional[str] = None,
    structure: _projection.Structure = None,
    prunable: _prunable.Prunable = None,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """SAFE-Multi: the target sparsity is drawn from ``sparsity_choices`` at each z-update.

  Training against a random target from a set makes one run usable at each
  of those sparsities; finalize at the sparsity you deploy.

  Args:
    learning_rate: as in :func:`safe`.
    sparsity_choices: non-empty sequence of target sparsities in ``[0, 1)``;
      one is drawn uniformly at random at every dual update.
    penalty, penalty_schedule, total_steps, rho, dual_every: as in :func:`safe`.
    momentum, nesterov, weight_decay: as in :func:`safe`.
    scope, structure, prunable, adaptive, max_grad_norm, decoupled_penalty: as in
      :func:`safe`.
    seed: seeds the draws.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn(params, step)``.

  Raises:
    ValueError: ``sparsity_choices`` is empty or not a sequence.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> loss = lambda p: jnp.sum((p['w'] - jnp.array([[3., 0.1], [0.2, -2.]])) ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = safe_optax.safe_multi(0.1, (0.25, 0.5), penalty=1.0, total_steps=100,
    ...                            dual_every=4)
    >>> params = {'w': jnp.zeros((2, 2))}
    >>> @jax.jit
    ... def step(params, state):
    ...   updates, state = tx.update(grad_fn(params, 0), state, params, grad_fn=grad_fn)
    ...   return optax.apply_updates(params, updates), state
    >>> state = tx.init(params)
    >>> for _ in range(100):
    ...   params, state = step(params, state)
    >>> safe_optax.finalize(params, 0.5)[1]['w']
    Array([[ True, False],
           [False,  True]], dtype=bool)

  References:
    Lee, Lee, Chung, Lee, `SAFE: Finding Sparse and Flat Minima to Improve
    Pruning`, ICML 2025 (§4.4, App. D).
  """
  if isinstance(sparsity_choices, (str, bytes)) or not isinstance(sparsity_choices, Sequence) \
      or not sparsity_choices:
    raise ValueError(
        f"`sparsity_choices` must be a non-empty sequence of sparsities, got {sparsity_choices!r}.")
  sparsity = tuple(sparsity_choices)
  del sparsity_choices
  return _pruning_chain(**locals(), scores=None, sparse_gradient=False)
