"""The documentation: Sphinx builds with warnings as errors, covers the public API,
and the guide's examples run; public docstrings keep optax's form."""

import doctest
import inspect
import pathlib
import subprocess
import sys

import pytest

import safe_optax

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")

from sphinx.util.inventory import InventoryFile  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """Builds the HTML docs once; returns (output dir, completed process)."""
  out = tmp_path_factory.mktemp("docs_html")
  doctrees = tmp_path_factory.mktemp("doctrees")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-d", str(doctrees),
       str(DOCS), str(out)],
      capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
  )
  return out, proc


def _documented_names(out: pathlib.Path) -> set[str]:
  with open(out / "objects.inv", "rb") as f:
    inventory = InventoryFile.load(f, "", lambda base, uri: uri)
  names = set()
  for entries in inventory.values() if hasattr(inventory, "values") else inventory.data.values():
    names.update(entries)
  return names


def test_sphinx_build_has_no_warnings(built):
  out, proc = built
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-6000:]
  for page in ("index.html", "guide.html", "api.html", "changelog.html"):
    assert (out / page).is_file(), page


def test_api_reference_covers_the_public_api(built):
  out, proc = built
  assert proc.returncode == 0, proc.stderr[-3000:]
  names = _documented_names(out)
  from safe_optax import flax_utils  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import input_pipeline, models  # pylint: disable=import-outside-toplevel

  expected = {f"safe_optax.{name}" for name in safe_optax.__all__}
  expected |= {f"safe_optax.flax_utils.{name}" for name in flax_utils.__all__}
  expected |= {f"safe_optax.vision.models.{name}" for name in models.__all__}
  expected |= {
      f"safe_optax.vision.input_pipeline.{name}"
      for name, obj in vars(input_pipeline).items()
      if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
      and obj.__module__ == input_pipeline.__name__
  }
  missing = sorted(expected - names)
  assert not missing, f"not in the API reference: {missing}"
  # The rendered page carries the docstrings' maths and examples, not just names.
  api = (out / "api.html").read_text(encoding="utf-8")
  assert "SAFE+: SAFE with the generalized projection" in api
  assert api.count('class="doctest') >= len(_public_functions()), "doctest examples not rendered"
  assert 'class="math' in api, "maths not rendered"


def test_guide_examples_run():
  result = doctest.testfile(
      str(DOCS / "guide.md"), module_relative=False,
      optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False,
  )
  assert result.attempted >= 20
  assert result.failed == 0


def _public_functions():
  return [name for name in safe_optax.__all__
          if inspect.isfunction(getattr(safe_optax, name))]


@pytest.mark.parametrize("name", _public_functions())
def test_public_functions_have_optax_style_docstrings(name):
  """Summary line, Args, Returns and a doctest example, in that order."""
  doc = inspect.getdoc(getattr(safe_optax, name))
  assert doc, name
  summary = doc.splitlines()[0]
  assert summary.strip() and len(summary) <= 100, summary
  positions = [doc.find(section) for section in ("Args:", "Returns:", "Examples:")]
  assert all(p > 0 for p in positions), f"{name}: missing Args/Returns/Examples"
  assert positions == sorted(positions), f"{name}: sections out of order"
  assert ">>> " in doc[positions[2]:], name
