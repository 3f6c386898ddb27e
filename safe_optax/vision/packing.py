"""Runs packed into one program: several runs of one configuration trained as one ``jax.vmap``.

A small model at batch 128 leaves most of a GPU idle (ResNet-20x2 on an H200
ran at a few percent of its peak). Runs that share one compiled program (the
same configuration but for the seed, for the methods whose optimizer does not
read the seed) are trained together: their :class:`~safe_optax.vision.train_state.TrainState`
trees are stacked along a leading run axis, and the packed step is
``jax.vmap`` of the lone run's :attr:`~safe_optax.vision.programs.Programs.train_step`
(and of its dual program), so each run keeps its own BatchNorm statistics,
SAM pass, projection, dual update, schedules, data order (its seed's
permutation, gathered on the host as a lone run gathers its batch) and
augmentation keys.

Each run's folder gets exactly what a lone ``train`` writes there:
``config.json``, Orbax checkpoints of its own (unstacked) state,
``metrics.jsonl``, TensorBoard events, and after the last step
:func:`safe_optax.vision.finish.finish`'s ``results.json``, plots and export.
A pack resumes from its runs' checkpoints (all at one step), and a lone
``train`` resumes a run that a pack started, and the other way round.

:func:`pack_key` is what must match; :func:`check_packable` refuses a pack
whose runs differ, naming the field; :func:`group` splits runs into packs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import numpy as np

from safe_optax import experiment
from safe_optax import methods
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import configs
from safe_optax.vision import datasets
from safe_optax.vision import finish as finish_lib
from safe_optax.vision import input_pipeline
from safe_optax.vision import metrics as metrics_lib
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import steps as steps_lib
from safe_optax.vision import train as train_lib
from safe_optax.vision import workdirs
from safe_optax.vision.train_state import zero_metrics

_LOG = logging.getLogger(__name__)


def pack_key(config: configs.Config) -> configs.Config:
  """The part of ``config`` that runs packed together share: all of it but the seed.

  The seed differs freely only where the optimizer does not read it
  (:attr:`~safe_optax.methods.Method.seeded`); the seed of a seeded method
  stays in the key, so its runs are not packed with other seeds.
  """
  if methods.get(config.method).seeded(config):
    return config
  return dataclasses.replace(config, seed=0)


def check_packable(runs: Sequence[configs.Config]) -> None:
  """Raises unless every config of ``runs`` shares one :func:`pack_key`.

  Raises:
    ValueError: no runs, or a run whose settings other than ``seed`` differ
      from the first run's; the message names the fields.
  """
  if not runs:
    raise ValueError("a pack needs at least one run, got none.")
  first = pack_key(runs[0])
  for i, config in enumerate(runs[1:], 1):
    differ = sorted(k for k, v in configs.to_dict(pack_key(config)).items()
                    if configs.to_dict(first)[k] != v)
    if differ:
      seeded = " (its optimizer reads the seed)" if differ == ["seed"] else ""
      raise ValueError(f"run {i} cannot be packed with run 0: {differ} differ{seeded}; a pack's "
                       "runs share every setting but the seed (use packing.group).")


def group(runs: Sequence[configs.Config], size: int) -> list[list[int]]:
  """Indices of ``runs`` split into packs of at most ``size`` that :func:`check_packable` accepts.

  Runs keep their order within a pack; packs are ordered by their first run.

  Examples:
    >>> c = configs.get_config("mlp-mnist", method="gmp", sparsity=0.9)
    >>> runs = [c.replace(seed=s) for s in range(3)] + [c.replace(method="admm")]
    >>> group(runs, 2)
    [[0, 1], [2], [3]]
  """
  methods.check_positive_int(size, "size")
  keyed: dict[configs.Config, list[int]] = {}
  for i, config in enumerate(runs):
    keyed.setdefault(pack_key(config), []).append(i)
  packs = [members[j:j + size] for members in keyed.values()
           for j in range(0, len(members), size)]
  return sorted(packs, key=lambda p: p[0])


def stack(states: Sequence[Any]) -> Any:
  """The trees ``states`` stacked along a new leading (run) axis."""
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)


def unstack(state: Any, i: int) -> Any:
  """Run ``i`` of a stacked tree."""
  return jax.tree.map(lambda x: x[i], state)


# id(programs) -> (programs, train, dual); Programs holds a Linen module, which is not hashable.
_PACKED: dict[int, tuple[programs_lib.Programs, Any, Optional[Any]]] = {}


def packed_programs(programs: programs_lib.Programs) -> tuple[Any, Optional[Any]]:
  """``(train, dual)``: ``jax.vmap`` of ``programs``' train and dual steps over the run axis.

  ``train(states, images, labels, dual_due=...)`` takes per-run batches
  ``[runs, batch, ...]`` and donates ``states``; ``dual`` is ``None`` where
  ``programs.dual`` is. Built once per ``programs``.
  """
  cached = _PACKED.get(id(programs))
  if cached is not None and cached[0] is programs:
    return cached[1], cached[2]
  def train(states, images, labels, dual_due=None):
    return jax.vmap(functools.partial(programs.train_step, dual_due=dual_due))(
        states, images, labels)
  dual = (jax.jit(jax.vmap(programs.dual_step), out_shardings=programs.replicated)
          if programs.dual_step is not None else None)
  jitted = jax.jit(train, donate_argnums=0, out_shardings=programs.replicated,
                   static_argnames="dual_due")
  _PACKED[id(programs)] = (programs, jitted, dual)
  return jitted, dual


def train_packed(runs: Sequence[configs.Config], run_dirs: Sequence[os.PathLike], *,
                 data: input_pipeline.Dataset, checkpoint_seconds: Optional[float] = None,
                 stop_after_epoch: Optional[int] = None,
                 on_step: Optional[Callable[[int], None]] = None, progress: bool = False,
                 tensorboard: Optional[bool] = None) -> list[train_lib.Outcome]:
  """Trains ``runs[i]`` in ``run_dirs[i]`` as one packed program, then finishes each run.

  What :func:`~safe_optax.vision.train.train_and_evaluate` does for one run,
  for a pack: the same files in each folder, the same resume.

  Args:
    runs: configs that :func:`check_packable` accepts.
    run_dirs: one folder per run (``config.json``, ``checkpoints/``, ...).
    data: the loaded data set, shared by every run.
    checkpoint_seconds: also checkpoint every run after the first step that
      ends this many seconds after the last checkpoint (``None``: only every
      ``checkpoint_every`` epochs), so an interrupted lease loses at most
      about this long.
    stop_after_epoch: stop (with a checkpoint) once this many epochs are done.
    on_step: called with the step number after each step (on the host).
    progress: a tqdm bar.
    tensorboard: as :func:`~safe_optax.vision.train.train_and_evaluate`'s.

  Returns:
    One :class:`~safe_optax.vision.train.Outcome` per run. On
    ``KeyboardInterrupt`` every run's checkpoint of the last completed step is
    written and :class:`~safe_optax.vision.checkpoint.Interrupted` is raised.

  Raises:
    ValueError: the runs cannot be packed (the message names the differing
      field), their folders hold checkpoints of different steps, the run and
      folder counts differ, or several processes run (packs are one process).
  """
  wall_start = time.perf_counter()
  check_packable(runs)
  if len(run_dirs) != len(runs):
    raise ValueError(f"run_dirs has {len(run_dirs)} folders for {len(runs)} runs.")
  if jax.process_count() > 1:
    raise ValueError("a pack of runs trains in one process; run several processes with "
                     "train_and_evaluate instead.")
  run_dirs = [pathlib.Path(d) for d in run_dirs]
  for config, workdir in zip(runs, run_dirs):
    workdirs.claim_workdir(workdir, config)
    workdirs.raise_if_diverged(workdir)
  config = runs[0]
  num_train = len(data.train_labels)
  spe = input_pipeline.num_batches(num_train, config.batch_size)
  total_steps = config.epochs * spe
  programs = programs_lib.for_data(config, data)
  train, dual = packed_programs(programs)
  ckpts = [checkpoint_lib.Checkpointer(d / "checkpoints") for d in run_dirs]
  states = [programs.init(jax.random.PRNGKey(c.seed)) for c in runs]
  latest = [c.latest_step() for c in ckpts]
  if len(set(latest)) > 1:
    for c in ckpts:
      c.close()
    raise ValueError(f"the runs' checkpoints are at different steps {latest}: resume them "
                     "alone (train_and_evaluate) or in packs of one step.")
  if latest[0] is not None:
    states = [c.restore(latest[0], s) for c, s in zip(ckpts, states)]
    _LOG.info("pack of %d: resuming from step %d of %d", len(runs), latest[0], total_steps)
  state = jax.device_put(stack(states), programs.replicated)
  del states
  start_step = int(state.step[0])
  histories = [workdirs.read_history(d / "metrics.jsonl", start_step // spe) for d in run_dirs]
  for d, history in zip(run_dirs, histories):
    workdirs.write_history(d / "metrics.jsonl", history)
  if tensorboard is None:
    tensorboard = metrics_lib.tensorboard_available()
  boards = ([metrics_lib.TensorBoard(d / workdirs.TENSORBOARD_DIR, purge_step=start_step)
             for d in run_dirs] if tensorboard else [])
  seeds = [c.seed for c in runs]

  def save(step: int) -> None:
    for i, c in enumerate(ckpts):
      if c.latest_step() != step:
        c.save(step, unstack(state, i))

  step = start_step
  last_saved, saved_at = start_step, time.monotonic()
  bar = experiment.progress(total_steps, initial=start_step,
                            desc=f"{config.method}@{config.sparsity:g} x{len(runs)}",
                            enabled=progress)
  try:
    for epoch in range(start_step // spe, config.epochs):
      if stop_after_epoch is not None and epoch >= stop_after_epoch:
        break
      epoch_start = time.perf_counter()
      position = position_start = step - epoch * spe
      orders = [datasets.epoch_batches(num_train, config.batch_size, s, epoch) for s in seeds]
      for batch in zip(*(order[position:] for order in orders)):
        images = np.stack([data.train_images[idx] for idx in batch])
        labels = np.stack([data.train_labels[idx] for idx in batch])
        run_dual, due = programs_lib.plan(programs, config, step)
        with checkpoint_lib.sigint_deferred():  # as train_and_evaluate: the state is donated
          if run_dual:
            state = steps_lib.with_dual_step(state, dual(state))
          state = train(state, images, labels, dual_due=due)
        step += 1
        position += 1
        bar.update(1)
        if on_step is not None:
          on_step(step)
        if checkpoint_seconds is not None and time.monotonic() - saved_at >= checkpoint_seconds:
          save(step)
          last_saved, saved_at = step, time.monotonic()
      state = jax.block_until_ready(state)
      seconds = time.perf_counter() - epoch_start
      trained = sum(len(b) for b in orders[0][position_start:])
      problems = []
      for i, (c, workdir) in enumerate(zip(runs, run_dirs)):
        record = train_lib.epoch_record(programs, c, unstack(state, i), data, epoch, seconds,
                                        trained=trained, includes_compile=epoch == start_step // spe)
        histories[i].append(record)
        with open(workdir / "metrics.jsonl", "a", encoding="utf-8") as f:
          f.write(json.dumps(record) + "\n")
        if boards:
          boards[i].write(record)
        if not np.isfinite(record["train_loss"]):
          problems.append((workdir, i))
      state = state._replace(metrics=jax.device_put(
          stack([zero_metrics(programs.step_logger.empty())] * len(runs)), programs.replicated))
      if problems or (epoch + 1) % config.checkpoint_every == 0 or epoch + 1 == config.epochs:
        save(step)
        last_saved, saved_at = step, time.monotonic()
      for workdir, i in problems:
        workdirs.diverged(workdir, histories[i], step)
  except KeyboardInterrupt:
    if step != last_saved and train_lib.alive(state):
      save(step)
    saved = ckpts[0].latest_step()
    if saved is None:
      raise
    raise checkpoint_lib.Interrupted(saved, run_dirs[0] / "checkpoints") from None
  finally:
    bar.close()
    for c in ckpts:
      c.close()
    for board in boards:
      board.close()
  states = [unstack(state, i) for i in range(len(runs))]
  if step < total_steps:
    return [train_lib.Outcome(s, None, None, None) for s in states]
  outcomes = []
  for c, workdir, s, history in zip(runs, run_dirs, states, histories):
    # The pack's wall time: every run of it trained during all of it.
    sparse_params, model_state, results = finish_lib.finish(
        programs, c, s.params, s.model_state, data,
        [metrics_lib.without_step_rows(r) for r in history], workdir,
        wall_seconds=time.perf_counter() - wall_start)
    outcomes.append(train_lib.Outcome(s, sparse_params, model_state, results))
  return outcomes
