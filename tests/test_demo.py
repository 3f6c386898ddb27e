"""The digits demo end to end, in-process, on a tiny budget (1 seed, few epochs)."""

import json

import numpy as np
import pytest

import safe_optax

pytest.importorskip("sklearn")

from safe_optax import demo  # pylint: disable=wrong-import-position
from safe_optax import experiment  # pylint: disable=wrong-import-position

from cli_help import help_entries  # pylint: disable=wrong-import-position


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  path = tmp_path_factory.mktemp("demo") / "demo.json"
  rc = demo.main(["--epochs", "3", "--seeds", "1", "--sparsity", "0.9",
                  "--json", str(path), "--no-progress", "--fast-compile"])
  assert rc == 0
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def test_pruned_models_have_exact_sparsity(results):
  pruned = [r for r in results["runs"] if r["method"] != "dense"]
  assert {(r["method"], r["sparsity_target"]) for r in pruned} == {
      (m, s) for m in ("magnitude", "admm", "safe") for s in (0.9,)}
  for r in pruned:
    size = r["prunable_size"]
    assert size == 64 * 128 + 128 * 64 + 64 * 10
    assert r["prunable_nonzero"] == safe_optax.num_keep(size, r["sparsity_target"]), r
    assert r["sparsity"] == pytest.approx(1 - safe_optax.num_keep(size, r["sparsity_target"]) / size)


def test_dense_learns(results):
  (dense,) = [r for r in results["runs"] if r["method"] == "dense"]
  assert dense["sparsity"] < 0.01
  assert dense["test_accuracy"] > 0.3  # chance is 0.1
  losses = dense["epoch_train_loss"]
  assert len(losses) == 3 and losses[-1] < losses[0]


def test_json_records_versions_config_and_summary(results):
  for key in ("jax", "optax", "safe_optax", "numpy", "sklearn"):
    assert results["versions"][key]
  assert results["config"]["epochs"] == 3 and results["config"]["seeds"] == 1
  assert results["config"]["sparsities"] == [0.9]
  assert results["data"]["n_train"] + results["data"]["n_test"] == 1797
  methods = [(row["method"], row["sparsity_target"]) for row in results["summary"]]
  assert methods[0] == ("dense", 0.0) and len(methods) == 4
  assert all(row["test_accuracy_se"] is None for row in results["summary"])  # one seed
  assert all(np.isfinite(row["test_accuracy_mean"]) for row in results["summary"])


def test_split_and_batch_order_are_deterministic():
  config = demo.Config(epochs=2)
  a, b = demo.load_data(config), demo.load_data(config)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  # Stratified: every class keeps its share of the test split (to within one example).
  test_counts = np.bincount(a["y_test"], minlength=10)
  all_counts = test_counts + np.bincount(a["y_train"], minlength=10)
  assert np.abs(test_counts - config.test_fraction * all_counts).max() <= 1
  n = a["x_train"].shape[0]
  draw = lambda seed: experiment.batch_order(seed, n, batch_size=config.batch_size,
                                             epochs=config.epochs)
  order = draw(3)
  np.testing.assert_array_equal(order, draw(3))
  assert order.shape == (2 * (n // 64), 64)
  assert len(np.unique(order[: n // 64])) == (n // 64) * 64  # one epoch: no repeats
  assert not np.array_equal(order, draw(4))


def test_format_table_and_mean_se():
  mean, se = experiment.mean_se([0.5, 0.7])
  assert mean == pytest.approx(0.6) and se == pytest.approx(0.1)
  table = demo.format_table({"summary": [{
      "method": "safe", "sparsity_target": 0.9, "test_accuracy_mean": 0.95,
      "test_accuracy_se": 0.01, "test_accuracy_before_projection_mean": 0.96,
      "achieved_sparsity": [0.9, 0.9], "train_seconds_mean": 1.0}]})
  assert "95.00 ± 1.00" in table and "0.9000" in table


def test_cli_rejects_bad_sparsity():
  with pytest.raises(SystemExit):
    demo.parse_args(["--sparsity", "1.0"])


# ----------------------------------------------------------------------------- command line



def test_every_flag_has_help_with_its_default(capsys):
  with pytest.raises(SystemExit) as info:
    demo.parse_args(["--help"])
  assert info.value.code == 0
  entries = {k: v for k, v in help_entries(capsys.readouterr().out).items() if k.startswith("-")}
  assert len(entries) >= 15 and "--log-level {DEBUG,INFO,WARNING,ERROR}" in entries
  for invocation, text in entries.items():
    if invocation.startswith(("-h", "--version")):
      continue
    assert text, f"{invocation} has no help text"
    assert "(default: " in text, f"{invocation} does not show its default: {text!r}"
  assert entries["--epochs EPOCHS"].endswith(f"(default: {demo.Config().epochs})")
  assert entries["--sparsity SPARSITY [SPARSITY ...]"].endswith("(default: 0.9)")
  progress = {i.split()[0] for i in entries if "progress" in i}
  assert progress == {"--no-progress"}  # one spelling across the CLIs


def test_version(capsys):
  with pytest.raises(SystemExit) as info:
    demo.main(["--version"])
  assert info.value.code == 0
  assert capsys.readouterr().out == f"safe-optax-demo {safe_optax.__version__}\n"


def _fake_run(config, progress=True):
  del config, progress
  return {"summary": [{"method": "dense", "sparsity_target": 0.0, "test_accuracy_mean": 0.9,
                       "test_accuracy_se": 0.01, "test_accuracy_before_projection_mean": None,
                       "achieved_sparsity": [0.0], "train_seconds_mean": 1.0}],
          "compile_seconds": {"dense": 0.5}, "total_seconds": 2.0,
          "data": {"n_train": 10, "n_test": 5}, "versions": {"backend": "cpu"}}


@pytest.mark.parametrize("level, logged", [("INFO", True), ("warning", False)])
def test_informational_lines_are_log_records_and_the_table_is_stdout(
    tmp_path, capsys, caplog, monkeypatch, level, logged):
  import logging  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(demo, "run", _fake_run)
  caplog.set_level(logging.DEBUG, logger="safe_optax")  # main lowers or raises it again
  path = tmp_path / "demo.json"
  assert demo.main(["--epochs", "3", "--json", str(path), "--log-level", level]) == 0
  out = capsys.readouterr().out
  assert out.startswith("method") and "90.00 ± 1.00" in out
  assert "wrote" not in out and "demo: digits" not in out  # logged, not printed
  records = [r for r in caplog.records if r.name == "safe_optax.demo"]
  if not logged:
    assert not records
    return
  messages = [r.getMessage() for r in records]
  assert all(r.levelno == logging.INFO for r in records)
  assert messages[0].startswith(f"safe_optax {safe_optax.__version__} demo: digits MLP "
                                "64-128-64-10, 3 epochs")
  assert messages[-1] == f"wrote {path}" and path.exists()
