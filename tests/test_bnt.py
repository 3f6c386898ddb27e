"""Tests for `flax_utils.recalibrate_batch_stats` (BatchNorm re-estimation, BNT).

* A Dense-BN-ReLU-Dense-BN Linen model on 23 examples in batches of 10, 10
  and 3: the statistics equal a direct numpy computation over all 23
  examples (the second layer's inputs produced in training mode, batch by
  batch, as BNT runs the model), whatever the old statistics were, and differ
  from the plain mean of per-batch statistics (the unequal last batch counts
  for 3 examples, not a third).
* The project's CIFAR ResNet (``safe_optax.vision.ResNet``, BatchNorm in the
  stem, inside blocks and on projection shortcuts): every layer's statistics
  equal the size-weighted combination of Flax's own per-batch statistics
  (read back from ``BatchNorm``'s running-average update from zero).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from safe_optax import flax_utils
from safe_optax.vision import ResNet
from safe_optax.vision.models import BN_MOMENTUM

EPS = 1e-5


class TwoBN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(5)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=EPS)(x)
    x = nn.relu(x)
    x = nn.Dense(3)(x)
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=EPS)(x)


def numpy_variables(model, x, seed=0):
  """Variables drawn in numpy (random initialisers inside jit cost seconds of compile)."""
  abstract = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, train=False), x)
  rng = np.random.default_rng(seed)
  variables = jax.tree.map(lambda s: (0.5 * rng.normal(size=s.shape) + 0.1).astype(np.float32),
                           abstract)
  params = variables.pop("params")
  # Arbitrary old statistics: BNT must not use them.
  variables["batch_stats"] = jax.tree.map(lambda v: np.abs(v) + 3.0, variables["batch_stats"])
  return params, variables


def numpy_two_bn_stats(params, batches):
  """Inputs of both BatchNorm layers, batch by batch in training mode, then moments over all."""
  dense0, dense1 = params["Dense_0"], params["Dense_1"]
  bn0 = params["BatchNorm_0"]
  first, second = [], []
  for x in batches:
    x = np.asarray(x, np.float64)
    h = x @ dense0["kernel"] + dense0["bias"]
    first.append(h)
    normed = (h - h.mean(0)) / np.sqrt(h.var(0) + EPS) * bn0["scale"] + bn0["bias"]
    second.append(np.maximum(normed, 0.0) @ dense1["kernel"] + dense1["bias"])
  first, second = np.concatenate(first), np.concatenate(second)
  return {"BatchNorm_0": (first.mean(0), first.var(0)),
          "BatchNorm_1": (second.mean(0), second.var(0))}


def test_two_bn_model_equals_direct_average_with_unequal_last_batch():
  rng = np.random.default_rng(1)
  x = (rng.normal(size=(23, 4)) * 2.0 + 1.5).astype(np.float32)
  batches = [x[:10], x[10:20], x[20:]]
  model = TwoBN()
  params, model_state = numpy_variables(model, x[:2])
  old_stats = jax.tree.map(np.copy, model_state["batch_stats"])
  new_state = flax_utils.recalibrate_batch_stats(model.apply, params, model_state,
                                                 iter(batches))
  # The caller's state is not modified in place.
  jax.tree.map(np.testing.assert_array_equal, model_state["batch_stats"], old_stats)
  want = numpy_two_bn_stats(params, batches)
  stats = new_state["batch_stats"]
  for name, (mean, var) in want.items():
    np.testing.assert_allclose(stats[name]["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[name]["var"], var, rtol=1e-5, atol=1e-6)
    assert stats[name]["mean"].dtype == jnp.float32
  # Not an average of per-batch statistics: the 3-example batch weighs 3/23.
  h = [np.asarray(b, np.float64) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]
       for b in batches]
  unweighted = np.mean([hb.mean(0) for hb in h], axis=0)
  assert not np.allclose(stats["BatchNorm_0"]["mean"], unweighted, rtol=1e-3)
  # Params and the rest of the state are untouched; batch_stats keep their structure.
  assert set(new_state) == set(model_state)
  assert jax.tree.structure(new_state["batch_stats"]) == jax.tree.structure(
      jax.tree.map(jnp.asarray, model_state["batch_stats"]))


def test_errors():
  model = TwoBN()
  x = np.ones((4, 4), np.float32)
  params, model_state = numpy_variables(model, x)
  with pytest.raises(ValueError, match="empty"):
    flax_utils.recalibrate_batch_stats(model.apply, params, model_state, [])
  with pytest.raises(ValueError, match="batch_stats"):
    flax_utils.recalibrate_batch_stats(model.apply, params, {}, [x])


@pytest.mark.slow
def test_resnet_blocks_match_flax_batch_statistics():
  model = ResNet(blocks_per_stage=1, width=1, num_classes=10)
  rng = np.random.default_rng(2)
  images = rng.normal(size=(9, 8, 8, 3)).astype(np.float32)
  batches = [images[:6], images[6:]]
  params, model_state = numpy_variables(model, images[:1])
  # Positive BN scales keep activations alive through the blocks.
  params = jax.tree_util.tree_map_with_path(
      lambda p, v: np.abs(v) + 0.5 if p[-1].key == "scale" else v, params)
  new_state = flax_utils.recalibrate_batch_stats(model.apply, params, model_state, batches)

  # Reference: Flax's own per-batch statistics, read from its running-average
  # update started at zero (new = (1 - momentum) * batch statistic).
  zeros = jax.tree.map(np.zeros_like, model_state["batch_stats"])

  @jax.jit
  def flax_batch_stats(x):
    _, mutated = model.apply({"params": params, "batch_stats": zeros}, x, train=True,
                             mutable=["batch_stats"])
    return jax.tree.map(lambda v: v / (1.0 - BN_MOMENTUM), mutated["batch_stats"])

  per_batch = [jax.device_get(flax_batch_stats(b)) for b in batches]
  sizes = np.array([len(b) for b in batches], np.float64)

  flat_new = jax.tree_util.tree_flatten_with_path(new_state["batch_stats"])[0]
  layers = {tuple(k.key for k in p[:-1]) for p, _ in flat_new}
  assert len(layers) == 1 + 3 * 2 + 2  # stem, two per block, two projection shortcuts
  assert any(len(layer) == 2 and layer[0].startswith("ResNetBlock") for layer in layers)
  for path, value in flat_new:
    layer = [k.key for k in path[:-1]]
    node_b = list(per_batch)
    for name in layer:
      node_b = [n[name] for n in node_b]
    mu_b = np.stack([n["mean"] for n in node_b]).astype(np.float64)
    var_b = np.stack([n["var"] for n in node_b]).astype(np.float64)
    mu = sizes @ mu_b / sizes.sum()
    want = mu if path[-1].key == "mean" else sizes @ (var_b + (mu_b - mu) ** 2) / sizes.sum()
    np.testing.assert_allclose(value, want, rtol=2e-4, atol=2e-5, err_msg="/".join(layer))
