"""Tests for the Flax NNX helpers of `safe_optax.flax_utils` (BatchNorm + dropout).

The notebook's recipe (``nnx.merge`` of the model's own state inside
``grad_fn``) raises ``TraceContextError`` once the model has ``nnx.BatchNorm``;
the helpers give, under ``nnx.jit`` and with a different batch at every step:

* SAFE steps whose update is exactly ``-lr * grad f(x + e)`` (plain-JAX
  reference on the same batch and dropout masks);
* BatchNorm running statistics that are those of the clean pass alone;
* exact BatchNorm re-estimation (numpy mean and biased variance over all
  examples), the layers' momentum and mode restored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import safe_optax
from safe_optax import flax_utils

LR, RHO, MOMENTUM = 0.1, 0.3, 0.9


class Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, dropout: float = 0.3):
    self.l1 = nnx.Linear(4, 6, rngs=rngs)
    self.bn = nnx.BatchNorm(6, momentum=MOMENTUM, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.l2 = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batch(t: int, n: int = 16):
  x = jax.random.normal(jax.random.PRNGKey(50 + t), (n, 4))
  return x, (x[:, 0] + x[:, 1] > 0).astype(jnp.int32)


def tx_plain_sam():
  """SAFE reduced to SAM + SGD: penalty 0, no momentum, so update = -lr * SAM gradient."""
  return safe_optax.safe(LR, 0.5, penalty=0.0, penalty_schedule="constant", rho=RHO,
                         momentum=0.0, dual_every=4)


@nnx.jit
def train_step(model, optimizer, batch):
  grad_fn = flax_utils.nnx_sam_grad_fn(model, batch, loss_fn)
  (loss, _), grads = flax_utils.nnx_loss_and_grad(model, batch, loss_fn)
  optimizer.update(model, grads, grad_fn=grad_fn)
  return loss


def reference_step(model, batch):
  """Plain JAX on a snapshot: (SAM-step params, clean-pass BN mean/var)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.as_pure(params), nnx.as_pure(rest)
  x, y = batch

  def f(p):
    copy = nnx.merge(graphdef, p, rest)  # same RNG counters: the same dropout masks
    return loss_fn(copy(x), y)

  g = jax.grad(f)(params)
  norm = optax.tree.norm(g)
  sam = jax.grad(f)(jax.tree.map(lambda p, d: p + RHO * d / (norm + 1e-12), params, g))
  new_params = jax.tree.map(lambda p, s: p - LR * s, params, sam)
  h = nnx.merge(graphdef, params, rest).l1(x)
  mean = MOMENTUM * rest["bn"]["mean"] + (1 - MOMENTUM) * h.mean(0)
  var = MOMENTUM * rest["bn"]["var"] + (1 - MOMENTUM) * h.var(0)
  return new_params, mean, var


@pytest.mark.slow
def test_the_notebook_recipe_fails_with_batchnorm():
  """What the helpers replace: nnx.merge of the model's own state inside grad_fn."""
  model = Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx_plain_sam(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    loss_at = lambda p: loss_fn(nnx.merge(graphdef, p, rest)(x), y)
    _, grads = nnx.value_and_grad(lambda m: loss_fn(m(x), y))(model)
    optimizer.update(model, grads, grad_fn=lambda p, _: jax.grad(loss_at)(p))

  with pytest.raises(Exception, match="Cannot mutate BatchStat from a different trace"):
    step(model, optimizer, *batch(0))


@pytest.mark.slow
def test_safe_step_is_sam_on_the_same_batch_and_keeps_clean_pass_statistics():
  model = Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx_plain_sam(), wrt=nnx.Param)
  for t in range(4):
    b = batch(t)
    want_params, want_mean, want_var = reference_step(model, b)
    train_step(model, optimizer, b)
    got = nnx.as_pure(nnx.state(model, nnx.Param))
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(want_mean),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(model.bn.var[...]), np.asarray(want_var),
                               rtol=1e-6, atol=1e-7)


def test_grad_fn_at_the_unperturbed_params_is_the_clean_gradient_with_dropout():
  """Built before the clean pass, grad_fn draws the same dropout masks."""
  model = Net(nnx.Rngs(0), dropout=0.5)
  b = batch(7)

  @nnx.jit
  def both(model, b):
    grad_fn = flax_utils.nnx_sam_grad_fn(model, b, loss_fn)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    (loss, logits), grads = flax_utils.nnx_loss_and_grad(model, b, loss_fn)
    return nnx.as_pure(grads), grad_fn(params, 0), logits

  grads, again, logits = both(model, b)
  for a, c in zip(jax.tree.leaves(grads), jax.tree.leaves(again)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)
  assert logits.shape == (16, 3)
  # A new step draws new masks: dropout is really on.
  grads2, _, _ = both(model, b)
  assert not np.allclose(np.asarray(grads2["l1"]["kernel"]), np.asarray(grads["l1"]["kernel"]))


@pytest.mark.slow
def test_safe_trains_an_nnx_batchnorm_model_and_finalizes():
  model = Net(nnx.Rngs(1), dropout=0.0)
  tx = safe_optax.safe(0.1, 0.5, penalty=1.0, total_steps=40, dual_every=4, rho=0.05)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  losses = [float(train_step(model, optimizer, batch(t % 8))) for t in range(40)]
  assert np.mean(losses[-8:]) < np.mean(losses[:8])
  sparse, _ = safe_optax.finalize(nnx.as_pure(nnx.state(model, nnx.Param)), 0.5)
  nnx.update(model, sparse)
  kept = sum(int(np.count_nonzero(np.asarray(m.kernel[...]))) for m in (model.l1, model.l2))
  assert kept == safe_optax.num_keep(4 * 6 + 6 * 3, 0.5)


@pytest.mark.slow
def test_recalibration_is_exact_over_all_examples_and_restores_the_layers():
  model = Net(nnx.Rngs(2))
  model.eval()  # dropout off; BatchNorm uses running averages in eval
  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.normal(loc=3.0, size=(n, 4)), jnp.float32) for n in (8, 5, 11)]
  flax_utils.nnx_recalibrate_batch_stats(model, iter(xs))
  h = np.concatenate([np.asarray(model.l1(x), np.float64) for x in xs])
  np.testing.assert_allclose(np.asarray(model.bn.mean[...]), h.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(model.bn.var[...]), h.var(0), rtol=1e-4, atol=1e-6)
  assert model.bn.momentum == MOMENTUM and model.bn.use_running_average is True
  # Eval now normalises with those statistics: outputs of all the examples are centred.
  z = np.concatenate([np.asarray(model.bn(model.l1(x))) for x in xs])
  np.testing.assert_allclose(z.mean(0), 0.0, atol=1e-4)


def test_recalibration_errors():
  with pytest.raises(ValueError, match="no nnx.BatchNorm"):
    flax_utils.nnx_recalibrate_batch_stats(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), [jnp.ones((2, 2))])
  model = Net(nnx.Rngs(0))
  with pytest.raises(ValueError, match="`batches` is empty"):
    flax_utils.nnx_recalibrate_batch_stats(model, [])
  assert model.bn.momentum == MOMENTUM and model.bn.use_running_average is False
