"""The suite's compile mode (tests/conftest.py): fast by default, full optimisations where marked.

The tests in this file run in order in one process (pytest-xdist sends a
file to one worker), so the last one sees what the marked one left behind.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

FAST = os.environ.get("SAFE_OPTAX_TEST_XLA", "fast") == "fast"
_CHILD = "import jax; print(jax.config.read('jax_disable_most_optimizations'))"


def _child_disables_optimizations() -> bool:
  out = subprocess.run([sys.executable, "-c", _CHILD], check=True, capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  return out.strip() == "True"


@jax.jit
def _affine(x):
  return x * 3.1 + 0.7


@pytest.mark.slow
def test_unmarked_tests_and_their_subprocesses_compile_without_optimisations():
  assert jax.config.read("jax_disable_most_optimizations") is FAST
  assert (os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1") is FAST
  assert _child_disables_optimizations() is FAST
  _affine(jnp.arange(4.0))  # compiled here, in this mode, for the marked test below


@pytest.mark.slow
@pytest.mark.xla_optimized
def test_a_marked_test_and_its_subprocesses_compile_as_a_users_run():
  assert jax.config.read("jax_disable_most_optimizations") is False
  assert "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ
  assert _child_disables_optimizations() is False
  x = jnp.linspace(-3.0, 3.0, 7)
  # The program compiled above in the other mode is not reused (caches cleared): it compiles
  # again, at another shape, and computes the same function.
  np.testing.assert_allclose(_affine(x), np.asarray(x) * 3.1 + 0.7, rtol=1e-6)


def test_the_mode_is_restored_after_a_marked_test():
  assert jax.config.read("jax_disable_most_optimizations") is FAST
  assert (os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1") is FAST


@pytest.mark.slow
def test_an_unknown_mode_is_refused_naming_the_variable_and_the_modes(tmp_path):
  env = {**os.environ, "SAFE_OPTAX_TEST_XLA": "quick", "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n0", "--co",
       "--rootdir", os.path.dirname(os.path.dirname(__file__)), __file__],
      capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
  assert done.returncode != 0
  assert "SAFE_OPTAX_TEST_XLA='quick'" in done.stderr + done.stdout
  assert "('fast', 'optimized')" in done.stderr + done.stdout


def test_the_fast_mode_turns_off_the_fusion_emitters_in_every_child():
  import conftest  # pylint: disable=import-outside-toplevel
  import process_launcher  # pylint: disable=import-outside-toplevel
  flags = os.environ.get("XLA_FLAGS", "").split()
  for flag in conftest.FAST_XLA_FLAGS:
    assert (flag in flags) is FAST
    # A child with forced devices keeps the suite's flags, once each.
    assert process_launcher.forced_devices_flags(2).split().count(flag) == int(FAST)
  assert "--xla_force_host_platform_device_count=2" in process_launcher.forced_devices_flags(2)


@pytest.mark.slow
def test_a_flag_that_xla_does_not_know_is_detected_before_it_aborts_a_test():
  import conftest  # pylint: disable=import-outside-toplevel
  assert conftest.xla_accepts(conftest.FAST_XLA_FLAGS)
  assert not conftest.xla_accepts(["--xla_no_such_flag_in_any_xla=1"])


@pytest.mark.slow
@pytest.mark.xla_default_codegen
def test_a_default_codegen_test_runs_where_xla_flags_lack_the_fast_flags():
  import conftest  # pylint: disable=import-outside-toplevel
  flags = os.environ.get("XLA_FLAGS", "").split()
  assert not set(conftest.FAST_XLA_FLAGS) & set(flags)
  # Run in a child process when this pytest run has the fast flags; here otherwise.
  assert (os.environ.get("SAFE_OPTAX_TEST_DEFAULT_CODEGEN_CHILD") == "1") is (
      FAST and conftest.xla_accepts(conftest.FAST_XLA_FLAGS))
