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
from safe_optax import methods as methods_lib
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


def _kernel_counts(tree) -> list[tuple[int, int]]:
  """(nonzeros, size) of each prunable leaf (the kernels: ndim >= 2), in tree order."""
  return [(int(np.count_nonzero(np.asarray(leaf))), int(np.size(leaf)))
          for leaf in jax.tree.leaves(tree) if np.ndim(leaf) >= 2]


PRUNING_METHODS = [m for m in configs.METHODS if m != "dense"]


def _expected_counts(structure, sizes_shapes):
  shapes = [shape for _, shape in sizes_shapes]
  if structure == "per_leaf":
    return [safe_optax.num_keep(int(np.prod(shape)), 0.8) for shape in shapes]
  return safe_optax.erk_keep_counts(shapes, 0.8)


# The structure reaches every method through one helper (``methods.projection``), so each of
# the registry's builders runs once with ``per_leaf`` (safe-sg shares safe's, cram-plus cram's)
# and ERK runs on the three families of the CrAM / ERK comparison.
STRUCTURE_CASES = [(m, "per_leaf") for m in PRUNING_METHODS
                   if m not in ("safe-sg", "cram-plus")] + [
    (m, "erk") for m in ("safe", "gmp", "cram")]


@pytest.mark.parametrize("method, structure", STRUCTURE_CASES)
def test_per_leaf_structures_prune_every_kernel_to_its_count(method, structure, tmp_path):
  """``per_leaf`` / ``erk`` reach each kernel's own count, during training too."""
  config = test_train.tiny_config(method=method, epochs=1, warmup_epochs=0, gmp_update_every=2,
                                  imp_every_epochs=1, multi_sparsities=(0.5, 0.8),
                                  structure=structure)
  out = train.train_and_evaluate(config, tmp_path, data_dir=None,
                                 dataset=test_train.tiny_dataset())
  counts = _kernel_counts(out.sparse_params)
  shapes = [(n, np.shape(leaf)) for n, leaf in zip(
      [c for c, _ in counts], [x for x in jax.tree.leaves(out.sparse_params) if np.ndim(x) >= 2])]
  assert len(counts) == 2
  # Each kernel keeps its own count: the per-leaf top-k, or its ERK share of the total.
  want = _expected_counts(structure, shapes)
  assert [n for n, _ in counts] == want
  assert want != _expected_counts("erk" if structure == "per_leaf" else "per_leaf", shapes)
  if method in ("gmp", "imp-sam"):
    # The pruners hold their mask on the trained weights themselves.
    assert _kernel_counts(out.state.params) == counts
  if methods_lib.get(method).has_admm_state and method != "safe-multi":
    # The ADMM target z is the per-leaf projection: SAFE-Multi's last draw may be 0.5.
    z = safe_optax.find_admm_state(out.state.opt_state).z
    assert _kernel_counts(z) == counts


def test_global_structure_leaves_layers_at_different_sparsities(tmp_path):
  """The default (one top-k over both kernels) does not split the budget evenly on this
  model, so the per-leaf test above could not pass by accident."""
  config = test_train.tiny_config(method="gmp", epochs=1, warmup_epochs=0, gmp_update_every=2)
  out = train.train_and_evaluate(config, tmp_path, data_dir=None,
                                 dataset=test_train.tiny_dataset())
  counts = _kernel_counts(out.sparse_params)
  assert sum(n for n, _ in counts) == safe_optax.num_keep(sum(s for _, s in counts), 0.8)
  assert counts != [(safe_optax.num_keep(size, 0.8), size) for _, size in counts]
