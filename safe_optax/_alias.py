"""Ready-made optimizers in optax's style: SAFE, SAFE+, ADMM and the paper's variants.

:func:`safe` builds every one of them: an ``optax.chain`` of this package's
transforms and optax's SGD, as in the official recipe::

  sam_perturb(rho) -> [add_projected_gradient] -> [clip_by_global_norm(max_grad_norm)]
  -> admm_penalty -> add_decayed_weights(weight_decay) -> sgd(learning_rate, momentum)

With ``decoupled_penalty=True`` the penalty moves after SGD as the paper's
plain step ``x -= eta_t * lambda_t * (x - z + u)`` (:func:`decoupled_admm_penalty`).
The variants are written in terms of :func:`safe` with their own explicit
signatures, as optax's ``nadamw`` is written in terms of ``adamw``:
:func:`safe_plus` (a saliency, SNIP by default), :func:`safe_sg`
(``sparse_gradient=True``) and :func:`admm` (no SAM, constant penalty).
SAFE-Multi is ``safe`` with a sequence of sparsities. Call ``update`` with ``params`` and
``grad_fn`` (the SAM aliases need it; ``admm`` does not). ``rho=None`` leaves
SAM out, for ``sam(wrapper(alias(..., rho=None)), rho)`` with
``optax.MultiSteps`` / ``apply_if_finite`` / ``masked`` (see ``_sam.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import optax

from safe_optax import _admm
from safe_optax import _prunable
from safe_optax import _sam
from safe_optax import _schedules
from safe_optax import _scores
from safe_optax import _structures
from safe_optax._structures import Global
from safe_optax._structures import Structure

SparsityArg = Union[float, Sequence[float], optax.Schedule, None]


def safe(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: SparsityArg,
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    structure: Structure = Global(),
    prunable: _prunable.Prunable = None,
    scores: Optional[_scores.Saliency] = None,
    sparse_gradient: bool = False,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
    rescale_dual: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""SAFE: sharpness-aware ADMM pruning with SGD (Lee et al., ICML 2025).

  Each step: SAM gradient :math:`g = \nabla f(x + \rho \nabla f / \|\nabla f\|)`,
  plus the penalty :math:`\lambda_t (x - z + u)` on prunable leaves, plus
  weight decay, through SGD with momentum; every ``dual_every`` steps
  :math:`z = \mathrm{Proj}(x + u),\ u \mathrel{+}= x - z`. Finish with
  :func:`safe_optax.finalize`.

  Args:
    learning_rate: SGD step size (number or optax schedule).
    sparsity: target fraction of zeros among prunable weights, a schedule, or
      a non-empty sequence of fractions for SAFE-Multi (one drawn at random at
      every dual update; finalize at the sparsity you deploy).
    penalty: ``lambda`` (or a schedule).
    penalty_schedule: ``"cosine"`` (vision default), ``"linear"`` or
      ``"constant"``; ``None`` when ``penalty`` is a schedule.
    total_steps: training steps ``T``, required by the ramps.
    rho: SAM radius; ``None`` leaves SAM out, to wrap the optimizer in an
      optax wrapper inside :func:`safe_optax.sam`:
      ``sam(optax.MultiSteps(safe(..., rho=None), k), rho)`` (likewise
      ``apply_if_finite``, ``masked``, ``multi_transform`` and clips).
    dual_every: ``K``, steps between dual updates.
    momentum, nesterov: SGD momentum.
    weight_decay: L2 weight decay added to the gradient (all leaves).
    structure, prunable: the sparsity set (see :func:`project_topk`; default
      :class:`Global`).
    scores: the projection's saliency, a callable such as
      :func:`safe_optax.snip_saliency` (SAFE+, see :func:`safe_plus`);
      ``None`` is magnitude.
    sparse_gradient: add ``grad f(Proj(x))`` to the x-step (SAFE+SG, see
      :func:`safe_sg`).
    adaptive: ASAM perturbation (needs ``rho``).
    max_grad_norm: if set, clip the loss gradient (the SAM gradient) to this
      global norm, before the penalty and weight decay are added. An optax clip
      placed *before* the alias in an ``optax.chain`` would clip nothing (SAM's
      gradient replaces its output) and is not detected: use this argument or
      ``sam(optax.chain(clip, safe(..., rho=None)), rho)``.
    decoupled_penalty: apply the penalty as a plain step after SGD (paper)
      instead of through momentum (official code, default).
    seed: seeds SAFE-Multi draws and OBD's Hutchinson probes.
    rescale_dual: keep the unscaled dual ``lambda * u`` when the penalty
      ramps (Boyd et al. 2011, §3.4.1; see :func:`admm_penalty`). Off by
      default, as in the paper; turn it on at extreme sparsity, where the
      paper's update can diverge under the cosine ramp
      (``docs/dual_rescaling.md``).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn(params, step)``.

  Raises:
    ValueError, TypeError: a configuration out of range, naming the argument
      and its allowed values.

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
  structure = _structures.check_structure(structure)
  penalty_args = dict(
      dual_every=dual_every, penalty_schedule=penalty_schedule, total_steps=total_steps,
      structure=structure, scores=scores, prunable=prunable, seed=seed,
      rescale_dual=rescale_dual)
  base = [optax.add_decayed_weights(weight_decay),
          optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)]
  if decoupled_penalty:
    body = [_admm.decoupled_admm_penalty(optax.chain(*base), sparsity, penalty,
                                         learning_rate=learning_rate, **penalty_args)]
  else:
    body = [_admm.admm_penalty(sparsity, penalty, **penalty_args), *base]
  head = []
  if rho is not None:
    head.append(_sam.sam_perturb(rho, adaptive=adaptive))
  elif adaptive:
    raise ValueError("`adaptive=True` (ASAM) needs a SAM radius `rho`, got rho=None.")
  if sparse_gradient:
    head.append(_sam.add_projected_gradient(
        sparsity, structure=structure, prunable=prunable, seed=seed))
  if max_grad_norm is not None:
    # After the gradient passes (which replace the incoming gradient), before the penalty.
    _schedules.check_nonnegative(max_grad_norm, "max_grad_norm")
    head.append(optax.clip_by_global_norm(max_grad_norm))
  return optax.chain(*head, *body)


def safe_plus(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: SparsityArg,
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    structure: Structure = Global(),
    prunable: _prunable.Prunable = None,
    scores: _scores.Saliency = _scores.snip_saliency(),
    sparse_gradient: bool = False,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
    rescale_dual: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""SAFE+: SAFE with the generalized projection ``Proj^P`` (saliency scores).

  :func:`safe` with a saliency (SNIP by default): the dual update projects
  with a diagonal metric ``P``,

  .. math::

    z = \arg\min_{\|z\|_0 \le d} (z - v)^\top P (z - v), \quad v = x + u,

  i.e. it keeps the entries of ``v`` with the largest saliency
  :math:`\sqrt{P_{ii}}\,|v_i|`. Finalize with the same scores.

  Args:
    learning_rate: as in :func:`safe`, like every argument not listed here.
    scores: the saliency: :func:`safe_optax.snip_saliency` (default,
      ``|g * v|``, ``g`` the gradient entering the penalty, i.e. the SAM
      gradient, also with ``decoupled_penalty=True``),
      :func:`safe_optax.obd_saliency` (Hutchinson Hessian diagonal, one probe
      per dual update; costs a Hessian-vector product then),
      :func:`safe_optax.wanda_saliency`, or ``safe_optax.Saliency(fn)``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params`` and ``grad_fn(params, step)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> loss = lambda p: jnp.sum((p['w'] - jnp.array([[3., 0.1], [0.2, -2.]])) ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = safe_optax.safe_plus(0.1, 0.5, penalty=1.0, total_steps=100, dual_every=4)
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
  return safe(
      learning_rate, sparsity, penalty=penalty, penalty_schedule=penalty_schedule,
      total_steps=total_steps, rho=rho, dual_every=dual_every, momentum=momentum,
      nesterov=nesterov, weight_decay=weight_decay, structure=structure, prunable=prunable,
      scores=scores, sparse_gradient=sparse_gradient, adaptive=adaptive,
      max_grad_norm=max_grad_norm, decoupled_penalty=decoupled_penalty, seed=seed,
      rescale_dual=rescale_dual)


def admm(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: SparsityArg,
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "constant",
    total_steps: Optional[int] = None,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    structure: Structure = Global(),
    prunable: _prunable.Prunable = None,
    scores: Optional[_scores.Saliency] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
    rescale_dual: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""ADMM pruning (Zhang et al., 2018): SAFE without SAM, constant penalty by default.

  :func:`safe` with ``rho=None`` and ``penalty_schedule="constant"``. Each
  step adds :math:`\lambda_t (x - z + u)` to the gradient of the prunable
  leaves, then weight decay and SGD with momentum; every ``dual_every`` steps
  :math:`z = \mathrm{Proj}(x + u),\ u \mathrel{+}= x - z`. Finish with
  :func:`safe_optax.finalize`.

  Args:
    learning_rate: as in :func:`safe`, like every argument not listed here.
    penalty_schedule: as in :func:`safe`, but ``"constant"`` by default.
    scores: a SAFE+-style saliency, as in :func:`safe_plus` (``None``:
      magnitude).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`; ``update`` needs
    ``params``, and ``grad_fn`` only with :func:`safe_optax.obd_saliency`.

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
  return safe(
      learning_rate, sparsity, penalty=penalty, penalty_schedule=penalty_schedule,
      total_steps=total_steps, rho=None, dual_every=dual_every, momentum=momentum,
      nesterov=nesterov, weight_decay=weight_decay, structure=structure, prunable=prunable,
      scores=scores, decoupled_penalty=decoupled_penalty, seed=seed, rescale_dual=rescale_dual)


def safe_sg(
    learning_rate: optax.ScalarOrSchedule,
    sparsity: SparsityArg,
    *,
    penalty: Union[float, optax.Schedule],
    penalty_schedule: Optional[str] = "cosine",
    total_steps: Optional[int] = None,
    rho: Optional[float] = 0.1,
    dual_every: int = 32,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    structure: Structure = Global(),
    prunable: _prunable.Prunable = None,
    scores: Optional[_scores.Saliency] = None,
    adaptive: bool = False,
    max_grad_norm: Optional[float] = None,
    decoupled_penalty: bool = False,
    seed: int = 0,
    rescale_dual: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""SAFE+SG: SAFE whose x-step also adds ``grad f(Proj(x))`` (paper App. D).

  :func:`safe` with ``sparse_gradient=True``. The x-step gradient is
  :math:`\nabla f(x + \rho g/\|g\|) + \nabla f(\mathrm{Proj}(x)) + \lambda_t (x - z + u)`,
  so the dense iterate also trains the sparse model it will be pruned to.
  Costs a third gradient per step; ``grad_fn`` is called with step 1 for it.

  Args:
    learning_rate: as in :func:`safe`, like every argument not listed here.
    sparsity: as in :func:`safe`; a sequence gives SAFE+SG,Multi.

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
  return safe(
      learning_rate, sparsity, penalty=penalty, penalty_schedule=penalty_schedule,
      total_steps=total_steps, rho=rho, dual_every=dual_every, momentum=momentum,
      nesterov=nesterov, weight_decay=weight_decay, structure=structure, prunable=prunable,
      scores=scores, sparse_gradient=True, adaptive=adaptive, max_grad_norm=max_grad_norm,
      decoupled_penalty=decoupled_penalty, seed=seed, rescale_dual=rescale_dual)
