"""Multi-process runs on JAX's distributed runtime: join it, one global mesh, per-process input.

JAX runs one controller per process; every process runs the same program on
its own devices, and ``jax.devices()`` lists the devices of *all* processes
once :func:`initialize` has joined the runtime. A jitted step over arrays
sharded on a :func:`data_mesh` is then one program over the global mesh:
gradients, SAM's second pass, the projection and the dual update all see the
global batch, exactly as one process with as many devices would.

Input stays per process: each process builds only its rows of every global
batch (:func:`process_rows`) and :func:`global_batch` assembles the global
array without any process ever holding the whole batch
(``jax.make_array_from_process_local_data``).

How a process learns that it is one of several, first match wins:

1. explicit arguments (the CLIs' ``--coordinator``, ``--num-processes``,
   ``--process-id``);
2. the environment variables ``SAFE_OPTAX_COORDINATOR``,
   ``SAFE_OPTAX_NUM_PROCESSES`` and ``SAFE_OPTAX_PROCESS_ID``;
3. a cluster that JAX detects by itself (:func:`detected_cluster`: SLURM with
   more than one task, Open MPI's ``mpirun``, a multi-host Cloud TPU slice), for
   which ``jax.distributed.initialize()`` takes no arguments.

Otherwise the run is a single process and nothing is initialised. On CPU the
cross-process collectives need gloo, which :func:`initialize` selects.

Examples:
  >>> import numpy as np
  >>> from safe_optax import distributed
  >>> distributed.initialize()  # no flags, no variables, no cluster: one process
  1
  >>> mesh = distributed.data_mesh()
  >>> x = distributed.global_batch(mesh, np.arange(8.0).reshape(4, 2))
  >>> x.shape, distributed.process_rows(mesh, 4)
  ((4, 2), slice(0, 4, None))
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ENV_COORDINATOR = "SAFE_OPTAX_COORDINATOR"
ENV_NUM_PROCESSES = "SAFE_OPTAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SAFE_OPTAX_PROCESS_ID"
DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process joins a multi-process run.

  Attributes:
    coordinator: ``host:port`` of process 0's coordination service, or
      ``None`` to let JAX find it (a detected cluster).
    num_processes: processes in the run (``None``: from the cluster).
    process_id: this process's index in ``[0, num_processes)`` (likewise).
    source: where the settings came from: ``"arguments"``, ``"environment"``
      or the detected cluster's name.
  """

  coordinator: Optional[str]
  num_processes: Optional[int]
  process_id: Optional[int]
  source: str


def _as_int(value: Any, name: str) -> int:
  try:
    number = int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be an integer, got {value!r}.") from None
  if isinstance(value, float) and value != number:
    raise ValueError(f"{name} must be an integer, got {value!r}.")
  return number


def _checked(coordinator: Any, num_processes: Any, process_id: Any, names: tuple[str, str, str],
             source: str) -> Launch:
  given = {names[0]: coordinator, names[1]: num_processes, names[2]: process_id}
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(f"a multi-process launch needs all of {list(names)}; {missing} "
                     f"{'is' if len(missing) == 1 else 'are'} missing (got {given}).")
  host, sep, port = str(coordinator).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{names[0]} must be 'host:port' with a port in 1..65535, "
                     f"got {coordinator!r}.")
  n = _as_int(num_processes, names[1])
  if n < 1:
    raise ValueError(f"{names[1]} must be >= 1, got {num_processes!r}.")
  i = _as_int(process_id, names[2])
  if not 0 <= i < n:
    raise ValueError(f"{names[2]} must lie in [0, {n}) for {names[1]}={n}, got {process_id!r}.")
  return Launch(str(coordinator), n, i, source)


def detected_cluster(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
  """The multi-process cluster that ``jax.distributed.initialize()`` can join unaided, if any.

  Recognised: ``"slurm"`` (``SLURM_JOB_ID`` with ``SLURM_NTASKS`` > 1, i.e.
  an ``srun`` step of several tasks), ``"openmpi"`` (``OMPI_COMM_WORLD_SIZE``
  > 1, i.e. ``mpirun -n N``) and ``"tpu"`` (a multi-host Cloud TPU slice:
  ``TPU_WORKER_HOSTNAMES`` lists more than one host). A single-task SLURM job
  or a one-host TPU is one process: ``None``.

  Examples:
    >>> detected_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    'slurm'
    >>> detected_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    True
    >>> detected_cluster({"TPU_WORKER_HOSTNAMES": "t-0,t-1"})
    'tpu'
  """
  env = os.environ if environ is None else environ

  def count(name: str) -> int:
    try:
      return int(env.get(name, "1"))
    except ValueError:
      return 1

  if "SLURM_JOB_ID" in env and count("SLURM_NTASKS") > 1:
    return "slurm"
  if count("OMPI_COMM_WORLD_SIZE") > 1:
    return "openmpi"
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hosts) > 1:
    return "tpu"
  return None


def resolve_launch(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
                   process_id: Optional[int] = None, *,
                   environ: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
  """How to join the runtime (see the module docstring), or ``None`` for one process.

  Raises:
    ValueError: the arguments (or the variables) are given only in part, or
      are out of range; the message names them and the allowed values.

  Examples:
    >>> resolve_launch("127.0.0.1:1234", 2, 1)
    Launch(coordinator='127.0.0.1:1234', num_processes=2, process_id=1, source='arguments')
    >>> resolve_launch(environ={}) is None
    True
    >>> resolve_launch("127.0.0.1:1234", 2, 2)
    Traceback (most recent call last):
    ...
    ValueError: process_id must lie in [0, 2) for num_processes=2, got 2.
  """
  env = os.environ if environ is None else environ
  if (coordinator, num_processes, process_id) != (None, None, None):
    return _checked(coordinator, num_processes, process_id,
                    ("coordinator", "num_processes", "process_id"), "arguments")
  values = (env.get(ENV_COORDINATOR), env.get(ENV_NUM_PROCESSES), env.get(ENV_PROCESS_ID))
  if values != (None, None, None):
    return _checked(*values, (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID),
                    "environment")
  cluster = detected_cluster(env)
  if cluster is not None:
    return Launch(None, None, None, cluster)
  return None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout_seconds: int = 300) -> int:
  """Joins JAX's distributed runtime if this is a multi-process run; returns the process count.

  Call it first, before anything touches a JAX device. Calling it again
  (once joined) is a no-op. A launch of one process
  (``num_processes=1``) initialises nothing.

  Args:
    coordinator, num_processes, process_id: an explicit launch (all three or
      none); see :func:`resolve_launch` for the fall-backs.
    timeout_seconds: how long to wait for every process to join; a peer that
      never starts makes the others fail after this long instead of hanging.

  Returns:
    ``jax.process_count()``.
  """
  if jax.distributed.is_initialized():
    return jax.process_count()
  launch = resolve_launch(coordinator, num_processes, process_id)
  if launch is None or launch.num_processes == 1:
    return jax.process_count()
  # CPU devices need gloo for cross-process collectives; the setting does not affect GPU/TPU.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if launch.coordinator is None:
    jax.distributed.initialize(initialization_timeout=timeout_seconds)
  else:
    jax.distributed.initialize(coordinator_address=launch.coordinator,
                               num_processes=launch.num_processes,
                               process_id=launch.process_id,
                               initialization_timeout=timeout_seconds)
  return jax.process_count()


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
  """``--coordinator``, ``--num-processes`` and ``--process-id`` for a command line."""
  group = parser.add_argument_group(
      "multi-process launch", "all three, or none: then the SAFE_OPTAX_COORDINATOR / "
      "SAFE_OPTAX_NUM_PROCESSES / SAFE_OPTAX_PROCESS_ID variables, or the cluster JAX detects "
      "(SLURM, Open MPI, Cloud TPU), or one process")
  group.add_argument("--coordinator", metavar="HOST:PORT",
                     help="process 0's address and a free port, the same in every process "
                          "(default: from the launch variables or the cluster, else one process)")
  group.add_argument("--num-processes", type=int, metavar="N",
                     help="processes in the run (default: as --coordinator)")
  group.add_argument("--process-id", type=int, metavar="I",
                     help="this process's index in 0..N-1, 0 writes the outputs "
                          "(default: as --coordinator)")


def initialize_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """:func:`initialize` from :func:`add_launch_arguments`' flags; errors name the flags."""
  try:
    return initialize(args.coordinator, args.num_processes, args.process_id)
  except ValueError as err:
    parser.error(re.sub(r"\b(coordinator|num_processes|process_id)\b",
                        lambda m: "--" + m.group(1).replace("_", "-"), str(err)))
    raise  # parser.error exits; this line only tells type checkers so


def is_primary() -> bool:
  """True in the process that writes logs, metrics, plots and results (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process has reached the barrier ``name`` (nothing in one process).

  For files: process 0 writes, the others wait here before they read.
  """
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def data_mesh(devices: Optional[list[Any]] = None) -> Mesh:
  """A 1-D mesh with axis ``'data'`` over every device of every process (or ``devices``).

  ``jax.devices()`` orders devices by process, so each process's devices hold
  one contiguous block of rows of a batch sharded over ``'data'``.
  """
  return Mesh(np.asarray(jax.devices() if devices is None else devices), (DATA_AXIS,))


# Both are asked for every step with the same (mesh, size): computed once per pair.
@functools.lru_cache(maxsize=64)
def batch_sharding(mesh: Mesh, size: int) -> NamedSharding:
  """Rows split over ``'data'``; a batch that does not split evenly is replicated instead."""
  spec = PartitionSpec(DATA_AXIS) if size % mesh.size == 0 else PartitionSpec()
  return NamedSharding(mesh, spec)


@functools.lru_cache(maxsize=64)
def process_rows(mesh: Mesh, size: int) -> slice:
  """The rows of a global batch of ``size`` that this process holds under :func:`batch_sharding`.

  Raises:
    ValueError: this process's devices do not hold one contiguous block (a
      mesh not built in ``jax.devices()`` order).
  """
  sharding = batch_sharding(mesh, size)
  if not sharding.spec:  # replicated: every process holds every row
    return slice(0, size)
  rows = sorted((idx[0].start or 0, size if idx[0].stop is None else idx[0].stop)
                for idx in sharding.addressable_devices_indices_map((size,)).values())
  for (_, stop), (start, _) in zip(rows, rows[1:]):
    if stop != start:
      raise ValueError(f"this process's devices hold rows {rows} of the batch: not one "
                       "contiguous block. Build the mesh with data_mesh().")
  return slice(rows[0][0], rows[-1][1])


def global_batch(mesh: Mesh, local: Any, size: Optional[int] = None) -> Any:
  """The global array(s) of a batch from this process's rows (a pytree of arrays).

  Args:
    mesh: the :func:`data_mesh`.
    local: this process's rows (``process_rows(mesh, size)`` of the global
      batch) of every leaf.
    size: the global batch size (default: the local size times the process
      count).
  """
  leaves, treedef = jax.tree.flatten(local)
  arrays, shapes, shardings = [], [], []
  for x in leaves:
    x = np.asarray(x)
    n = x.shape[0] * jax.process_count() if size is None else size
    rows = process_rows(mesh, n)
    if x.shape[0] != rows.stop - rows.start:
      raise ValueError(f"this process must give rows {rows.start}..{rows.stop} of the global "
                       f"batch of {n} ({rows.stop - rows.start} rows), got {x.shape[0]}.")
    arrays.append(x)
    shapes.append((n,) + x.shape[1:])
    shardings.append(batch_sharding(mesh, n))
  if jax.process_count() == 1:
    # The whole batch is here: one transfer for every leaf, the cheapest per-step path.
    out = jax.device_put(arrays, shardings)
  else:
    out = [jax.make_array_from_process_local_data(s, x, shape)
           for x, shape, s in zip(arrays, shapes, shardings)]
  return jax.tree.unflatten(treedef, out)


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole value (parameters, optimizer state, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


# ----------------------------------------------------------------------------- fixed-order sums
# A cross-device all-reduce sums in an order that depends on the device count, so
# one process and several disagree in the last bits. The functions below sum
# per-item values (one per calibration window, say) on one fixed binary tree
# instead: each process sums its contiguous block of items, which is a whole
# subtree, and the blocks' sums are gathered (a copy, exact) and combined on
# the same tree. Any power-of-two process count then gives the bits of one.


@jax.jit
def _add(a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: x + y, a, b)


def tree_sum(items: list[Any]) -> Any:
  """Sum of pytrees on the binary tree that halves ``[0, n)`` at ``n // 2``, recursively.

  Examples:
    >>> import numpy as np
    >>> items = [np.float32(v) for v in (1e8, 1.0, -1e8, 1.0)]
    >>> float(tree_sum(items))  # (1e8 + 1) + (-1e8 + 1); left to right would give 1.0
    0.0
  """
  if not items:
    raise ValueError("tree_sum needs at least one item.")
  if len(items) == 1:
    return items[0]
  mid = len(items) // 2
  return _add(tree_sum(items[:mid]), tree_sum(items[mid:]))


def process_items(count: int, what: str = "items") -> slice:
  """This process's contiguous block of ``count`` items for :func:`allgather_sum`.

  Raises:
    ValueError: the process count is not a power of two, or does not divide
      ``count`` (the blocks would not be subtrees of :func:`tree_sum`'s tree).
  """
  p = jax.process_count()
  if p & (p - 1) or count % p:
    raise ValueError(f"{count} {what} cannot be split over {p} processes in a fixed order: "
                     "the process count must be a power of two that divides it.")
  size = count // p
  return slice(jax.process_index() * size, (jax.process_index() + 1) * size)


def _allgather(tree: Any, tiled: bool) -> Any:
  if jax.process_count() == 1:
    return jax.tree.map(lambda x: np.asarray(x)[None] if not tiled else np.asarray(x), tree)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return multihost_utils.process_allgather(tree, tiled=tiled)


def allgather_sum(local_sum: Any) -> Any:
  """The sum over all items, given this process's :func:`tree_sum` of its :func:`process_items`.

  Every process gets the same bits, and so does one process summing all the
  items with :func:`tree_sum`.
  """
  if jax.process_count() == 1:
    return local_sum
  stacked = _allgather(local_sum, tiled=False)
  return tree_sum([jax.tree.map(lambda x, i=i: x[i], stacked)
                   for i in range(jax.process_count())])


def allgather_rows(local: Any) -> Any:
  """Every process's rows (its :func:`process_items` block), concatenated in process order."""
  return _allgather(local, tiled=True)
