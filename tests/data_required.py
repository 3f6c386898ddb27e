"""Data sets for tests, found through ``safe_optax.data_paths`` (one documented place).

Outside CI a missing data set skips the test with a reason that says how to get
it; with ``SAFE_OPTAX_REQUIRE_DATA=1`` (``.ci/run`` sets it, and provides the
data) a missing data set fails the test instead, so CI cannot pass by skipping.
"""

import os
import pathlib

import pytest

from safe_optax import data_paths

REQUIRE_ENV = "SAFE_OPTAX_REQUIRE_DATA"


def require_data(name: str) -> pathlib.Path:
  """The path of data set ``name``; skips (or, under CI, fails) the test when it is absent."""
  path = data_paths.find(name)
  if path is None:
    message = data_paths.missing_message(name)
    if os.environ.get(REQUIRE_ENV) == "1":
      pytest.fail(f"{message} ({REQUIRE_ENV}=1: CI provides every data set)", pytrace=False)
    pytest.skip(message)
  return path
