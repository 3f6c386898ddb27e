"""Test configuration: a hypothesis profile sized for a 2-core CPU.

Every new leaf shape or static argument costs a jit compilation (about 1-3 s
for the radix-select kernels on CPU), so property tests draw from a small set
of tree templates and keep the example count modest.

Most of a trainer test's time is XLA compiling small programs, many of them
the same program in another test of the same file (the tiny trainer's
evaluation, projection, BatchNorm and initialisation steps under every method).
So each test process keeps a persistent JAX compilation cache of its own: a
fresh folder, deleted at the end, used by that process alone (subprocesses
that tests start do not inherit it, so no two processes ever read and write
one folder). The cache key is the program, the compile options, the XLA flags
and the JAX version, so a hit is the executable a compile would give. Set
``SAFE_OPTAX_TEST_JAX_CACHE=0`` to compile everything afresh.
"""

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

_OWNED = pytest.StashKey[str]()  # this process's cache folder (deleted at the end)


def pytest_configure(config):
  """Gives this process its own compilation cache (see the module docstring)."""
  switch = os.environ.get("SAFE_OPTAX_TEST_JAX_CACHE", "1")
  if switch not in ("0", "1"):
    raise pytest.UsageError(f"SAFE_OPTAX_TEST_JAX_CACHE={switch!r}: use 1 (the default) or 0")
  if switch == "0":
    return
  import jax  # pylint: disable=import-outside-toplevel
  if jax.config.jax_compilation_cache_dir:  # the caller's own cache
    return
  folder = tempfile.mkdtemp(prefix="safe_optax_test_jax_cache_")
  config.stash[_OWNED] = folder
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  folder = config.stash.get(_OWNED, None)
  if folder:
    shutil.rmtree(folder, ignore_errors=True)


settings.register_profile(
    "default",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
