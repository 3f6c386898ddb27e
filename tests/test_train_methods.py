"""Every training method of the vision trainer, end to end on a tiny problem.

`test_train.py` covers the trainer's machinery (resume, sharding, compile
counts) with SAFE; here each method of ``configs.METHODS`` runs a short
``train_and_evaluate`` and must land exactly on the requested sparsity with
finite weights, and a BatchNorm model checks that the reported sparse accuracy
is the one after BatchNorm re-estimation (BNT).
"""

import os
import sys

import jax
import numpy as np
import pytest

import safe_optax
from safe_optax.vision import configs
from safe_optax.vision import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train  # noqa: E402  (the tiny data set and config of the trainer tests)

# Every method, plus SAFE+ with its other saliency and IMP+SAM with a linear ramp.
CASES = [(method, {}) for method in configs.METHODS] + [
    ("safe-plus", {"saliency": "obd"}),
    ("imp-sam", {"imp_power": 1}),
]


@pytest.mark.parametrize("method, overrides", CASES,
                         ids=[m + "".join(f"-{v}" for v in o.values()) for m, o in CASES])
def test_method_reaches_the_exact_sparsity(method, overrides, tmp_path):
  config = test_train.tiny_config(method=method, epochs=1, warmup_epochs=0, gmp_update_every=2,
                                  imp_every_epochs=1, multi_sparsities=(0.5, 0.8), **overrides)
  out = train.train_and_evaluate(config, tmp_path, data_dir=None,
                                 dataset=test_train.tiny_dataset())
  final, report = out.results["final"], out.results["sparsity_report"]
  leaves = jax.tree.leaves(out.sparse_params)
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)
  if method == "dense":
    assert report["prunable_nonzero"] == report["prunable_size"]
    return
  assert report["prunable_nonzero"] == safe_optax.num_keep(report["prunable_size"], 0.8)
  # Non-prunable leaves (biases) are never pruned by the final projection.
  biases = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
      out.sparse_params) if np.ndim(leaf) == 1]
  dense_biases = [np.asarray(leaf) for leaf in jax.tree.leaves(out.state.params)
                  if np.ndim(leaf) == 1]
  for got, want in zip(biases, dense_biases):
    np.testing.assert_array_equal(got, want)
  assert 0.0 <= final["sparse_accuracy"] <= 1.0
  assert len(out.results["history"]) == 1


def test_bnt_accuracy_is_reported_for_a_batchnorm_model(tmp_path):
  """A BatchNorm model (ResNet-20): BNT replaces the running statistics with a true average."""
  config = test_train.tiny_config(model="resnet20", method="admm", epochs=1, warmup_epochs=0,
                                  bnt_samples=48,
                                  batch_size=50, eval_batch_size=20)
  out = train.train_and_evaluate(config, tmp_path, data_dir=None,
                                 dataset=test_train.tiny_dataset())
  final = out.results["final"]
  assert final["bnt_samples"] == 48
  assert {"sparse_accuracy_before_bnt", "sparse_accuracy"} <= set(final)
  before = jax.tree.leaves(out.state.model_state)
  after = jax.tree.leaves(out.model_state)
  assert len(before) == len(after) > 0
  # BNT recomputes every BatchNorm mean and variance for the sparse weights.
  assert all(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in zip(before, after))
  assert out.results["sparsity_report"]["prunable_nonzero"] == safe_optax.num_keep(
      out.results["sparsity_report"]["prunable_size"], 0.8)
