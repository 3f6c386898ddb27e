"""Tests of safe_optax.vision.packing: a packed run equals the run trained alone.

Cost: 32 generated 8x8 images at batch 16 (two steps an epoch, a dual update
every step), two epochs, test evaluation only after the last. Each method
trains two seeds alone and as one pack of two that is interrupted after its
first step and resumed from the checkpoints. ADMM and GMP stop after the
first epoch (no evaluation or ``finish`` to compile); dense runs ResNet-8
(BatchNorm statistics per run); SAFE runs to the end and compares the files.
A pack's step is a vmapped convolution, whose rounding differs from the lone
one's (about 5e-7 relative a step on ResNet-8, growing over training), so the
runs are kept to a few steps.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import configs
from safe_optax.vision import input_pipeline
from safe_optax.vision import packing
from safe_optax.vision import train

SEEDS = (0, 1)


def tiny_dataset() -> input_pipeline.Dataset:
  """4 classes of 8x8 images (class c about 60 c bright): 32 to train, 16 to test."""
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 4, 48).astype(np.int32)
  images = (60 * labels[:, None, None, None] + rng.integers(0, 50, (48, 8, 8, 1))).astype(np.uint8)
  return input_pipeline.Dataset(images[:32], labels[:32], images[32:], labels[32:],
                                ("a", "b", "c", "d"))


def tiny_config(method: str, **overrides) -> configs.Config:
  base = configs.Config(model="mlp", mlp_features=(16,), dataset="mnist", method=method,
                        sparsity=0.0 if method == "dense" else 0.8, epochs=2, warmup_epochs=1,
                        batch_size=16, learning_rate=0.3, eval_batch_size=16, eval_every=2,
                        penalty=1e-2, dual_every=1, bnt_samples=32, gmp_update_every=1)
  return base.replace(**overrides)


def assert_same_run(lone, packed) -> None:
  """Weights within 1e-5 relative, the same zeros, the same BatchNorm statistics and steps."""
  assert int(lone.step) == int(packed.step)
  for tree in ("params", "model_state", "opt_state"):
    a, b = jax.tree.leaves(getattr(lone, tree)), jax.tree.leaves(getattr(packed, tree))
    assert len(a) == len(b) and (a or tree == "model_state")
    for x, y in zip(a, b):
      x, y = np.asarray(x), np.asarray(y)
      assert x.dtype == y.dtype and x.shape == y.shape
      if np.issubdtype(x.dtype, np.floating):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(x)) + 1e-30))
        np.testing.assert_array_equal(y == 0, x == 0)
      else:
        np.testing.assert_array_equal(y, x)


def interrupt_at(step: int):
  def on_step(s: int) -> None:
    if s == step:
      raise KeyboardInterrupt
  return on_step


def train_both(runs, tmp_path, *, stop_after_epoch=None):
  """Each run alone, then all as one pack interrupted after its first step and resumed."""
  data = tiny_dataset()
  lone = [train.train_and_evaluate(c, tmp_path / f"lone{c.seed}", data_dir=None, dataset=data,
                                   stop_after_epoch=stop_after_epoch, tensorboard=False)
          for c in runs]
  dirs = [tmp_path / f"pack{c.seed}" for c in runs]
  with pytest.raises(checkpoint_lib.Interrupted, match="step 1"):
    packing.train_packed(runs, dirs, data=data, on_step=interrupt_at(1), tensorboard=False)
  packed = packing.train_packed(runs, dirs, data=data, stop_after_epoch=stop_after_epoch,
                                tensorboard=False)
  for a, b in zip(lone, packed):
    assert_same_run(a.state, b.state)
  # The runs differ from each other (their own seeds, data order and augmentation).
  assert not np.allclose(jax.tree.leaves(packed[0].state.params)[-1],
                         jax.tree.leaves(packed[1].state.params)[-1])
  return lone, packed, dirs


@pytest.mark.slow
@pytest.mark.parametrize("method,model,conv_impl", [
    ("admm", "mlp", "xla"), ("gmp", "mlp", "xla"), ("dense", "resnet8", "xla"),
    # im2col: the packed step's convolutions are batched matmuls, not grouped convolutions
    ("safe", "resnet8", "im2col")])
def test_a_packed_run_resumed_from_its_checkpoint_equals_the_run_alone(method, model, conv_impl,
                                                                       tmp_path):
  runs = [tiny_config(method, model=model, conv_impl=conv_impl, seed=s) for s in SEEDS]
  lone, packed, _ = train_both(runs, tmp_path, stop_after_epoch=1)
  assert all(o.results is None and int(o.state.step) == 2 for o in lone + packed)


@pytest.mark.slow
def test_a_finished_packed_safe_run_writes_what_a_lone_run_writes(tmp_path):
  runs = [tiny_config("safe", seed=s) for s in SEEDS]
  lone, packed, dirs = train_both(runs, tmp_path)
  for seed, a, b, workdir in zip(SEEDS, lone, packed, dirs):
    for x, y in zip(jax.tree.leaves(a.sparse_params), jax.tree.leaves(b.sparse_params)):
      np.testing.assert_array_equal(np.asarray(y) == 0, np.asarray(x) == 0)
    assert a.results["final"] == pytest.approx(b.results["final"], rel=1e-5)
    lone_dir = tmp_path / f"lone{seed}"
    assert sorted(p.name for p in workdir.iterdir()) == sorted(p.name for p in lone_dir.iterdir())
    results = [json.loads((d / "results.json").read_text()) for d in (lone_dir, workdir)]
    assert sorted(results[0]) == sorted(results[1])
    assert results[0]["config"] == results[1]["config"]
    lines = [(d / "metrics.jsonl").read_text().splitlines() for d in (lone_dir, workdir)]
    assert len(lines[0]) == len(lines[1]) == 2
    for x, y in zip(*lines):
      x, y = json.loads(x), json.loads(y)
      assert sorted(x) == sorted(y) and x["train_loss"] == pytest.approx(y["train_loss"], 1e-5)
      assert [r["step"] for r in x["steps"]] == [r["step"] for r in y["steps"]]


def test_runs_that_differ_in_more_than_the_seed_are_refused_naming_the_field():
  base = tiny_config("safe")
  with pytest.raises(ValueError, match=r"\['sparsity'\] differ"):
    packing.check_packable([base, base.replace(sparsity=0.9, seed=1)])
  with pytest.raises(ValueError, match=r"\['method', 'penalty'\] differ"):
    packing.check_packable([base, base.replace(method="admm", penalty=0.1)])
  multi = base.replace(method="safe-multi", multi_sparsities=(0.7, 0.8))
  with pytest.raises(ValueError, match="optimizer reads the seed"):
    packing.check_packable([multi, multi.replace(seed=1)])
  assert packing.group([base.replace(seed=s) for s in range(5)] + [base.replace(sparsity=0.9)],
                       2) == [[0, 1], [2, 3], [4], [5]]


def test_a_sweep_packs_unfinished_runs_by_program_and_checkpoint_step(monkeypatch, tmp_path):
  from safe_optax.vision import sweeps
  calls = []
  monkeypatch.setattr(packing, "train_packed", lambda runs, dirs, **kw: calls.append(
      [d.name for d in dirs]))
  # seed 3 stopped at step 8, the others have no checkpoint; seed 4 finished.
  monkeypatch.setattr(sweeps, "checkpoint_step", lambda d: 8 if d.name.endswith("3") else None)
  jobs = [(tiny_config(m, seed=s), tmp_path / f"{m}{s}") for m in ("safe", "admm")
          for s in range(5)]
  (tmp_path / "safe4").mkdir()
  (tmp_path / "safe4" / "results.json").write_text("{}")
  sweeps.train_packs(jobs, 2, data=None)
  assert calls == [["safe0", "safe1"], ["safe2"], ["safe3"], ["admm0", "admm1"],
                   ["admm2", "admm4"], ["admm3"]]


def test_the_sweep_command_refuses_a_pack_size_below_one(tmp_path, capsys):
  from safe_optax.vision import cli
  with pytest.raises(SystemExit):
    cli.main(["sweep", "--preset", "mlp-mnist", "--methods", "safe", "--sparsities", "0.9",
              "--data-dir", str(tmp_path), "--workdir", str(tmp_path / "out"), "--pack", "0"])
  assert "--pack must be a positive integer, got 0" in capsys.readouterr().err
