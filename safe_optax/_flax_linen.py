"""Flax Linen helpers for SAM / SAFE steps with BatchNorm and dropout (see :mod:`safe_optax.flax_utils`).

The clean pass (:func:`loss_and_grad_with_state`), SAM's pass on the same
batch and key without its BatchNorm updates (:func:`sam_grad_fn`) and
BatchNorm re-estimation after pruning (:func:`recalibrate_batch_stats`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ApplyFn = Callable[..., Any]
LossFn = Callable[[Any, Any], jax.Array]
Rng = Union[None, jax.Array, Mapping[str, jax.Array]]
GradFn = Callable[[Any, int], Any]


def _rngs(rng: Rng) -> Optional[dict[str, jax.Array]]:
  """``None`` -> no rngs; a key -> ``{'dropout': key}``; a mapping -> itself."""
  if rng is None:
    return None
  if isinstance(rng, Mapping):
    return dict(rng)
  return {"dropout": rng}


def split_batch(batch: Any) -> tuple[Any, Any]:
  if not isinstance(batch, (tuple, list)) or len(batch) != 2:
    raise TypeError(
        "`batch` must be a pair (inputs, targets): inputs go to apply_fn, targets to "
        f"loss_fn(logits, targets); got {type(batch).__name__}. For a dict batch pass "
        "(batch['image'], batch['label'])."
    )
  inputs, targets = batch
  return inputs, targets


def _train_loss(apply_fn, model_state, batch, loss_fn, rng, mutable):
  """``params -> (loss, (logits, new_model_state))`` in training mode."""
  inputs, targets = split_batch(batch)
  rngs = _rngs(rng)
  mutable = list(mutable)

  def loss(params):
    variables = {**model_state, "params": params}
    logits, mutated = apply_fn(variables, inputs, train=True, mutable=mutable, rngs=rngs)
    # Collections that were not mutated (none, usually) are carried over as is.
    new_model_state = {**model_state, **mutated}
    return loss_fn(logits, targets), (logits, new_model_state)

  return loss


def loss_and_grad_with_state(
    apply_fn: ApplyFn,
    params: Any,
    model_state: Mapping[str, Any],
    batch: Any,
    loss_fn: LossFn,
    rng: Rng = None,
    *,
    mutable: Sequence[str] = ("batch_stats",),
) -> tuple[tuple[jax.Array, tuple[Any, dict[str, Any]]], Any]:
  """The first (clean) pass of a training step: loss, logits, new state, gradient.

  Runs ``apply_fn({'params': params, **model_state}, inputs, train=True,
  mutable=mutable, rngs=...)`` under :func:`jax.value_and_grad`.

  Args:
    apply_fn: ``model.apply`` of a Linen module taking ``(inputs, train=...)``.
    params: the ``'params'`` collection (what the optimizer updates).
    model_state: the other collections, e.g. ``{'batch_stats': ...}``; ``{}``
      for a model without BatchNorm.
    batch: ``(inputs, targets)``.
    loss_fn: ``loss_fn(logits, targets) -> scalar``.
    rng: ``None``, a PRNG key (used as the ``'dropout'`` stream) or a mapping
      ``{stream_name: key}`` passed as ``rngs``.
    mutable: collections updated in training mode.

  Returns:
    ``((loss, (logits, new_model_state)), grads)``: ``new_model_state`` is
    ``model_state`` with the mutated collections replaced (BatchNorm running
    statistics of this pass); ``grads`` has the structure of ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from safe_optax.flax_utils import loss_and_grad_with_state
    >>> model = nn.BatchNorm(use_running_average=False, momentum=0.9, use_scale=False,
    ...                      use_bias=False)
    >>> x = jnp.array([[1.0], [3.0]])
    >>> variables = model.init(jax.random.PRNGKey(0), x)
    >>> apply_fn = lambda v, x, train, **kw: model.apply(v, x, **kw)
    >>> (loss, (logits, state)), grads = loss_and_grad_with_state(
    ...     apply_fn, {}, {'batch_stats': variables['batch_stats']}, (x, None),
    ...     lambda logits, _: jnp.sum(logits ** 2))
    >>> state['batch_stats']['mean']  # 0.9 * 0 + 0.1 * mean([1, 3])
    Array([0.2], dtype=float32)
  """
  loss = _train_loss(apply_fn, model_state, batch, loss_fn, rng, mutable)
  return jax.value_and_grad(loss, has_aux=True)(params)


def sam_grad_fn(
    apply_fn: ApplyFn,
    model_state: Mapping[str, Any],
    batch: Any,
    loss_fn: LossFn,
    rng: Rng = None,
    *,
    mutable: Sequence[str] = ("batch_stats",),
) -> GradFn:
  """A ``grad_fn(params, step) -> grads`` for :func:`safe_optax.sam_perturb`.

  The returned function evaluates the gradient of the same training-mode loss
  as :func:`loss_and_grad_with_state` -- same ``batch``, same ``rng`` (so the
  same dropout masks), BatchNorm on the batch statistics -- at whatever
  ``params`` it is given (the SAM ascent point ``x + e``, or ``Proj(x)`` for
  :func:`safe_optax.add_projected_gradient`), and **drops** the BatchNorm
  statistics of that pass: keep the ``new_model_state`` of the first pass.
  Under ``jax.jit`` the dropped running-average updates are dead code.

  ``step`` (0 from ``sam_perturb``, 1 from ``add_projected_gradient``) is
  ignored: every call sees the same batch and key. The function is
  differentiable (OBD saliencies take its Hessian-vector products).

  Args:
    apply_fn, model_state, batch, loss_fn, rng, mutable: as in
      :func:`loss_and_grad_with_state`; pass the *same* values as to the
      first pass (``model_state`` is the state before the step; its running
      statistics are not read in training mode anyway).

  Returns:
    ``grad_fn(params, step)`` returning a gradient shaped like ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from safe_optax import sam_perturb
    >>> from safe_optax.flax_utils import sam_grad_fn
    >>> apply_fn = lambda v, x, train, mutable, rngs: (x @ v['params']['w'], {})
    >>> loss_fn = lambda logits, y: jnp.mean((logits - y) ** 2)
    >>> batch = (jnp.eye(2), jnp.array([[1.0], [0.0]]))
    >>> grad_fn = sam_grad_fn(apply_fn, {}, batch, loss_fn)
    >>> params = {'w': jnp.zeros((2, 1))}
    >>> grad_fn(params, 0)['w'].ravel()
    Array([-1.,  0.], dtype=float32)
    >>> tx = sam_perturb(rho=0.5)  # gradient at w + 0.5 * g / |g| = [-0.5, 0]
    >>> sam_grads, _ = tx.update(grad_fn(params, 0), tx.init(params), params,
    ...                          grad_fn=grad_fn)
    >>> sam_grads['w'].ravel()
    Array([-1.5,  0. ], dtype=float32)
  """
  loss = _train_loss(apply_fn, model_state, batch, loss_fn, rng, mutable)
  grad = jax.grad(loss, has_aux=True)

  def grad_fn(params: Any, step: int = 0) -> Any:
    del step
    grads, _discarded_aux = grad(params)
    return grads

  return grad_fn


def _batch_moments(apply_fn: ApplyFn, variables: Any, inputs: Any,
                   rngs: Optional[dict[str, jax.Array]]) -> dict[tuple[str, ...], Any]:
  """Per-channel mean and biased variance of every BatchNorm input in one training pass.

  Every ``nn.BatchNorm`` call that normalises with batch statistics is
  intercepted (its input read, the call itself left alone), so the layers
  after it see exactly what training mode gives them. Returns
  ``{module path: (count, mean, var)}`` where ``count`` (a Python int) is the
  number of reduced entries per channel; a module called twice gets a list.
  """
  found: dict[tuple[str, ...], list[Any]] = {}

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
      use_running_average = nn.merge_param(
          "use_running_average", module.use_running_average, kwargs.get("use_running_average",
                                                                        args[1] if len(args) > 1
                                                                        else None))
      if not use_running_average:
        if kwargs.get("mask") is not None:
          raise ValueError(
              f"recalibrate_batch_stats: BatchNorm '{'/'.join(module.path)}' is called with a "
              "`mask`; masked statistics are not supported.")
        x = jnp.asarray(args[0])
        axes = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
        feature_axes = tuple(a % x.ndim for a in axes)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = x32.mean(reduction_axes)
        # Centred within the batch (not E[x^2] - mean^2): no cancellation when |mean| >> std.
        var = jnp.square(x32 - jnp.expand_dims(mean, reduction_axes)).mean(reduction_axes)
        count = int(np.prod([x.shape[i] for i in reduction_axes]))
        found.setdefault(tuple(module.path), []).append((count, mean, var))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    apply_fn(variables, inputs, train=True, mutable=["batch_stats"], rngs=rngs)
  return {path: calls for path, calls in found.items()}


def add_moments(totals: dict[Any, list[Any]], key: Any, count: int, mean: Any,
                 var: Any) -> None:
  """Folds one batch's per-channel ``(count, mean, biased var)`` into ``totals[key]``.

  Running float64 totals ``[N, mean, M2 = N * var]``, combined exactly with
  the parallel-variance formula (Chan et al.).
  """
  # Python ints: entry counts reach 1e7+ (10k images x 32 x 32), int32 products overflow.
  count = int(count)
  mean, var = np.asarray(mean, np.float64), np.asarray(var, np.float64)
  if key not in totals:
    totals[key] = [count, mean, var * count]
    return
  n_a, mean_a, m2_a = totals[key]
  n = n_a + count
  delta = mean - mean_a
  totals[key] = [n, mean_a + delta * (count / n),
                 m2_a + var * count + np.square(delta) * (n_a * count / n)]


def recalibrate_batch_stats(
    apply_fn: ApplyFn,
    params: Any,
    model_state: Mapping[str, Any],
    batches: Iterable[Any],
    *,
    rng: Rng = None,
) -> dict[str, Any]:
  r"""BatchNorm re-estimation (BNT): exact statistics over all examples of ``batches``.

  Runs the model in training mode on every batch (each BatchNorm normalises
  with its batch's statistics, as in training, so later layers see training
  activations), records each BatchNorm layer's per-batch mean and biased
  variance per channel in one jitted pass per batch shape, and combines them
  exactly over all examples (in float64, with the parallel-variance formula):

  .. math::

    \mu = \frac{1}{N}\sum_b n_b \mu_b, \qquad
    \sigma^2 = \frac{1}{N}\sum_b n_b \left(\sigma_b^2 + (\mu_b - \mu)^2 \right)

  with ``n_b`` the entries per channel in batch ``b`` (batch size times
  spatial positions) and ``N = sum_b n_b``. This is the mean and the
  **biased** (population, divide-by-``N``) variance of each layer's input
  over all the examples: Flax's ``BatchNorm`` normalises training batches
  with the biased batch variance and stores that in ``batch_stats['var']``,
  so evaluation then uses the same estimator as training. (PyTorch stores
  the unbiased one; at ``N`` = 10k examples the two differ by a factor
  ``N/(N-1)``.) Unlike an exponential moving average, every example counts
  the same and the old statistics are not used at all.

  Args:
    apply_fn: ``model.apply`` of a Linen module called as ``(inputs, train=...)``.
    params: the ``'params'`` collection (e.g. the sparse parameters after
      :func:`safe_optax.finalize`).
    model_state: the other collections, with ``'batch_stats'``.
    batches: an iterable of model inputs (the positional input of
      ``apply_fn``, e.g. image arrays: pass ``(x for x, _ in loader)`` for
      ``(inputs, labels)`` pairs), e.g. 10k training examples in batches;
      the last batch may be smaller. Every example counts once.
    rng: ``None``; a PRNG key (the ``'dropout'`` stream) or a mapping of
      keys, folded with the batch index, for models with dropout.

  The per-batch pass is compiled once per ``apply_fn`` and batch shape and
  kept for later calls; every batch is dispatched before the moments are
  read back.

  Returns:
    ``model_state`` with every BatchNorm layer's ``mean`` and ``var`` in
    ``'batch_stats'`` replaced (same dtypes, and the same shardings where the
    old statistics are ``jax.Array`` values, so programs compiled for the old state
    take the new one); other entries unchanged.

  Raises:
    ValueError: ``batches`` is empty, or ``model_state`` has no statistics
      for a BatchNorm layer that ran.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, flax, flax.linen as nn
    >>> from safe_optax.flax_utils import recalibrate_batch_stats
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, train):
    ...     return nn.BatchNorm(use_running_average=not train)(nn.Dense(3)(x))
    >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(10, 4)), jnp.float32)
    >>> model_state, params = flax.core.pop(Net().init(jax.random.PRNGKey(0), x, train=False),
    ...                                     'params')
    >>> new_state = recalibrate_batch_stats(Net().apply, params, model_state, [x[:8], x[8:]])
    >>> h = x @ params['Dense_0']['kernel'] + params['Dense_0']['bias']
    >>> stats = new_state['batch_stats']['BatchNorm_0']
    >>> bool(jnp.allclose(stats['mean'], h.mean(0), atol=1e-6)), bool(
    ...     jnp.allclose(stats['var'], h.var(0), atol=1e-6))
    (True, True)

  References:
    Hubara et al., `Accelerated Sparse Neural Training
    <https://arxiv.org/abs/2102.08124>`_, 2021; Peste et al., CrAM, ICLR 2023
    (BatchNorm tuning after one-shot pruning).
  """
  if "batch_stats" not in model_state:
    raise ValueError("`model_state` has no 'batch_stats' collection to recalibrate.")
  rngs_base = _rngs(rng)
  try:
    moments = _moments_program(apply_fn)
  except TypeError:  # an unhashable apply_fn: compiled for this call only
    moments = _moments_program.__wrapped__(apply_fn)

  # Every batch is dispatched before any result is read (the per-channel moments are
  # small), so the host feeds the next batch while the device works on this one.
  per_batch = []
  for index, inputs in enumerate(batches):
    rngs = None if rngs_base is None else {
        name: jax.random.fold_in(key, index) for name, key in rngs_base.items()}
    per_batch.append(moments(params, model_state, inputs, rngs))
  totals: dict[tuple[str, ...], list[Any]] = {}
  for found in jax.device_get(per_batch):
    for path, calls in found.items():
      for count, mean, var in calls:
        add_moments(totals, path, count, mean, var)
  if not totals:
    raise ValueError("`batches` is empty, or the model has no BatchNorm layer in training mode.")

  stats = flax.core.unfreeze(model_state["batch_stats"])
  for path, (n, mean, m2) in totals.items():
    node = stats
    try:
      for name in path:
        node = node[name]
      old_mean, old_var = node["mean"], node["var"]
    except (KeyError, TypeError) as err:
      raise ValueError(
          f"`model_state['batch_stats']` has no mean/var for BatchNorm '{'/'.join(path)}'."
      ) from err
    node["mean"] = _like(mean, old_mean)
    node["var"] = _like(m2 / n, old_var)
  return {**model_state, "batch_stats": stats}


@functools.lru_cache(maxsize=8)
def _moments_program(apply_fn: ApplyFn) -> Callable[..., Any]:
  """:func:`_batch_moments` jitted once per ``apply_fn`` (a BNT after every run of a sweep,
  or before and after pruning, compiles once)."""
  def moments(params, model_state, inputs, rngs):
    return _batch_moments(apply_fn, {**model_state, "params": params}, inputs, rngs)
  return jax.jit(moments)


def _like(value: np.ndarray, old: Any) -> Any:
  """``value`` with the dtype of ``old``, and its sharding when ``old`` is a ``jax.Array``.

  The same placement as the statistics it replaces, so a jitted evaluation
  compiled for the old state takes the new one without recompiling.
  """
  value = np.asarray(value, jnp.result_type(old))
  if isinstance(old, jax.Array):
    # Every process holds the same host totals, so each fills its own shards.
    return jax.make_array_from_callback(value.shape, old.sharding, lambda index: value[index])
  return jnp.asarray(value)
