"""Console-script entry points that check their extra before importing it.

``pip install safe-optax`` installs the optax transforms only; the commands
need an extra (``safe-optax[vision]``, ``[llm]``, ``[demo]``). Without it, the
command prints one line naming the extra and exits with status 2 instead of a
``ModuleNotFoundError`` traceback from deep inside the import. What an extra
holds is read from the installed package's own metadata (``pyproject.toml``'s
``[project.optional-dependencies]``), so the list lives in one place.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from collections.abc import Callable, Sequence
from typing import Optional

DISTRIBUTION = "safe-optax"
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]")


def extra_requirements(extra: str) -> list[str]:
  """Names of the distributions that ``safe-optax[extra]`` installs, from the package metadata.

  Returns an empty list where ``safe_optax`` runs from a source tree that was never installed
  (no metadata to read): the import itself then reports what is missing.
  """
  try:
    requires = importlib.metadata.requires(DISTRIBUTION) or []
  except importlib.metadata.PackageNotFoundError:
    return []
  names = []
  for line in requires:
    match = _REQUIREMENT.match(line)
    if match and match.group(2) == extra:
      names.append(match.group(1))
  return names


def missing_requirements(extra: str) -> list[str]:
  """The distributions of ``extra`` that are not installed, in the extra's order."""
  missing = []
  for name in extra_requirements(extra):
    try:
      importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      missing.append(name)
  return missing


def _run(prog: str, extra: str, target: str, argv: Optional[Sequence[str]]) -> int:
  missing = missing_requirements(extra)
  if missing:
    print(f"{prog}: error: this command needs the '{extra}' extra (missing: {', '.join(missing)}); "
          f"install it with: pip install \"safe-optax[{extra}]\"", file=sys.stderr)
    return 2
  module_name, function_name = target.split(":")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as err:
    # An extra's package that is installed under another distribution name, or broken.
    print(f"{prog}: error: cannot import {err.name!r}; install the '{extra}' extra with: "
          f"pip install \"safe-optax[{extra}]\"", file=sys.stderr)
    return 2
  main: Callable[[Optional[Sequence[str]]], int] = getattr(module, function_name)
  return main(argv)


def vision(argv: Optional[Sequence[str]] = None) -> int:
  """``safe-optax-vision``: :func:`safe_optax.vision.cli.main` once the ``vision`` extra is here."""
  return _run("safe-optax-vision", "vision", "safe_optax.vision.cli:main", argv)


def llm(argv: Optional[Sequence[str]] = None) -> int:
  """``safe-optax-llm``: :func:`safe_optax.llm.cli.main` once the ``llm`` extra is here."""
  return _run("safe-optax-llm", "llm", "safe_optax.llm.cli:main", argv)


def demo(argv: Optional[Sequence[str]] = None) -> int:
  """``safe-optax-demo``: :func:`safe_optax.demo.main` once the ``demo`` extra is here."""
  return _run("safe-optax-demo", "demo", "safe_optax.demo:main", argv)
