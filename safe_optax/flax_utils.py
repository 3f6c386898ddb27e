r"""Flax (Linen and NNX) helpers for SAM / SAFE steps with BatchNorm and dropout.

:func:`safe_optax.sam_perturb` (and so :func:`safe_optax.safe`) evaluates a
second gradient at the perturbed point through ``grad_fn(params, step)``. With
a Flax model that gradient must be taken

* on the **same minibatch** and with the **same dropout key** as the first
  (clean) gradient, in training mode (BatchNorm normalises with the batch's
  own statistics, as in the reference PyTorch SAM/SAFE code), and
* **without keeping** the BatchNorm running statistics computed at the
  perturbed point: the step keeps the statistics of the first, unperturbed
  pass only.

Two pure functions do this; the training loop stays yours:

* :func:`loss_and_grad_with_state` -- the first pass: loss, logits, the new
  model state (``batch_stats`` updated) and the gradient;
* :func:`sam_grad_fn` -- a ``grad_fn(params, step)`` closed over the same
  model state, batch and key, whose BatchNorm updates are dropped.

After the final projection, :func:`recalibrate_batch_stats` re-estimates the
BatchNorm statistics of the sparse model (BNT) as exact averages over a set
of training inputs.

Flax NNX models get the same three: :func:`nnx_sam_grad_fn` (built first, from
the model before the step), :func:`nnx_loss_and_grad` (the clean pass, which
updates the model's statistics in place) and :func:`nnx_recalibrate_batch_stats`.
Merging the model's own state back into a module inside ``grad_fn`` fails with
``TraceContextError`` once it has ``nnx.BatchNorm`` (the merged statistics
belong to the outer trace); :func:`nnx_sam_grad_fn` merges pure arrays instead.

Conventions: ``apply_fn`` is ``model.apply`` of a module called as
``model(inputs, train=...)``; ``batch`` is a pair ``(inputs, targets)``,
``inputs`` is the model's positional input (any pytree) and
``loss_fn(logits, targets)`` returns the scalar minibatch loss (``targets``
may be any pytree, e.g. labels and a mask). ``model_state`` holds the
non-parameter collections, e.g. ``{'batch_stats': ...}``, or ``{}``.

Examples:
  A complete SAFE step on a tiny BatchNorm model:

  >>> import jax, jax.numpy as jnp, optax, flax, flax.linen as nn
  >>> import safe_optax
  >>> from safe_optax import flax_utils
  >>> class Net(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x, train):
  ...     x = nn.Dense(8)(x)
  ...     x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
  ...     return nn.Dense(2)(nn.relu(x))
  >>> model = Net()
  >>> x = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
  >>> batch = (x, (x[:, 0] > 0).astype(jnp.int32))
  >>> model_state, params = flax.core.pop(model.init(jax.random.PRNGKey(0), x, train=False),
  ...                                     'params')
  >>> def loss_fn(logits, labels):
  ...   return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  >>> tx = safe_optax.safe(0.1, 0.5, penalty=1e-3, total_steps=100)
  >>> @jax.jit
  ... def train_step(params, model_state, opt_state, batch):
  ...   (loss, (_, new_model_state)), grads = flax_utils.loss_and_grad_with_state(
  ...       model.apply, params, model_state, batch, loss_fn)
  ...   grad_fn = flax_utils.sam_grad_fn(model.apply, model_state, batch, loss_fn)
  ...   updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
  ...   return optax.apply_updates(params, updates), new_model_state, opt_state, loss
  >>> opt_state = tx.init(params)
  >>> losses = []
  >>> for _ in range(20):
  ...   params, model_state, opt_state, loss = train_step(params, model_state, opt_state, batch)
  ...   losses.append(float(loss))
  >>> losses[-1] < losses[0]
  True
"""

from safe_optax._flax_linen import loss_and_grad_with_state
from safe_optax._flax_linen import recalibrate_batch_stats
from safe_optax._flax_linen import sam_grad_fn

__all__ = (
    "loss_and_grad_with_state",
    "nnx_loss_and_grad",
    "nnx_recalibrate_batch_stats",
    "nnx_sam_grad_fn",
    "recalibrate_batch_stats",
    "sam_grad_fn",
)

# The NNX helpers load flax.nnx (about 0.75 s: it imports IPython and treescope) on first
# use, so a Linen program (the vision and LLM CLIs) does not pay for it at start-up.
_NNX = ("nnx_loss_and_grad", "nnx_recalibrate_batch_stats", "nnx_sam_grad_fn")


def __getattr__(name):
  if name in _NNX:
    from safe_optax import _flax_nnx  # pylint: disable=import-outside-toplevel
    return getattr(_flax_nnx, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_NNX))
