"""The fast evaluation, BNT and Hessian paths equal plain references and compile once (issue 14).

* the Hessian measures called outside ``jit`` (a Python loop over one jitted
  product per batch, no convolution inside an XLA while loop) equal
  ``jax.jvp`` of ``jax.grad`` and the traced ``lax.while_loop`` path on a
  small conv net with BatchNorm;
* ``finish.evaluate`` equals a plain per-batch loop over ``model.apply``, and
  neither it nor BNT recompiles across calls, BNT's statistics included;
* ``finish`` takes the dense and projected test accuracy of the last epoch's
  record instead of two more passes over the test split, and they equal
  direct evaluations.
"""

from __future__ import annotations

import functools
import os
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from safe_optax import flatness
from safe_optax import flax_utils
from safe_optax._hessian import _add_hvp_program
from safe_optax.experiment import cross_entropy
from safe_optax.vision import evaluation
from safe_optax.vision import finish
from safe_optax.vision import train
from safe_optax.vision import datasets
from safe_optax.vision import programs as programs_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train  # noqa: E402  (the tiny data set and config of the trainer tests)

_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _compiles.__setitem__(0, _compiles[0] + (
        name == "/jax/core/compile/backend_compile_duration")))


def compiles_during(fn, *args, **kwargs):
  """``(fn(...), XLA compilations it caused)``."""
  before = _compiles[0]
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, _compiles[0] - before


class ConvNet(nn.Module):
  """Two 3x3 convs (the second strided) with BatchNorm, mean pooling, a Dense head."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = nn.relu(nn.Conv(6, (3, 3), strides=(2, 2))(x))
    return nn.Dense(3)(x.mean((1, 2)))


@pytest.fixture(scope="module")
def conv_case():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 4, 6, 6, 2)).astype(np.float32)
  y = rng.integers(0, 3, (3, 4)).astype(np.int32)
  model = ConvNet()
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(0), x[0])
  model_state, params = flax.core.pop(variables, "params")
  # Non-trivial running statistics, so inference-mode BatchNorm is not the identity.
  model_state = jax.tree.map(lambda s: s + 0.3, model_state)

  def loss_fn(p, batch):
    return cross_entropy(model.apply({"params": p, **model_state}, batch[0], train=False),
                         batch[1])

  batches = [(x[i], y[i]) for i in range(3)]
  # A sparse model: every other weight of the first conv kernel pruned.
  kernel = params["Conv_0"]["kernel"]
  params = flax.core.copy(params, {"Conv_0": {"kernel": kernel * (np.arange(kernel.size)
                                                                  .reshape(kernel.shape) % 2)}})
  return loss_fn, params, batches


@functools.partial(jax.jit, static_argnums=0)
def reference_hvp(loss_fn, params, batches, vector):
  """``jax.jvp`` of ``jax.grad`` of the batch mean, written out (no loop primitive)."""
  def mean_loss(p):
    return sum(loss_fn(p, b) for b in batches) / len(batches)
  return jax.jvp(jax.grad(mean_loss), (params,), (vector,))[1]


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.slow
def test_eager_hvp_equals_jvp_of_grad(conv_case):
  loss_fn, params, batches = conv_case
  vector = optax.tree.random_like(jax.random.PRNGKey(1), params)
  got = flatness.hessian_vector_product(loss_fn, params, batches, vector)
  assert_trees_close(got, reference_hvp(loss_fn, params, batches, vector))


@pytest.mark.slow
def test_eager_power_iteration_equals_the_while_loop(conv_case):
  loss_fn, params, batches = conv_case
  support = flatness.support_mask(params)
  key = jax.random.PRNGKey(3)

  def both(tol, max_iterations):
    eager = flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=key, tol=tol,
                                            max_iterations=max_iterations, support=support)
    traced = jax.jit(lambda p, bs: flatness.max_hessian_eigenvalue(
        loss_fn, p, bs, key=key, tol=tol, max_iterations=max_iterations, support=support))(
            params, batches)
    return eager, traced

  # Without the stopping rule both paths run the same iterations on the same vectors.
  eager, traced = both(0.0, 12)
  assert int(eager.num_iterations) == int(traced.num_iterations) == 12
  assert not bool(eager.converged) and not bool(traced.converged)
  np.testing.assert_allclose(float(eager.eigenvalue), float(traced.eigenvalue), rtol=1e-5)
  # With it, both stop; the eager and the fused program round differently, which can move a
  # stop that sits on the tolerance by one iteration (seen: 11 against 12 on one machine).
  eager, traced = both(1e-5, 30)
  assert bool(eager.converged) and bool(traced.converged)
  assert abs(int(eager.num_iterations) - int(traced.num_iterations)) <= 1
  np.testing.assert_allclose(float(eager.eigenvalue), float(traced.eigenvalue), rtol=1e-4)
  # The eigen-pair of the reference product: H v = lambda v.
  hv = jax.tree.map(lambda h, m: jnp.where(m, h, 0),
                    reference_hvp(loss_fn, params, batches, eager.eigenvector), support)
  assert_trees_close(hv, jax.tree.map(lambda v: float(eager.eigenvalue) * v, eager.eigenvector),
                     rtol=0.05, atol=0.05 * abs(float(eager.eigenvalue)))
  # P H P: nothing off the support.
  assert not np.any(np.asarray(eager.eigenvector["Conv_0"]["kernel"])[
      ~np.asarray(support["Conv_0"]["kernel"])])


@pytest.mark.slow
def test_eager_trace_equals_the_traced_estimate(conv_case):
  loss_fn, params, batches = conv_case
  key = jax.random.PRNGKey(4)
  eager = flatness.hessian_trace(loss_fn, params, batches, key=key, num_probes=2)
  traced = jax.jit(lambda p, bs: flatness.hessian_trace(loss_fn, p, bs, key=key,
                                                        num_probes=2))(params, batches)
  np.testing.assert_allclose(float(eager), float(traced), rtol=1e-5)


@pytest.mark.xla_default_codegen  # bit for bit / HLO: XLA's own code generation
@pytest.mark.slow
def test_eager_product_compiles_once_without_a_loop(conv_case):
  loss_fn, params, batches = conv_case
  key = jax.random.PRNGKey(5)
  flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=key, max_iterations=3)
  _, count = compiles_during(flatness.max_hessian_eigenvalue, loss_fn, params, batches,
                             key=jax.random.PRNGKey(6), max_iterations=5)
  assert count == 0
  compiled = _add_hvp_program(loss_fn).lower(
      jax.tree.map(jnp.zeros_like, params), params, None, params, batches[0]).compile()
  # XLA:CPU's fast convolutions need the convolution outside any loop body.
  assert "while" not in compiled.as_text()


RESNET = dict(model="resnet8", width=1, bnt_samples=48)


@pytest.fixture(scope="module")
def resnet_case():
  config = test_train.tiny_config(**RESNET)
  data = test_train.tiny_dataset()
  programs = programs_lib.build_programs(config, test_train.N_TRAIN, 4, (8, 8, 1))
  state = programs.init(jax.random.PRNGKey(0))
  return config, data, programs, state


def plain_evaluation(model, params, model_state, images, labels, batch_size):
  """Accuracy and mean loss by ``model.apply`` on consecutive batches, summed in numpy."""
  correct, loss = 0, 0.0
  mean, std = datasets.NORMALIZATION["mnist"]
  for start in range(0, len(labels), batch_size):
    x = (images[start:start + batch_size].astype(np.float32) / 255.0 - mean) / std
    logits = np.asarray(model.apply({"params": params, **model_state}, x, train=False),
                        np.float64)
    y = labels[start:start + batch_size]
    correct += int(np.sum(np.argmax(logits, -1) == y))
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    loss += float(-log_probs[np.arange(len(y)), y].sum())
  return {"accuracy": correct / len(labels), "loss": loss / len(labels)}


@pytest.mark.slow
def test_evaluate_equals_a_plain_loop_and_compiles_once(resnet_case):
  config, data, programs, state = resnet_case
  # 40 test images in batches of 16: the last one padded.
  got = finish.evaluate(programs.eval, state.params, state.model_state, data.test_images,
                        data.test_labels, config.eval_batch_size)
  want = plain_evaluation(programs.model, state.params, state.model_state, data.test_images,
                          data.test_labels, 7)
  assert got["accuracy"] == want["accuracy"]
  assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
  sparse = programs.project(state.params)
  _, count = compiles_during(finish.evaluate, programs.eval, sparse, state.model_state,
                             data.test_images, data.test_labels, config.eval_batch_size)
  assert count == 0
  # After BNT: the new statistics are placed like the old ones, and BNT compiles once.
  recalibrated = finish.recalibrate(programs, config, sparse, state.model_state,
                                    data.train_images, test_train.N_TRAIN)
  again, count = compiles_during(finish.recalibrate, programs, config, sparse,
                                 state.model_state, data.train_images, test_train.N_TRAIN)
  assert count == 0
  assert_trees_close(again, recalibrated, rtol=0, atol=0)
  old, new = jax.tree.leaves(state.model_state), jax.tree.leaves(recalibrated)
  assert [a.sharding for a in old] == [b.sharding for b in new]
  assert [a.dtype for a in old] == [b.dtype for b in new]
  after, count = compiles_during(finish.evaluate, programs.eval, sparse, recalibrated,
                                 data.test_images, data.test_labels, config.eval_batch_size)
  assert count == 0
  assert after == pytest.approx(plain_evaluation(programs.model, sparse, recalibrated,
                                                 data.test_images, data.test_labels, 40),
                                rel=1e-5)


@pytest.mark.slow
def test_recalibration_reads_results_once_and_equals_per_batch_statistics(resnet_case):
  config, data, programs, state = resnet_case
  batches = list(finish.bnt_batches(programs, config, data.train_images, test_train.N_TRAIN))
  new = flax_utils.recalibrate_batch_stats(programs.model.apply, state.params,
                                           state.model_state, batches)
  # Reference: the first BatchNorm's input over all BNT images at once.
  x = jnp.concatenate(batches)
  _, inputs = programs.model.apply(
      {"params": state.params, **state.model_state}, x, train=True, mutable=["batch_stats"],
      capture_intermediates=lambda m, _: isinstance(m, nn.Conv) and m.name == "conv_init")
  h = np.asarray(inputs["intermediates"]["conv_init"]["__call__"][0], np.float64)
  stats = new["batch_stats"]["bn_init"]
  np.testing.assert_allclose(stats["mean"], h.mean((0, 1, 2)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], h.var((0, 1, 2)), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_predict_takes_the_variables_as_arguments(resnet_case):
  config, data, programs, state = resnet_case
  variables = {"params": state.params, **state.model_state}
  mean, std = (jnp.asarray(v, jnp.float32) for v in datasets.NORMALIZATION[config.dataset])
  images = jnp.asarray(data.test_images[:16])
  jaxpr = jax.make_jaxpr(evaluation._predict, static_argnums=0)(
      programs.model, variables, mean, std, images)
  assert not jaxpr.consts  # nothing folded into the program
  got = evaluation._predict(programs.model, variables, mean, std, images)
  logits = programs.model.apply(variables, (images / 255.0 - mean) / std, train=False)
  np.testing.assert_array_equal(got, np.argmax(logits, -1))


@pytest.mark.slow
def test_finish_reuses_the_last_records_test_passes(tmp_path, monkeypatch):
  data = test_train.tiny_dataset()
  config = test_train.tiny_config(epochs=1, warmup_epochs=0)
  passes = []
  original = finish.evaluate

  def counting(*args, **kwargs):
    passes.append(args[1])
    return original(*args, **kwargs)

  monkeypatch.setattr(finish, "evaluate", counting)  # the epoch records' passes and finish's
  out = train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data)
  # The last record: dense and projected; finish: only the model after BNT.
  assert len(passes) == 3
  final, last = out.results["final"], out.results["history"][-1]
  programs = programs_lib.build_programs(config, test_train.N_TRAIN, 4, (8, 8, 1))
  dense = original(programs.eval, out.state.params, out.state.model_state, data.test_images,
                   data.test_labels, 7)
  projected = original(programs.eval, out.sparse_params, out.state.model_state,
                       data.test_images, data.test_labels, 7)
  assert final["dense_accuracy"] == dense["accuracy"] == last["test_accuracy"]
  assert final["dense_loss"] == pytest.approx(dense["loss"], rel=1e-5)
  assert final["sparse_accuracy_before_bnt"] == projected["accuracy"]
