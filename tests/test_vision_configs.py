"""Tests of the vision config files: ConfigDicts of presets, --config FILE, --config.KEY=VALUE."""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest

import safe_optax

from safe_optax.vision import cli
from safe_optax.vision import config_files
from safe_optax.vision import configs
from safe_optax.vision import sweeps
from safe_optax.vision import workdirs

RUN = ["train", "--data-dir", "DATA", "--workdir", "OUT"]


def _cli_error(argv, capsys) -> str:
  with pytest.raises(SystemExit) as info:
    cli.resolved_config(argv)
  assert info.value.code == 2
  return capsys.readouterr().err


def test_every_preset_has_a_config_file_that_loads_as_the_preset():
  files = {p.stem for p in config_files.DIRECTORY.glob("*.py")} - {"__init__"}
  assert files == {name.replace("-", "_") for name in configs.PRESETS}
  for name, preset in configs.PRESETS.items():
    assert config_files.load(config_files.path(name)) == preset, name
    assert cli.resolved_config(RUN + ["--config", str(config_files.path(name))]) == (
        cli.resolved_config(RUN + ["--preset", name])), name


def test_config_dicts_keep_none_fields_tuples_and_types():
  config = configs.get_config("mlp-mnist", test_only_split=(8000, 2000), penalty=None,
                              train_subset=None, multi_sparsities=(0.5, 0.9))
  values = config_files.to_config_dict(config)
  assert config_files.from_config_dict(values) == config
  values.penalty = 3  # an optional float: an int is read as a float
  values.train_subset = 500
  assert config_files.from_config_dict(values) == config.replace(penalty=3.0, train_subset=500)
  with pytest.raises(TypeError, match="epochs"):
    values.epochs = "ten"
  with pytest.raises(TypeError, match="validation"):
    values.validation = "all"
  with pytest.raises(AttributeError, match="colour"):
    values.colour = 1  # locked: no new fields


def test_an_edited_copy_of_a_config_file_runs_with_its_edits(tmp_path):
  source = config_files.path("mlp-mnist").read_text(encoding="utf-8")
  edited = source.replace("  return config", "  config.sparsity = 0.95\n  config.epochs = 10\n"
                                             "  config.mlp_features = (64, 32)\n  return config")
  assert edited != source
  (tmp_path / "mine.py").write_text(edited, encoding="utf-8")
  assert config_files.load(tmp_path / "mine.py") == configs.get_config(
      "mlp-mnist", sparsity=0.95, epochs=10, mlp_features=(64, 32))


@pytest.mark.parametrize("key, text, expected", [
    ("epochs", "20", 20), ("learning_rate", "1e-3", 1e-3), ("learning_rate", "1", 1.0),
    ("penalty", "0.5", 0.5), ("augment", "false", False), ("augment", "True", True),
    ("method", "admm", "admm"), ("mlp_features", "(32, 16)", (32, 16)),
    ("mlp_features", "64", (64,)), ("test_only_split", "[8000, 2000]", (8000, 2000)),
    ("penalty_table", "((0.9, 1e-3), (1, 1e-2))", ((0.9, 1e-3), (1.0, 1e-2))),
    ("train_subset", "500", 500),
])
def test_overrides_are_read_by_the_fields_type(key, text, expected):
  # A bool flag takes its value after `=` only (absl: `--config.augment false` is two tokens).
  forms = [[f"--config.{key}={text}"]] + ([[f"--config.{key}", text]] if key != "augment" else [])
  for argv in forms:
    value = getattr(cli.resolved_config(RUN + ["--preset", "mlp-mnist", *argv]), key)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("key, text, match", [
    ("epochs", "abc", "--config.epochs=abc: invalid literal for int()"),
    ("epochs", "2.5", "(config field `epochs` is int)"),
    ("learning_rate", "fast", "(config field `learning_rate` is float)"),
    ("augment", "maybe", "(config field `augment` is bool)"),
    ("test_only_split", "(1, 2, 3)", r"`test_only_split` must be tuple[int, int] or None"),
    ("mlp_features", "('a',)", "`mlp_features` must be tuple"),
    ("penalty", "[1]", "(config field `penalty` is float or None)"),
    ("epoch", "3", "--config.epoch: unknown config field `epoch`; did you mean epochs"),
    ("colour", "red", "--config.colour: unknown config field `colour`; known:"),
])
def test_bad_overrides_are_one_line_naming_the_key(key, text, match, capsys):
  err = _cli_error(RUN + ["--preset", "mlp-mnist", f"--config.{key}={text}"], capsys)
  assert match in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_cli_precedence_preset_or_file_then_config_keys_then_flags():
  file = str(config_files.path("mlp-mnist"))
  assert cli.resolved_config(RUN + ["--config", file]).epochs == 100
  assert cli.resolved_config(RUN + ["--config", file, "--config.epochs=20"]).epochs == 20
  assert cli.resolved_config(RUN + ["--config", file, "--config.epochs", "20"]).epochs == 20
  # A named flag overrides --config.KEY, whichever comes first.
  for argv in (["--config.epochs=20", "--epochs", "30"], ["--epochs", "30", "--config.epochs=20"]):
    assert cli.resolved_config(RUN + ["--config", file, *argv]).epochs == 30
  # --config.KEY works on a preset too, for any field (here one without a flag).
  config = cli.resolved_config(RUN + ["--preset", "mlp-mnist", "--config.mlp_features=(64,)",
                                      "--config.method=admm", "--sparsity", "0.95"])
  assert (config.mlp_features, config.method, config.sparsity) == ((64,), "admm", 0.95)
  # The base's warm-up is capped for a short run, as for a preset.
  with pytest.warns(UserWarning, match="config file .* warms up for 5 epochs"):
    assert cli.resolved_config(RUN + ["--config", file, "--config.epochs=3"]).warmup_epochs == 0
  # Dense runs have no target sparsity, however the method is chosen.
  assert cli.resolved_config(RUN + ["--config", file, "--config.method=dense"]).sparsity == 0.0
  assert cli.resolved_config(RUN + ["--preset", "mlp-mnist", "--method", "dense"]).sparsity == 0.0


def test_cli_errors_name_the_key(capsys):
  file = str(config_files.path("mlp-mnist"))
  assert "--config.epochs=abc: invalid literal for int()" in _cli_error(
      RUN + ["--config", file, "--config.epochs=abc"], capsys)
  assert "--config.colour: unknown config field `colour`" in _cli_error(
      RUN + ["--preset", "mlp-mnist", "--config.colour=red"], capsys)
  assert "--config.epochs: expected a value" in _cli_error(
      RUN + ["--preset", "mlp-mnist", "--config.epochs"], capsys)
  assert "`warmup_epochs` must be in [0, epochs=3)" in _cli_error(
      RUN + ["--config", file, "--config.epochs=3", "--warmup-epochs", "3"], capsys)
  assert "unrecognized arguments: --colour" in _cli_error(
      RUN + ["--preset", "mlp-mnist", "--config.epochs=3", "--colour"], capsys)
  assert "not allowed with argument" in _cli_error(
      RUN + ["--config", file, "--preset", "mlp-mnist"], capsys)
  assert "one of the arguments --preset --config is required" in _cli_error(RUN, capsys)
  assert "does not exist" in _cli_error(RUN + ["--config", "nope.py"], capsys)
  with pytest.raises(SystemExit):
    cli.main(["eval", "--workdir", "W", "--data-dir", "D", "--config.epochs=3"])
  assert "apply to train and sweep only" in capsys.readouterr().err


def test_bad_config_files_name_the_file_and_the_field(tmp_path, capsys):
  (tmp_path / "typo.json").write_text(json.dumps({"epochs": 3, "colour": "red"}))
  (tmp_path / "wrong.json").write_text(json.dumps({"epochs": "3"}))
  (tmp_path / "empty.py").write_text("x = 1\n")
  (tmp_path / "config.yaml").write_text("epochs: 3\n")
  for name, match in (("typo.json", "unknown config field 'colour'"),
                      ("wrong.json", "config field `epochs` must be int, got '3'"),
                      ("empty.py", "defines no get_config"), ("config.yaml", "suffix '.yaml'")):
    with pytest.raises(ValueError, match=match) as info:
      config_files.load(tmp_path / name)
    assert name in str(info.value)
    assert match.split("'")[0] in _cli_error(RUN + ["--config", str(tmp_path / name)], capsys)


def test_the_config_json_a_run_writes_reproduces_its_config(tmp_path):
  """claim_workdir writes config.json when a run starts; --config reads it back unchanged."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the warm-up cap of a short run
    config = cli.resolved_config(RUN + ["--preset", "lenet5-fashion-mnist", "--epochs", "3",
                                        "--method", "safe-plus", "--sparsity", "0.98",
                                        "--config.saliency=obd", "--test-only-split", "800", "200",
                                        "--penalty", "0.3", "--seed", "2"])
  workdirs.claim_workdir(tmp_path, config)
  assert cli.resolved_config(RUN + ["--config", str(tmp_path / "config.json")]) == config
  # The copy is a config file like any other: overrides apply on top.
  assert cli.resolved_config(RUN + ["--config", str(tmp_path / "config.json"),
                                    "--seed", "3"]) == config.replace(seed=3)


def test_a_config_file_may_return_a_mapping_or_a_config(tmp_path):
  (tmp_path / "mapping.py").write_text(textwrap.dedent("""
      def get_config():
        return {"model": "mlp", "dataset": "mnist", "epochs": 4, "warmup_epochs": 1}
  """))
  (tmp_path / "typed.py").write_text(textwrap.dedent("""
      from safe_optax.vision import configs

      def get_config():
        return configs.get_config("vgg19-cifar10", sparsity=0.95)
  """))
  assert config_files.load(tmp_path / "mapping.py") == configs.Config(
      model="mlp", dataset="mnist", epochs=4, warmup_epochs=1)
  assert config_files.load(tmp_path / "typed.py") == configs.get_config("vgg19-cifar10",
                                                                         sparsity=0.95)


def test_sweep_takes_a_config_file_too():
  _, args = cli._parse(["sweep", "--config", str(config_files.path("mlp-mnist")),
                         "--config.dual_every=8", "--methods", "safe", "--sparsities", "0.9",
                         "--data-dir", "D", "--workdir", "W"])
  assert cli._config(args.parser, args) == configs.get_config("mlp-mnist", dual_every=8)


def test_structure_is_a_config_field_a_flag_and_a_config_key(capsys):
  from safe_optax import methods  # pylint: disable=import-outside-toplevel
  assert configs.get_config("mlp-mnist").structure == "global"
  with pytest.raises(ValueError, match=r"`structure` must be one of \['global', 'per_leaf', "
                                       r"'erk'\], got 'per_layer'"):
    configs.get_config("mlp-mnist", structure="per_layer")
  for argv in (["--structure", "per_leaf"], ["--config.structure=per_leaf"]):
    config = cli.resolved_config(RUN + ["--preset", "mlp-mnist", *argv])
    assert config.structure == "per_leaf"
    assert methods.projection(config)["structure"] == safe_optax.PerLeaf()
  config = cli.resolved_config(RUN + ["--preset", "mlp-mnist", "--structure", "erk"])
  assert methods.projection(config)["structure"] == safe_optax.ERK()
  assert "invalid choice: 'rows'" in _cli_error(
      RUN + ["--preset", "mlp-mnist", "--structure", "rows"], capsys)
  # Runs of another sparsity set never share a sweep folder with the global ones.
  c = configs.get_config("mlp-mnist", method="gmp", sparsity=0.9)
  assert sweeps.run_dir("r", c) != sweeps.run_dir("r", c.replace(structure="per_leaf"))
  assert sweeps.run_dir("r", c.replace(structure="erk")).name == "gmp-s0.9-erk-seed0"
  assert sweeps.run_dir("r", c.replace(method="dense", sparsity=0.0)) == sweeps.run_dir(
      "r", c.replace(method="dense", sparsity=0.0, structure="per_leaf"))
