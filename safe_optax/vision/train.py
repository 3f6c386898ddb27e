"""Training and evaluation of the vision models with SAFE and the paper's baselines.

Shaped like the google/flax examples: a pure, jitted :func:`train_step`, an
:func:`evaluate`, and :func:`train_and_evaluate` (``config, workdir``) that
runs a whole experiment:

* the training set lives on the device; each step gathers its minibatch by
  index, augments it (pad 4, random crop, flip) and normalises it in JAX;
  the per-epoch order is a permutation fixed by ``(seed, epoch)`` and every
  example is used exactly once per epoch (the last batch may be short);
* data parallelism with :mod:`jax.sharding`: a 1-D ``Mesh`` over all local
  devices, the batch sharded over it, parameters and optimizer state
  replicated (``jax.jit`` does the cross-device means, SAM's second gradient
  included);
* SAM / SAFE steps keep the BatchNorm statistics of the clean pass
  (:mod:`safe_optax.flax_utils`);
* Orbax checkpoints after every epoch and on ``KeyboardInterrupt``; a run
  restarted in the same ``workdir`` resumes bit-exactly (same step, same data
  order, same augmentation keys);
* per-epoch JSONL metrics (loss, accuracies, ``||x - Proj(x)||`` and, for
  the ADMM-based methods, ``||x - z||``), then the final projection
  (:func:`safe_optax.finalize`), BatchNorm re-estimation on ``bnt_samples``
  training images (:func:`safe_optax.flax_utils.recalibrate_batch_stats`), a
  ``results.json`` and matplotlib plots.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import safe_optax
from safe_optax import experiment
from safe_optax import flax_utils
from safe_optax.experiment import cross_entropy
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import configs
from safe_optax.vision import input_pipeline
from safe_optax.vision import models
from safe_optax.vision import plots

Config = configs.Config

FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)
NORMALIZATION = {
    "cifar10": (input_pipeline.CIFAR10_MEAN, input_pipeline.CIFAR10_STD),
    "cifar100": (input_pipeline.CIFAR100_MEAN, input_pipeline.CIFAR100_STD),
    "mnist": (input_pipeline.MNIST_MEAN, input_pipeline.MNIST_STD),
    "fashion_mnist": (FASHION_MNIST_MEAN, FASHION_MNIST_STD),
}
# Methods whose optimizer carries an ADMMState (z, u): their ||x - z|| is logged.
_ADMM_METHODS = ("safe", "safe-plus", "admm", "safe-sg", "safe-multi")
# Methods that call grad_fn inside tx.update (SAM-style second gradients).
_GRAD_FN_METHODS = ("safe", "safe-plus", "safe-sg", "safe-multi", "imp-sam", "cram",
                    "cram-plus")
# Batches of training data whose mean gradient gives SAFE+'s final scores.
_SCORE_BATCHES = 8


class EpochMetrics(NamedTuple):
  """Running sums over the current epoch, kept on the device (no per-step syncs)."""

  loss_sum: jax.Array
  """Sum over examples of the training loss (clean pass)."""
  correct: jax.Array
  """Correctly classified training examples (clean pass, augmented)."""
  count: jax.Array
  """Training examples used so far in this epoch."""


def _zero_metrics() -> EpochMetrics:
  return EpochMetrics(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32),
                      jnp.zeros([], jnp.int32))


class TrainState(NamedTuple):
  """Everything that changes during training (what a checkpoint holds)."""

  step: jax.Array
  """Steps taken (int32); fixes the epoch and the position in it."""
  rng: jax.Array
  """The run's augmentation key; step ``t`` uses ``fold_in(rng, t)``."""
  params: Any
  """The ``'params'`` collection."""
  model_state: Any
  """The other collections, ``{'batch_stats': ...}`` or ``{}``."""
  opt_state: Any
  """The optax state."""
  metrics: EpochMetrics
  """Running sums of the current epoch."""


class Outcome(NamedTuple):
  """What :func:`train_and_evaluate` returns."""

  state: TrainState
  """The final (dense, unprojected) training state."""
  sparse_params: Any
  """``finalize(params)`` (the dense params for ``method='dense'``)."""
  model_state: Any
  """The model state after BatchNorm re-estimation of the sparse model."""
  results: Optional[dict[str, Any]]
  """The ``results.json`` content; ``None`` when stopped early."""


# ----------------------------------------------------------------------------- model, data


def create_model(config: Config, num_classes: int) -> nn.Module:
  """The Linen model of ``config.model``."""
  if config.model == "resnet8":
    return models.ResNet(blocks_per_stage=1, num_classes=num_classes, width=config.width)
  if config.model == "resnet20":
    return models.resnet20(num_classes, width=config.width)
  if config.model == "resnet32":
    return models.resnet32(num_classes, width=config.width)
  if config.model == "vgg19":
    return models.vgg19(num_classes)
  if config.model == "lenet5":
    return models.lenet5(num_classes)
  return models.MLP(features=tuple(config.mlp_features), num_classes=num_classes)


def load_dataset(config: Config, data_dir: os.PathLike) -> input_pipeline.Dataset:
  """Loads ``config.dataset`` from ``data_dir``, then applies subsets, label noise and the
  validation split.

  The training subset (a seeded sample), the test subset, the label noise and
  the validation split are drawn from ``config.data_seed``, so they are the
  same for every training seed. With ``config.validation`` the returned
  ``test_*`` arrays are the held-out training examples, not the test set.

  Raises:
    FileNotFoundError: ``data_dir`` is missing or lacks the expected files
      (the message lists them).
  """
  path = pathlib.Path(data_dir)
  if not path.exists():
    raise FileNotFoundError(f"--data-dir '{path}' does not exist.")
  if config.dataset in ("cifar10", "cifar100"):
    data = input_pipeline.load_cifar(path)
  else:
    data = input_pipeline.load_mnist(path, test_only_split=config.test_only_split,
                                     seed=config.data_seed)
  expected = {"cifar10": 10, "cifar100": 100, "mnist": 10, "fashion_mnist": 10}[config.dataset]
  if data.num_classes != expected:
    raise ValueError(f"'{path}' holds {data.num_classes} classes, but dataset "
                     f"{config.dataset!r} has {expected}.")
  train_x, train_y, test_x, test_y = (data.train_images, data.train_labels, data.test_images,
                                      data.test_labels)
  rng = np.random.default_rng([config.data_seed, 17])
  keep = input_pipeline.sample_indices(len(train_y), config.train_subset, rng)
  train_x, train_y = train_x[keep], train_y[keep]
  keep = input_pipeline.sample_indices(len(test_y), config.test_subset, rng)
  test_x, test_y = test_x[keep], test_y[keep]
  if config.label_noise > 0:
    train_y, _ = input_pipeline.symmetric_label_noise(train_y, config.label_noise,
                                                      data.num_classes, config.data_seed)
  if config.validation is not None:
    rest, held_out = input_pipeline.validation_split(len(train_y), config.validation,
                                                     config.data_seed)
    return input_pipeline.Dataset(train_x[rest], train_y[rest], train_x[held_out],
                                  train_y[held_out], data.classes)
  return input_pipeline.Dataset(train_x, train_y, test_x, test_y, data.classes)


def epoch_batches(num_examples: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
  """The minibatch indices of one epoch: every example exactly once, the last batch short.

  Examples:
    >>> batches = epoch_batches(10, 4, seed=0, epoch=0)
    >>> [len(b) for b in batches], sorted(np.concatenate(batches).tolist()) == list(range(10))
    ([4, 4, 2], True)
  """
  order = input_pipeline.epoch_order(num_examples, seed, epoch).astype(np.int32)
  return [order[i * batch_size:(i + 1) * batch_size]
          for i in range(input_pipeline.num_batches(num_examples, batch_size))]


def steps_per_epoch(config: Config, num_train: int) -> int:
  return input_pipeline.num_batches(num_train, config.batch_size)


# ----------------------------------------------------------------------------- optimizers


def learning_rate_schedule(config: Config, num_steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up for ``warmup_epochs``, then cosine decay to 0 at step ``epochs * spe``.

  optax's ``decay_steps`` is the length of the whole schedule, warm-up
  included, so the rate reaches 0 exactly when training ends (the official
  code passes the post-warm-up length and so trains its last 5 epochs at 0).
  """
  total = config.epochs * num_steps_per_epoch
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=config.warmup_epochs * num_steps_per_epoch, decay_steps=total, end_value=0.0)


def make_optimizer(config: Config, num_steps_per_epoch: int) -> optax.GradientTransformation:
  """The optax optimizer of ``config.method`` (SGD + momentum + weight decay base).

  * ``dense``: SGD only;
  * ``magnitude``: dense training, then one-shot magnitude pruning at the
    last step (:func:`safe_optax.magnitude_pruning` whose sparsity jumps from
    0 to the target there; no fine-tuning, as the paper's baselines);
  * ``safe`` / ``safe-plus`` / ``safe-sg`` / ``safe-multi``: the aliases with
    the cosine-ramped penalty; ``admm``: constant penalty, no SAM;
  * ``gmp``: magnitude pruning with a persistent mask on a cubic
    :func:`safe_optax.polynomial_sparsity` ramp over
    ``[gmp_begin_fraction, gmp_end_fraction]`` of training, masks every
    ``gmp_update_every`` steps;
  * ``imp-sam``: SAM, then magnitude pruning every ``imp_every_epochs``
    (capped at the ramp length) with a linear or cubic increase;
  * ``cram`` / ``cram-plus``: :func:`safe_optax.cram` before the base optimizer.
  """
  lr = learning_rate_schedule(config, num_steps_per_epoch)
  total = config.epochs * num_steps_per_epoch
  base = [optax.add_decayed_weights(config.weight_decay),
          optax.sgd(lr, momentum=config.momentum)]
  method, s = config.method, config.sparsity
  common = dict(total_steps=total, dual_every=config.dual_every, momentum=config.momentum,
                weight_decay=config.weight_decay, seed=config.seed)
  lam = config.resolved_penalty()
  if method == "dense":
    return optax.chain(*base)
  if method == "magnitude":
    last = max(total - 1, 1)
    at_end = lambda step: jnp.where(step >= last, jnp.float32(s), jnp.float32(0.0))
    return optax.chain(*base, safe_optax.magnitude_pruning(at_end, update_every=last))
  if method == "safe":
    return safe_optax.safe(lr, s, penalty=lam, penalty_schedule=config.penalty_schedule,
                           rho=config.rho, **common)
  if method == "safe-plus":
    return safe_optax.safe_plus(lr, s, penalty=lam, scores=config.saliency,
                                penalty_schedule=config.penalty_schedule, rho=config.rho,
                                **common)
  if method == "admm":
    admm_lam = lam if config.admm_penalty is None else config.admm_penalty
    return safe_optax.admm(lr, s, penalty=admm_lam, penalty_schedule="constant", **common)
  if method == "safe-sg":
    return safe_optax.safe_sg(lr, s, penalty=lam, penalty_schedule=config.penalty_schedule,
                              rho=config.rho, **common)
  if method == "safe-multi":
    return safe_optax.safe_multi(lr, config.multi_sparsities, penalty=lam,
                                 penalty_schedule=config.penalty_schedule, rho=config.rho,
                                 **common)
  if method in ("gmp", "imp-sam"):
    if method == "gmp":
      every = config.gmp_update_every
    else:
      every = config.imp_every_epochs * num_steps_per_epoch
    ramp_end = max(1, int(config.gmp_end_fraction * total))
    every = min(every, ramp_end)
    # Both ends on the mask-update grid, so masks change exactly when the sparsity does.
    begin = (int(config.gmp_begin_fraction * total) // every) * every
    end = max(begin + every, (ramp_end // every) * every)
    schedule = safe_optax.polynomial_sparsity(
        s, begin_step=begin, end_step=end, power=3 if method == "gmp" else config.imp_power,
        update_every=every)
    pruner = safe_optax.magnitude_pruning(schedule, update_every=every, update_until=end)
    head = [safe_optax.sam_perturb(config.rho)] if method == "imp-sam" else []
    return optax.chain(*head, *base, pruner)
  # cram / cram-plus
  return optax.chain(safe_optax.cram(config.rho, s, plus=method == "cram-plus"), *base)


# ----------------------------------------------------------------------------- steps


def prepare_images(images: jax.Array, key: Optional[jax.Array], mean: tuple[float, ...],
                   std: tuple[float, ...]) -> jax.Array:
  """uint8 batch -> normalised float32, with pad-crop-flip augmentation when ``key`` is set."""
  if key is not None:
    images = input_pipeline.random_crop_flip(key, images)
  return input_pipeline.normalize(images, mean, std)


def _batch_sharding(mesh: Mesh, size: int) -> NamedSharding:
  # A batch that does not split evenly (a short last batch) is replicated instead.
  spec = PartitionSpec("data") if size % mesh.size == 0 else PartitionSpec()
  return NamedSharding(mesh, spec)


def train_step(state: TrainState, images: jax.Array, labels: jax.Array, indices: jax.Array,
               *, apply_fn: Callable[..., Any], tx: optax.GradientTransformation,
               uses_grad_fn: bool, augment: bool, mean: tuple[float, ...],
               std: tuple[float, ...], mesh: Optional[Mesh] = None) -> TrainState:
  """One training step on ``images[indices]`` (pure; jit it with the keywords bound).

  The augmentation key is ``fold_in(state.rng, step)``, so a resumed run
  sees the same crops and flips. The clean pass updates the BatchNorm
  statistics; the SAM pass (``grad_fn``) reuses the same batch and drops its
  statistics.

  Args:
    state: the :class:`TrainState`.
    images, labels: the whole training set on the device (uint8, int32).
    indices: this minibatch's example indices.
    apply_fn, tx: the model's ``apply`` and the optimizer.
    uses_grad_fn: pass ``grad_fn`` to ``tx.update`` (SAM-style methods).
    augment: pad-crop-flip the batch.
    mean, std: normalisation constants.
    seed: the run's seed.
    mesh: the data-parallel mesh; the batch is sharded over its ``'data'`` axis.

  Returns:
    The new state (epoch metric sums updated).
  """
  key = jax.random.fold_in(state.rng, state.step)
  batch_images = images[indices]
  if mesh is not None:
    batch_images = jax.lax.with_sharding_constraint(
        batch_images, _batch_sharding(mesh, indices.shape[0]))
  batch = (prepare_images(batch_images, key if augment else None, mean, std), labels[indices])
  (loss, (logits, new_model_state)), grads = flax_utils.loss_and_grad_with_state(
      apply_fn, state.params, state.model_state, batch, cross_entropy)
  if uses_grad_fn:
    grad_fn = flax_utils.sam_grad_fn(apply_fn, state.model_state, batch, cross_entropy)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, grad_fn=grad_fn)
  else:
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
  n = indices.shape[0]
  correct = jnp.sum(jnp.argmax(logits, -1) == batch[1]).astype(jnp.int32)
  metrics = EpochMetrics(state.metrics.loss_sum + loss * n, state.metrics.correct + correct,
                         state.metrics.count + n)
  return TrainState(optax.safe_increment(state.step), state.rng,
                    optax.apply_updates(state.params, updates), new_model_state, opt_state,
                    metrics)


def eval_step(params: Any, model_state: Any, images: jax.Array, labels: jax.Array,
              valid: jax.Array, *, apply_fn: Callable[..., Any], mean: tuple[float, ...],
              std: tuple[float, ...]) -> tuple[jax.Array, jax.Array]:
  """``(correct, loss_sum)`` over the ``valid`` examples of a (padded) batch, inference mode."""
  logits = apply_fn({"params": params, **model_state}, prepare_images(images, None, mean, std),
                    train=False)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = jnp.sum(jnp.where(valid, jnp.argmax(logits, -1) == labels, False))
  return correct.astype(jnp.int32), jnp.sum(jnp.where(valid, losses, 0.0))


def evaluate(eval_fn: Callable[..., Any], params: Any, model_state: Any, images: np.ndarray,
             labels: np.ndarray, batch_size: int) -> dict[str, float]:
  """Accuracy and mean loss over a whole split, in fixed-size padded batches (one compile)."""
  correct, loss, n = 0, 0.0, len(labels)
  results = []
  for start in range(0, n, batch_size):
    x, y = images[start:start + batch_size], labels[start:start + batch_size]
    valid = np.ones(batch_size, bool)
    if len(y) < batch_size:
      pad = batch_size - len(y)
      valid[len(y):] = False
      x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
      y = np.concatenate([y, np.zeros(pad, y.dtype)])
    results.append(eval_fn(params, model_state, x, y, valid))
  for c, l in jax.device_get(results):
    correct += int(c)
    loss += float(l)
  return {"accuracy": correct / n, "loss": loss / n}


def distance_to_projection(params: Any, sparsity: float) -> jax.Array:
  """``||x - Proj(x)||_2`` at ``sparsity`` (only prunable leaves differ)."""
  projected, _ = safe_optax.project_topk(params, sparsity)
  return optax.tree.norm(jax.tree.map(jnp.subtract, params, projected))


# ----------------------------------------------------------------------------- the run


class _Programs(NamedTuple):
  model: nn.Module
  tx: optax.GradientTransformation
  mesh: Mesh
  replicated: NamedSharding
  init: Callable[..., Any]
  train: Callable[..., Any]
  eval: Callable[..., Any]
  distance: Optional[Callable[..., Any]]
  project: Optional[Callable[..., Any]]
  distance_to_z: Optional[Callable[..., Any]]
  prepare: Callable[..., Any]


def _programs(config: Config, num_train: int, num_classes: int,
              image_shape: tuple[int, ...]) -> _Programs:
  """The jitted functions of a configuration (cached, so repeated runs compile once).

  The seed only enters the optimizer of SAFE-Multi (its draws) and of the
  OBD saliency (its probes); other methods share programs across seeds.
  """
  if not (config.method == "safe-multi" or (config.method == "safe-plus"
                                            and config.saliency == "obd")):
    config = dataclasses.replace(config, seed=0)
  return _cached_programs(config, num_train, num_classes, image_shape)


@functools.lru_cache(maxsize=8)
def _cached_programs(config: Config, num_train: int, num_classes: int,
                     image_shape: tuple[int, ...]) -> _Programs:
  model = create_model(config, num_classes)
  spe = steps_per_epoch(config, num_train)
  tx = make_optimizer(config, spe)
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  replicated = NamedSharding(mesh, PartitionSpec())
  mean, std = NORMALIZATION[config.dataset]

  def init(key):
    init_key, data_key = jax.random.split(key)
    variables = model.init(init_key, jnp.zeros((1,) + image_shape, jnp.float32), train=False)
    model_state, params = flax.core.pop(dict(variables), "params")
    return TrainState(jnp.zeros([], jnp.int32), data_key, params, dict(model_state),
                      tx.init(params), _zero_metrics())

  step = functools.partial(
      train_step, apply_fn=model.apply, tx=tx, uses_grad_fn=config.method in _GRAD_FN_METHODS,
      augment=config.augment, mean=mean, std=std, mesh=mesh)
  evaluate_batch = functools.partial(eval_step, apply_fn=model.apply, mean=mean, std=std)
  sparsity = config.sparsity if config.sparsity > 0 else None
  return _Programs(
      model=model, tx=tx, mesh=mesh, replicated=replicated,
      init=jax.jit(init, out_shardings=replicated),
      train=jax.jit(step, donate_argnums=0, out_shardings=replicated),
      eval=jax.jit(evaluate_batch),
      distance=jax.jit(functools.partial(distance_to_projection, sparsity=sparsity))
      if sparsity else None,
      project=jax.jit(lambda p: safe_optax.finalize(p, sparsity)[0]) if sparsity else None,
      distance_to_z=jax.jit(safe_optax.constraint_distance)
      if config.method in _ADMM_METHODS else None,
      prepare=jax.jit(prepare_images, static_argnums=(2, 3)),
  )


def _bnt_batches(programs: _Programs, config: Config, images_dev: jax.Array,
                 num_train: int) -> Iterator[jax.Array]:
  """Augmented, normalised training batches covering ``bnt_samples`` examples once."""
  mean, std = NORMALIZATION[config.dataset]
  n = min(config.bnt_samples, num_train)
  # A data stream of its own: the pseudo-epoch just past the last training epoch.
  order = input_pipeline.epoch_order(num_train, config.seed, config.epochs)[:n].astype(np.int32)
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), config.epochs)
  for i, start in enumerate(range(0, n, config.batch_size)):
    batch = images_dev[order[start:start + config.batch_size]]
    yield programs.prepare(batch, jax.random.fold_in(key, i) if config.augment else None,
                           mean, std)


def _final_scores(programs: _Programs, config: Config, params: Any, model_state: Any,
                  images_dev: jax.Array, labels_dev: jax.Array, num_train: int) -> Any:
  """SAFE+'s final projection uses the same metric P as training (SNIP or OBD scores)."""
  mean, std = NORMALIZATION[config.dataset]
  order = input_pipeline.epoch_order(num_train, config.seed, config.epochs + 1).astype(np.int32)
  batches = [order[i * config.batch_size:(i + 1) * config.batch_size]
             for i in range(min(_SCORE_BATCHES, num_train // config.batch_size or 1))]
  apply_fn = programs.model.apply

  @jax.jit
  def scores(params, idx, key):
    batch = (prepare_images(images_dev[idx], None, mean, std), labels_dev[idx])
    grad_fn = flax_utils.sam_grad_fn(apply_fn, model_state, batch, cross_entropy)
    if config.saliency == "snip":
      return grad_fn(params, 0)
    return safe_optax.hutchinson_diagonal(grad_fn, params, key)

  total = None
  for i, idx in enumerate(batches):
    part = scores(params, idx, jax.random.PRNGKey(i))
    total = part if total is None else jax.tree.map(jnp.add, total, part)
  total = jax.tree.map(lambda t: t / len(batches), total)
  if config.saliency == "snip":
    return safe_optax.snip_scores(params, total)
  return safe_optax.obd_scores(params, total)


def _recalibrate(programs: _Programs, config: Config, params: Any, model_state: Any,
                 images_dev: jax.Array, num_train: int) -> Any:
  if not model_state:
    return model_state
  recalibrate = getattr(flax_utils, "recalibrate_batch_stats", None)
  if recalibrate is None:
    raise NotImplementedError("BatchNorm re-estimation needs "
                              "safe_optax.flax_utils.recalibrate_batch_stats.")
  return recalibrate(programs.model.apply, params, model_state,
                     _bnt_batches(programs, config, images_dev, num_train))


def train_and_evaluate(config: Config, workdir: os.PathLike, *, data_dir: os.PathLike,
                       dataset: Optional[input_pipeline.Dataset] = None,
                       stop_after_epoch: Optional[int] = None,
                       on_step: Optional[Callable[[int], None]] = None,
                       progress: bool = False, restart: bool = False) -> Outcome:
  """Trains ``config`` in ``workdir`` (resuming from its checkpoint), then evaluates.

  Args:
    config: a validated :class:`~safe_optax.vision.configs.Config`.
    workdir: output folder: ``checkpoints/``, ``metrics.jsonl``,
      ``results.json``, ``accuracy.png``, ``distance.png``.
    data_dir: where :func:`load_dataset` finds the data.
    dataset: an already loaded data set (skips ``data_dir``).
    stop_after_epoch: stop (with a checkpoint) once this many epochs are done.
    on_step: called with the step number after each step (on the host).
    progress: show tqdm progress bars.
    restart: discard what ``workdir`` holds (checkpoints, metrics, results)
      and train from scratch, whatever settings it was run with.

  A workdir is one run: the resolved config is written to ``config.json`` at
  the start, and a workdir whose run has other settings is refused (the
  error names them) unless ``restart``; with the same settings the run
  resumes from its last checkpoint.

  Returns:
    An :class:`Outcome`. On ``KeyboardInterrupt`` a checkpoint of the last
    completed step is written and
    :class:`~safe_optax.vision.checkpoint.Interrupted` (a ``KeyboardInterrupt``
    naming the step and the checkpoint folder) is raised.

  Raises:
    ValueError: ``workdir`` holds a run of other settings.
    TrainingDiverged: the training loss of an epoch was not finite (training
      stops at the end of that epoch; ``diverged.json`` records where).
  """
  wall_start = time.perf_counter()
  workdir = pathlib.Path(workdir)
  claim_workdir(workdir, config, restart=restart)
  data = dataset if dataset is not None else load_dataset(config, data_dir)
  num_train = len(data.train_labels)
  spe = steps_per_epoch(config, num_train)
  total_steps = config.epochs * spe
  programs = _programs(config, num_train, data.num_classes, tuple(data.train_images.shape[1:]))
  images_dev = jax.device_put(data.train_images, programs.replicated)
  labels_dev = jax.device_put(data.train_labels, programs.replicated)

  state = programs.init(jax.random.PRNGKey(config.seed))
  ckpt = checkpoint_lib.Checkpointer(workdir / "checkpoints")
  if (workdir / DIVERGED_FILE).exists():
    with open(workdir / DIVERGED_FILE, encoding="utf-8") as f:
      raise TrainingDiverged(**json.load(f))
  latest = ckpt.latest_step()
  if latest is not None:
    state = ckpt.restore(latest, state)
    print(f"{workdir}: resuming from step {latest} of {total_steps}", file=sys.stderr,
          flush=True)
  start_step = int(state.step)
  metrics_path = workdir / "metrics.jsonl"
  history = _read_history(metrics_path, start_step // spe)
  _write_history(metrics_path, history)

  epochs_run = 0
  last_saved = start_step
  bar = experiment.progress(total_steps, initial=start_step,
                            desc=f"{config.method}@{config.sparsity:g}", enabled=progress)
  try:
    for epoch in range(start_step // spe, config.epochs):
      if stop_after_epoch is not None and epoch >= stop_after_epoch:
        break
      epoch_start = time.perf_counter()
      position = position_start = int(state.step) - epoch * spe
      batches = epoch_batches(num_train, config.batch_size, config.seed, epoch)
      for indices in batches[position:]:
        state = programs.train(state, images_dev, labels_dev,
                               jax.device_put(indices, _batch_sharding(programs.mesh,
                                                                       len(indices))))
        position += 1
        bar.update(1)
        if on_step is not None:
          on_step(epoch * spe + position)
      state = jax.block_until_ready(state)
      epoch_seconds = time.perf_counter() - epoch_start
      record = _epoch_record(programs, config, state, data, epoch, epoch_seconds,
                             trained=sum(len(b) for b in batches[position_start:]),
                             includes_compile=epochs_run == 0)
      epochs_run += 1
      history.append(record)
      bar.set_postfix_str(f"loss {record['train_loss']:.3f} test {record.get('test_accuracy', 0):.3f}")
      with open(metrics_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
      if not np.isfinite(record["train_loss"]):
        _diverged(workdir, history, int(state.step))
      state = state._replace(metrics=jax.device_put(_zero_metrics(), programs.replicated))
      if (epoch + 1) % config.checkpoint_every == 0 or epoch + 1 == config.epochs:
        ckpt.save(int(state.step), state)
        last_saved = int(state.step)
  except KeyboardInterrupt:
    # An interrupt held back by ckpt.save arrives after that save committed
    # (before last_saved was updated): the checkpoint is already there.
    if int(state.step) != last_saved and ckpt.latest_step() != int(state.step):
      ckpt.save(int(state.step), state)
    saved = ckpt.latest_step()
    bar.close()
    ckpt.close()
    if saved is None:
      raise
    raise checkpoint_lib.Interrupted(saved, workdir / "checkpoints") from None
  except TrainingDiverged:
    bar.close()
    ckpt.close()
    raise
  bar.close()
  ckpt.close()
  if int(state.step) < total_steps:
    return Outcome(state, None, None, None)
  return _finish(programs, config, state, data, images_dev, labels_dev, history, workdir,
                 wall_seconds=time.perf_counter() - wall_start)


DIVERGED_FILE = "diverged.json"
_RUN_FILES = ("checkpoints", "metrics.jsonl", "results.json", "eval.json", "eval.md",
              "accuracy.png", "distance.png", DIVERGED_FILE)


class TrainingDiverged(RuntimeError):
  """The training loss stopped being finite; the run is stopped at the end of that epoch.

  Attributes:
    workdir: the run's folder (it keeps ``diverged.json``, so a rerun of the
      same settings reports the divergence again instead of retraining).
    step: the step count at the end of the epoch whose loss was not finite.
    last_finite_loss: the mean training loss of the last finite epoch
      (``None`` if the first epoch already diverged).
    last_finite_epoch: that epoch (``None`` likewise).
  """

  def __init__(self, workdir: str, step: int, last_finite_loss: Optional[float],
               last_finite_epoch: Optional[int]):
    self.workdir, self.step = workdir, step
    self.last_finite_loss, self.last_finite_epoch = last_finite_loss, last_finite_epoch
    last = ("no epoch had a finite loss" if last_finite_loss is None else
            f"last finite loss {last_finite_loss:.4g} in epoch {last_finite_epoch}")
    super().__init__(f"training diverged in '{workdir}': the training loss is not finite at "
                     f"step {step} ({last}); lower the learning rate or the penalty.")


def _diverged(workdir: pathlib.Path, history: list[dict[str, Any]], step: int) -> None:
  finite = [r for r in history if np.isfinite(r["train_loss"])]
  info = {"workdir": str(workdir), "step": step,
          "last_finite_loss": finite[-1]["train_loss"] if finite else None,
          "last_finite_epoch": finite[-1]["epoch"] if finite else None}
  with open(workdir / DIVERGED_FILE, "w", encoding="utf-8") as f:
    json.dump(info, f)
  raise TrainingDiverged(**info)


def claim_workdir(workdir: pathlib.Path, config: Config, *, restart: bool = False) -> None:
  """Makes ``workdir`` this run's: writes ``config.json``, refuses a run of other settings.

  Raises:
    ValueError: ``workdir`` holds a run (``config.json``, or the config of its
      ``results.json``) whose settings differ from ``config``; the message
      names them and the way to start over.
  """
  import shutil  # pylint: disable=import-outside-toplevel
  workdir.mkdir(parents=True, exist_ok=True)
  recorded = None
  for name, get in (("config.json", lambda d: d), ("results.json", lambda d: d["config"])):
    if (workdir / name).exists():
      with open(workdir / name, encoding="utf-8") as f:
        recorded = configs.from_dict(get(json.load(f)))
      break
  if recorded is None and (workdir / "checkpoints").exists():
    raise ValueError(f"workdir '{workdir}' holds checkpoints of a run without a config.json; "
                     "restart it (restart=True, CLI --restart) or use another workdir.")
  if recorded is not None and recorded != config:
    if not restart:
      old, new = configs.to_dict(recorded), configs.to_dict(config)
      differ = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in sorted(new)
                         if old.get(k) != new[k])
      raise ValueError(f"workdir '{workdir}' holds a run with other settings ({differ}); "
                       "use another workdir, or restart=True (CLI --restart) to discard it.")
  if restart:
    for name in _RUN_FILES:
      path = workdir / name
      if path.is_dir():
        shutil.rmtree(path)
      elif path.exists():
        path.unlink()
  with open(workdir / "config.json", "w", encoding="utf-8") as f:
    json.dump(configs.to_dict(config), f, indent=1)
    f.write("\n")


def _throughput(history: list[dict[str, Any]]) -> dict[str, Any]:
  """Training images and seconds of the whole run, from its per-epoch records.

  Summed over every process that trained a part of the run (resumes included),
  so finishing a run again (``evaluate_workdir`` does) keeps its record. The
  steady rate leaves out each process's first epoch, which compiles the step.
  """
  def rate(records):
    seconds = sum(r["epoch_seconds"] for r in records)
    return sum(r["trained_images"] for r in records) / seconds if seconds else None

  # Records written before these fields existed: every example once, epoch 0 compiling.
  records = [{"trained_images": r.get("trained_images", r["train_examples"]),
              "epoch_seconds": r["epoch_seconds"],
              "includes_compile": r.get("includes_compile", r["epoch"] == 0)} for r in history]
  return {"train_seconds": sum(r["epoch_seconds"] for r in records),
          "trained_images": sum(r["trained_images"] for r in records),
          "images_per_second": rate(records),
          # Without the first epoch of each process, which includes the compilation.
          "steady_images_per_second": rate([r for r in records if not r["includes_compile"]])}


def _read_history(path: pathlib.Path, epochs_done: int) -> list[dict[str, Any]]:
  """Metric records of the epochs a resumed run already has (later lines are dropped)."""
  if not path.exists():
    return []
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [r for r in records if r["epoch"] < epochs_done]


def _write_history(path: pathlib.Path, history: list[dict[str, Any]]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for record in history:
      f.write(json.dumps(record) + "\n")


def _epoch_record(programs: _Programs, config: Config, state: TrainState,
                  data: input_pipeline.Dataset, epoch: int, seconds: float, *, trained: int,
                  includes_compile: bool) -> dict[str, Any]:
  metrics = jax.device_get(state.metrics)
  record: dict[str, Any] = {
      "epoch": epoch, "step": int(state.step),
      "train_loss": float(metrics.loss_sum) / max(int(metrics.count), 1),
      "train_accuracy": int(metrics.correct) / max(int(metrics.count), 1),
      "train_examples": int(metrics.count), "epoch_seconds": seconds,
      # Images this process trained in ``seconds``, and whether they include compiling.
      "trained_images": trained, "includes_compile": includes_compile,
  }
  if programs.distance is not None:
    record["distance_to_projection"] = float(programs.distance(state.params))
  if programs.distance_to_z is not None:
    record["distance_to_z"] = float(programs.distance_to_z(state.params, state.opt_state))
  if (epoch + 1) % config.eval_every == 0 or epoch + 1 == config.epochs:
    dense = evaluate(programs.eval, state.params, state.model_state, data.test_images,
                     data.test_labels, config.eval_batch_size)
    record.update(test_accuracy=dense["accuracy"], test_loss=dense["loss"])
    if config.sparsity > 0 and config.method != "dense":
      sparse = evaluate(programs.eval, programs.project(state.params), state.model_state, data.test_images,
                        data.test_labels, config.eval_batch_size)
      record["test_accuracy_projected"] = sparse["accuracy"]
  return record


def _finish(programs: _Programs, config: Config, state: TrainState,
            data: input_pipeline.Dataset, images_dev: jax.Array, labels_dev: jax.Array,
            history: list[dict[str, Any]], workdir: pathlib.Path, *,
            wall_seconds: float) -> Outcome:
  """Final projection, BNT, evaluation, ``results.json`` and plots."""
  num_train = len(data.train_labels)
  evaluate_split = functools.partial(evaluate, programs.eval, images=data.test_images,
                                     labels=data.test_labels, batch_size=config.eval_batch_size)
  dense = evaluate_split(params=state.params, model_state=state.model_state)
  final: dict[str, Any] = {"dense_accuracy": dense["accuracy"], "dense_loss": dense["loss"]}
  if config.method == "dense":
    sparse_params, model_state = state.params, state.model_state
  else:
    scores = None
    if config.method == "safe-plus":
      scores = _final_scores(programs, config, state.params, state.model_state, images_dev,
                             labels_dev, num_train)
    if scores is None:
      sparse_params = programs.project(state.params)
    else:
      sparse_params, _ = safe_optax.finalize(state.params, config.sparsity, scores=scores)
    if not all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(sparse_params)):
      raise RuntimeError(f"training diverged: the final {config.method} parameters are not "
                         "finite.")
    before = evaluate_split(params=sparse_params, model_state=state.model_state)
    model_state = _recalibrate(programs, config, sparse_params, state.model_state, images_dev,
                               num_train)
    after = evaluate_split(params=sparse_params, model_state=model_state)
    final.update(sparse_accuracy_before_bnt=before["accuracy"],
                 sparse_accuracy=after["accuracy"], sparse_loss=after["loss"],
                 bnt_samples=min(config.bnt_samples, num_train) if model_state else 0)
  report = safe_optax.sparsity_report(sparse_params)
  final["sparsity"] = report.sparsity
  results = {
      "config": configs.to_dict(config),
      "versions": experiment.versions(),
      "data": {"num_train": num_train, "num_test": len(data.test_labels),
               "evaluated_on": "test" if config.validation is None else "validation",
               "num_classes": data.num_classes, "steps_per_epoch": steps_per_epoch(
                   config, num_train)},
      "final": final,
      "sparsity_report": report.as_dict(),
      # This process's wall time (for a resumed or re-finished run, not the run's).
      "wall_seconds": wall_seconds,
      **_throughput(history),
      "history": history,
  }
  with open(workdir / "results.json", "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
    f.write("\n")
  plots.plot_history(history, workdir, title=f"{config.model} {config.method} "
                                             f"sparsity {config.sparsity:g}")
  return Outcome(state, sparse_params, model_state, results)
