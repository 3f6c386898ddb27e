"""Flax NNX versions of the SAM / SAFE helpers (re-exported by :mod:`safe_optax.flax_utils`).

:func:`nnx_sam_grad_fn` (built first, from the model before the step),
:func:`nnx_loss_and_grad` (the clean pass, which updates the model's
statistics in place) and :func:`nnx_recalibrate_batch_stats`. Merging the
model's own state back into a module inside ``grad_fn`` fails with
``TraceContextError`` once it has ``nnx.BatchNorm`` (the merged statistics
belong to the outer trace); :func:`nnx_sam_grad_fn` merges pure arrays
instead. The conventions are :mod:`safe_optax.flax_utils`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from safe_optax._flax_linen import GradFn, LossFn, add_moments, split_batch

def nnx_sam_grad_fn(
    model: nnx.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    wrt: Any = nnx.Param,
) -> GradFn:
  """A ``grad_fn(params, step) -> grads`` for an NNX model, dropping BatchNorm updates.

  Snapshots ``model``'s non-``wrt`` state (BatchNorm statistics, dropout RNG
  counters) as pure arrays and returns a function that evaluates
  ``loss_fn(model(inputs), targets)`` at the ``params`` it is given (the pure
  ``nnx.State`` that ``nnx.Optimizer`` passes to the transform) on a fresh copy
  of the model, whose statistics are discarded. Build it **before**
  :func:`nnx_loss_and_grad`, so both passes draw the same dropout masks.
  Called inside ``nnx.jit`` it never touches ``model``.

  Args:
    model: the NNX model, in the mode of the clean pass (``model.train()``).
    batch: ``(inputs, targets)``; ``inputs`` is the model's positional input.
    loss_fn: ``loss_fn(outputs, targets) -> scalar``.
    wrt: the filter of the trained state (``nnx.Optimizer``'s ``wrt``).

  Returns:
    ``grad_fn(params, step)`` returning a gradient shaped like ``params``
    (``step`` is ignored).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from safe_optax.flax_utils import nnx_sam_grad_fn
    >>> model = nnx.Sequential(nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(1, use_scale=False, use_bias=False,
    ...                                      rngs=nnx.Rngs(0)))
    >>> batch = (jnp.array([[1., 0.], [0., 1.]]), jnp.array([[1.], [-1.]]))
    >>> grad_fn = nnx_sam_grad_fn(model, batch, lambda out, y: jnp.mean((out - y) ** 2))
    >>> params = nnx.as_pure(nnx.state(model, nnx.Param))
    >>> jax.tree.map(jnp.shape, grad_fn(params, 0))['layers'][0]['kernel']
    (2, 1)
    >>> float(model.layers[1].mean[0])  # the pass's statistics were dropped
    0.0
  """
  graphdef, _, rest = nnx.split(model, wrt, ...)
  # Pure arrays: a copy merged from them belongs to the gradient's trace, so its
  # BatchNorm may update (and then drop) statistics; the model's own Variables may not.
  rest = nnx.as_pure(rest)
  inputs, targets = split_batch(batch)

  def loss_at(params):
    return loss_fn(nnx.merge(graphdef, params, rest)(inputs), targets)

  grad = jax.grad(loss_at)

  def grad_fn(params: Any, step: int = 0) -> Any:
    del step
    return grad(params)

  return grad_fn


def nnx_loss_and_grad(
    model: nnx.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    wrt: Any = nnx.Param,
) -> tuple[tuple[jax.Array, Any], Any]:
  """The clean pass of an NNX training step: loss, outputs and gradient.

  Runs ``loss_fn(model(inputs), targets)`` under ``nnx.value_and_grad`` with
  respect to the ``wrt`` state; the model's BatchNorm statistics (and RNG
  counters) are updated **in place**, as in a plain NNX step.

  Args:
    model, batch, loss_fn, wrt: as in :func:`nnx_sam_grad_fn`.

  Returns:
    ``((loss, outputs), grads)``; pass ``grads`` to ``nnx.Optimizer.update``.

  Examples:
    A SAFE step on an NNX model with BatchNorm:

    >>> import jax, jax.numpy as jnp, optax, safe_optax
    >>> from flax import nnx
    >>> from safe_optax import flax_utils
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(8, momentum=0.9, rngs=nnx.Rngs(0)),
    ...                        nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    >>> x = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    >>> batch = (x, (x[:, 0] > 0).astype(jnp.int32))
    >>> loss_fn = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
    ...     logits, y).mean()
    >>> tx = safe_optax.safe(0.1, 0.5, penalty=1e-3, total_steps=20)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> @nnx.jit
    ... def train_step(model, optimizer, batch):
    ...   grad_fn = flax_utils.nnx_sam_grad_fn(model, batch, loss_fn)  # first: same dropout
    ...   (loss, _), grads = flax_utils.nnx_loss_and_grad(model, batch, loss_fn)
    ...   optimizer.update(model, grads, grad_fn=grad_fn)
    ...   return loss
    >>> losses = [float(train_step(model, optimizer, batch)) for _ in range(20)]
    >>> losses[-1] < losses[0]
    True
  """
  inputs, targets = split_batch(batch)

  def loss(m):
    outputs = m(inputs)
    return loss_fn(outputs, targets), outputs

  return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, wrt), has_aux=True)(model)


def nnx_recalibrate_batch_stats(model: nnx.Module, batches: Iterable[Any]) -> None:
  r"""BatchNorm re-estimation (BNT) for an NNX model, in place: exact statistics.

  The NNX counterpart of :func:`recalibrate_batch_stats`: every
  ``nnx.BatchNorm`` normalises each batch with that batch's statistics (as
  in training) and its ``mean`` / ``var`` become the exact mean and biased
  variance of its input over all the examples of ``batches`` (combined in
  float64). Other modules (dropout) keep their mode: call ``model.eval()``
  first for deterministic dropout. Each BatchNorm's ``momentum`` and
  ``use_running_average`` are restored afterwards.

  Limits: a BatchNorm called more than once per forward pass keeps its last
  call's statistics, and batches are weighted by their leading dimension
  (every batch must have the same other dimensions, e.g. image size).

  Args:
    model: the NNX model (e.g. after :func:`safe_optax.finalize` and
      ``nnx.update``); its BatchNorm statistics are replaced.
    batches: an iterable of model inputs (the positional input).

  Raises:
    ValueError: ``batches`` is empty or the model has no ``nnx.BatchNorm``.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from flax import nnx
    >>> from safe_optax.flax_utils import nnx_recalibrate_batch_stats
    >>> model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(10, 4)), jnp.float32)
    >>> nnx_recalibrate_batch_stats(model, [x[:8], x[8:]])
    >>> h = model.layers[0](x)
    >>> bn = model.layers[1]
    >>> bool(jnp.allclose(bn.mean[...], h.mean(0), atol=1e-6)), bool(
    ...     jnp.allclose(bn.var[...], h.var(0), atol=1e-6))
    (True, True)
  """
  norms = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.BatchNorm)]
  if not norms:
    raise ValueError("`model` has no nnx.BatchNorm to recalibrate.")
  saved = [(m.momentum, m.use_running_average) for m in norms]

  @nnx.jit
  def moments(model, inputs):
    model(inputs)
    return [(m.mean[...], m.var[...]) for _, m in nnx.iter_modules(model)
            if isinstance(m, nnx.BatchNorm)]

  totals: dict[int, list[Any]] = {}
  try:
    for m in norms:
      # Momentum 0: after a pass each layer holds exactly that batch's statistics.
      m.momentum, m.use_running_average = 0.0, False
    for inputs in batches:
      count = jax.tree.leaves(inputs)[0].shape[0]
      for i, (mean, var) in enumerate(jax.device_get(moments(model, inputs))):
        add_moments(totals, i, count, mean, var)
  finally:
    for m, (momentum, use_running_average) in zip(norms, saved):
      m.momentum, m.use_running_average = momentum, use_running_average
  if not totals:
    raise ValueError("`batches` is empty.")
  for i, m in enumerate(norms):
    n, mean, m2 = totals[i]
    m.mean[...] = jnp.asarray(mean, m.mean[...].dtype)
    m.var[...] = jnp.asarray(m2 / n, m.var[...].dtype)
