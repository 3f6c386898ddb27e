"""Packaging: one version everywhere, and a wheel + sdist that install and import.

``python -m build`` builds the sdist, then the wheel from the unpacked sdist
(so a file missing from the sdist breaks the wheel too). The wheel goes into
a fresh virtual environment that borrows the packages of the interpreter
running the tests (system Python or a venv) only for jax / optax / numpy (no
download); the import must come from the wheel.
"""

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest
from packaging.version import Version

import safe_optax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_has_a_single_source():
  tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
  with open(ROOT / "pyproject.toml", "rb") as f:
    pyproject = tomllib.load(f)
  project = pyproject["project"]
  assert "version" not in project and "version" in project["dynamic"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
      "attr": "safe_optax.__version__"}
  Version(safe_optax.__version__)  # raises for a non-PEP 440 version
  assert importlib.metadata.version("safe-optax") == safe_optax.__version__


def test_changelog_has_a_section_for_this_version():
  changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
  headings = re.findall(r"^## \[([^\]]+)\]", changelog, flags=re.M)
  assert headings, "CHANGELOG.md has no '## [version]' sections"
  version = Version(safe_optax.__version__)
  if version.is_prerelease or version.is_devrelease:
    assert headings[0] == "Unreleased"
    assert safe_optax.__version__ in changelog
  else:
    assert safe_optax.__version__ in headings
  # Keep a Changelog: every released section is dated, newest first.
  released = re.findall(r"^## \[([^\]]+)\] - (\d{4}-\d{2}-\d{2})$", changelog, flags=re.M)
  assert [Version(v) for v, _ in released] == sorted(
      (Version(v) for v, _ in released), reverse=True)
  # What a user needs per release, not the project's diary: a few dozen lines a section.
  sections = re.split(r"^## ", changelog, flags=re.M)[1:]
  long = {section.splitlines()[0]: len(section.splitlines()) for section in sections
          if len(section.splitlines()) > 60}
  assert not long, f"CHANGELOG sections over 60 lines: {long}"
  # Each version links to its tag, at the repository's one address.
  for version, _ in released:
    assert f"[{version}]: {repository_url()}/releases/tag/v{version}" in changelog, version


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
  pytest.importorskip("build")
  out = tmp_path_factory.mktemp("dist")
  # --no-isolation: the build backend (setuptools, wheel; in the dev extra) is
  # already installed, so nothing is downloaded and the test stays fast.
  proc = subprocess.run(
      [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
      capture_output=True, text=True, timeout=300, check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return out


@pytest.mark.slow
def test_build_produces_wheel_and_sdist(dist):
  version = safe_optax.__version__
  (wheel,) = dist.glob("*.whl")
  (sdist,) = dist.glob("*.tar.gz")
  assert wheel.name.startswith(f"safe_optax-{version}-") and wheel.name.endswith("-none-any.whl")
  assert sdist.name == f"safe_optax-{version}.tar.gz"
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    metadata = zf.read(f"safe_optax-{version}.dist-info/METADATA").decode()
  for module in ("__init__.py", "_projection.py", "_alias.py", "py.typed", "flax_utils.py",
                 "vision/models.py"):
    assert f"safe_optax/{module}" in names, module
  assert not any(n.startswith(("tests/", "benchmarks/", "docs/", "notebooks/")) for n in names)
  assert f"Version: {version}" in metadata
  assert "Provides-Extra: docs" in metadata and "Provides-Extra: corruptions" in metadata
  # Apache-2.0 requires shipping its text: in the wheel's dist-info and in the sdist.
  assert "License-Expression: Apache-2.0" in metadata
  assert f"safe_optax-{version}.dist-info/licenses/LICENSE" in names
  assert f"Project-URL: Repository, {repository_url()}" in metadata
  with tarfile.open(sdist) as tf:
    members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    license_text = tf.extractfile(f"safe_optax-{version}/LICENSE").read().decode()
  assert {"pyproject.toml", "README.md", "safe_optax/__init__.py", "LICENSE"} <= members
  assert "Apache License" in license_text and "Version 2.0" in license_text
  # The sdist holds what its own tests read (docs, notebooks, benchmarks, results, ...).
  read = paths_the_tests_read()
  assert {"benchmarks", "notebooks", "docs", "results", "CHANGELOG.md"} <= read
  missing = sorted(p for p in read if p not in members and not any(
      m.startswith(p + "/") for m in members))
  assert not missing, f"the sdist lacks {missing}, which tests read (MANIFEST.in)"


def paths_the_tests_read() -> set[str]:
  """The top-level files and folders the test files name as ``ROOT / "..."``."""
  read = set()
  for test in (ROOT / "tests").glob("*.py"):
    read.update(re.findall(r'ROOT / "(\.?\w[\w.-]*)"', test.read_text(encoding="utf-8")))
  return read


def repository_url() -> str:
  """The repository's one address: ``[project.urls] Repository`` in pyproject.toml."""
  tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]["urls"]["Repository"]


# Where a reader meets the address: install lines, badges and links.
_USER_FACING = ["README.md", "CHANGELOG.md", "CONTRIBUTING.md", "docs/*.md", "docs/*.rst",
                "notebooks/*.ipynb"]


def _user_facing_texts() -> dict[str, str]:
  return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
          for pattern in _USER_FACING for path in sorted(ROOT.glob(pattern))}


def test_every_address_of_the_repository_is_the_one_in_pyproject():
  url = repository_url()
  assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
  slug = url.removeprefix("https://github.com/")
  texts = _user_facing_texts()
  assert "README.md" in texts and any(k.startswith("notebooks/") for k in texts)
  # Any GitHub or Colab address of a repository called safe_optax, in any spelling.
  pattern = re.compile(r"(?:github\.com|colab\.research\.google\.com/github)/([\w.-]+/safe[_-]optax)\b",
                       flags=re.I)
  found = {(name, m.group(1)) for name, text in texts.items() for m in pattern.finditer(text)}
  wrong = sorted((name, s) for name, s in found if s != slug)
  assert not wrong, f"addresses other than {url}: {wrong}"
  assert f'safe-optax @ git+{url}' in texts["README.md"]
  # Each notebook opens in Colab from a badge that points at itself.
  for name, text in texts.items():
    if name.startswith("notebooks/"):
      assert f"colab.research.google.com/github/{slug}/blob/main/{name}" in text, name


@pytest.mark.parametrize("placeholder", [r"<repository URL>", r"<[^<>\s]*(?:url|URL)>", r"\bOWNER\b"])
def test_no_placeholder_where_a_user_reads(placeholder):
  hits = [(name, m.group(0)) for name, text in _user_facing_texts().items()
          for m in re.finditer(placeholder, text)]
  assert not hits, hits


def fresh_venv(venv: pathlib.Path) -> pathlib.Path:
  """A new venv at ``venv`` that borrows this interpreter's packages; returns its python.

  ``--system-site-packages`` would borrow the *base* Python's packages: run
  from a venv holding jax (the README's set-up), the new venv would not see
  it. Instead a ``.pth`` file adds this interpreter's ``sys.path`` entries as
  site directories (their own ``.pth`` files processed), after the venv's own
  site-packages, so what is installed into the venv is imported first. The
  checkout is left out (a venv inside it, such as ``.venv/``, is not), so
  ``safe_optax`` can only come from what is installed.
  """
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                 timeout=120)
  (site_dir,) = venv.glob("lib/python*/site-packages")
  borrowed = []
  for entry in sys.path:
    path = pathlib.Path(entry or ".").resolve()
    # The checkout's own folders are left out, but not a venv kept inside it (`.venv/`).
    in_checkout = (path == ROOT or ROOT in path.parents) and not (
        {"site-packages", "dist-packages"} & set(path.parts))
    if path.is_dir() and not in_checkout and str(path) not in borrowed:
      borrowed.append(str(path))
  # A .pth line starting with "import" is executed; it must be one line.
  (site_dir / "_borrowed_site_packages.pth").write_text(
      "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in borrowed) + "\n")
  return venv / "bin" / "python"


_NESTED = textwrap.dedent("""
    import pathlib, sys
    sys.path.insert(0, {tests!r})
    import test_packaging
    print(test_packaging.fresh_venv(pathlib.Path({inner!r})))
""")


@pytest.mark.slow
def test_fresh_venv_sees_the_packages_of_the_environment_running_the_tests(tmp_path):
  """Run from inside a venv, the test venv sees that venv's packages, not only the base's.

  The outer venv stands for a user's ``python -m venv`` + ``pip install -e
  .[dev]``: a package that only it holds (``only_in_outer_venv``) must be
  importable in the venv the wheel test builds, as jax is.
  """
  outer_python = fresh_venv(tmp_path / "outer")
  (outer_site,) = (tmp_path / "outer").glob("lib/python*/site-packages")
  (outer_site / "only_in_outer_venv.py").write_text("MARK = 42\n")
  script = _NESTED.format(tests=str(ROOT / "tests"), inner=str(tmp_path / "inner"))
  proc = subprocess.run([str(outer_python), "-c", script], capture_output=True, text=True,
                        cwd=tmp_path, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  inner_python = proc.stdout.strip().splitlines()[-1]
  check = ("import json, jax, only_in_outer_venv, sys; "
           "print(json.dumps([only_in_outer_venv.MARK, sys.prefix]))")
  proc = subprocess.run([inner_python, "-c", check], capture_output=True, text=True,
                        cwd=tmp_path, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  mark, prefix = json.loads(proc.stdout.strip().splitlines()[-1])
  assert mark == 42 and pathlib.Path(prefix).resolve() == (tmp_path / "inner").resolve()


@pytest.mark.slow
@pytest.mark.parametrize("artifact", ["*.whl", "*.tar.gz"], ids=["wheel", "sdist"])
def test_artifact_installs_and_imports_in_a_fresh_venv(dist, tmp_path, artifact):
  """The wheel, and the sdist built into a wheel by pip, each install and work."""
  (archive,) = dist.glob(artifact)
  venv = tmp_path / "venv"
  python = fresh_venv(venv)
  # The outer pip installs into the venv (--python); --no-deps/--no-index: the
  # dependencies come from the borrowed site-packages, nothing is fetched; the
  # sdist builds with this interpreter's setuptools (--no-build-isolation).
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
       "--no-index", "--no-build-isolation", "--force-reinstall", "--no-warn-conflicts",
       str(archive)],
      capture_output=True, text=True, timeout=300, check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  smoke = textwrap.dedent("""
      import importlib.metadata, json, pathlib, sys
      import jax.numpy as jnp
      import safe_optax, safe_optax.experimental
      sparse, masks = safe_optax.project_topk({'w': jnp.array([[3., -1.], [0.5, -4.]])}, 0.5)
      tx = safe_optax.safe(0.1, 0.5, penalty=1e-3, total_steps=10)
      print(json.dumps({
          "file": safe_optax.__file__, "prefix": sys.prefix,
          "version": safe_optax.__version__,
          "dist_version": importlib.metadata.version("safe-optax"),
          "kept": int(masks['w'].sum()), "w": sparse['w'].tolist(),
          "n_all": len(safe_optax.__all__),
          "typed": (pathlib.Path(safe_optax.__file__).parent / "py.typed").is_file(),
      }))
  """)
  # Run outside the checkout, and without a PYTHONPATH (a developer's may name a checkout), so
  # the working tree is not importable.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([str(python), "-c", smoke], capture_output=True, text=True,
                        cwd=tmp_path, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  info = json.loads(proc.stdout.strip().splitlines()[-1])
  site = pathlib.Path(info["file"]).resolve()
  assert pathlib.Path(info["prefix"]).resolve() == venv.resolve()
  assert venv.resolve() in site.parents, f"imported from {site}, not the {artifact}"
  assert ROOT not in site.parents
  assert info["version"] == info["dist_version"] == safe_optax.__version__
  assert info["kept"] == 2 and info["w"] == [[3.0, 0.0], [0.0, -4.0]]
  assert info["n_all"] == len(safe_optax.__all__) and info["typed"]
  assert (venv / "bin" / "safe-optax-demo").is_file()  # the console script entry point
  # The installed commands start (through safe_optax._entry, which checks their extra).
  for command in ("safe-optax-vision", "safe-optax-llm"):
    proc = subprocess.run([str(venv / "bin" / command), "--version"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"{command} {safe_optax.__version__}"
