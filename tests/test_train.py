"""Tests of safe_optax.vision.{configs,train,checkpoint}: schedule, data order, SAM/BN, resume, sharding.

Cost: the training runs share one tiny configuration (an MLP on 100 generated
8x8 images, batch 16: six full batches and a short one per epoch), so the
jitted programs compile once (``programs_lib.build_programs`` caches them) and are reused
by the uninterrupted, stopped and interrupted runs. The 8-device run is a
subprocess started when the module is imported, so it overlaps the others.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import textwrap

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import safe_optax
from safe_optax import flax_utils
from safe_optax import methods
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import configs
from safe_optax.vision import finish
from safe_optax.vision import input_pipeline
from safe_optax.vision import train
from safe_optax import experiment
from safe_optax.vision import datasets
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import steps as steps_lib
from safe_optax.vision import train_state
from safe_optax.vision import workdirs
import process_launcher  # tests/process_launcher.py: forced-device XLA flags

N_TRAIN, N_TEST, BATCH, EPOCHS = 100, 40, 16, 3
TINY = dict(model="mlp", mlp_features=(16,), dataset="mnist", method="safe", sparsity=0.8,
            epochs=EPOCHS, warmup_epochs=1, batch_size=BATCH, learning_rate=0.3, eval_batch_size=16, augment=True,
            penalty=1e-2, dual_every=2, bnt_samples=64)


def tiny_dataset(seed: int = 0) -> input_pipeline.Dataset:
  """4 classes of 8x8 images: class c has brightness about 60 c (crops and flips keep it)."""
  rng = np.random.default_rng(seed)
  n = N_TRAIN + N_TEST
  labels = rng.integers(0, 4, n).astype(np.int32)
  images = (60 * labels[:, None, None, None] + rng.integers(0, 50, (n, 8, 8, 1))).astype(np.uint8)
  return input_pipeline.Dataset(images[:N_TRAIN], labels[:N_TRAIN], images[N_TRAIN:],
                                labels[N_TRAIN:], ("a", "b", "c", "d"))


def tiny_config(**overrides) -> configs.Config:
  return configs.validate(configs.Config(**{**TINY, **overrides}))


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    import jax, numpy as np
    sys.path.insert(0, {tests_dir!r})
    import test_train as t
    from safe_optax.vision import train
    out = train.train_and_evaluate(t.tiny_config(), tempfile.mkdtemp(), data_dir=None,
                                   dataset=t.tiny_dataset())
    leaves = jax.tree.leaves(out.state.params)
    print(json.dumps({{
        "devices": jax.device_count(),
        "param_devices": [len(x.sharding.device_set) for x in leaves],
        "replicated": [bool(x.sharding.is_fully_replicated) for x in leaves],
        "params": [np.asarray(x).tolist() for x in leaves],
        "sparse_accuracy": out.results["final"]["sparse_accuracy"],
    }}))
""")


def _launch_sharded_run() -> subprocess.Popen:
  env = {**os.environ, "XLA_FLAGS": process_launcher.forced_devices_flags(8),
         "JAX_PLATFORMS": "cpu"}
  script = _SHARDED_SCRIPT.format(tests_dir=os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_BACKGROUND = {}


@pytest.fixture(scope="module", autouse=True)
def _background_sharded_run(request):
  """Starts the 8-device run when this module's first test starts, if its test is selected
  (not at import: every test process imports this module, and other test files import it)."""
  if any(getattr(item, "module", None) is sys.modules[__name__]
         and item.originalname == "test_8_devices_match_1_device"
         for item in request.session.items):
    _BACKGROUND["sharded"] = _launch_sharded_run()
  yield
  proc = _BACKGROUND.pop("sharded", None)
  if proc is not None and proc.poll() is None:
    proc.kill()
    proc.communicate()


# ----------------------------------------------------------------------------- configs


def test_presets_follow_the_paper():
  r20 = configs.get_config("resnet20x2-cifar10")
  assert (r20.model, r20.width, r20.epochs, r20.batch_size, r20.learning_rate, r20.momentum,
          r20.weight_decay, r20.rho, r20.dual_every, r20.warmup_epochs) == (
              "resnet20", 2, 200, 128, 0.1, 0.9, 1e-4, 0.1, 32, 5)
  lam = lambda preset, s: configs.get_config(preset, sparsity=s).resolved_penalty()
  assert [lam("resnet20x2-cifar10", s) for s in (0.9, 0.98, 0.99, 0.995)] == [
      1e-3, 1e-3, 1e-2, 1e-2]
  assert [lam("vgg19-cifar10", s) for s in (0.7, 0.95, 0.98, 0.99)] == [1e-4, 1e-4, 1e-3, 1e-2]
  assert [lam("resnet32x2-cifar100", s) for s in (0.95, 0.98)] == [1e-3, 1e-2]
  assert lam("vgg19-cifar100", 0.99) == 1e-3
  assert configs.get_config("vgg19-cifar100").epochs == 300
  assert configs.get_config("resnet20x2-cifar10", penalty=0.5).resolved_penalty() == 0.5
  config = configs.get_config("mlp-mnist", seed=3, epochs=7)
  assert configs.from_dict(json.loads(json.dumps(configs.to_dict(config)))) == config


def test_a_run_shorter_than_the_presets_warm_up_warms_up_for_a_tenth_of_it():
  with pytest.warns(UserWarning, match="warms up for 5 epochs, more than the run's 1; warming "
                                       "up for 0"):
    assert configs.get_config("resnet20x2-cifar10", epochs=1).warmup_epochs == 0
  with pytest.warns(UserWarning, match="warming up for 0"):
    assert configs.get_config("mlp-mnist", epochs=5).warmup_epochs == 0
  # Longer runs and explicit warm-ups are left alone.
  assert configs.get_config("mlp-mnist", epochs=6).warmup_epochs == 5
  assert configs.get_config("mlp-mnist", epochs=3, warmup_epochs=2).warmup_epochs == 2


@pytest.mark.parametrize("overrides, match", [
    (dict(method="sgd"), "method"), (dict(sparsity=1.0), "sparsity"),
    (dict(epochs=3, warmup_epochs=3), "warmup_epochs"), (dict(batch_size=0), "batch_size"),
    (dict(model="resnet50"), "model"), (dict(label_noise=1.5), "label_noise"),
    (dict(imp_power=2), "imp_power"), (dict(colour=1), "unknown config fields"),
])
def test_bad_config_values_are_named(overrides, match):
  with pytest.raises(ValueError, match=match):
    configs.get_config("resnet20x2-cifar10", **overrides)
  with pytest.raises(ValueError, match="unknown preset"):
    configs.get_config("resnet18-imagenet")


# ----------------------------------------------------------------------------- schedule, data


def test_learning_rate_reaches_its_end_value_at_the_last_step():
  config = configs.get_config("resnet20x2-cifar10", epochs=20)
  spe = 7
  total, warm = 20 * spe, 5 * spe
  lr = methods.learning_rate_schedule(config, spe)
  steps = np.arange(total + 1)
  got = np.asarray([float(lr(t)) for t in steps])
  # Independent reference: linear warm-up, then half a cosine from warm to total.
  ref = np.where(steps < warm, 0.1 * steps / warm,
                 0.05 * (1 + np.cos(np.pi * (steps - warm) / (total - warm))))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
  assert got[total] == 0.0 and 0 < got[total - 1] < 1e-4
  # The official code's schedule is already 0 five epochs before the end; this one is not.
  assert got[total - warm] > 0.01


@given(n=st.integers(1, 300), batch=st.integers(1, 64), seed=st.integers(0, 5),
       epoch=st.integers(0, 3))
def test_every_example_once_per_epoch(n, batch, seed, epoch):
  batches = datasets.epoch_batches(n, batch, seed, epoch)
  assert len(batches) == math.ceil(n / batch)
  assert all(len(b) == batch for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch
  np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(n))
  again = datasets.epoch_batches(n, batch, seed, epoch)
  assert all(np.array_equal(a, b) for a, b in zip(batches, again))


# ----------------------------------------------------------------------------- SAM and BatchNorm


class _ConvBN(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(4)(jnp.mean(nn.relu(x), axis=(1, 2)))


@pytest.mark.slow
def test_sam_pass_leaves_batch_stats_of_the_clean_pass():
  data = tiny_dataset()
  images, labels = jnp.asarray(data.train_images), jnp.asarray(data.train_labels)
  model = _ConvBN()
  # Every computation below is compiled (a handful of programs), not run op by op (each
  # operation and shape its own compile).
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(0),
                                                                  jnp.zeros((1, 8, 8, 1)))
  model_state, params = flax.core.pop(dict(variables), "params")
  mean, std = input_pipeline.MNIST_MEAN, input_pipeline.MNIST_STD
  indices = jnp.arange(BATCH)

  def step(tx, uses_grad_fn):
    state = train_state.TrainState(jnp.int32(0), jax.random.PRNGKey(5), params, dict(model_state),
                             jax.jit(tx.init)(params), train_state.zero_metrics())
    fn = jax.jit(functools.partial(steps_lib.train_step, apply_fn=model.apply, tx=tx,
                                   uses_grad_fn=uses_grad_fn, augment=True, mean=mean,
                                   std=std))
    return fn(state, images[indices], labels[indices])

  safe = step(optax.chain(safe_optax.sam_perturb(1.0), optax.sgd(0.1)), True)
  sgd = step(optax.sgd(0.1), False)
  # Reference: the clean pass's statistics on the same augmented batch.
  key = jax.random.fold_in(jax.random.PRNGKey(5), 0)
  x = jax.jit(functools.partial(datasets.prepare_images, mean=mean, std=std))(images[indices],
                                                                              key)
  stats = jax.jit(lambda p: model.apply({"params": p, **model_state}, x, train=True,
                                        mutable=["batch_stats"])[1])
  clean = stats(params)
  for a, b, c in zip(jax.tree.leaves(safe.model_state), jax.tree.leaves(sgd.model_state),
                     jax.tree.leaves(clean["batch_stats"])):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
  # The perturbed point's statistics differ, so keeping them would have shown.

  @jax.jit
  def perturbed(params):
    grads = jax.grad(lambda p: experiment.cross_entropy(model.apply(
        {"params": p, **model_state}, x, train=True, mutable=["batch_stats"])[0],
        labels[indices]))(params)
    norm = optax.tree.norm(grads)
    return jax.tree.map(lambda p, g: p + 1.0 * g / norm, params, grads)

  at_perturbed = stats(perturbed(params))
  assert not np.allclose(jax.tree.leaves(at_perturbed["batch_stats"])[0],
                         jax.tree.leaves(safe.model_state)[0])
  # SAM did change the step itself.
  assert not np.allclose(jax.tree.leaves(safe.params)[0], jax.tree.leaves(sgd.params)[0])


# ----------------------------------------------------------------------------- full runs


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("full")


@pytest.fixture(scope="module")
def full_run(full_dir):
  return train.train_and_evaluate(tiny_config(), full_dir, data_dir=None,
                                  dataset=tiny_dataset())


def _assert_same_state(a: train_state.TrainState, b: train_state.TrainState):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_full_run_reports_exact_sparsity_and_learns(full_run, full_dir):
  results = full_run.results
  report = results["sparsity_report"]
  assert report["prunable_nonzero"] == safe_optax.num_keep(report["prunable_size"], 0.8)
  assert report["prunable_size"] == 64 * 16 + 16 * 4
  assert results["final"]["sparsity"] == pytest.approx(0.8, abs=1e-3)
  # 4 classes (chance 0.25), 21 steps.
  assert results["final"]["dense_accuracy"] > 0.5 and results["final"]["sparse_accuracy"] > 0.35
  history = results["history"]
  assert [r["epoch"] for r in history] == list(range(EPOCHS))
  assert all(r["train_examples"] == N_TRAIN for r in history)  # every example, once
  assert all(r["distance_to_projection"] > 0 and r["distance_to_z"] > 0 for r in history)
  for name in ("metrics.jsonl", "accuracy.png", "distance.png"):
    assert (full_dir / name).stat().st_size > 0
  with open(full_dir / "results.json", encoding="utf-8") as f:
    assert json.load(f)["final"] == results["final"]
  versions = results["versions"]
  assert versions["jax"] == jax.__version__ and versions["device_count"] == jax.device_count()
  assert results["images_per_second"] > 0 and results["steady_images_per_second"] > 0
  assert results["trained_images"] == EPOCHS * N_TRAIN
  assert [r["includes_compile"] for r in history] == [True] + [False] * (EPOCHS - 1)


def test_finishing_a_finished_run_again_keeps_its_training_record(full_run, full_dir):
  """evaluate_workdir re-finishes the run: results.json must keep the training throughput."""
  again = train.train_and_evaluate(tiny_config(), full_dir, data_dir=None,
                                   dataset=tiny_dataset()).results
  for key in ("train_seconds", "trained_images", "images_per_second",
              "steady_images_per_second", "final"):
    assert again[key] == full_run.results[key], key
  steady = [r for r in again["history"] if not r["includes_compile"]]
  assert again["steady_images_per_second"] == pytest.approx(
      sum(r["trained_images"] for r in steady) / sum(r["epoch_seconds"] for r in steady))


def test_train_step_compiles_once_per_batch_shape(full_run):
  del full_run
  config = tiny_config()
  programs = programs_lib.build_programs(config, N_TRAIN, 4, (8, 8, 1))
  # 3 epochs x 7 steps: one step program per batch shape (full, the short last one), all
  # without the projection (SAFE's dual update runs as a program of its own, compiled once),
  # none per step.
  spe = -(-N_TRAIN // BATCH)
  plans = [programs_lib.plan(programs, config, step)
           for step in range(EPOCHS * spe)]
  used = {(step % spe == spe - 1, plan[1]) for step, plan in enumerate(plans)}
  assert used == {(True, False), (False, False)}
  assert sum(plan[0] for plan in plans) == len(range(0, EPOCHS * spe, config.dual_every))
  assert programs.train._cache_size() == len(used) and programs.dual._cache_size() == 1


@pytest.mark.slow
def test_split_dual_programs_train_bit_for_bit_like_one_program(full_run, tmp_path, monkeypatch):
  """The host's dual hint (the dual update as a program of its own, the steps without the
  projection) changes nothing: a run with one program that decides inside reaches the same
  state, bit for bit."""
  monkeypatch.setattr(programs_lib, "dual_due", lambda config, step: None)
  single = train.train_and_evaluate(tiny_config(), tmp_path, data_dir=None,
                                    dataset=tiny_dataset())
  _assert_same_state(single.state, full_run.state)
  # No dual update was skipped by a wrong hint in the split run (they would be counted).
  admm = safe_optax.find_admm_state(full_run.state.opt_state)
  assert int(admm.invalid_hyperparams) == 0 and int(admm.count) == EPOCHS * 7


def test_stop_and_resume_is_bit_identical(full_run, tmp_path):
  data = tiny_dataset()
  stopped = train.train_and_evaluate(tiny_config(), tmp_path, data_dir=None, dataset=data,
                                     stop_after_epoch=1)
  assert stopped.results is None and int(stopped.state.step) == 7
  resumed = train.train_and_evaluate(tiny_config(), tmp_path, data_dir=None, dataset=data)
  _assert_same_state(resumed.state, full_run.state)
  _assert_same_state(resumed.sparse_params, full_run.sparse_params)
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    epochs = [json.loads(line)["epoch"] for line in f]
  assert epochs == list(range(EPOCHS))
  assert [r["train_loss"] for r in resumed.results["history"]] == [
      r["train_loss"] for r in full_run.results["history"]]


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_resumes_mid_epoch(full_run, tmp_path):
  data = tiny_dataset()

  def interrupt(step):
    if step == 10:  # in the middle of the second epoch
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(tiny_config(), tmp_path, data_dir=None, dataset=data,
                             on_step=interrupt)
  assert checkpoint_lib.Checkpointer(tmp_path / "checkpoints").latest_step() == 10
  resumed = train.train_and_evaluate(tiny_config(), tmp_path, data_dir=None, dataset=data)
  _assert_same_state(resumed.state, full_run.state)


def test_8_devices_match_1_device(full_run):
  proc = _BACKGROUND.pop("sharded", None) or _launch_sharded_run()
  stdout, stderr = proc.communicate(timeout=900)
  assert proc.returncode == 0, stderr[-4000:]
  result = json.loads(stdout.strip().splitlines()[-1])
  assert result["devices"] == 8
  assert all(n == 8 for n in result["param_devices"]) and all(result["replicated"])
  for got, want in zip(result["params"], jax.tree.leaves(full_run.state.params)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=0,
                               atol=2e-5)
  assert result["sparse_accuracy"] == pytest.approx(
      full_run.results["final"]["sparse_accuracy"], abs=1.0 / N_TEST + 1e-9)


def test_bnt_batches_cover_bnt_samples_distinct_training_images():
  config = tiny_config(bnt_samples=40, augment=False)
  data = tiny_dataset()
  programs = programs_lib.build_programs(config, N_TRAIN, 4, (8, 8, 1))
  images = jnp.asarray(data.train_images)
  batches = list(finish.bnt_batches(programs, config, images, N_TRAIN))
  assert [b.shape[0] for b in batches] == [16, 16, 8]
  got = np.concatenate([np.asarray(b) for b in batches])
  normalized = np.asarray(input_pipeline.normalize(images, input_pipeline.MNIST_MEAN,
                                                   input_pipeline.MNIST_STD))
  # Each batch row is one training image, 40 different ones (a seeded subset).
  flat = normalized.reshape(N_TRAIN, -1)
  rows = [int(np.argmin(np.abs(flat - g.reshape(1, -1)).sum(1))) for g in got]
  assert len(set(rows)) == 40
  np.testing.assert_allclose(got, normalized[rows], rtol=0, atol=1e-6)
  again = np.concatenate([np.asarray(b) for b in finish.bnt_batches(programs, config, images,
                                                                    N_TRAIN)])
  np.testing.assert_array_equal(got, again)


@pytest.mark.slow
def test_a_workdir_is_one_run(full_run, full_dir, tmp_path, caplog):
  data = tiny_dataset()
  results_before = (full_dir / "results.json").read_text()
  # A finished run of other settings is refused, naming what differs; nothing is rewritten.
  with pytest.raises(ValueError, match=r"other settings \(method: 'safe' -> 'admm', "
                                       r"sparsity: 0.8 -> 0.5\)"):
    train.train_and_evaluate(tiny_config(method="admm", sparsity=0.5), full_dir, data_dir=None,
                             dataset=data)
  assert (full_dir / "results.json").read_text() == results_before
  with open(full_dir / "config.json", encoding="utf-8") as f:
    assert configs.from_dict(json.load(f)) == tiny_config()
  # An unfinished run too: a longer schedule with another learning rate must not continue it.
  stopped = tmp_path / "stopped"
  train.train_and_evaluate(tiny_config(), stopped, data_dir=None, dataset=data,
                           stop_after_epoch=1)
  with pytest.raises(ValueError, match=r"epochs: 3 -> 4, learning_rate: 0.3 -> 0.1"):
    train.train_and_evaluate(tiny_config(epochs=4, learning_rate=0.1), stopped, data_dir=None,
                             dataset=data)
  # The same settings resume and say so.
  caplog.clear()
  with caplog.at_level("INFO", logger="safe_optax.vision.train"):
    resumed = train.train_and_evaluate(tiny_config(), stopped, data_dir=None, dataset=data)
  assert "resuming from step 7 of 21" in caplog.text
  _assert_same_state(resumed.state, full_run.state)
  # restart discards the old run and trains the new settings from scratch (another seed: the
  # programs compiled above serve it, SAFE's programs do not read the seed).
  fresh = train.train_and_evaluate(tiny_config(seed=1), stopped, data_dir=None,
                                   dataset=data, restart=True)
  assert fresh.results["config"]["seed"] == 1
  assert [r["epoch"] for r in fresh.results["history"]] == list(range(EPOCHS))


@pytest.mark.slow
def test_divergence_stops_at_once_with_the_step_and_the_last_finite_loss(tmp_path):
  data = tiny_dataset()
  config = tiny_config(learning_rate=1e30, warmup_epochs=0, epochs=20)
  with pytest.raises(workdirs.TrainingDiverged, match="not finite at step 7 ") as info:
    train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data)
  assert info.value.step == 7  # the end of the first epoch, not of the 20th
  with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
    assert len(f.readlines()) == 1
  # A rerun of the same settings reports it again without training.
  with pytest.raises(workdirs.TrainingDiverged, match="step 7"):
    train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data,
                             on_step=lambda step: pytest.fail("trained again"))
  assert not (tmp_path / "results.json").exists()
