"""The dependency floors: pyproject.toml's lower bounds and .ci/floors.txt say the same versions.

.ci/run installs the package with ``-c .ci/floors.txt`` in a fresh virtual environment and runs
the default tier on exactly those versions (CONTRIBUTING.md), so a lower bound in
pyproject.toml is a version the suite has passed with only while the two files agree.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLOORS = ROOT / ".ci" / "floors.txt"


def _pyproject() -> dict:
  tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)


def _pins() -> dict[str, Version]:
  pins = {}
  for line in FLOORS.read_text(encoding="utf-8").splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)", line)
    assert m, f".ci/floors.txt: {line!r} is not name==version"
    name = canonicalize_name(m.group(1))
    assert name not in pins, f".ci/floors.txt pins {name} twice"
    pins[name] = Version(m.group(2))
  return pins


def _floors(requirements: list[str]) -> dict[str, Version | None]:
  """name -> the version after ``>=`` (None for a requirement without a lower bound)."""
  floors = {}
  for text in requirements:
    req = Requirement(text)
    lower = [s.version for s in req.specifier if s.operator == ">="]
    floors[canonicalize_name(req.name)] = Version(lower[0]) if lower else None
  return floors


def test_every_floor_of_the_core_and_the_dev_extra_is_pinned_to_its_lower_bound():
  project = _pyproject()["project"]
  declared = {**_floors(project["dependencies"]),
              **_floors(project["optional-dependencies"]["dev"])}
  pins = _pins()
  expected = {name: floor for name, floor in declared.items() if floor is not None}
  expected["jaxlib"] = expected["jax"]  # jaxlib is always jax's version
  assert pins == expected


def test_a_package_has_one_floor_in_every_extra():
  project = _pyproject()["project"]
  seen: dict[str, set] = {}
  for requirements in [project["dependencies"], *project["optional-dependencies"].values()]:
    for name, floor in _floors(requirements).items():
      if floor is not None:
        seen.setdefault(name, set()).add(floor)
  assert {name: floors for name, floors in seen.items() if len(floors) > 1} == {}


def test_ci_runs_the_default_tier_on_the_floors():
  """The README's test command (the default tier) in the virtual environment of the floors."""
  lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
  assert any('install -q --no-compile -c .ci/floors.txt -e ".[dev]"' in line for line in lines)
  assert any(line.endswith('venv/bin/python" -m pytest -q -n 2 || status=1') for line in lines)
