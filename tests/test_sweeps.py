"""Validation splits, lambda selection and stale-run refusal (safe_optax.vision.sweeps)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from safe_optax.vision import cli, configs, input_pipeline, sweeps
from safe_optax.vision import selection as selection_lib
from safe_optax.vision import datasets
from safe_optax.vision import workdirs

from data_required import require_data



def _fake_dataset(n_train=50, n_test=20):
  rng = np.random.default_rng(0)
  return input_pipeline.Dataset(
      rng.integers(0, 256, (n_train, 28, 28, 1), dtype=np.uint8),
      np.arange(n_train, dtype=np.int32) % 10,
      rng.integers(0, 256, (n_test, 28, 28, 1), dtype=np.uint8),
      np.arange(n_test, dtype=np.int32) % 10, tuple(str(i) for i in range(10)))


@pytest.mark.parametrize("n, size, seed", [(10, 1, 0), (10, 9, 3), (1000, 250, 7)])
def test_validation_split_partitions_the_training_set(n, size, seed):
  train, held_out = input_pipeline.validation_split(n, size, seed)
  assert len(held_out) == size and len(train) == n - size
  assert not set(train) & set(held_out)
  assert sorted(np.concatenate([train, held_out]).tolist()) == list(range(n))
  again = input_pipeline.validation_split(n, size, seed)
  np.testing.assert_array_equal(again[1], held_out)


@pytest.mark.parametrize("size", [0, 10, -1])
def test_validation_split_rejects_sizes_outside_the_training_set(size):
  with pytest.raises(ValueError, match="`validation` must be in"):
    input_pipeline.validation_split(10, size, 0)


def test_load_dataset_holds_out_noisy_training_examples_instead_of_the_test_set(monkeypatch):
  data = _fake_dataset()
  monkeypatch.setattr(input_pipeline, "load_mnist", lambda *a, **k: data)
  config = configs.get_config("mlp-mnist", validation=15, label_noise=0.5)
  split = datasets.load_dataset(config, "/")  # the path only has to exist
  rest, held_out = input_pipeline.validation_split(50, 15, config.data_seed)
  noisy, corrupted = input_pipeline.symmetric_label_noise(data.train_labels, 0.5, 10,
                                                          config.data_seed)
  np.testing.assert_array_equal(split.test_images, data.train_images[held_out])
  np.testing.assert_array_equal(split.train_images, data.train_images[rest])
  # The held-out labels are as noisy as the training labels (a noisy validation split).
  np.testing.assert_array_equal(split.test_labels, noisy[held_out])
  np.testing.assert_array_equal(split.train_labels, noisy[rest])
  assert corrupted[held_out].any()
  # Without a validation split the test set is the real one.
  plain = datasets.load_dataset(configs.get_config("mlp-mnist"), "/")
  np.testing.assert_array_equal(plain.test_images, data.test_images)


def test_validation_must_leave_training_examples():
  with pytest.raises(ValueError, match="`validation` .* smaller than `train_subset`"):
    configs.get_config("mlp-mnist", validation=100, train_subset=100)
  with pytest.raises(ValueError, match="`validation` must be a positive int"):
    configs.get_config("mlp-mnist", validation=0)


def _results(config, accuracy, losses=(1.0, 0.5, 0.4, 0.4)):
  history = [{"epoch": i, "train_loss": l, "distance_to_z": 0.1 * (4 - i),
              "distance_to_projection": 0.2} for i, l in enumerate(losses)]
  return {"config": configs.to_dict(config), "history": history, "images_per_second": 1.0,
          "wall_seconds": 1.0, "data": {"evaluated_on": "validation" if config.validation
                                        else "test"},
          "final": {"dense_accuracy": accuracy + 0.01, "sparse_accuracy_before_bnt": accuracy,
                    "sparse_accuracy": accuracy, "sparsity": config.sparsity}}


def install_fake_runs(monkeypatch, score=lambda config: 0.8) -> list:
  """Replaces training: each run "finishes" with accuracy ``score(config)``.

  Returns the list that collects ``(config, run folder name)`` of every run asked for.
  """
  seen = []

  def fake_run(config, workdir, **kwargs):
    del kwargs
    seen.append((config, pathlib.Path(workdir).name))
    return _results(config, score(config))

  monkeypatch.setattr(sweeps, "run_or_load", fake_run)
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  return seen


def test_select_hyperparameters_keeps_the_best_mean_validation_accuracy(monkeypatch, tmp_path):
  # Accuracy peaks at lambda 0.1 for SAFE and 0.01 for ADMM; a tie goes to the smaller lambda.
  peak = {"safe": 0.1, "admm": 0.01}
  seen = []

  def fake_run(config, workdir, *, data, data_dir, progress):
    seen.append(config)
    lam = config.penalty if config.method == "safe" else config.admm_penalty
    score = 0.9 - abs(np.log10(lam) - np.log10(peak[config.method])) / 10
    return _results(config, score + 0.001 * config.seed)

  monkeypatch.setattr(sweeps, "run_or_load", fake_run)
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  base = configs.get_config("mlp-mnist")
  selection = selection_lib.select_hyperparameters(
      base, ["dense", "safe", "admm", "gmp"], [0.9, 0.99],
      {"safe": [1e-2, 1e-1, 1.0], "admm": [1e-3, 1e-2, 1e-1]}, validation=123, seeds=[0, 1],
      root=tmp_path, data_dir="/", method_overrides={"safe": {"rescale_dual": True}})
  assert selection["chosen"] == {"safe@0.9": 0.1, "safe@0.99": 0.1, "admm@0.9": 0.01,
                                 "admm@0.99": 0.01}
  assert selection["at_grid_edge"] == []  # every optimum is inside its grid
  # Per-method overrides reach that method's runs only.
  assert {c.rescale_dual for c in seen if c.method == "safe"} == {True}
  assert {c.rescale_dual for c in seen if c.method == "admm"} == {False}
  # Only penalty methods are tuned, every run on the validation split, both seeds.
  assert {c.method for c in seen} == {"safe", "admm"} and len(seen) == 2 * 2 * 3 * 2
  assert all(c.validation == 123 for c in seen)
  assert {c.seed for c in seen} == {0, 1}
  rows = [r for r in selection["grid"] if r["method"] == "safe" and r["sparsity"] == 0.9]
  assert [r["penalty"] for r in rows] == [1e-2, 1e-1, 1.0]
  assert rows[1]["validation_accuracy_mean"] == pytest.approx(0.9005)
  assert selection_lib.chosen_overrides(selection, "admm", 0.99) == {"admm_penalty": 0.01}
  assert selection_lib.chosen_overrides(selection, "gmp", 0.99) == {}


def test_select_hyperparameters_tunes_cram_rho_only_when_given_a_grid(monkeypatch, tmp_path):
  # CrAM's validation accuracy peaks at rho 0.03; its runs get rho folders, not lambda ones.
  seen = []

  def fake_run(config, workdir, *, data, data_dir, progress):
    seen.append((config, pathlib.Path(workdir).name))
    if config.method == "cram":
      if config.rho >= 0.3:
        raise workdirs.TrainingDiverged(str(workdir), 10, 2.3, 1)
      return _results(config, 0.9 - abs(np.log10(config.rho) - np.log10(0.03)))
    return _results(config, 0.8)

  monkeypatch.setattr(sweeps, "run_or_load", fake_run)
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  base = configs.get_config("mlp-mnist")
  selection = selection_lib.select_hyperparameters(
      base, ["safe", "cram"], [0.99], {"safe": [0.1], "cram": [0.3, 0.01, 0.03, 0.1]},
      validation=10, seeds=[0], root=tmp_path, data_dir="/")
  assert selection["chosen"] == {"safe@0.99": 0.1, "cram@0.99": 0.03}
  assert selection["fields"] == {"safe": "penalty", "cram": "rho"}
  # A one-value grid is used as given: no validation run, not an edge, listed as fixed.
  assert selection["at_grid_edge"] == [] and selection["fixed"] == ["safe"]
  assert not [c for c, _ in seen if c.method == "safe"]
  cram_rows = [r for r in selection["grid"] if r["method"] == "cram"]
  assert [(r["field"], r["value"], r["diverged"]) for r in cram_rows] == [
      ("rho", 0.01, False), ("rho", 0.03, False), ("rho", 0.1, False), ("rho", 0.3, True)]
  assert all("penalty" not in r for r in cram_rows)
  assert sorted(name for c, name in seen if c.method == "cram") == [
      "cram-s0.99-rho0.01-seed0", "cram-s0.99-rho0.03-seed0", "cram-s0.99-rho0.1-seed0",
      "cram-s0.99-rho0.3-seed0"]
  assert selection_lib.chosen_overrides(selection, "cram", 0.99) == {"rho": 0.03}
  # Without a CrAM grid nothing is tuned for it: the final runs keep the preset's rho.
  seen.clear()
  plain = selection_lib.select_hyperparameters(base, ["safe", "cram"], [0.99], {"safe": [0.1]},
                                        validation=10, seeds=[0], root=tmp_path, data_dir="/")
  assert not seen  # SAFE's one lambda needs no run, and CrAM has no grid
  assert selection_lib.chosen_overrides(plain, "cram", 0.99) == {}
  with pytest.raises(ValueError, match=r"has no hyperparameter to choose.*'cram'"):
    sweeps.tuned_field("gmp")


def test_select_with_rho_picks_the_best_pair_and_leaves_admm_alone(monkeypatch, tmp_path):
  # SAFE's validation accuracy peaks at (rho 0.05, lambda 1); at rho 0.1 lambda 3 diverges.
  seen = []

  def fake_run(config, workdir, *, data, data_dir, progress):
    seen.append((config, pathlib.Path(workdir).name))
    if config.method == "admm":
      return _results(config, 0.7)
    if config.rho == 0.1 and config.penalty == 3.0:
      raise workdirs.TrainingDiverged(str(workdir), 10, 2.3, 1)
    score = 0.8 - abs(config.rho - 0.05) - 0.01 * abs(np.log10(config.penalty))
    return _results(config, score)

  monkeypatch.setattr(sweeps, "run_or_load", fake_run)
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  selection = selection_lib.select_with_rho(
      configs.get_config("mlp-mnist"), ["safe", "admm"], [0.9],
      {"safe": [0.1, 1.0, 3.0], "admm": [0.01, 0.1]}, [0.1, 0.02, 0.05],
      method_overrides={"safe": {"rescale_dual": True}}, validation=10, seeds=[0],
      root=tmp_path, data_dir="/")
  assert selection["chosen"] == {"safe@0.9": 1.0, "admm@0.9": 0.01}
  assert selection["chosen_rho"] == {"safe@0.9": 0.05}
  assert selection["rho_grid"] == [0.02, 0.05, 0.1] and selection["at_grid_edge"] == [
      "admm@0.9"]
  assert selection_lib.chosen_overrides(selection, "safe", 0.9) == {"penalty": 1.0, "rho": 0.05}
  assert selection_lib.chosen_overrides(selection, "admm", 0.9) == {"admm_penalty": 0.01}
  # SAFE ran at every (rho, lambda), rescaled; ADMM kept the default rho and its folders.
  safe = {(c.rho, c.penalty) for c, _ in seen if c.method == "safe"}
  assert safe == {(r, l) for r in (0.02, 0.05, 0.1) for l in (0.1, 1.0, 3.0)}
  assert {c.rescale_dual for c, _ in seen if c.method == "safe"} == {True}
  assert {(c.rho, n) for c, n in seen if c.method == "admm"} == {
      (0.1, "admm-s0.9-lam0.01-seed0"), (0.1, "admm-s0.9-lam0.1-seed0")}
  # The diverged pair is recorded in the rho-0.1 rows and could not win.
  lost = [r for r in selection["grid"] if r["method"] == "safe" and r["rho"] == 0.1
          and r["value"] == 3.0]
  assert lost[0]["diverged"]
  # The best rho at an end of the grid is flagged.
  edge = selection_lib.select_with_rho(
      configs.get_config("mlp-mnist"), ["safe"], [0.9], {"safe": [0.1, 1.0, 3.0]},
      [0.05, 0.02], validation=10, seeds=[0], root=tmp_path, data_dir="/")
  assert edge["chosen_rho"] == {"safe@0.9": 0.05} and "safe@0.9 rho" in edge["at_grid_edge"]
  with pytest.raises(ValueError, match="`rhos` must be a non-empty list"):
    selection_lib.select_with_rho(configs.get_config("mlp-mnist"), ["safe"], [0.9],
                           {"safe": [0.1]}, [], validation=10, seeds=[0], root=tmp_path,
                           data_dir="/")


def test_select_with_rho_scores_a_single_lambda_and_survives_a_radius_that_diverges(
    monkeypatch, tmp_path):
  # One lambda: rho is still chosen (runs are trained); at rho 0.3 every lambda diverges.
  def fake_run(config, workdir, *, data, data_dir, progress):
    if config.rho >= 0.3:
      raise workdirs.TrainingDiverged(str(workdir), 10, 2.3, 1)
    return _results(config, 0.8 - abs(config.rho - 0.05))

  monkeypatch.setattr(sweeps, "run_or_load", fake_run)
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  selection = selection_lib.select_with_rho(
      configs.get_config("mlp-mnist"), ["safe"], [0.9], {"safe": [1.0]}, [0.02, 0.05, 0.3],
      validation=10, seeds=[0], root=tmp_path, data_dir="/")
  assert selection["chosen"] == {"safe@0.9": 1.0}
  assert selection["chosen_rho"] == {"safe@0.9": 0.05}
  assert list(selection["rho_all_diverged"]) == ["0.3"]
  assert {r["rho"] for r in selection["grid"]} == {0.02, 0.05}
  with pytest.raises(ValueError, match=r"every rho of \[0.3, 0.5\] diverged"):
    selection_lib.select_with_rho(configs.get_config("mlp-mnist"), ["safe"], [0.9], {"safe": [1.0]},
                           [0.3, 0.5], validation=10, seeds=[0], root=tmp_path, data_dir="/")


def test_select_hyperparameters_breaks_ties_towards_the_smaller_lambda(monkeypatch, tmp_path):
  monkeypatch.setattr(sweeps, "run_or_load", lambda config, *a, **k: _results(config, 0.5))
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  selection = selection_lib.select_hyperparameters(configs.get_config("mlp-mnist"), ["safe"], [0.9],
                                            {"safe": [1.0, 0.01, 0.1]}, validation=10,
                                            seeds=[0], root=tmp_path, data_dir="/")
  assert selection["chosen"] == {"safe@0.9": 0.01}
  # The smallest lambda of the grid won: the optimum may lie below it, and the result says so.
  assert selection["at_grid_edge"] == ["safe@0.9"]


def test_select_hyperparameters_needs_a_grid_per_penalty_method(tmp_path):
  with pytest.raises(ValueError, match=r"no lambda grid for \['admm'\]"):
    selection_lib.select_hyperparameters(configs.get_config("mlp-mnist"), ["safe", "admm"], [0.9],
                                  {"safe": [0.1]}, validation=10, seeds=[0], root=tmp_path,
                                  data_dir="/")


def test_convergence_reports_plateau_distance_and_projection_cost():
  config = configs.get_config("mlp-mnist", method="safe", sparsity=0.9)
  losses = [2.0] * 8 + [1.1, 1.0]  # 10 epochs: the last tenth is 1 epoch, the one before 1.1
  out = sweeps.convergence(_results(config, 0.8, losses))
  assert out["final_train_loss"] == 1.0
  assert out["loss_change_last_tenth"] == pytest.approx(0.1)
  assert out["constraint_distance"] == pytest.approx(0.1 * (4 - 9))
  assert out["projection_cost"] == pytest.approx(0.01)
  record = sweeps.record(config, _results(config, 0.8, losses))
  assert record["penalty"] == config.resolved_penalty() and record["evaluated_on"] == "test"


def test_run_dir_names_every_setting_that_varies():
  base = configs.get_config("mlp-mnist")
  names = {sweeps.run_dir("r", base.replace(method=m, sparsity=s, seed=seed, penalty=lam,
                                            label_noise=noise)).name
           for m in ("safe", "gmp") for s in (0.9, 0.99) for seed in (0, 1)
           for lam in (0.1, 1.0) for noise in (0.0, 0.5)}
  # gmp has no lambda, so its two lambdas share a folder: 2*2*2*2 (safe) + 2*2*2 (gmp).
  assert len(names) == 16 + 8
  assert "noise0.5-safe-s0.99-lam1-seed1" in names


def test_run_or_load_refuses_a_finished_run_of_other_settings(tmp_path):
  config = configs.get_config("mlp-mnist", method="safe", sparsity=0.9, epochs=3,
                              warmup_epochs=0)
  tmp_path.joinpath("results.json").write_text(json.dumps(_results(config, 0.5)))
  assert sweeps.run_or_load(config, tmp_path, data=None, data_dir="/")["final"][
      "sparse_accuracy"] == 0.5
  with pytest.raises(ValueError, match=r"other settings \(\['epochs', 'learning_rate'\]\)"):
    sweeps.run_or_load(config.replace(epochs=4, learning_rate=0.05), tmp_path, data=None,
                       data_dir="/")


@pytest.mark.slow
def test_cli_sweep_refuses_stale_results_and_train_reports_the_validation_split(tmp_path,
                                                                                 capsys):
  mnist = str(require_data("mnist"))
  common = ["--preset", "mlp-mnist", "--data-dir", mnist, "--test-only-split",
            "8000", "2000", "--train-subset", "512", "--epochs", "1", "--warmup-epochs", "0",
            "--workdir", str(tmp_path), "--no-progress", "--methods", "safe",
            "--sparsities", "0.9", "--seeds", "0"]
  assert cli.main(["sweep", *common, "--validation", "128"]) == 0
  with open(tmp_path / "safe-s0.9-seed0" / "results.json", encoding="utf-8") as f:
    results = json.load(f)
  assert results["data"]["evaluated_on"] == "validation"
  assert results["data"]["num_train"] == 512 - 128 and results["data"]["num_test"] == 128
  # The same folder with another learning rate: refused, naming the setting; nothing rewritten.
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["sweep", *common, "--validation", "128", "--lr", "0.05"])
  assert exit_info.value.code == 2
  assert "['learning_rate']" in capsys.readouterr().err
  with open(tmp_path / "sweep.json", encoding="utf-8") as f:
    assert json.load(f)["config"]["learning_rate"] == 0.1


def test_a_diverging_lambda_loses_the_selection_instead_of_crashing_it(monkeypatch, tmp_path):
  def fake_run(config, workdir, *, data, data_dir, progress):
    if config.penalty >= 1.0:
      raise workdirs.TrainingDiverged(str(workdir), 40, 2.3, 1)
    return _results(config, 0.5 + config.penalty)

  monkeypatch.setattr(sweeps, "run_or_load", fake_run)
  monkeypatch.setattr(datasets, "load_dataset", lambda config, data_dir: None)
  selection = selection_lib.select_hyperparameters(configs.get_config("mlp-mnist"), ["safe"], [0.99],
                                            {"safe": [0.01, 0.1, 1.0]}, validation=10,
                                            seeds=[0], root=tmp_path, data_dir="/")
  assert selection["chosen"] == {"safe@0.99": 0.1}
  lost = [r for r in selection["grid"] if r["penalty"] == 1.0][0]
  assert lost["diverged"] and lost["validation_accuracy_mean"] is None
  assert lost["runs"][0]["diverged"] == {"step": 40, "last_finite_loss": 2.3}
  with pytest.raises(ValueError, match=r"every lambda of \[1.0, 2.0\] diverged for safe"):
    selection_lib.select_hyperparameters(configs.get_config("mlp-mnist"), ["safe"], [0.99],
                                  {"safe": [1.0, 2.0]}, validation=10, seeds=[0],
                                  root=tmp_path, data_dir="/")
