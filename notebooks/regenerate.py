"""Runs the notebooks at their test budget and stores the outputs in the .ipynb files.

GitHub and Colab show a notebook's stored outputs (tables, plots) before anyone runs it, so
the committed notebooks carry the outputs of a run at the test budget
(``SAFE_OPTAX_NOTEBOOK_BUDGET=ci``, a few minutes on a CPU in all), made by this script:

  python notebooks/regenerate.py                       # every notebook
  python notebooks/regenerate.py quickstart.ipynb      # one

Each code cell's metadata keeps the hash of the source that made its outputs
(``source_sha256``): ``tests/test_notebooks.py`` fails, naming this command, when a cell
was edited after its outputs were made, and its slow tier runs the notebooks and compares
their outputs' structure and normalised text (:func:`signature`) with the stored ones.
What would differ between two runs on the same code is not stored: stderr (warnings,
progress bars), timing metadata and widget state; PNGs are re-encoded with a palette to keep
the files small. Data sets come through ``safe_optax.data_paths`` (``SAFE_OPTAX_DATA``).
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import io
import os
import pathlib
import re
from collections.abc import Mapping

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent
BUDGET_ENV = {"SAFE_OPTAX_NOTEBOOK_BUDGET": "ci", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
COMMAND = "python notebooks/regenerate.py"


def source_hash(source: str) -> str:
  """The hash a code cell's metadata keeps of the source that made its outputs."""
  return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def execute(path: pathlib.Path, env: Mapping[str, str]) -> nbformat.NotebookNode:
  """Runs the notebook top to bottom in a fresh kernel started with ``env``, its working
  directory the notebook's folder (as Jupyter's and Colab's); returns it executed (the
  file is not rewritten)."""
  nb = nbformat.read(path, as_version=4)
  # "python3" is ipykernel's native kernel: this interpreter, where safe_optax is installed.
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                          resources={"metadata": {"path": str(path.parent)}}).execute(env=env)
  return nb


def _small_png(data: str) -> str:
  """A base64 PNG re-encoded with a 256-colour palette (a plot has few colours)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  image = Image.open(io.BytesIO(base64.b64decode(data)))
  out = io.BytesIO()
  image.quantize(256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
  return base64.b64encode(out.getvalue()).decode("ascii")


def _kept(outputs: list) -> list:
  """``outputs`` without stderr, consecutive stdout chunks joined (the kernel flushes stdout
  on a timer, so a rerun may split the same text differently)."""
  kept = []
  for output in outputs:
    if output.output_type == "stream" and output.name == "stderr":
      continue
    if output.output_type == "stream" and kept and kept[-1].output_type == "stream":
      kept[-1].text += output.text
      continue
    kept.append(output)
  return kept


def store(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """Keeps what an executed notebook should commit: stdout and rich outputs (small PNGs),
  and each code cell's ``source_sha256``; drops stderr and widget state."""
  nb.metadata.pop("widgets", None)
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    cell.metadata.pop("execution", None)
    cell.metadata["source_sha256"] = source_hash(cell.source)
    cell.outputs = _kept(cell.outputs)
    for output in cell.outputs:
      data = output.get("data", {})
      data.pop("application/vnd.jupyter.widget-view+json", None)
      if "image/png" in data:
        data["image/png"] = _small_png(data["image/png"])
  return nb


# What a rerun on other hardware or in the other compile mode may print differently: numbers
# (timings, accuracies, versions), flags computed from them (whether a power iteration
# converged), temporary paths, object addresses, the backend's name.
_VOLATILE = [(re.compile(r"(/[\w.+-]+)+/?"), "<path>"),
             (re.compile(r"0x[0-9a-f]+"), "<address>"),
             (re.compile(r"\b(cpu|gpu|tpu|cuda|rocm)", re.I), "<backend>"),
             (re.compile(r"\b(True|False|true|false)\b"), "<bool>"),
             (re.compile(r"[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?"), "#"),
             (re.compile(r"\s+"), " ")]


def normalise(text: str) -> str:
  """``text`` with what a rerun may print differently replaced by placeholders."""
  for pattern, placeholder in _VOLATILE:
    text = pattern.sub(placeholder, text)
  return text.strip()


def signature(nb: nbformat.NotebookNode) -> list[tuple[str, ...]]:
  """Per code cell, what a rerun of the same code reproduces: each stored output's kind
  (stdout, or the MIME types of a rich output) and its normalised text."""
  rows = []
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    row = [cell.get("id", "")]
    for output in _kept(copy.deepcopy(cell.outputs)):
      if output.output_type == "stream":
        row.append(f"stdout: {normalise(output.text)}")
      elif output.output_type == "error":
        row.append(f"error: {output.ename}")
      else:
        data = output.get("data", {})
        kinds = sorted(set(data) - {"application/vnd.jupyter.widget-view+json"})
        text = normalise(data.get("text/plain", "")) if kinds == ["text/plain"] else ""
        row.append(f"{output.output_type} {' '.join(kinds)}: {text}".rstrip(": "))
    rows.append(tuple(row))
  return rows


def kernel_env() -> dict[str, str]:
  """This process's environment with the test budget, compiled as a user's run is (without
  the test suite's fast compile mode)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
  return {**env, **BUDGET_ENV}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  names = sorted(p.name for p in HERE.glob("*.ipynb"))
  parser.add_argument("notebooks", nargs="*", metavar="NAME",
                      help=f"notebooks to run (default: all of {', '.join(names)})")
  args = parser.parse_args()
  unknown = sorted(set(args.notebooks) - set(names))
  if unknown:
    parser.error(f"no such notebook in {HERE}: {', '.join(unknown)}")
  for name in args.notebooks or names:
    path = HERE / name
    nb = store(execute(path, kernel_env()))
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"{name}: {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
  main()
