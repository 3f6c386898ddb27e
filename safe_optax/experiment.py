"""What every experiment shares: versions, mean +- s.e., batch orders, progress bars, the loss.

The experiment layer (the digits demo, :mod:`safe_optax.vision`,
:mod:`safe_optax.llm`, the benchmarks) writes results that carry the
library versions and the device (:func:`versions`), summarises seeds as
mean +- standard error (:func:`mean_se`), shows tqdm bars
(:func:`progress`), trains classifiers with the mean softmax cross entropy
(:func:`cross_entropy`) and writes every output file whole or not at all
(:func:`atomic_write`). The fixed-size minibatch orders of the whole-run
``lax.scan`` trainers (the demo, ``benchmarks/claims/flatness_mlp.py``) are
:func:`batch_order`.

Nothing here knows a model or a method; nothing below the experiment layer
imports it.

Examples:
  >>> from safe_optax import experiment
  >>> experiment.mean_se([0.9, 0.8, 1.0])
  (0.9, 0.0577...)
  >>> experiment.batch_order(0, 10, batch_size=4, epochs=2).shape  # 2 full batches an epoch
  (4, 4)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import pathlib
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, Iterator, Optional

import jax
import numpy as np
import optax
from jax import lax

import safe_optax

_CORE_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
TMP_MARK = ".tmp"
"""What :func:`atomic_write` puts in a temporary file's name (``*.tmp*`` globs find leftovers)."""


def _version(name: str) -> Optional[str]:
  """The installed version of distribution (or import package) ``name``; ``None`` if absent."""
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    pass
  # An import name whose distribution is called otherwise (sklearn: scikit-learn).
  for distribution in metadata.packages_distributions().get(name, []):
    try:
      return metadata.version(distribution)
    except metadata.PackageNotFoundError:
      continue
  return None


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``; else :func:`platform.processor`).

  Recorded with every result: XLA compiles for the host CPU's instruction set,
  so the same program and seeds can round differently on another CPU model and
  a long training run can end a little elsewhere.
  """
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def versions(*packages: str) -> dict[str, Any]:
  """Library versions, the devices and the machine, for a results file.

  Args:
    *packages: further distributions (or import names, e.g. ``"sklearn"``)
      to record besides jax, jaxlib, flax, optax, orbax-checkpoint and numpy.

  Returns:
    ``{"python", <package>: version or None, "safe_optax", "backend",
    "device_kind", "device_count", "platform", "processor", "cpu_model",
    "cpu_count"}``.

  Examples:
    >>> found = versions("sklearn")
    >>> found["safe_optax"] == safe_optax.__version__, found["device_count"] >= 1
    (True, True)
    >>> versions("no-such-package-here")["no-such-package-here"] is None
    True
    >>> found["cpu_model"] == cpu_model() != ""
    True
  """
  devices = jax.devices()
  return {
      "python": platform.python_version(),
      **{name: _version(name) for name in dict.fromkeys(_CORE_PACKAGES + packages)},
      "safe_optax": safe_optax.__version__,
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_model": cpu_model(),
      "cpu_count": os.cpu_count(),
  }


def mean_se(values: Sequence[float]) -> tuple[float, Optional[float]]:
  """Mean and standard error of the mean (``None`` for a single value).

  Args:
    values: one number per seed.

  Returns:
    ``(mean, standard error)``; the error is ``std(ddof=1) / sqrt(n)``.

  Examples:
    >>> mean_se([0.9, 0.8, 1.0])
    (0.9, 0.0577...)
    >>> mean_se([0.5])
    (0.5, None)
  """
  arr = np.asarray(values, np.float64)
  if arr.size == 0:
    raise ValueError("`values` must hold at least one number, got none.")
  if arr.size < 2:
    return float(arr.mean()), None
  return float(arr.mean()), float(arr.std(ddof=1) / math.sqrt(arr.size))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross entropy of integer ``labels``: the classifiers' training loss.

  Examples:
    >>> import jax.numpy as jnp
    >>> float(cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3])))  # log 4
    1.386...
  """
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  """Full minibatches in one epoch of :func:`batch_order` (the remainder is left out).

  Examples:
    >>> steps_per_epoch(1000, 64)
    15
  """
  if batch_size < 1 or num_examples < batch_size:
    raise ValueError(f"`batch_size` must be in [1, num_examples={num_examples}], "
                     f"got {batch_size}.")
  return num_examples // batch_size


def batch_order(seed: int, num_examples: int, *, batch_size: int, epochs: int) -> np.ndarray:
  """Minibatch indices of every step, ``(epochs * steps_per_epoch, batch_size)`` int32.

  A fresh permutation of the examples per epoch, drawn on the host from
  ``seed`` (NumPy's PCG64); the last ``num_examples % batch_size`` examples of
  each permutation are left out of that epoch, so every batch has the same
  shape and a whole run is one ``lax.scan``.

  Args:
    seed: the run's data-order seed.
    num_examples: training examples.
    batch_size: examples per step.
    epochs: passes over the data.

  Returns:
    The int32 index array.

  Examples:
    >>> order = batch_order(3, 10, batch_size=4, epochs=1)
    >>> order.shape, len(set(order.ravel().tolist()))  # no example twice in an epoch
    ((2, 4), 8)
  """
  rng = np.random.default_rng(seed)
  steps = steps_per_epoch(num_examples, batch_size)
  order = [rng.permutation(num_examples)[:steps * batch_size] for _ in range(epochs)]
  return np.concatenate(order).reshape(-1, batch_size).astype(np.int32)


def scan_trainer(loss_fn: Callable[..., jax.Array], tx: optax.GradientTransformation, *,
                 uses_grad_fn: bool, epochs: int, steps_per_epoch: int) -> Callable[..., Any]:
  """A whole training run as one jitted ``lax.scan`` over every minibatch step.

  Args:
    loss_fn: ``loss_fn(params, x, y)``, the mean loss of a minibatch.
    tx: the optimizer (:func:`safe_optax.methods.make_optimizer`).
    uses_grad_fn: pass ``grad_fn`` (the same minibatch's gradient at other
      parameters) to ``tx.update``, for the SAM-style methods.
    epochs, steps_per_epoch: the run's length; the rows of ``order`` must
      number ``epochs * steps_per_epoch``.

  Returns:
    ``train(params, order, x, y) -> (params, opt_state, epoch_losses)``,
    jitted; ``order`` is :func:`batch_order`'s, ``epoch_losses`` the mean
    training loss of each epoch.

  Examples:
    >>> import jax.numpy as jnp
    >>> loss = lambda p, x, y: jnp.mean((x @ p - y) ** 2)
    >>> train = scan_trainer(loss, optax.sgd(0.1), uses_grad_fn=False, epochs=2,
    ...                      steps_per_epoch=2)
    >>> x, y = jnp.eye(4), jnp.arange(4.0)
    >>> params, _, losses = train(jnp.zeros(4), batch_order(0, 4, batch_size=2, epochs=2), x, y)
    >>> losses.shape, bool(losses[1] < losses[0])
    ((2,), True)
  """
  def train(params, order, x_train, y_train):
    def step(carry, idx):
      params, opt_state = carry
      xb, yb = x_train[idx], y_train[idx]
      loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
      if uses_grad_fn:
        grad_fn = lambda p, _: jax.grad(loss_fn)(p, xb, yb)  # same minibatch for SAM
        updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
      else:
        updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    (params, opt_state), losses = lax.scan(step, (params, tx.init(params)), order)
    return params, opt_state, losses.reshape(epochs, steps_per_epoch).mean(axis=1)

  return jax.jit(train)


class _Plain:
  """A progress bar without tqdm: a line per update, or nothing when disabled."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self.n, self.total, self.enabled = initial, total, enabled

  def update(self, k: int = 1) -> None:
    self.n += k
    if self.enabled:
      print(f"  {self.n}/{self.total}", file=sys.stderr, flush=True)

  def set_postfix_str(self, s: str) -> None:  # pylint: disable=unused-argument
    """tqdm's method; nothing to show."""

  def close(self) -> None:
    """tqdm's method; nothing to close."""


def progress(total: int, *, initial: int = 0, desc: Optional[str] = None, unit: str = "step",
             enabled: bool = True, leave: bool = True) -> Any:
  """A tqdm bar on stderr (a plain line per update if tqdm is missing).

  Args:
    total: the count at which the work is done.
    initial: where a resumed run starts.
    desc: the bar's label.
    unit: what one update counts.
    enabled: ``False`` shows nothing.
    leave: keep the finished bar on screen.

  Returns:
    An object with tqdm's ``update``, ``set_postfix_str`` and ``close``.

  Examples:
    >>> bar = progress(3, initial=1, enabled=False)  # a resumed run: 1 of 3 done
    >>> bar.n
    1
    >>> bar.close()
  """
  try:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return _Plain(total, initial, enabled)
  return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled,
              leave=leave, dynamic_ncols=True, file=sys.stderr)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""Values of ``--log-level``: the least severe message of the ``safe_optax`` loggers shown."""


def add_output_options(parser: Any) -> None:
  """Adds the commands' shared ``--no-progress`` and ``--log-level`` to an argparse parser or group.

  Every command spells them the same way: progress bars go to stderr unless
  ``--no-progress``; log messages of the ``safe_optax`` loggers from
  ``--log-level`` up (default INFO) go to stderr (:func:`configure_logging`).
  """
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bars (default: progress bars on stderr)")
  parser.add_argument("--log-level", choices=LOG_LEVELS, default="INFO", type=str.upper,
                      help="least severe log message written to stderr; WARNING silences the "
                           "informational ones (default: %(default)s)")


class _AboveProgressBars(logging.StreamHandler):
  """A stream handler that prints each record above the progress bars (``tqdm.write``)."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    except ImportError:
      super().emit(record)
      return
    try:
      tqdm.write(self.format(record), file=self.stream)
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)


def configure_logging(level: str, *, primary: bool = True) -> None:
  """Log messages of the ``safe_optax`` loggers from ``level`` up go to stderr.

  The root logger gets a stderr handler, which prints above any progress bar,
  unless it has one already (a program or a test harness that set up logging
  keeps its own); only ``safe_optax``'s loggers are lowered to ``level``, so
  other libraries' informational messages stay hidden. A process other than
  the primary one (process 0) shows warnings and errors only.

  Args:
    level: one of :data:`LOG_LEVELS`.
    primary: whether this is the process that reports (process 0).
  """
  if level not in LOG_LEVELS:
    raise ValueError(f"level must be one of {', '.join(LOG_LEVELS)}; got {level!r}")
  logging.basicConfig(format="%(levelname)s %(name)s: %(message)s",
                      handlers=[_AboveProgressBars(sys.stderr)])
  threshold = logging.getLevelName(level)
  logging.getLogger("safe_optax").setLevel(threshold if primary else
                                           max(threshold, logging.WARNING))


@contextlib.contextmanager
def atomic_write(path: os.PathLike) -> Iterator[pathlib.Path]:
  """Yields a temporary path beside ``path``, renamed onto ``path`` when the block ends.

  A reader sees either the old file or the whole new one, never a part: a
  run killed while writing leaves ``path`` as it was. The temporary name
  keeps the suffix (``model.tmp.safetensors``), so writers that append one
  (``np.savez``) use it as given; it is removed if the block raises
  (Ctrl-C included).

  Examples:
    >>> import tempfile
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "result.json"
    >>> with atomic_write(target) as tmp:
    ...   _ = tmp.write_text("{}")
    >>> target.read_text(), sorted(p.name for p in target.parent.iterdir())
    ('{}', ['result.json'])
  """
  path = pathlib.Path(path)
  tmp = path.with_name(f"{path.stem}{TMP_MARK}{path.suffix}")
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()
