"""Every notebook in notebooks/ runs top to bottom (small budget) and its key outputs hold.

Notebooks are executed with nbclient in a fresh kernel, with
``SAFE_OPTAX_NOTEBOOK_BUDGET=ci`` and the working directory ``notebooks/`` (as
Colab or Jupyter would). A cell tagged ``summary`` prints one JSON line; the
notebook-specific checks below read it. Committed notebooks carry no outputs.
"""

import concurrent.futures
import json
import math
import os
import pathlib
import re
import sys

import pytest

import safe_optax
from data_required import require_data
from safe_optax import data_paths

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BUDGET_ENV = {"SAFE_OPTAX_NOTEBOOK_BUDGET": "ci", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
# The data sets a notebook reads through safe_optax.data_paths (without them it downloads, which
# a test must not do): the test skips, or fails under SAFE_OPTAX_REQUIRE_DATA=1, when one is absent.
NOTEBOOK_DATA = {"cifar_safe.ipynb": ("cifar10",),
                 "llm_pruning.ipynb": ("wikitext-2-raw/wiki.test.raw", "wikitext-2/valid.txt")}
# Kernels compiled as a user's run is (conftest's fast compile mode left out of their
# environment): llm_pruning is bound by execution, not compilation (SAFE+ on SmolLM2's 30
# blocks), and ran faster so on a 2-core CPU; the other three compile more than they run
# and ran faster in the fast mode (benchmarks/perf/notebook_time.py, its results JSON).
XLA_OPTIMIZED = {"llm_pruning.ipynb"}


def _missing_data(path: pathlib.Path) -> list[str]:
  return [name for name in NOTEBOOK_DATA.get(path.name, ()) if data_paths.find(name) is None]


def kernel_env(name: str) -> dict[str, str]:
  """The environment a notebook's kernel starts with: this process's, the CI budget, and
  without conftest's fast compile mode for the notebooks in ``XLA_OPTIMIZED``."""
  env = {**os.environ, **BUDGET_ENV}
  if name in XLA_OPTIMIZED:
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
  return env


def _execute(path: pathlib.Path):
  """Runs the notebook in a fresh kernel; returns (executed notebook, summary dict or None)."""
  nb = nbformat.read(path, as_version=4)
  # "python3" is ipykernel's native kernel: this interpreter, where safe_optax is installed.
  # ``env`` goes to jupyter_client's KernelManager.start_kernel: each kernel gets its own.
  nbclient.NotebookClient(
      nb, timeout=600, kernel_name="python3",
      resources={"metadata": {"path": str(path.parent)}},
  ).execute(env=kernel_env(path.name))
  summary = None
  for cell in nb.cells:
    if "summary" in cell.get("metadata", {}).get("tags", []):
      text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                     if o.get("output_type") == "stream")
      summary = json.loads(text.strip().splitlines()[-1])
  return nb, summary


@pytest.fixture(scope="module")
def executed():
  """Every notebook, executed once, two kernels at a time.

  Most of a small-budget run is single-threaded XLA compilation, so two
  kernels side by side keep both cores of a CI machine busy. Values are
  ``(notebook, summary)`` or the exception the run raised.
  """
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    futures = {path.name: pool.submit(_execute, path) for path in NOTEBOOKS
               if not _missing_data(path)}
    results = {}
    for name, future in futures.items():
      try:
        results[name] = future.result()
      except Exception as err:  # pylint: disable=broad-except
        results[name] = err
  return results


def _run(executed, path):
  for name in _missing_data(path):
    require_data(name)  # skips, or fails under CI
  result = executed[path.name]
  if isinstance(result, Exception):
    raise result
  return result


def test_there_are_notebooks():
  names = {p.name for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "custom_model.ipynb", "cifar_safe.ipynb",
          "llm_pruning.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean_and_installs_first(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), (
      f"{path.name}: clear the outputs before committing")
  first = code[0].source
  assert "pip" in first and "install" in first, "the first code cell installs the package"
  assert "jax.default_backend()" in first and "SAFE_OPTAX_NOTEBOOK_BUDGET" in first


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(executed, path):
  nb, _ = _run(executed, path)
  errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors, errors


def _summary(executed, name):
  path = ROOT / "notebooks" / name
  if not path.exists():
    pytest.skip(f"{name} is not in notebooks/")
  _, summary = _run(executed, path)
  assert summary is not None, f"{name} has no cell tagged 'summary'"
  assert summary["budget"] == "ci"
  return summary


@pytest.mark.slow
def test_quickstart_outputs(executed):
  s = _summary(executed, "quickstart.ipynb")
  assert s["chains_max_diff"] == 0.0  # the hand-built chain is safe_optax.safe
  size = s["prunable_size"]
  assert size == 64 * 128 + 128 * 64 + 64 * 10
  rows = s["rows"]
  dense = [r for r in rows if r["method"] == "dense"]
  assert len(dense) == 1 and dense[0]["accuracy"] > 0.8  # chance is 0.1
  pruned = [r for r in rows if r["method"] != "dense"]
  assert {r["method"] for r in pruned} == {"magnitude", "admm", "safe"}
  for r in pruned:
    # Exactly num_keep weights survive the final projection.
    assert r["achieved"] == pytest.approx(1 - safe_optax.num_keep(size, r["sparsity"]) / size)
    assert 0.0 <= r["accuracy"] <= 1.0
  for r in rows:
    if r["method"] in ("admm", "safe"):
      assert r["accuracy"] > 0.3 and r["distance"] >= 0.0


@pytest.mark.slow
def test_custom_model_outputs(executed):
  s = _summary(executed, "custom_model.ipynb")
  nnx = s["nnx"]
  # Prunable: the two hidden kernels; the head kernel and the biases stay dense.
  assert nnx["prunable_size"] == 64 * 128 + 128 * 64
  assert nnx["prunable_nonzero"] == safe_optax.num_keep(nnx["prunable_size"], nnx["sparsity"])
  assert nnx["head_nonzero"] == nnx["head_size"] == 64 * 10
  assert nnx["accuracy"] > 0.3
  linen = s["linen"]
  assert linen["nm_ok"] and linen["sparsity"] == pytest.approx(0.5)
  assert linen["first_conv_dense"]
  assert linen["resume_identical"] and linen["restored_step"] == linen["total_steps"] // 2
  assert linen["lambda_start"] == 0.0 and linen["lambda_end"] == pytest.approx(linen["penalty"])
  assert linen["accuracy"] > 0.3


@pytest.mark.slow
def test_cifar_safe_outputs(executed):
  s = _summary(executed, "cifar_safe.ipynb")
  config = s["config"]
  assert (config["model"], config["width"], config["method"]) == ("resnet8", 1, "safe")
  assert (s["num_train"], s["num_test"]) == (config["train_subset"], config["test_subset"])
  assert s["epochs_recorded"] == {"dense": config["epochs"], "safe": config["epochs"]}
  # ResNet-8 x1 kernels: stem 3*3*3*16, stage 1 2*(3*3*16*16), stage 2 3*3*16*32 + 3*3*32*32 +
  # a 1x1 shortcut 16*32, stage 3 likewise with 32 -> 64, the 64x10 classifier.
  size = s["prunable_size"]
  assert size == (432 + 2 * 2304 + (4608 + 9216 + 512) + (18432 + 36864 + 2048) + 640)
  keep = safe_optax.num_keep(size, config["sparsity"])
  assert s["prunable_nonzero"] == keep
  assert s["safe"]["sparsity"] == pytest.approx(1 - keep / size)
  assert s["dense"]["dense_accuracy"] > 0.15  # chance is 0.1 (measured 0.22)
  safe = s["safe"]
  assert safe["sparse_accuracy"] > 0.13 and safe["bnt_samples"] == config["bnt_samples"]
  # BNT repairs the statistics the projection broke (measured 8 % -> 19 %).
  assert safe["sparse_accuracy"] > safe["sparse_accuracy_before_bnt"]
  curve = s["curve"]
  assert {r["method"] for r in curve} == {"dense", "safe"}
  assert config["sparsity"] in {r["sparsity"] for r in curve}
  for r in curve:
    assert r["prunable_nonzero"] == safe_optax.num_keep(size, r["sparsity"])
    assert 0.0 <= r["before_bnt"] <= 1.0 and 0.0 <= r["after_bnt"] <= 1.0
  at_target = [r for r in curve if r["sparsity"] == config["sparsity"]]
  assert all(r["after_bnt"] > r["before_bnt"] for r in at_target)
  assert len(s["sharpness"]) == 3
  for result in s["sharpness"].values():
    assert math.isfinite(result["lambda_max"]) and result["lambda_max"] != 0.0
    assert 2 <= result["iterations"]


@pytest.mark.slow
def test_llm_pruning_outputs(executed):
  s = _summary(executed, "llm_pruning.ipynb")
  assert s["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and s["num_layers"] == 30
  # 30 blocks of q, o (576x576), k, v (576x192), gate, up, down (576x1536).
  size = s["prunable_size"]
  assert size == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
  rows = {r["method"]: r for r in s["rows"]}
  assert set(rows) == {"dense", "wanda", "safe-plus"}
  dense = rows["dense"]["perplexity"]
  assert 10.0 < dense < 60.0  # measured 39.0 on the first 256 test tokens
  for method in ("wanda", "safe-plus"):
    r = rows[method]
    # Every output row of every block matrix keeps exactly half its weights.
    assert r["prunable_nonzero"] == size // 2 and r["sparsity"] == pytest.approx(0.5)
    assert math.isfinite(r["perplexity"]) and dense < r["perplexity"] < 5 * dense
    assert s["blocks"][method] == 30
  export = s["export"]
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(export["files"])
  assert export["prunable_nonzero"] == size // 2 and export["sparsity"] == pytest.approx(0.5)
  # The GGUF's interleaved Q/K rows are written in the Hugging Face layout and read back.
  assert export["rope_layout"] == "half" and export["same_tokens"]
  assert export["perplexity"] == pytest.approx(rows["safe-plus"]["perplexity"], rel=1e-4)


# The install cell's logic, outside a checkout (Colab) and inside one, with pip and the
# import system mocked: which command runs, or which single sentence stops the notebook.
_MAYBE_MISSING = {"safe_optax", "flax", "orbax", "tqdm", "matplotlib", "PIL", "sklearn",
                  "safetensors", "gguf", "tokenizers"}
# Importable wherever a notebook runs: Jupyter / Colab (IPython), safe_optax's own dependencies
# (jax, optax, numpy), and datasets, which llm_pruning imports only on Colab (preinstalled there)
# when the WikiText-2 copies beside the checkout are absent.
_PROVIDED = {"IPython", "jax", "optax", "numpy", "safe_optax", "datasets"}


def _recorded_numbers(value, key=""):
  """The measured numbers of a recorded notebook run (its config left out): every float that is
  not a round setting such as 0.5 or 0.1."""
  if isinstance(value, dict):
    for k, v in value.items():
      if k != "config":
        yield from _recorded_numbers(v, k)
  elif isinstance(value, list):
    for v in value:
      yield from _recorded_numbers(v, key)
  elif isinstance(value, float) and not math.isclose(value, round(value, 2), abs_tol=1e-12):
    yield value


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_retypes_no_number_of_the_recorded_full_run(path):
  """A result is read from ``results/notebook_<name>_full.json``, never typed into the prose,
  where it would drift from the JSON when the notebook is run again."""
  recorded = json.loads((ROOT / "results" / f"notebook_{path.stem}_full.json").read_text())
  measured = [*_recorded_numbers(recorded["summary"]),
              recorded["wall_seconds_whole_notebook"] / 60]
  assert len(measured) >= 3  # the check has something to find
  # as prose would round them, to at least two significant digits (so not 0.9 for 0.912)
  as_shown = {f"{x:.{d}f}" for v in measured for x in (v, 100 * v) for d in (1, 2)
              if abs(x) >= 10.0 ** -d * 10}
  nb = nbformat.read(path, as_version=4)
  typed = {n for cell in nb.cells if cell.cell_type == "markdown"
           for n in re.findall(r"\d+\.\d+", cell.source)}
  assert not typed & as_shown, f"{path.name} types recorded results: {sorted(typed & as_shown)}"


def _install_cell(path):
  code = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
  head, sep, _ = code.source.partition("\nimport jax\n")
  assert sep, f"{path.name}: the install logic comes before 'import jax'"
  return head


def _run_install_cell(path, monkeypatch, cwd, missing, source=None):
  """Executes the cell's install part; returns (pip commands run, the cell's namespace)."""
  import importlib.util
  import subprocess
  calls = []
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
      None if name in missing else real_find_spec(name, *args)))
  monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: calls.append(command))
  monkeypatch.chdir(cwd)
  if source is None:
    monkeypatch.delenv("SAFE_OPTAX_SOURCE", raising=False)
  else:
    monkeypatch.setenv("SAFE_OPTAX_SOURCE", source)
  namespace = {"__name__": "__main__"}
  try:
    exec(compile(_install_cell(path), str(path), "exec"), namespace)  # pylint: disable=exec-used
  finally:
    monkeypatch.undo()
  return calls, namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_outside_a_checkout_asks_for_safe_optax_source(path, tmp_path, monkeypatch):
  with pytest.raises(RuntimeError) as err:
    _run_install_cell(path, monkeypatch, tmp_path, missing={"safe_optax"})
  message = str(err.value)
  assert "SAFE_OPTAX_SOURCE" in message and "git+https://" in message
  assert "\n" not in message and message.count(". ") == 0  # one sentence


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_installs_the_source_and_only_what_the_notebook_imports(path, tmp_path,
                                                                             monkeypatch):
  source = "git+https://example.invalid/someone/safe_optax.git"
  calls, namespace = _run_install_cell(path, monkeypatch, tmp_path, _MAYBE_MISSING, source)
  needs = namespace["NEEDS"]
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", source, *needs.values()]]
  assert not any("jupyter" in part or "[" in part for part in calls[0])  # no extras, no Jupyter
  # Every third-party module the notebook imports is either provided or in NEEDS.
  nb = nbformat.read(path, as_version=4)
  imported = {m.split(".")[0] for c in nb.cells if c.cell_type == "code"
              for m in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", c.source, flags=re.M)}
  third_party = imported - set(sys.stdlib_module_names) - _PROVIDED
  assert third_party <= set(needs), third_party - set(needs)
  # With everything installed, the cell runs no pip at all.
  calls, namespace = _run_install_cell(path, monkeypatch, tmp_path, missing=set())
  assert calls == [] and namespace["command"] is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_in_a_checkout_installs_it_editable(path, monkeypatch):
  calls, _ = _run_install_cell(path, monkeypatch, ROOT / "notebooks", {"safe_optax", "flax"})
  expected = ["-e", str(ROOT)] + (["flax>=0.10"] if path.name != "quickstart.ipynb" else [])
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", *expected]]


def test_kernels_compile_as_the_test_mode_says_except_the_execution_bound_ones(monkeypatch):
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # conftest's fast mode
  assert XLA_OPTIMIZED <= {p.name for p in NOTEBOOKS}
  for path in NOTEBOOKS:
    env = kernel_env(path.name)
    assert env["SAFE_OPTAX_NOTEBOOK_BUDGET"] == "ci"
    assert ("JAX_DISABLE_MOST_OPTIMIZATIONS" in env) == (path.name not in XLA_OPTIMIZED)
  assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"  # this process's is untouched
