"""Where safe_optax finds data sets on disk: one documented search path.

Loaders in ``safe_optax.vision`` and ``safe_optax.llm`` take explicit paths;
this module answers "where is data set X on this machine?" for the tests, the
notebooks and the benchmark scripts, so that none of them hard-codes a folder.
A name such as ``"mnist"`` or ``"wikitext-2-raw/wiki.test.raw"`` is looked up,
in order, under

1. every folder in the ``SAFE_OPTAX_DATA`` environment variable
   (``os.pathsep``-separated);
2. the user's cache, ``$XDG_CACHE_HOME/safe_optax`` (``~/.cache/safe_optax``);
3. ``../shared/data`` beside the checkout this package was imported from, when
   it is imported from a checkout (the project's CI layout; absent in a user's
   clone);
4. ``/usr/share/datasets``, where Debian's data packages install
   (``apt-get install dataset-fashion-mnist`` gives ``fashion-mnist``).

The first folder that holds the name wins. ``docs/data.md`` says where each
data set comes from.

Examples:
  >>> import os, pathlib, tempfile
  >>> from safe_optax import data_paths
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> (root / "mnist").mkdir()
  >>> before = os.environ.get("SAFE_OPTAX_DATA")
  >>> os.environ["SAFE_OPTAX_DATA"] = str(root)
  >>> data_paths.find("mnist") == root / "mnist"
  True
  >>> data_paths.find("no-such-set") is None
  True
  >>> if before is None: del os.environ["SAFE_OPTAX_DATA"]
  ... else: os.environ["SAFE_OPTAX_DATA"] = before
"""

from __future__ import annotations

import os
import pathlib

ENV_VAR = "SAFE_OPTAX_DATA"

# Where each data set the project uses comes from (docs/data.md has the same list).
SOURCES = {
    "mnist": "the official MNIST idx files (t10k-images-idx3-ubyte.gz, ...) in a folder `mnist`",
    "fashion-mnist": "`apt-get install dataset-fashion-mnist` (Debian), or the Fashion-MNIST "
                     "idx files in a folder `fashion-mnist`",
    "cifar10": "CIFAR-10 as `cifar10/cifar10_jpg.tar.gz` (train/<class>/*.jpg, test/...) or the "
               "official python pickles as `cifar10/cifar-10-batches-py`",
    "wikitext-2-raw": "the WikiText-2 (raw) test split as `wikitext-2-raw/wiki.test.raw`",
    "wikitext-2": "the WikiText-2 validation split as `wikitext-2/valid.txt`",
    "austen": "Jane Austen's novels as plain text in `austen/` (Debian r-cran-janeaustenr)",
}


def _checkout_data() -> list[pathlib.Path]:
  # <checkout>/safe_optax/data_paths.py -> <checkout>/../shared/data; an installed (not
  # editable) package has no checkout around it.
  checkout = pathlib.Path(__file__).resolve().parents[1]
  if not (checkout / "pyproject.toml").is_file():
    return []
  return [checkout.parent / "shared" / "data"]


def cache_dir() -> pathlib.Path:
  """The user's cache folder for safe_optax data (``$XDG_CACHE_HOME/safe_optax``)."""
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "safe_optax"


def search_path() -> list[pathlib.Path]:
  """The folders searched, in order (those that do not exist included)."""
  env = [pathlib.Path(p).expanduser() for p in os.environ.get(ENV_VAR, "").split(os.pathsep)
         if p]
  return [*env, cache_dir(), *_checkout_data(), pathlib.Path("/usr/share/datasets")]


def _check_name(name: str) -> pathlib.PurePosixPath:
  if not isinstance(name, str) or not name:
    raise ValueError(f"name must be a non-empty relative path such as 'mnist', got {name!r}")
  relative = pathlib.PurePosixPath(name)
  if relative.is_absolute() or ".." in relative.parts:
    raise ValueError(f"name must be a relative path inside a data folder, got {name!r}")
  return relative


def find(name: str) -> pathlib.Path | None:
  """The first ``folder / name`` on :func:`search_path` that exists, else None."""
  relative = _check_name(name)
  for folder in search_path():
    candidate = folder / relative
    if candidate.exists():
      return candidate
  return None


def missing_message(name: str) -> str:
  """One line saying that ``name`` was not found, where it was looked for and how to get it."""
  relative = _check_name(name)
  source = SOURCES.get(relative.parts[0], f"the data set `{name}`")
  searched = ", ".join(str(p) for p in search_path())
  return (f"data set {name!r} not found in {searched}; get {source} and put it in a folder named "
          f"by {ENV_VAR} (or {cache_dir()}); see docs/data.md")


def require(name: str) -> pathlib.Path:
  """Like :func:`find`, but raises ``FileNotFoundError`` with :func:`missing_message`."""
  path = find(name)
  if path is None:
    raise FileNotFoundError(missing_message(name))
  return path
