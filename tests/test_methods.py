"""The vision method registry: one entry per method, and what each entry claims holds.

`test_train_methods.py` trains every method; here the registry's flags are
checked against the optimizers they describe, the names derived from it
(``configs.METHODS``, ``sweeps.PENALTY_METHODS``, run folders) stay what
finished runs were written under, and :func:`methods.projection` is the one
place the trainer's sparsity set comes from.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import safe_optax
from safe_optax import methods
from safe_optax.vision import configs
from safe_optax.vision import sweeps
from safe_optax.vision import train
from safe_optax.vision import programs as programs_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train  # noqa: E402  (the tiny data set and config of the trainer tests)


def test_names_derived_from_the_registry_keep_their_order():
  assert configs.METHODS == ("dense", "safe", "safe-plus", "admm", "gmp", "magnitude", "imp-sam",
                             "cram", "cram-plus", "safe-sg", "safe-multi")
  # configs names what a config may hold, methods builds it: one entry for every name.
  assert tuple(methods.REGISTRY) == configs.METHODS
  assert tuple(methods.STRUCTURES) == configs.STRUCTURES
  assert sweeps.SAFE_FAMILY == ("safe", "safe-plus", "safe-sg", "safe-multi")
  assert sweeps.PENALTY_METHODS == sweeps.SAFE_FAMILY + ("admm",)
  assert sweeps.TUNED_METHODS == sweeps.PENALTY_METHODS + ("cram", "cram-plus")


@pytest.mark.parametrize("name", configs.METHODS)
def test_registry_flags_match_the_optimizer(name):
  config = test_train.tiny_config(method=name, sparsity=0.5 if name != "dense" else 0.0,
                                  multi_sparsities=(0.5,))
  entry = methods.get(name)
  tx = methods.make_optimizer(config, 4)
  params = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)}}
  state = tx.init(params)
  admm_states = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
      s, safe_optax.ADMMState)) if isinstance(s, safe_optax.ADMMState)]
  assert len(admm_states) == (1 if entry.has_admm_state else 0)
  grads = jax.tree.map(jnp.ones_like, params)
  grad_fn = lambda p, _: grads
  if entry.uses_grad_fn:
    with pytest.raises(Exception, match="grad_fn"):
      tx.update(grads, state, params)
    tx.update(grads, state, params, grad_fn=grad_fn)
  else:
    tx.update(grads, state, params)
  assert (entry.penalty_field is not None) == (name in sweeps.PENALTY_METHODS)


def test_unknown_method_is_named_with_the_known_ones():
  with pytest.raises(ValueError, match=r"`method` must be one of \['dense', 'safe'"):
    methods.get("sgd")


@pytest.mark.parametrize("method, overrides, name", [
    ("safe", {}, "safe-s0.9-lam0.1-seed0"),
    ("safe", {"penalty": 0.03}, "safe-s0.9-lam0.03-seed0"),
    ("admm", {}, "admm-s0.9-lam0.01-seed0"),
    ("admm", {"admm_penalty": None, "penalty": 0.5}, "admm-s0.9-lam0.5-seed0"),
    ("safe-multi", {"seed": 2}, "safe-multi-s0.9-lam0.1-seed2"),
    ("gmp", {}, "gmp-s0.9-seed0"),
])
def test_run_folders_keep_the_names_finished_runs_were_written_under(method, overrides, name):
  config = configs.get_config("mlp-mnist", method=method, sparsity=0.9)
  config = configs.Config(**{**configs.to_dict(config), **overrides})
  assert sweeps.run_dir("root", config).name == name


def test_seeded_methods_get_programs_of_their_own_per_seed():
  a = test_train.tiny_config(method="safe-multi", multi_sparsities=(0.5,))
  b = test_train.tiny_config(method="safe")
  assert methods.get("safe-multi").seeded(a) and not methods.get("safe").seeded(b)
  assert methods.get("safe-plus").seeded(b.replace(method="safe-plus", saliency="obd"))
  build = lambda c: programs_lib.build_programs(c, test_train.N_TRAIN, 4, (8, 8, 1))
  assert build(b) is build(b.replace(seed=3))
  assert build(a) is not build(a.replace(seed=3))


@pytest.mark.slow
def test_the_trainer_projects_onto_methods_projection(monkeypatch, tmp_path):
  """Every projection of a run (the optimizer's, ||x - Proj(x)||, the final one) follows
  `methods.projection`: changing it there changes the deployed sparsity."""
  monkeypatch.setattr(methods, "projection",
                      lambda config: {"sparsity": 0.5, "structure": safe_optax.Global()})
  config = test_train.tiny_config(method="admm", sparsity=0.8, epochs=1, warmup_epochs=0,
                                  bnt_samples=17)  # a config no other test compiled
  out = train.train_and_evaluate(config, tmp_path, data_dir=None,
                                 dataset=test_train.tiny_dataset())
  report = out.results["sparsity_report"]
  assert report["prunable_nonzero"] == safe_optax.num_keep(report["prunable_size"], 0.5)
  z = safe_optax.find_admm_state(out.state.opt_state).z
  kept = sum(int(jnp.count_nonzero(leaf)) for leaf in jax.tree.leaves(z) if leaf.ndim > 1)
  assert kept == safe_optax.num_keep(report["prunable_size"], 0.5)
