"""The data of a vision run: the configured data set, its normalisation, its batches.

:func:`load_dataset` reads ``config.dataset`` and applies the run's subsets,
label noise and validation split (all seeded by ``config.data_seed``);
:data:`NORMALIZATION` holds each data set's channel means and deviations;
:func:`prepare_images` turns a uint8 batch into the model's input (with
pad-crop-flip augmentation when given a key); :func:`epoch_batches` is one
epoch's minibatch indices and :func:`gather_batch` turns indices into the
global batch, each process reading only its rows from host memory.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from safe_optax import distributed
from safe_optax.vision import configs
from safe_optax.vision import input_pipeline

FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)
NORMALIZATION = {
    "cifar10": (input_pipeline.CIFAR10_MEAN, input_pipeline.CIFAR10_STD),
    "cifar100": (input_pipeline.CIFAR100_MEAN, input_pipeline.CIFAR100_STD),
    "mnist": (input_pipeline.MNIST_MEAN, input_pipeline.MNIST_STD),
    "fashion_mnist": (FASHION_MNIST_MEAN, FASHION_MNIST_STD),
}
"""``{dataset: (mean, std)}`` per channel, of pixels scaled to [0, 1]."""


def load_dataset(config: configs.Config, data_dir: os.PathLike) -> input_pipeline.Dataset:
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


def gather_batch(mesh: Mesh, arrays: tuple[Any, ...], indices: np.ndarray) -> tuple[jax.Array, ...]:
  """The global batch ``a[indices]`` of each array, sharded over ``mesh``'s ``'data'`` axis.

  Every process holds the whole (host-memory) data set and the same
  ``indices``; it gathers only its own rows
  (:func:`~safe_optax.distributed.process_rows`) and
  :func:`~safe_optax.distributed.global_batch` assembles the global arrays, so
  no device ever holds the data set and the batch is the one a single process
  would build.

  Examples:
    >>> from safe_optax import distributed
    >>> x, y = gather_batch(distributed.data_mesh(), (np.arange(10) * 10, np.arange(10)),
    ...                     np.array([3, 1]))
    >>> x.tolist(), y.tolist()
    ([30, 10], [3, 1])
  """
  indices = np.asarray(indices)
  rows = indices[distributed.process_rows(mesh, len(indices))]
  return distributed.global_batch(mesh, tuple(np.asarray(a[rows]) for a in arrays),
                                  len(indices))


def prepare_images(images: jax.Array, key: Optional[jax.Array], mean: tuple[float, ...],
                   std: tuple[float, ...]) -> jax.Array:
  """uint8 batch -> normalised float32, with pad-crop-flip augmentation when ``key`` is set."""
  if key is not None:
    images = input_pipeline.random_crop_flip(key, images)
  return input_pipeline.normalize(images, mean, std)
