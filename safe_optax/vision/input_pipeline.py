"""Image-classification data: loaders, label noise, on-device augmentation, epoch order.

Loaders return uint8 images ``(N, H, W, C)`` and int32 labels held in host
memory; augmentation and normalisation run on the device in JAX so an
accelerator is never starved. Supported sources:

* CIFAR-10 / CIFAR-100 official python pickles (``cifar-10-batches-py``,
  ``cifar-100-python``);
* an image-folder layout ``train/<class>/*.{jpg,png}``, ``test/<class>/...``,
  as a directory or a ``.tar.gz`` of it (decoded once, cached as ``.npz``);
* TFDS (``cifar10``, ``cifar100``, ``mnist``, ``fashion_mnist``) when
  ``tensorflow_datasets`` is installed and the data set is prepared;
* MNIST / Fashion-MNIST idx files (``*-images-idx3-ubyte[.gz]``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import os
import pathlib
import pickle
import tarfile
import zlib
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


class Dataset(NamedTuple):
  """An in-memory image-classification data set (uint8 images, int32 labels)."""

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  classes: tuple[str, ...]

  @property
  def num_classes(self) -> int:
    return len(self.classes)


def _missing(path: pathlib.Path, expected: str) -> FileNotFoundError:
  return FileNotFoundError(f"no data set at '{path}': expected {expected}.")


# What the standard library raises on a cut or damaged archive, gzip stream or
# pickle (a bare ``EOFError`` names no file).
_DAMAGED = (EOFError, tarfile.ReadError, zlib.error, gzip.BadGzipFile, pickle.UnpicklingError)


def _corrupt(file: pathlib.Path, err: BaseException) -> ValueError:
  return ValueError(f"'{file}' is truncated or corrupt ({type(err).__name__}: {err}); "
                    "download or extract it again.")


def _cifar_pickles(path: pathlib.Path) -> Dataset:
  def read(name):
    try:
      with open(path / name, "rb") as f:
        return pickle.load(f, encoding="latin1")
    except _DAMAGED as err:
      raise _corrupt(path / name, err) from err

  def images(batch):
    return np.asarray(batch["data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)

  if (path / "data_batch_1").exists():
    train = [read(f"data_batch_{i}") for i in range(1, 6)]
    test = read("test_batch")
    meta = read("batches.meta")
    return Dataset(
        np.concatenate([images(b) for b in train]),
        np.concatenate([np.asarray(b["labels"], np.int32) for b in train]),
        images(test), np.asarray(test["labels"], np.int32), tuple(meta["label_names"]))
  train, test, meta = read("train"), read("test"), read("meta")
  return Dataset(images(train), np.asarray(train["fine_labels"], np.int32),
                 images(test), np.asarray(test["fine_labels"], np.int32),
                 tuple(meta["fine_label_names"]))


def _decode(data: bytes) -> np.ndarray:
  from PIL import Image  # pylint: disable=import-outside-toplevel
  with Image.open(io.BytesIO(data)) as image:
    return np.asarray(image.convert("RGB"), np.uint8)


def _image_folder(path: pathlib.Path) -> Dataset:
  """Decodes ``{train,test}/<class>/<file>`` from a directory or a tar(.gz) archive."""
  entries: dict[str, list[tuple[str, str, bytes]]] = {"train": [], "test": []}
  if path.is_dir():
    for file in sorted(path.glob("*/*/*")):
      split, label = file.parts[-3], file.parts[-2]
      if split in entries and file.suffix.lower() in _IMAGE_SUFFIXES:
        entries[split].append((label, file.name, file.read_bytes()))
  else:
    try:
      with tarfile.open(path) as archive:
        for member in archive:
          parts = pathlib.PurePosixPath(member.name).parts
          if (member.isfile() and len(parts) >= 3 and parts[-3] in entries
              and pathlib.PurePosixPath(member.name).suffix.lower() in _IMAGE_SUFFIXES):
            entries[parts[-3]].append((parts[-2], parts[-1], archive.extractfile(member).read()))
    except _DAMAGED as err:
      raise _corrupt(path, err) from err
  if not entries["train"] or not entries["test"]:
    raise _missing(path, "train/<class>/*.jpg|png and test/<class>/*.jpg|png images")
  classes = tuple(sorted({label for label, _, _ in entries["train"]}))
  index = {name: i for i, name in enumerate(classes)}
  unknown = {label for label, _, _ in entries["test"]} - set(classes)
  if unknown:
    raise ValueError(f"test classes {sorted(unknown)} in '{path}' have no training images.")

  def split(items):
    items = sorted(items)  # deterministic order: class, then file name
    images = np.stack([_decode(data) for _, _, data in items])
    return images, np.asarray([index[label] for label, _, _ in items], np.int32)

  return Dataset(*split(entries["train"]), *split(entries["test"]), classes)


def _cache_path(path: pathlib.Path, cache_dir: Optional[os.PathLike]) -> pathlib.Path:
  stat = path.stat()
  tag = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
  root = pathlib.Path(cache_dir or os.environ.get("SAFE_OPTAX_CACHE",
                                                  pathlib.Path.home() / ".cache" / "safe_optax"))
  return root / f"{path.name}-{tag[:16]}.npz"


def _cached(path: pathlib.Path, cache_dir: Optional[os.PathLike], load) -> Dataset:
  cache = _cache_path(path, cache_dir)
  if cache.exists():
    with np.load(cache) as data:
      return Dataset(data["train_images"], data["train_labels"], data["test_images"],
                     data["test_labels"], tuple(str(c) for c in data["classes"]))
  dataset = load(path)
  cache.parent.mkdir(parents=True, exist_ok=True)
  tmp = cache.with_suffix(".tmp.npz")
  np.savez(tmp, **dataset._asdict() | {"classes": np.asarray(dataset.classes)})
  tmp.replace(cache)
  return dataset


def load_cifar(path: os.PathLike, *, cache_dir: Optional[os.PathLike] = None) -> Dataset:
  """Loads CIFAR-10/100 from official pickles, an image folder, or its ``.tar.gz``.

  Args:
    path: a ``cifar-10-batches-py`` / ``cifar-100-python`` folder, an
      image-folder directory, or a tar(.gz) archive of one.
    cache_dir: where decoded image folders are cached (default
      ``$SAFE_OPTAX_CACHE`` or ``~/.cache/safe_optax``).

  Raises:
    FileNotFoundError: naming the files that were expected.
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise _missing(path, "a cifar-10-batches-py / cifar-100-python folder, an image folder "
                         "(train/<class>/*.jpg), or a .tar.gz of one")
  if path.is_dir() and ((path / "data_batch_1").exists() or (path / "train").is_file()):
    expected = ["data_batch_1", "data_batch_5", "test_batch", "batches.meta"] if (
        path / "data_batch_1").exists() else ["train", "test", "meta"]
    missing = [name for name in expected if not (path / name).exists()]
    if missing:
      raise _missing(path, f"the official pickle files, missing {missing}")
    return _cifar_pickles(path)
  if path.is_dir() and not ((path / "train").is_dir() and (path / "test").is_dir()):
    raise _missing(path, "data_batch_1..5 + test_batch (CIFAR-10), train + test + meta "
                         "(CIFAR-100), or train/<class>/ and test/<class>/ image folders")
  return _cached(path, cache_dir, _image_folder)


def _read_idx(file: pathlib.Path) -> np.ndarray:
  opener = gzip.open if file.suffix == ".gz" else open
  try:
    with opener(file, "rb") as f:
      data = f.read()
  except _DAMAGED as err:
    raise _corrupt(file, err) from err
  magic = int.from_bytes(data[:4], "big")
  if magic >> 8 != 0x08:
    raise ValueError(f"'{file}' is not an idx file of uint8 (magic {magic:#x}).")
  ndim = magic & 0xFF
  shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
  payload = len(data) - (4 + 4 * ndim)
  if payload != math.prod(shape):
    raise ValueError(f"'{file}' is truncated or corrupt: its header promises shape {shape} "
                     f"({math.prod(shape)} bytes) but {payload} bytes follow; download it again.")
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _idx_file(directory: pathlib.Path, stem: str) -> Optional[pathlib.Path]:
  for name in (stem, stem + ".gz"):
    if (directory / name).exists():
      return directory / name
  return None


def load_mnist(path: os.PathLike, *, test_only_split: Optional[tuple[int, int]] = None,
               seed: int = 0) -> Dataset:
  """Loads MNIST or Fashion-MNIST idx files (gzipped or not) from a directory.

  Args:
    path: directory with ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``.
    test_only_split: ``(n_train, n_test)`` to split the ``t10k`` files alone
      (e.g. ``(8000, 2000)`` when only the official test set is at hand), with
      a seeded permutation; otherwise the train files are required.
    seed: seeds that permutation.
  """
  directory = pathlib.Path(path)
  files = {f"{split}-{kind}": _idx_file(directory, f"{split}-{kind}-ubyte")
           for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")}
  needed = ["t10k-images-idx3", "t10k-labels-idx1"]
  if test_only_split is None:
    needed += ["train-images-idx3", "train-labels-idx1"]
  missing = [f"{name}-ubyte[.gz]" for name in needed if files[name] is None]
  if missing:
    raise _missing(directory, f"idx files {missing}")
  classes = tuple(str(i) for i in range(10))
  test_x = _read_idx(files["t10k-images-idx3"])[..., None]
  test_y = _read_idx(files["t10k-labels-idx1"]).astype(np.int32)
  if test_only_split is not None:
    n_train, n_test = test_only_split
    if n_train < 1 or n_test < 1 or n_train + n_test > len(test_y):
      raise ValueError(f"`test_only_split` {test_only_split} must be positive and sum to "
                       f"at most {len(test_y)}.")
    order = np.random.default_rng(seed).permutation(len(test_y))
    tr, te = order[:n_train], order[n_train:n_train + n_test]
    return Dataset(test_x[tr], test_y[tr], test_x[te], test_y[te], classes)
  return Dataset(_read_idx(files["train-images-idx3"])[..., None],
                 _read_idx(files["train-labels-idx1"]).astype(np.int32), test_x, test_y, classes)


def load_tfds(name: str, *, data_dir: Optional[os.PathLike] = None) -> Dataset:
  """Loads a prepared TFDS data set (``download=False``: nothing is fetched)."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError("load_tfds needs `tensorflow_datasets` installed.") from err
  builder = tfds.builder(name, data_dir=data_dir)
  splits = {s: tfds.as_numpy(builder.as_dataset(split=s, batch_size=-1)) for s in ("train", "test")}
  classes = tuple(builder.info.features["label"].names)
  return Dataset(splits["train"]["image"], splits["train"]["label"].astype(np.int32),
                 splits["test"]["image"], splits["test"]["label"].astype(np.int32), classes)


def symmetric_label_noise(labels: np.ndarray, ratio: float, num_classes: int,
                          seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Corrupts exactly ``round(ratio * N)`` labels, each to a *different* class.

  Returns:
    ``(noisy_labels, corrupted)`` with ``corrupted`` the boolean mask of
    changed examples.
  """
  if not 0.0 <= ratio <= 1.0:
    raise ValueError(f"`ratio` must be in [0, 1], got {ratio}.")
  if num_classes < 2:
    raise ValueError(f"`num_classes` must be >= 2 to corrupt labels, got {num_classes}.")
  rng = np.random.default_rng(seed)
  labels = np.asarray(labels, np.int32)
  corrupted = np.zeros(len(labels), bool)
  corrupted[rng.permutation(len(labels))[:round(ratio * len(labels))]] = True
  # An offset in 1..C-1 always lands on another class, uniformly.
  offsets = rng.integers(1, num_classes, size=len(labels))
  noisy = np.where(corrupted, (labels + offsets) % num_classes, labels).astype(np.int32)
  return noisy, corrupted


def sample_indices(num_examples: int, size: Optional[int],
                   rng: np.random.Generator) -> np.ndarray:
  """Sorted indices of a seeded sample of ``size`` examples without replacement.

  Every subset of a data set is drawn with this, never as its first ``size``
  examples: image-folder data sets are stored class by class, so the first
  1,000 CIFAR-10 test images are all airplanes. ``size`` of ``None`` or at
  least ``num_examples`` gives every index, and then ``rng`` is not drawn from.

  Examples:
    >>> import numpy as np
    >>> sample_indices(10, 4, np.random.default_rng(0))
    array([2, 4, 6, 7])
    >>> sample_indices(3, None, np.random.default_rng(0))
    array([0, 1, 2])
  """
  if size is not None and size < 0:
    raise ValueError(f"subset size must be non-negative, got {size}.")
  if size is None or size >= num_examples:
    return np.arange(num_examples)
  return np.sort(rng.permutation(num_examples)[:size])


def validation_split(num_examples: int, size: int, data_seed: int) -> tuple[np.ndarray,
                                                                              np.ndarray]:
  """``(train_indices, held_out_indices)``: a seeded sample of ``size`` held out.

  The vision trainer's ``Config.validation`` and the flatness benchmark carve
  their validation splits with this; the sample is a stream of its own
  (``[data_seed, 23]``), so adding a validation split changes no other draw.

  Examples:
    >>> train, held_out = validation_split(10, 3, data_seed=0)
    >>> len(train), len(held_out), sorted(set(train) | set(held_out)) == list(range(10))
    (7, 3, True)
  """
  if not 0 < size < num_examples:
    raise ValueError(f"`validation` must be in [1, {num_examples}) (the training examples), "
                     f"got {size}.")
  held_out = sample_indices(num_examples, size,
                                           np.random.default_rng([data_seed, 23]))
  return np.setdiff1d(np.arange(num_examples), held_out), held_out


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example order of one epoch: a permutation fixed by ``(seed, epoch)``."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def num_batches(num_examples: int, batch_size: int) -> int:
  """Batches per epoch when every example is seen exactly once (last one may be short)."""
  return -(-num_examples // batch_size)


def random_crop_flip(key: jax.Array, images: jax.Array, pad: int = 4) -> jax.Array:
  """Pads by ``pad`` (zeros), crops back at a random offset, flips half at random.

  Runs on the device; one independent crop and flip per image.
  """
  n, h, w, _ = images.shape
  crop_key, flip_key = jax.random.split(key)
  offsets = jax.random.randint(crop_key, (n, 2), 0, 2 * pad + 1)
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  crop = jax.vmap(lambda im, o: jax.lax.dynamic_slice(im, (o[0], o[1], 0), (h, w, im.shape[-1])))
  cropped = crop(padded, offsets)
  flips = jax.random.bernoulli(flip_key, 0.5, (n, 1, 1, 1))
  return jnp.where(flips, cropped[:, :, ::-1], cropped)


def normalize(images: jax.Array, mean: tuple[float, ...], std: tuple[float, ...]) -> jax.Array:
  """uint8 pixels -> float32 ``(x / 255 - mean) / std``."""
  x = images.astype(jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)
