"""Every training method of the vision trainer, end to end on a tiny problem.

`test_train.py` covers the trainer's machinery (resume, sharding, compile
counts) with SAFE; here each method of ``configs.METHODS`` runs a short
``train_and_evaluate`` and must land exactly on each kernel's count with finite
weights, and a BatchNorm model checks that the reported sparse accuracy is the
one after BatchNorm re-estimation (BNT).
"""

import os
import sys

import jax
import numpy as np
import pytest

import safe_optax
from safe_optax import methods as methods_lib
from safe_optax.vision import configs
from safe_optax.vision import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train  # noqa: E402  (the tiny data set and config of the trainer tests)

# Every pruning method, plus SAFE+ with its other saliency and IMP+SAM with a linear ramp, each
# with one sparsity set per kernel (``per_leaf``): the structure reaches every method through one
# helper (``methods.projection``), so a builder that dropped it would fall back to the default
# global top-k and miss the per-kernel counts. The global default runs below (GMP) and in
# ``test_train.py`` (SAFE); ERK on one pruner and one ADMM-type method.
PRUNING_METHODS = [m for m in configs.METHODS if m != "dense"]
CASES = [(m, "per_leaf", {}) for m in PRUNING_METHODS] + [
    ("safe-plus", "per_leaf", {"saliency": "obd"}),
    ("imp-sam", "per_leaf", {"imp_power": 1}),
    ("safe", "erk", {}),
    ("gmp", "erk", {}),
]


def _kernel_counts(tree) -> list[tuple[int, int]]:
  """(nonzeros, size) of each prunable leaf (the kernels: ndim >= 2), in tree order."""
  return [(int(np.count_nonzero(np.asarray(leaf))), int(np.size(leaf)))
          for leaf in jax.tree.leaves(tree) if np.ndim(leaf) >= 2]


def _expected_counts(structure, shapes):
  if structure == "per_leaf":
    return [safe_optax.num_keep(int(np.prod(shape)), 0.8) for shape in shapes]
  return safe_optax.erk_keep_counts(shapes, 0.8)


# Batches of 20 split the 100 training images evenly: each method compiles one train step
# (test_train.py's batches of 16 add a short last batch, a second program, which it checks).
BATCH = 20


def _run(tmp_path, **overrides):
  config = test_train.tiny_config(epochs=1, warmup_epochs=0, gmp_update_every=2,
                                  imp_every_epochs=1, multi_sparsities=(0.5, 0.8),
                                  batch_size=BATCH, **overrides)
  return train.train_and_evaluate(config, tmp_path, data_dir=None,
                                  dataset=test_train.tiny_dataset())


@pytest.mark.slow
@pytest.mark.parametrize("method, structure, overrides", CASES,
                         ids=[f"{m}-{s}" + "".join(f"-{v}" for v in o.values())
                              for m, s, o in CASES])
def test_method_prunes_every_kernel_to_its_exact_count(method, structure, overrides, tmp_path):
  """Each method lands exactly on each kernel's count (per-leaf top-k or its ERK share), with
  finite weights and untouched biases, during training as well as after it."""
  out = _run(tmp_path, method=method, structure=structure, **overrides)
  final, report = out.results["final"], out.results["sparsity_report"]
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(out.sparse_params))
  counts = _kernel_counts(out.sparse_params)
  shapes = [np.shape(x) for x in jax.tree.leaves(out.sparse_params) if np.ndim(x) >= 2]
  assert len(counts) == 2
  want = _expected_counts(structure, shapes)
  assert [n for n, _ in counts] == want
  # The per-kernel counts differ from the other structure's and from one global top-k.
  assert want != _expected_counts("erk" if structure == "per_leaf" else "per_leaf", shapes)
  assert sum(want) == report["prunable_nonzero"]
  # Non-prunable leaves (biases) are never pruned by the final projection.
  biases = [np.asarray(leaf) for leaf in jax.tree.leaves(out.sparse_params) if np.ndim(leaf) == 1]
  dense_biases = [np.asarray(leaf) for leaf in jax.tree.leaves(out.state.params)
                  if np.ndim(leaf) == 1]
  assert len(biases) == len(dense_biases) == 2
  for got, dense in zip(biases, dense_biases):
    np.testing.assert_array_equal(got, dense)
  assert 0.0 <= final["sparse_accuracy"] <= 1.0
  assert len(out.results["history"]) == 1
  if method in ("gmp", "imp-sam"):
    # The pruners hold their mask on the trained weights themselves.
    assert _kernel_counts(out.state.params) == counts
  if methods_lib.get(method).has_admm_state and method != "safe-multi":
    # The ADMM target z is the same projection: SAFE-Multi's last draw may be 0.5.
    z = safe_optax.find_admm_state(out.state.opt_state).z
    assert _kernel_counts(z) == counts


@pytest.mark.slow
def test_dense_prunes_nothing(tmp_path):
  out = _run(tmp_path, method="dense")
  report = out.results["sparsity_report"]
  assert report["prunable_nonzero"] == report["prunable_size"]
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(out.sparse_params))


@pytest.mark.slow
def test_bnt_accuracy_is_reported_for_a_batchnorm_model(tmp_path):
  """A BatchNorm model (ResNet-8): BNT replaces the running statistics with a true average."""
  config = test_train.tiny_config(model="resnet8", method="admm", epochs=1, warmup_epochs=0,
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


@pytest.mark.slow
def test_global_structure_leaves_layers_at_different_sparsities(tmp_path):
  """The default (one top-k over both kernels) does not split the budget evenly on this
  model, so the per-leaf test above could not pass by accident."""
  out = _run(tmp_path, method="gmp")
  counts = _kernel_counts(out.sparse_params)
  assert sum(n for n, _ in counts) == safe_optax.num_keep(sum(s for _, s in counts), 0.8)
  assert counts != [(safe_optax.num_keep(size, 0.8), size) for _, size in counts]
