"""The two test tiers (CONTRIBUTING.md): the README's command runs the default tier, ``-m slow``
the slow tier, and the default tier still reaches every public module.

A test file whose every test is slow is a deliberate choice, listed below with the reason; a
public module that no default-tier test file imports is listed with the default-tier test that
runs it. Moving a test between tiers keeps these lists true.
"""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SLOW_ONLY_FILES = {
    "test_claims": "reruns committed evidence at its budget (the suite's largest cost)",
    "test_fault_injection": "kills child processes of both CLIs at random moments",
    "test_llm_real": "the real SmolLM2 weights and WikiText-2",
    "test_llm_data_parallel": "a pruning run over a two-device mesh, compared with one device",
    "test_train_methods": "a tiny vision run per method (the default tier trains SAFE through "
                          "test_cli's smoke run and every method's transform in test_conformance)",
    "test_finish": "finishing a trained run (the default tier finishes one in test_cli's smoke run)",
    "test_eval_paths": "evaluation paths on convolutional and ResNet runs",
}

# Public modules that no default-tier test file imports by name, and what runs them there.
REACHED_OTHERWISE = {
    "safe_optax.experimental": "its doctests (--doctest-modules)",
    "safe_optax.plots": "its doctests (--doctest-modules)",
    "safe_optax.llm.sparsegpt": "test_llm_prune (prune --method sparsegpt)",
    "safe_optax.vision.corruption_functions": "test_corruptions (through vision.corruptions)",
    "safe_optax.vision.config_files": "test_vision_configs (loads every config file by path)",
}


def _is_slow(node: ast.expr) -> bool:
  return "pytest.mark.slow" in ast.unparse(node)


def _test_files() -> dict[str, ast.Module]:
  return {path.stem: ast.parse(path.read_text(encoding="utf-8"))
          for path in sorted((ROOT / "tests").glob("test_*.py"))}


def _default_tests(tree: ast.Module) -> list[str]:
  """The test functions of a file that the default tier runs (not marked slow)."""
  for node in tree.body:
    if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                             for t in node.targets) and _is_slow(node.value)):
      return []
  return [node.name for node in tree.body
          if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
          and not any(_is_slow(d) for d in node.decorator_list)]


def _imported(tree: ast.Module) -> set[str]:
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
  return names


def _public_modules() -> list[str]:
  modules = []
  for path in sorted((ROOT / "safe_optax").rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    if not any(part.startswith("_") for part in parts):
      modules.append(".".join(parts))
  return modules


def test_the_default_command_deselects_the_slow_tier(pytestconfig):
  addopts = pytestconfig.getini("addopts")  # split as the shell would
  assert addopts[addopts.index("-m") + 1] == "not slow"
  assert "--durations=20" in addopts  # growth shows in every run's slowest tests
  assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))


def test_slow_only_files_are_the_declared_ones():
  slow_only = {name for name, tree in _test_files().items() if not _default_tests(tree)}
  assert slow_only == set(SLOW_ONLY_FILES), (
      f"newly slow-only: {sorted(slow_only - set(SLOW_ONLY_FILES))}; "
      f"no longer slow-only: {sorted(set(SLOW_ONLY_FILES) - slow_only)}")


def test_every_public_module_is_reached_by_the_default_tier():
  imported = set()
  for tree in _test_files().values():
    if _default_tests(tree):
      imported |= _imported(tree)
  unreached = [m for m in _public_modules()
               if m not in imported and not any(m == r or m.startswith(r + ".")
                                                for r in REACHED_OTHERWISE)]
  assert not unreached, unreached
  for module in REACHED_OTHERWISE:
    assert any(m == module or m.startswith(module + ".") for m in _public_modules()), module


@pytest.mark.parametrize("source, slow", [
    ("import pytest\n@pytest.mark.slow\ndef test_a():\n  pass\ndef test_b():\n  pass\n", False),
    ("import pytest\npytestmark = pytest.mark.slow\ndef test_a():\n  pass\n", True),
    ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.xla_optimized]\n"
     "def test_a():\n  pass\n", True),
    ("import pytest\n@pytest.mark.slow\ndef test_a():\n  pass\n", True),
])
def test_the_tier_reader_sees_function_and_file_marks(source, slow):
  assert (not _default_tests(ast.parse(source))) == slow


def test_the_longest_test_files_run_first_each_file_in_one_piece(tmp_path, monkeypatch,
                                                                 pytestconfig):
  import types  # pylint: disable=import-outside-toplevel
  import conftest  # pylint: disable=import-outside-toplevel
  durations = tmp_path / "durations.json"
  durations.write_text(json.dumps({"tests/test_b.py::test_long": 30.0, "tests/test_a.py::*": 0.5,
                                   "tests/test_c.py::test_one": 4.0}))
  monkeypatch.setattr(conftest, "DURATIONS", durations)
  names = ["tests/test_a.py::test_1", "tests/test_a.py::test_2", "tests/test_b.py::test_short",
           "tests/test_b.py::test_long", "tests/test_c.py::test_one", "tests/test_new.py::test_x"]
  items = [types.SimpleNamespace(nodeid=n, path=pathlib.Path(n.split("::")[0])) for n in names]
  conftest.pytest_collection_modifyitems(None, items)
  # b: 30 + an unrecorded test (0.5); c: 4; a: 2 x 0.5; new: one unrecorded test.
  assert [i.nodeid for i in items] == [
      "tests/test_b.py::test_short", "tests/test_b.py::test_long", "tests/test_c.py::test_one",
      "tests/test_a.py::test_1", "tests/test_a.py::test_2", "tests/test_new.py::test_x"]
  assert conftest.UNRECORDED_SECONDS == 0.5
  # xdist would otherwise reorder the files by their number of tests.
  assert "--no-loadscope-reorder" in pytestconfig.getini("addopts")
