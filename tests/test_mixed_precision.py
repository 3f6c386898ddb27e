"""Tests of the vision trainer's ``dtype="bfloat16"``: bf16 compute, float32 state.

Cost: the MLP and the two-epoch data of ``test_packing.py`` (four steps, SAFE,
stopped before the test evaluation); ResNet-8's BatchNorm applied eagerly once.
"""

from __future__ import annotations

import json
import os
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from safe_optax.vision import configs
from safe_optax.vision import models
from safe_optax.vision import programs
from safe_optax.vision import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_packing  # noqa: E402  (the tiny data set and config of the packing tests)


def floating_dtypes(tree) -> set:
  return {np.asarray(x).dtype for x in jax.tree.leaves(tree)
          if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)}


def initial_params(data):
  """The float32 run's parameters at step 0."""
  config = test_packing.tiny_config("safe")
  return programs.for_data(config, data).init(jax.random.PRNGKey(0)).params


def test_bfloat16_training_keeps_float32_state_and_stays_close_to_float32(tmp_path):
  data = test_packing.tiny_dataset()
  out = {}
  for dtype in configs.DTYPES:
    config = test_packing.tiny_config("safe", dtype=dtype)
    out[dtype] = train.train_and_evaluate(config, tmp_path / dtype, data_dir=None, dataset=data,
                                          stop_after_epoch=1, tensorboard=False).state
  low, full = out["bfloat16"], out["float32"]
  # Master weights, optimizer state (SAM, momentum, ADMM's z and u) and the epoch sums: float32.
  assert floating_dtypes((low.params, low.opt_state, low.metrics)) == {np.dtype(np.float32)}
  # bfloat16 keeps 8 significant bits (rounding 2^-9 relative) in each product; two steps of
  # updates at learning rate 0.3 move the weights by a few percent of their norm, so the
  # rounding of the gradients reaches the weights at well under 1 % of their norm.
  distance = float(optax.tree.norm(optax.tree.sub(low.params, full.params)))
  norm = float(optax.tree.norm(full.params))
  moved = float(optax.tree.norm(optax.tree.sub(
      full.params, initial_params(data))))
  assert 0 < distance < 0.01 * norm and distance < 0.1 * moved
  loss = [json.loads((tmp_path / d / "metrics.jsonl").read_text())["train_loss"]
          for d in configs.DTYPES]
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
