"""Writes tests/durations.json from JUnit XML reports; not a test module.

``tests/conftest.py`` starts the test files with the most recorded seconds
first (``--dist loadfile`` then ends each tier on short files, so the two test
processes finish together). Record after a change that moves a file's cost by
tens of seconds::

  python -m pytest -q -n 2 --junitxml=default.xml
  python -m pytest -q -n 2 -m slow --junitxml=slow.xml
  python tests/record_durations.py default.xml slow.xml

Tests of at least ``MIN_SECONDS`` are kept by name; each file's shorter tests
count as their mean (the key ``FILE::*``), and a test of a file with no record as
``conftest.UNRECORDED_SECONDS``.
"""

from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET

MIN_SECONDS = 0.2
OUT = pathlib.Path(__file__).with_name("durations.json")


def junit_nodeid(case: ET.Element) -> str:
  """The pytest node id of a JUnit test case (test functions in modules, and doctests)."""
  module = case.get("classname")
  if module.endswith(".md"):  # a markdown file's doctests (README.md)
    return f"{module}::{case.get('name')}"
  return module.replace(".", "/") + ".py::" + case.get("name")


def main(paths: list[str]) -> int:
  if not paths:
    print(__doc__)
    return 2
  seconds = {}
  for path in paths:
    for case in ET.parse(path).getroot().iter("testcase"):
      if case.find("skipped") is None:
        seconds[junit_nodeid(case)] = round(float(case.get("time")), 2)
  kept = {k: v for k, v in seconds.items() if v >= MIN_SECONDS}
  small: dict = {}
  for k, v in seconds.items():
    if v < MIN_SECONDS:
      small.setdefault(k.split("::")[0], []).append(v)
  for file, values in small.items():  # "FILE::*": the mean of the file's shorter tests
    kept[f"{file}::*"] = round(sum(values) / len(values), 3)
  kept = dict(sorted(kept.items()))
  OUT.write_text(json.dumps(kept, indent=0) + "\n", encoding="utf-8")
  print(f"{OUT.name}: {len(kept)} entries for {len(seconds)} tests, {sum(seconds.values()):.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
