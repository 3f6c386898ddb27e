"""The console scripts (``safe_optax._entry``): an extra that is missing is named, exit status 2."""

import importlib.metadata
import sys

import pytest

from safe_optax import _entry


def _without(monkeypatch, *missing: str) -> None:
  """Make ``importlib.metadata`` report the distributions ``missing`` as not installed."""
  real = importlib.metadata.distribution

  def distribution(name):
    if name in missing:
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)

  monkeypatch.setattr(importlib.metadata, "distribution", distribution)


@pytest.mark.parametrize("extra", ["vision", "llm", "demo", "dev"])
def test_extras_are_read_from_the_installed_metadata(extra):
  requirements = _entry.extra_requirements(extra)
  assert requirements, f"no requirements found for the '{extra}' extra"
  # The dev extra installs every command's extra, so each name is an installed distribution.
  for name in requirements:
    importlib.metadata.distribution(name)
  assert _entry.missing_requirements(extra) == []


def test_the_vision_extra_no_longer_carries_the_corruption_packages():
  vision = {name.lower() for name in _entry.extra_requirements("vision")}
  assert "flax" in vision
  assert not vision & {"opencv-python-headless", "scikit-image", "scipy", "numba",
                       "imagecorruptions-imaug"}
  assert "imagecorruptions-imaug" in _entry.extra_requirements("corruptions")


@pytest.mark.parametrize("command, extra", [(_entry.vision, "vision"), (_entry.llm, "llm"),
                                             (_entry.demo, "demo")])
def test_a_command_without_its_extra_prints_one_line_naming_it(monkeypatch, capsys, command,
                                                               extra):
  missing = _entry.extra_requirements(extra)[0]
  _without(monkeypatch, missing)
  # The module behind the command must not even be imported.
  target = {"vision": "safe_optax.vision.cli", "llm": "safe_optax.llm.cli",
            "demo": "safe_optax.demo"}[extra]
  monkeypatch.delitem(sys.modules, target, raising=False)
  assert command(["--help"]) == 2
  out, err = capsys.readouterr()
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert f"pip install \"safe-optax[{extra}]\"" in lines[0] and missing in lines[0]
  assert target not in sys.modules


def test_an_unimportable_module_is_one_line_too(monkeypatch, capsys):
  # Installed under another distribution name, or broken: the import fails after the check.
  monkeypatch.setitem(sys.modules, "safe_optax.llm.cli", None)
  assert _entry.llm(["--help"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "safe-optax[llm]" in err, err


def test_with_its_extra_the_command_runs(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _entry.llm(["--help"])
  assert exit_info.value.code == 0
  assert "usage: safe-optax-llm" in capsys.readouterr().out


def test_no_metadata_means_no_check(monkeypatch):
  """Run from a source tree that was never installed, the import itself reports what is missing."""
  def requires(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "requires", requires)
  assert _entry.extra_requirements("vision") == []
  assert _entry.missing_requirements("vision") == []
