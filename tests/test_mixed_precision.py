"""Tests of the vision trainer's ``dtype="bfloat16"``: bf16 compute, float32 state.

Cost: the MLP and data of ``test_packing.py``, four SAFE steps through the
trainer's programs in each dtype; one ResNet-8 BatchNorm pass.
"""

from __future__ import annotations

import os
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from safe_optax.vision import configs
from safe_optax.vision import datasets
from safe_optax.vision import models
from safe_optax.vision import programs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_packing  # noqa: E402  (the tiny data set and config of the packing tests)


def floating_dtypes(tree) -> set:
  return {np.asarray(x).dtype for x in jax.tree.leaves(tree)
          if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)}


def four_steps(config, data):
  """The state after four training steps (two epochs) of ``config``, and the initial params."""
  program = programs.for_data(config, data)
  state = program.init(jax.random.PRNGKey(0))
  initial = jax.device_get(state.params)
  for step in range(4):
    indices = datasets.epoch_batches(len(data.train_labels), config.batch_size, config.seed,
                                     step // 2)[step % 2]
    state = programs.run_step(program, config, state, data.train_images[indices],
                              data.train_labels[indices], step)
  return state, initial


@pytest.mark.slow
def test_bfloat16_training_keeps_float32_state_and_stays_close_to_float32():
  data = test_packing.tiny_dataset()
  low, initial = four_steps(test_packing.tiny_config("safe", dtype="bfloat16"), data)
  full, _ = four_steps(test_packing.tiny_config("safe"), data)
  # Master weights, optimizer state (SAM, momentum, ADMM's z and u) and the sums: float32.
  assert floating_dtypes((low.params, low.opt_state, low.metrics)) == {np.dtype(np.float32)}
  # bfloat16 keeps 8 significant bits (rounding 2^-9 relative) in each product; four steps at
  # learning rate 0.3 move the weights by a few percent of their norm, and the rounding of
  # the gradients reaches them at a small fraction of that: under 1 % of their norm and
  # under 10 % of the distance they moved.
  distance = float(optax.tree.norm(optax.tree.sub(low.params, full.params)))
  norm = float(optax.tree.norm(full.params))
  moved = float(optax.tree.norm(optax.tree.sub(full.params, initial)))
  assert 0 < distance < 0.01 * norm and distance < 0.1 * moved
  loss = [float(s.metrics.loss_sum) / int(s.metrics.count) for s in (low, full)]
  assert loss[0] == pytest.approx(loss[1], abs=0.02)


def test_bfloat16_batchnorm_statistics_and_parameters_stay_float32():
  config = configs.Config(model="resnet8", dataset="mnist", dtype="bfloat16",
                          matmul_precision="highest")
  model = models.create_model(config, 4)
  assert model.dtype == jnp.bfloat16 and model.precision == jax.lax.Precision.HIGHEST
  x = jnp.arange(128, dtype=jnp.float32).reshape(2, 8, 8, 1) / 128
  # Shapes and dtypes from the model's init, values made up (compiling init takes ~20 s here).
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, train=False))
  variables = jax.tree.map(lambda s: jnp.full(s.shape, 0.1, s.dtype), shapes)
  logits, updated = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(
      variables, x)
  assert logits.dtype == jnp.float32
  _, params = flax.core.pop(dict(variables), "params")
  assert floating_dtypes(params) == floating_dtypes(updated) == {np.dtype(np.float32)}
  # The statistics were updated (a bf16 pass fed them), and kept in float32.
  assert not np.allclose(jax.tree.leaves(updated)[0], jax.tree.leaves(variables["batch_stats"])[0])


def test_dtype_and_precision_are_checked_at_construction():
  with pytest.raises(ValueError, match="dtype.*float16"):
    configs.Config().replace(dtype="float16")
  with pytest.raises(ValueError, match="matmul_precision"):
    configs.Config().replace(matmul_precision="tf32")
