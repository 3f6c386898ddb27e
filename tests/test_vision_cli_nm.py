"""``safe-optax-vision --structure N:M``: validation before any data loads, and a tiny run whose
final kernels hold the N:M pattern (checked here with numpy, not with the library)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from safe_optax import methods
from safe_optax.vision import cli

from data_required import require_data


def _run(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  return exit_info.value.code, capsys.readouterr().err


@pytest.fixture
def no_data_loading(monkeypatch):
  """Loading data fails the test: the errors below must come before it."""
  from safe_optax.vision import datasets  # pylint: disable=import-outside-toplevel

  def refuse(*args, **kwargs):
    raise AssertionError("the data set was loaded before the arguments were checked")

  monkeypatch.setattr(datasets, "load_dataset", refuse)


def _train(tmp_path, *extra):
  return ["train", "--preset", "mlp-mnist", "--data-dir", str(tmp_path), "--workdir",
          str(tmp_path / "run"), *extra]


def test_nm_structure_sets_the_sparsity_and_reaches_the_projection(tmp_path):
  config = cli.resolved_config(_train(tmp_path, "--structure", "2:4"))
  assert config.structure == "2:4" and config.sparsity == 0.5  # the preset's 0.9 would conflict
  projection = methods.projection(config)
  assert projection["sparsity"] == 0.5
  assert (projection["structure"].n, projection["structure"].m) == (2, 4)
  assert cli.resolved_config(_train(tmp_path, "--structure", "1:8", "--sparsity",
                                    "0.875")).sparsity == 0.875
  # --method dense trains without a sparsity; the structure is then unused.
  assert cli.resolved_config(_train(tmp_path, "--structure", "2:4", "--method",
                                    "dense")).sparsity == 0.0


@pytest.mark.parametrize("value", ["4:2", "2:2", "0:4", "2:", "2:4:8", "-1:4", "two:four",
                                   "2.0:4", "nm"])
def test_bad_structure_is_one_line_naming_the_argument_and_allowed_values(
    tmp_path, capsys, no_data_loading, value):
  code, err = _run(_train(tmp_path, f"--structure={value}"), capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert err.startswith(f"safe-optax-vision train: error: argument --structure: invalid "
                        f"choice: {value!r} (choose from 'global', 'per_leaf', 'erk', or N:M "
                        "with integers 0 < N < M, e.g. 2:4)")


def test_bad_structure_in_a_config_names_the_field(tmp_path, capsys, no_data_loading):
  code, err = _run(_train(tmp_path, "--config.structure=4:2"), capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert "`structure` must be one of ['global', 'per_leaf', 'erk'], got '4:2'; N:M with " \
         "integers 0 < N < M (e.g. '2:4') is allowed too." in err


def test_conflicting_sparsity_is_refused_naming_the_flag(tmp_path, capsys, no_data_loading):
  code, err = _run(_train(tmp_path, "--structure", "2:4", "--sparsity", "0.9"), capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert "argument --sparsity: 0.9 conflicts with structure 2:4" in err
  assert "prunes exactly 0.5" in err and "pass 0.5" in err
  code, err = _run(_train(tmp_path, "--structure", "2:4", "--config.sparsity=0.8"), capsys)
  assert code == 2 and "argument --config.sparsity: 0.8 conflicts with structure 2:4" in err


@pytest.mark.parametrize("method", ["gmp", "imp-sam", "magnitude", "safe-multi"])
def test_methods_whose_sparsity_changes_refuse_nm(tmp_path, capsys, no_data_loading, method):
  """Their schedule (or SAFE-Multi's draw) would be ignored by N:M: refused, not run."""
  code, err = _run(_train(tmp_path, "--structure", "2:4", "--method", method), capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert f"method {method!r} changes its sparsity during training" in err
  assert "'safe'" in err and "'admm'" in err


def test_sweep_checks_every_sparsity_against_nm_before_data_loads(tmp_path, capsys,
                                                                  no_data_loading):
  code, err = _run(["sweep", "--preset", "mlp-mnist", "--structure", "2:4", "--methods", "dense",
                    "safe", "--sparsities", "0.9", "--data-dir", str(tmp_path), "--workdir",
                    str(tmp_path / "sweep")], capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert "--sparsities" in err and "safe at sparsity 0.9" in err and "'2:4'" in err


@pytest.mark.slow
def test_a_2_of_4_run_ends_with_2_of_every_4_weights(tmp_path, capsys):
  """End to end: the exported sparse kernels have at most 2 nonzero in every group of 4
  consecutive weights along the input axis (NM's axis -2 of a Dense kernel ``(in, out)``)."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  workdir = tmp_path / "run"
  mnist = str(require_data("mnist"))
  code = cli.main(["train", "--preset", "mlp-mnist", "--method", "safe", "--structure", "2:4",
                   "--data-dir", mnist, "--test-only-split", "8000", "2000",
                   "--train-subset", "1024", "--test-subset", "500", "--bnt-samples", "512",
                   "--epochs", "2", "--warmup-epochs", "1", "--dual-every", "4",
                   "--workdir", str(workdir), "--no-progress", "--log-level", "WARNING"])
  assert code == 0
  printed = json.loads(capsys.readouterr().out)
  with open(workdir / "results.json", encoding="utf-8") as f:
    results = json.load(f)
  assert results["config"]["structure"] == "2:4" and results["config"]["sparsity"] == 0.5
  prunable = {l["path"] for l in results["sparsity_report"]["leaves"] if l["prunable"]}
  assert prunable == {"Dense_0/kernel", "Dense_1/kernel", "Dense_2/kernel"}
  params = load_file(str(workdir / "sparse_params.safetensors"))
  for name in prunable:
    kernel = params[name]
    assert kernel.ndim == 2 and kernel.shape[0] % 4 == 0, (name, kernel.shape)
    groups = np.moveaxis(kernel, 0, -1).reshape(-1, 4)  # 4 consecutive inputs of one output
    nonzero = np.count_nonzero(groups, axis=1)
    assert nonzero.max() <= 2, (name, np.bincount(nonzero))
    assert nonzero.mean() > 1.9, name  # the 2 kept are trained weights, not zeros
  for name, value in params.items():
    if name not in prunable:
      assert np.count_nonzero(value) == value.size, name  # biases stay dense
  assert printed["sparse_accuracy"] > 0.5  # chance is 0.1


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_kernel_that_cannot_hold_nm_is_named_before_training(tmp_path, capsys, monkeypatch,
                                                               command):
  """LeNet-5's first conv has 1 input channel: no group of 4 along its input axis."""
  from safe_optax.vision import datasets, input_pipeline, train  # pylint: disable=import-outside-toplevel
  images = np.zeros((8, 28, 28, 1), np.uint8)
  labels = np.arange(8, dtype=np.int32) % 10
  fake = input_pipeline.Dataset(images, labels, images, labels, tuple(map(str, range(10))))
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: fake)
  monkeypatch.setattr(train, "train_and_evaluate", lambda *a, **k: pytest.fail("trained"))
  grid = ["--methods", "safe", "--sparsities", "0.5"] if command == "sweep" else []
  code, err = _run([command, "--preset", "lenet5-fashion-mnist", "--structure", "2:4", *grid,
                    "--data-dir", str(tmp_path), "--workdir", str(tmp_path / "run")], capsys)
  assert code == 2 and err.count("\n") == 1, err
  assert ("argument --structure: 2:4 needs every prunable kernel's input axis (axis -2) "
          "divisible by 4, but lenet5 on fashion_mnist has Conv_0/kernel (5, 5, 1, 6)") in err
