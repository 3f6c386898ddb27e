"""Test configuration: a hypothesis profile sized for a 2-core CPU.

Every new leaf shape or static argument costs a jit compilation (about 1-3 s
for the radix-select kernels on CPU), so property tests draw from a small set
of tree templates and keep the example count modest.

Most of a trainer test's time is XLA compiling small programs, many of them
the same program in another test, in the other test process or in a
subprocess that a test starts (a CLI run of the tiny trainer compiles what the
in-process tests compiled). So one run of pytest keeps one persistent JAX
compilation cache: a fresh folder that the controlling process makes and
deletes at the end, passed to the test processes and every subprocess they
start through ``JAX_COMPILATION_CACHE_DIR`` (with the thresholds at zero, so
every program is kept). A caller who sets ``JAX_COMPILATION_CACHE_DIR`` keeps
that folder (``.ci/run`` gives both tiers one, so the slow tier starts from
what the default tier compiled). The cache key is the program, the compile
options, the XLA flags and the JAX version, so a hit is the executable a
compile would give. The cache runs without a size limit, so JAX takes no file
lock (a lock with eviction serialised the processes; benchmarks/perf/results/
test_suite_time.json, ``rejected``); an entry that another process is still
writing reads as a damaged zlib stream, which JAX reports as a warning and
compiles afresh. Set ``SAFE_OPTAX_TEST_JAX_CACHE=0`` to compile everything
afresh.

For the same reason the suite compiles with JAX's ``jax_disable_most_optimizations``
(XLA's backend optimisation level 0, no expensive LLVM passes: the switch JAX
made for smoke tests, and that Flax uses on its slow-compiling tests). Programs
compile faster and compute the same functions, rounded differently, so every
tolerance-based check holds. Subprocesses that tests start inherit it through
``JAX_DISABLE_MOST_OPTIMIZATIONS``. Tests marked ``xla_optimized`` (the claim
tests, which rerun committed evidence and hold it to margins that the rounding
of the committed run sets) compile with the optimisations a user gets, with
JAX's in-memory caches cleared on the way in and out so no program crosses
between the two settings (the persistent cache keys on the setting). Set
``SAFE_OPTAX_TEST_XLA=optimized`` to compile every test as a user's run does.

The fast mode also turns off XLA:CPU's MLIR fusion emitters
(``--xla_cpu_use_fusion_emitters=false`` in ``XLA_FLAGS``, which the test
processes and their subprocesses inherit; ``process_launcher.forced_devices_flags``
keeps it): XLA generates each fusion's code with its older elemental emitter,
which compiles the suite's small programs in about half the time (the tiny
trainer's eleven programs: 9.2 s of backend compiling against 4.5 s; the
default tier 249 s against 346 s of wall, run back to back,
benchmarks/perf/results/test_suite_time.json ``fusion_emitters``) and computes
the same functions. ``XLA_FLAGS`` is read once per process, so the tests
marked ``xla_optimized`` share it; their execution-bound runs took the same
time either way. A jaxlib whose XLA no longer knows the flag would abort on
it, so the controlling process first starts one child with it and leaves the
flag out (with a warning) if that child fails. A test that asserts what XLA's
default code generation does (two program structures equal bit for bit, the
HLO a user's compile gives) is marked ``xla_default_codegen``: under the fast
flags it runs in a child pytest process whose ``XLA_FLAGS`` lack them (the
elemental emitter rounds some fusions another way, by an ulp, in one of the
two programs).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
from hypothesis import HealthCheck, settings

_OWNED = pytest.StashKey[str]()  # the cache folder this process made (deleted at the end)
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_CACHE_THRESHOLDS = ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
_XLA_MODES = ("fast", "optimized")
_FAST_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
# XLA flags of the fast mode (module docstring), added to XLA_FLAGS by the controlling process.
FAST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
# Set in the child pytest process that runs one ``xla_default_codegen`` test (no fast flags).
_CHILD_ENV = "SAFE_OPTAX_TEST_DEFAULT_CODEGEN_CHILD"


def xla_accepts(flags) -> bool:
  """Whether a child process with ``flags`` added to ``XLA_FLAGS`` starts JAX's CPU backend.

  XLA aborts the process on a flag it does not know, so this is asked of a child.
  """
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()}
  done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, check=False)
  return done.returncode == 0


def _add_fast_xla_flags() -> None:
  """Adds ``FAST_XLA_FLAGS`` to ``XLA_FLAGS`` once per pytest run (xdist workers inherit it)."""
  if os.environ.get(_CHILD_ENV) == "1":
    return
  present = os.environ.get("XLA_FLAGS", "").split()
  missing = [f for f in FAST_XLA_FLAGS if f not in present]
  if not missing:
    return
  if not xla_accepts(missing):
    warnings.warn(f"this jaxlib's XLA refuses {missing}: the suite compiles without them")
    return
  os.environ["XLA_FLAGS"] = " ".join([*present, *missing])


def pytest_configure(config):
  """Sets the compile mode and the compilation cache of this pytest run (module docstring)."""
  config.addinivalue_line(
      "markers", "slow: the slow tier (claims, notebooks, fault injection, multi-process runs, the "
      "real LLM, packaging, long property tests): `python -m pytest -q -n 2 -m slow`; the README's "
      "command runs the rest (CONTRIBUTING.md)")
  config.addinivalue_line(
      "markers", "xla_optimized: compile with XLA's full optimisations even under the suite's "
      "fast compile mode (tests/conftest.py)")
  config.addinivalue_line(
      "markers", "xla_default_codegen: asserts what XLA's default CPU code generation does; "
      "runs in a child process without the suite's fast XLA flags (tests/conftest.py)")
  mode = os.environ.get("SAFE_OPTAX_TEST_XLA", "fast")
  if mode not in _XLA_MODES:
    raise pytest.UsageError(f"SAFE_OPTAX_TEST_XLA={mode!r}: use one of {_XLA_MODES}")
  if mode == "fast":
    if not hasattr(config, "workerinput"):  # the controlling process (workers inherit it)
      _add_fast_xla_flags()
    import jax  # pylint: disable=import-outside-toplevel
    os.environ[_FAST_ENV] = "1"  # for the subprocesses tests start
    jax.config.update("jax_disable_most_optimizations", True)
  switch = os.environ.get("SAFE_OPTAX_TEST_JAX_CACHE", "1")
  if switch not in ("0", "1"):
    raise pytest.UsageError(f"SAFE_OPTAX_TEST_JAX_CACHE={switch!r}: use 1 (the default) or 0")
  if switch == "0":
    return
  if _CACHE_ENV not in os.environ:  # the controlling process (or a run without xdist)
    folder = tempfile.mkdtemp(prefix="safe_optax_test_jax_cache_")
    config.stash[_OWNED] = folder
    os.environ[_CACHE_ENV] = folder  # test processes and their subprocesses inherit it
  for name in _CACHE_THRESHOLDS:
    os.environ.setdefault(name, "0")
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ[_CACHE_THRESHOLDS[0]]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ[_CACHE_THRESHOLDS[1]]))


def pytest_unconfigure(config):
  folder = config.stash.get(_OWNED, None)
  if folder:
    shutil.rmtree(folder, ignore_errors=True)


# Recorded seconds of the tests, from JUnit XML (tests/record_durations.py).
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
UNRECORDED_SECONDS = 0.5  # a test of a file with no record (a new file)


@pytest.hookimpl(trylast=True)  # after -m has deselected the other tier
def pytest_collection_modifyitems(config, items):
  """Test files with the most recorded seconds first, each file's tests in their order.

  With ``--dist loadfile`` (and xdist's reordering by test count turned off,
  ``--no-loadscope-reorder``), the two test processes take files in this order,
  so a long file never starts last while the other process has nothing left.
  """
  del config
  recorded = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.exists() else {}
  cost: dict = {}
  for item in items:
    file = item.nodeid.split("::")[0]
    seconds = recorded.get(item.nodeid, recorded.get(f"{file}::*", UNRECORDED_SECONDS))
    cost[item.path] = cost.get(item.path, 0.0) + seconds
  items.sort(key=lambda item: -cost[item.path])  # stable: a file's tests keep their order


_CHILD_OUTCOMES: dict = {}  # nodeid -> (outcome, text) of the xla_default_codegen children


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """Runs a test marked ``xla_default_codegen`` in a child pytest without the fast XLA flags.

  One child per test file: the first marked test of a file runs every selected
  marked test of that file, and each reports its own outcome from the child's
  JUnit XML.
  """
  if pyfuncitem.get_closest_marker("xla_default_codegen") is None:
    return None
  flags = os.environ.get("XLA_FLAGS", "").split()
  if not any(flag in FAST_XLA_FLAGS for flag in flags):
    return None  # this process compiles as XLA does by default: the test runs here
  if pyfuncitem.nodeid not in _CHILD_OUTCOMES:
    _run_default_codegen_child(pyfuncitem, [flag for flag in flags if flag not in FAST_XLA_FLAGS])
  outcome, text = _CHILD_OUTCOMES.pop(pyfuncitem.nodeid)
  if outcome == "skipped":
    pytest.skip(f"skipped in its child process: {text}")
  if outcome != "passed":
    pytest.fail(f"{pyfuncitem.nodeid} failed in a child process with XLA's default code "
                f"generation (tests/conftest.py):\n{text}", pytrace=False)
  return True


def _run_default_codegen_child(item, xla_flags: list[str]) -> None:
  import xml.etree.ElementTree as ET  # pylint: disable=import-outside-toplevel
  from record_durations import junit_nodeid  # pylint: disable=import-outside-toplevel
  ids = [i.nodeid for i in item.session.items
         if i.get_closest_marker("xla_default_codegen") is not None and i.path == item.path]
  env = {**os.environ, _CHILD_ENV: "1", "XLA_FLAGS": " ".join(xla_flags)}
  with tempfile.TemporaryDirectory() as folder:
    junit = os.path.join(folder, "junit.xml")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "", "--no-header", f"--junitxml={junit}",
         *ids], cwd=item.config.rootpath, env=env, capture_output=True, text=True, check=False)
    log = f"{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    cases = ET.parse(junit).getroot().iter("testcase") if os.path.exists(junit) else ()
    for case in cases:
      nodeid = junit_nodeid(case)
      bad = case.find("failure") if case.find("failure") is not None else case.find("error")
      if bad is not None:
        _CHILD_OUTCOMES[nodeid] = ("failed", (bad.text or bad.get("message") or "")[-6000:])
      elif case.find("skipped") is not None:
        _CHILD_OUTCOMES[nodeid] = ("skipped", case.find("skipped").get("message", ""))
      else:
        _CHILD_OUTCOMES[nodeid] = ("passed", "")
  for nodeid in ids:  # not run by the child at all (a collection error, a crash)
    _CHILD_OUTCOMES.setdefault(nodeid, ("failed", f"the child did not run it:\n{log}"))


@pytest.fixture(autouse=True)
def _xla_optimized(request):
  """Compiles a test marked ``xla_optimized`` with full optimisations (module docstring).

  The test's own body and its function-scoped fixtures only: a module-scoped
  fixture is set up before this one, in the suite's mode (the marked files'
  module fixtures read JSON, GGUF weights and text, and compile nothing that
  their tests compare).
  """
  import jax  # pylint: disable=import-outside-toplevel
  if (request.node.get_closest_marker("xla_optimized") is None
      or not jax.config.read("jax_disable_most_optimizations")):
    yield
    return
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  saved = os.environ.pop(_FAST_ENV, None)
  try:
    yield
  finally:
    if saved is not None:
      os.environ[_FAST_ENV] = saved
    jax.config.update("jax_disable_most_optimizations", True)
    jax.clear_caches()


settings.register_profile(
    "default",
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=300)
# The default tier's second run in .ci/run, on the dependency floors: every test runs, each
# property with fewer drawn examples (the full search ran minutes before on the latest versions;
# this run asks whether the oldest versions work at all).
settings.register_profile("floors", parent=settings.get_profile("default"), max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
