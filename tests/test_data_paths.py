"""safe_optax.data_paths: the one documented place where data sets are found.

The search order is SAFE_OPTAX_DATA (several folders allowed), the user's
cache, ../shared/data beside a checkout, /usr/share/datasets; a test whose data
is missing skips with how to get it, and fails under SAFE_OPTAX_REQUIRE_DATA=1.
"""

import os
import pathlib

import pytest

from data_required import require_data
from safe_optax import data_paths


@pytest.fixture(name="homes")
def fixture_homes(tmp_path, monkeypatch):
  """Two SAFE_OPTAX_DATA folders and a cache folder, all empty, with the environment pointing at them."""
  first, second, cache = tmp_path / "first", tmp_path / "second", tmp_path / "xdg"
  for folder in (first, second, cache / "safe_optax"):
    folder.mkdir(parents=True)
  monkeypatch.setenv(data_paths.ENV_VAR, os.pathsep.join([str(first), str(second)]))
  monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
  return first, second, cache / "safe_optax"


def test_search_order_is_env_folders_then_cache_then_checkout_then_system(homes):
  first, second, cache = homes
  path = data_paths.search_path()
  assert path[:3] == [first, second, cache]
  assert path[-1] == pathlib.Path("/usr/share/datasets")
  checkout = pathlib.Path(data_paths.__file__).resolve().parents[1]
  assert (checkout.parent / "shared" / "data" in path) == (checkout / "pyproject.toml").is_file()


def test_the_first_folder_that_holds_the_name_wins(homes):
  first, second, cache = homes
  for folder in (second, cache):
    (folder / "mnist").mkdir()
  assert data_paths.find("mnist") == second / "mnist"
  (first / "mnist").mkdir()
  assert data_paths.find("mnist") == first / "mnist"
  (cache / "wikitext-2").mkdir()
  (cache / "wikitext-2" / "valid.txt").write_text("text")
  assert data_paths.find("wikitext-2/valid.txt") == cache / "wikitext-2" / "valid.txt"
  assert data_paths.require("wikitext-2/valid.txt") == cache / "wikitext-2" / "valid.txt"


def test_a_missing_data_set_says_where_it_looked_and_how_to_get_it(homes):
  first, _, cache = homes
  assert data_paths.find("fashion-mnist-nowhere") is None
  with pytest.raises(FileNotFoundError) as err:
    data_paths.require("cifar10/no-such-archive.tar.gz")  # absent even beside CI's checkout
  message = str(err.value)
  assert "\n" not in message
  assert str(first) in message and str(cache) in message
  assert data_paths.ENV_VAR in message and "docs/data.md" in message
  assert "CIFAR-10" in message  # the source of that data set


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../secret", "mnist/../../x", None, 3])
def test_names_outside_a_data_folder_are_refused(name):
  with pytest.raises(ValueError, match="name must be"):
    data_paths.find(name)


def test_tests_skip_without_data_and_fail_when_ci_requires_it(homes, monkeypatch):
  monkeypatch.delenv("SAFE_OPTAX_REQUIRE_DATA", raising=False)
  with pytest.raises(pytest.skip.Exception, match="SAFE_OPTAX_DATA"):
    require_data("no-such-data-set")
  monkeypatch.setenv("SAFE_OPTAX_REQUIRE_DATA", "1")
  with pytest.raises(pytest.fail.Exception, match="CI provides every data set"):
    require_data("no-such-data-set")
  (homes[0] / "no-such-data-set").mkdir()
  assert require_data("no-such-data-set") == homes[0] / "no-such-data-set"


def test_docs_list_every_data_set_the_locator_knows():
  docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text(
      encoding="utf-8")
  assert data_paths.ENV_VAR in docs and "SAFE_OPTAX_REQUIRE_DATA" in docs
  for name in data_paths.SOURCES:
    assert f"`{name}" in docs, name
