"""CI-sized checks of the paper's claims, on the real data beside the checkout.

Each test reruns seed 0 (``SAFE_OPTAX_CLAIM_SEEDS`` for more) of a committed
evidence run (the same code, the same budget, the lambdas chosen there on a
validation split) and fails if the ordering that ``results/`` reports regresses.
The ordering was checked over all the seeds of that run before relying on it;
the test asserts it with a margin well inside what every seed showed. A shorter
budget does not do: at 1,200 steps on 2,000 images SAFE's iterate is still far
from its sparse set and its lambda_max came out 3-5x *above* ADMM's in 4 of 4
seeds.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import pytest

import safe_optax
from safe_optax import flatness
from safe_optax.vision import models

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.claims import flatness_mlp
from data_required import require_data



# Reruns of committed evidence, held to the committed run's margins: compiled as a user's run
# is (tests/conftest.py: the suite otherwise compiles with XLA's optimisations off).
pytestmark = [pytest.mark.slow, pytest.mark.xla_optimized]

# Seed 0 by default (each seed is a full evidence-budget run, the suite's largest cost);
# SAFE_OPTAX_CLAIM_SEEDS="0,1" reruns more of the committed seeds.
SEEDS = [int(s) for s in os.environ.get("SAFE_OPTAX_CLAIM_SEEDS", "0").split(",")]
# The reruns save one checkpoint, at the end, where the committed runs saved one each epoch:
# a save of these MLPs costs about a third of a second, a third of a 60-epoch run's wall
# time, and checkpointing does not change the trained model (resuming is bit-for-bit, tested
# in tests/test_vision_checkpoint.py and tests/test_fault_injection.py).


def _committed(name: str) -> dict:
  with open(ROOT / "results" / name, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def mnist_flatness_config() -> flatness_mlp.Config:
  """The committed §4.1 MNIST run's config (100 epochs, chosen lambdas), on 1,000 Hessian images."""
  recorded = _committed("flatness_mnist/flatness_mnist.json")["config"]
  assert recorded["select"], "the committed run chose its lambdas on a validation split"
  return flatness_mlp.Config(
      dataset="mnist", data_dir=str(require_data("mnist")), epochs=recorded["epochs"],
      sparsity=recorded["sparsity"], safe_penalty=recorded["safe_penalty"],
      admm_penalty=recorded["admm_penalty"], rho=recorded["rho"],
      dual_every=recorded["dual_every"], hessian_examples=1000)


@pytest.mark.parametrize("seed", SEEDS)
def test_safe_finds_flatter_sparse_minima_than_admm(mnist_flatness_config, seed):
  """§4.1: SAFE's 90 %-sparse MLP has a smaller lambda_max than ADMM's.

  The committed run (5 seeds) has SAFE / ADMM ratios of 0.09-0.17; the test
  asserts < 0.5 for each rerun seed and that both iterates reached their sparse
  sets (relative ``||x - z||`` below 5 %).
  """
  config = mnist_flatness_config
  data = flatness_mlp.load(config)
  model = models.mlp()
  per = config.hessian_examples // 4
  batches = [(data["x_train"][i * per:(i + 1) * per], data["y_train"][i * per:(i + 1) * per])
             for i in range(4)]
  loss = lambda p, b: flatness_mlp.cross_entropy(model.apply({"params": p}, b[0]), b[1])
  top = jax.jit(lambda p, b, k: flatness.max_hessian_eigenvalue(
      loss, p, b, key=k, tol=config.power_tol, max_iterations=config.power_max_iterations))
  eig = {}
  for method, penalty in (("safe", config.safe_penalty), ("admm", config.admm_penalty)):
    (_, trained, opt_state, _, _), = flatness_mlp.train_runs(method, penalty, config, data,
                                                             [seed], model)
    final, _ = safe_optax.finalize(trained, config.sparsity)
    assert safe_optax.sparsity_report(final).sparsity == pytest.approx(config.sparsity, abs=1e-4)
    converged = flatness_mlp.convergence(trained, opt_state, [1.0], config)
    assert converged["constraint_distance"] < 0.05 * converged["prunable_norm"], method
    result = top(final, batches, jax.random.PRNGKey(1000 + seed))
    assert bool(result.converged), method
    eig[method] = float(result.eigenvalue)
  assert eig["safe"] < 0.5 * eig["admm"], eig


@pytest.fixture(scope="module")
def label_noise_runs() -> dict:
  """The committed Table 3 run: lambdas chosen on a noisy validation split, per noise ratio."""
  recorded = _committed("label_noise/label_noise_3seeds.json")
  five = _committed("label_noise/label_noise_5seeds.json")
  return {"config": recorded["config"], "chosen": recorded["selection"], "five": five["runs"]}


@pytest.mark.parametrize("seed", SEEDS)
def test_safe_is_more_robust_to_label_noise_than_admm(label_noise_runs, seed, tmp_path):
  """Table 3 at 25 % symmetric label noise: SAFE's 90 %-sparse MLP beats ADMM's on clean test data.

  The committed 5-seed run (``results/label_noise/label_noise_5seeds.json``, the lambdas
  chosen on a noisy validation split in ``label_noise_3seeds.json``) has
  SAFE ahead by 0.8-2.0 points in every seed; the test asserts more than 0.4,
  that both iterates reached their sparse sets, and that the rerun reproduces
  the committed accuracy within a point (same seed and data order; another CPU may round
  differently over 4,000 steps).
  """
  from safe_optax.vision import configs, sweeps  # pylint: disable=import-outside-toplevel
  recorded = label_noise_runs["config"]
  chosen = label_noise_runs["chosen"]["0.25"]["chosen"]
  base = configs.get_config(
      "mlp-mnist", epochs=recorded["epochs"], warmup_epochs=recorded["warmup_epochs"],
      batch_size=recorded["batch_size"], test_only_split=tuple(recorded["test_only_split"]),
      label_noise=0.25, sparsity=0.9, seed=seed, checkpoint_every=recorded["epochs"])
  accuracy = {}
  for method in ("safe", "admm"):
    config = base.replace(method=method,
                          **{sweeps.penalty_field(method): chosen[f"{method}@0.9"]})
    results = sweeps.run_or_load(config, tmp_path / method, data=None,
                                 data_dir=require_data("mnist"))
    record = sweeps.record(config, results)
    committed, = [r for r in label_noise_runs["five"]
                  if (r["method"], r["noise"], r["seed"]) == (method, 0.25, seed)]
    assert record["accuracy"] == pytest.approx(committed["accuracy"], abs=1e-2), method
    assert record["constraint_distance"] < 0.2, (method, record["constraint_distance"])
    accuracy[method] = record["accuracy"]
  assert accuracy["safe"] > accuracy["admm"] + 0.004, accuracy




@pytest.mark.parametrize("seed", SEEDS)
def test_rescaled_dual_keeps_safe_from_collapsing_at_extreme_sparsity(seed, tmp_path):
  """At 99.5 % sparsity under the cosine ramp, the paper's dual update collapses; rescaling does not.

  The committed 5-seed run (``results/dual_rescaling``: Fashion-MNIST
  MLP, 4,000 training images, 20 epochs, lambda 0.1) has the rescaled dual
  ahead by 35-45 points in every seed, with ``||x - z||`` less than half the
  paper update's. The test asserts a 20-point lead and the smaller ``||x - z||``.
  """
  from safe_optax.vision import configs, sweeps  # pylint: disable=import-outside-toplevel
  committed = json.loads((ROOT / "results" / "dual_rescaling" / "dual_rescaling.json"
                          ).read_text(encoding="utf-8"))
  args = committed["args"]
  base = configs.get_config(args["preset"], method="safe", sparsity=args["sparsity"],
                            epochs=args["epochs"], warmup_epochs=args["warmup_epochs"],
                            train_subset=args["train_subset"], test_subset=args["test_subset"],
                            eval_every=args["epochs"], penalty=0.1, seed=seed,
                            checkpoint_every=args["epochs"])
  record = {}
  for label, rescale in (("paper", False), ("rescaled", True)):
    config = base.replace(rescale_dual=rescale)
    results = sweeps.run_or_load(config, tmp_path / label, data=None,
                                 data_dir=require_data("fashion-mnist"))
    record[label] = sweeps.record(config, results)
    # No reproduction check against the committed accuracies: at 99.5 % on 4,000 images for
    # 20 epochs both variants move with the CPU's rounding. With the same versions, seed 0
    # ended at 38.3 % (paper) and 73.3 % (rescaled) on the machine that made the committed
    # run and at 31.7 % and 63.0 % on an AMD EPYC. The claim is the gap, asserted below.
  assert record["rescaled"]["accuracy"] > record["paper"]["accuracy"] + 0.20, record
  assert record["rescaled"]["constraint_distance"] < record["paper"]["constraint_distance"]


@pytest.mark.parametrize("seed", SEEDS)
def test_extreme_sparsity_order_safe_above_admm_gmp_just_above_safe(seed, tmp_path):
  """§5.2 at 99.5 % on 4,000 images: SAFE far above ADMM, on its sparse set; GMP level with or above SAFE.

  The order the committed 5-seed sweep shows (``results/sparse_set_995_small/
  sweep_60epochs.json``; its verdicts in ``results/README.md``): SAFE
  (``rescale_dual``) ahead of ADMM by 10-19 points in every seed, its
  ``||x - z||`` 0.14-0.45 and its final projection costing at most 0.3 points;
  GMP, never tuned, ahead of SAFE by 0.4-1.5 points in every seed, so the
  paper's SAFE > GMP does not hold on this MLP. The test reruns SAFE, ADMM and
  GMP for one seed and fails if any of that order regresses: SAFE above ADMM by
  8 points, SAFE's ``||x - z||`` below 1 and projection cost under 2 points,
  SAFE no more than 2.5 points below GMP, and SAFE's and GMP's accuracies within
  1.5 points of the committed run (ADMM, far from converged, is held to the order only).
  """
  from safe_optax.vision import configs, sweeps  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import selection as selection_lib  # pylint: disable=import-outside-toplevel
  committed = json.loads((ROOT / "results" / "sparse_set_995_small" / "sweep_60epochs.json"
                          ).read_text(encoding="utf-8"))
  base = configs.from_dict(committed["config"]).replace(sparsity=0.995, seed=seed)
  base = base.replace(checkpoint_every=base.epochs)
  overrides = selection_lib.rescaled_dual(["safe", "admm"], True)
  record = {}
  for method in ("safe", "admm", "gmp"):
    config = base.replace(method=method, **overrides.get(method, {}),
                          **selection_lib.chosen_overrides(committed["selection"], method, 0.995))
    results = sweeps.run_or_load(config, tmp_path / method, data=None,
                                 data_dir=require_data("fashion-mnist"))
    record[method] = sweeps.record(config, results)
    want, = [r for r in committed["runs"] if (r["method"], r["seed"]) == (method, seed)]
    # ADMM ends 5-6 from its sparse set and its final projection costs it 12-21 points, so
    # its accuracy moves with rounding on another CPU by more than between seeds (seed 1: 65.2 %
    # committed, 70.4 % on an AMD EPYC with the same versions): only SAFE and GMP must
    # reproduce; ADMM is held to the order below.
    if method != "admm":
      assert record[method]["accuracy"] == pytest.approx(want["accuracy"], abs=0.015), method
  safe, admm, gmp = record["safe"], record["admm"], record["gmp"]
  assert safe["accuracy"] > admm["accuracy"] + 0.08, record
  # The evidence report's declared sparse-set distance (benchmarks/report.py). The committed
  # seeds end at 0.14-0.45 with a projection cost of at most 0.3 points; reruns of seed 0 on
  # the same software end at 0.66 and 1.05 points (ADMM: 12-21 points).
  assert safe["constraint_distance"] < 1.0, safe["constraint_distance"]
  assert safe["projection_cost"] < 0.02 < admm["projection_cost"], record
  assert gmp["accuracy"] - 0.025 < safe["accuracy"], record
