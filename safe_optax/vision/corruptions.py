"""CIFAR-10-C-style common corruptions, generated locally and cached as uint8.

The 19 corruption types of CIFAR-10-C (Hendrycks & Dietterich, 2019) at
severities 1-5, with **CIFAR-10-C's own severity constants** -- not
ImageNet-C's, which are harsher on 32x32 images. Every constant below is
copied from Hendrycks' generator script ``make_cifar_c.py`` (repository
``hendrycks/robustness``, file ``ImageNet-C/create_c/make_cifar_c.py``, at
commit ``ca360085d57889288c4143fddd8a707bbcae01bd``), one tuple per severity,
under the function of the same name there. The building blocks come from the
maintained PyPI package ``imagecorruptions-imaug`` (a port of the ImageNet-C
code): the anti-aliased ``disk`` kernel, the diamond-square
``plasma_fractal``, the glass-blur pixel shuffle, the frost textures, and
``_motion_blur``, its NumPy re-implementation of ImageMagick's motion-blur
kernel (CIFAR-10-C called ImageMagick through Wand, which needs a system
library; so motion blur and snow follow the same kernel, not ImageMagick's
bytes). scikit-image, SciPy, OpenCV and Pillow do the rest, as in the script.

Differences from the script, all deliberate: randomness comes from one NumPy
``Generator`` per image seeded by ``(seed, type, severity, index)``, so a set
is reproducible and any image can be regenerated alone; sizes other than 32 are
accepted (the script's ``32`` becomes the image's height/width; elastic
constants scale with the image size as the script's ``IMSIZE``); a grayscale
``(H, W, 1)`` image is corrupted as RGB and averaged back. ``frost`` draws
from the first five textures only, as the script does (``randint(5)``).

Examples:
  >>> import numpy as np
  >>> from safe_optax.vision import corruptions
  >>> images = np.full((2, 32, 32, 3), 128, np.uint8)
  >>> noisy = corruptions.corrupt(images, 'gaussian_noise', severity=5, seed=0)
  >>> noisy.dtype, noisy.shape
  (dtype('uint8'), (2, 32, 32, 3))
  >>> bool(np.array_equal(noisy, corruptions.corrupt(images, 'gaussian_noise', 5, seed=0)))
  True
  >>> round(float(np.std(noisy / 255.0 - 128 / 255.0)), 2)  # sigma 0.10 at severity 5
  0.1

References:
  Hendrycks, Dietterich, `Benchmarking Neural Network Robustness to Common
  Corruptions and Perturbations <https://arxiv.org/abs/1903.12261>`_,
  ICLR 2019.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from safe_optax.vision import corruption_functions

__all__ = ("CORRUPTIONS", "SEVERITY_CONSTANTS", "corrupt", "corrupted_set",
           "corruption_accuracy")

CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression", "speckle_noise", "gaussian_blur",
    "spatter", "saturate",
)
"""The 19 CIFAR-10-C types, in the order of the ``make_cifar_c.py`` script."""

# Severity constants, severities 1..5, each from the function of the same name
# in make_cifar_c.py (hendrycks/robustness@ca36008, ImageNet-C/create_c/).
SEVERITY_CONSTANTS: dict[str, tuple[Any, ...]] = {
    # noise sigma on [0, 1] pixels
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
    # Poisson photon count per unit intensity
    "shot_noise": (500, 250, 100, 75, 50),
    # salt-and-pepper fraction
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
    # (disk radius, anti-alias sigma)
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),
    # (gaussian sigma, max shuffle distance, iterations)
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),
    # (radius, sigma) of the motion kernel
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),
    # zoom factors: arange(1, stop, 0.01)
    "zoom_blur": (1.06, 1.11, 1.16, 1.21, 1.26),
    # (loc, scale, zoom, threshold, blur radius, blur sigma, blend)
    "snow": ((0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
             (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9), (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
             (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)),
    # (image weight, frost weight)
    "frost": ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)),
    # (fog strength, wibble decay)
    "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),
    # added HSV value
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),
    # contrast factor
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),
    # (alpha, sigma, affine) as fractions of the image size (the script's IMSIZE * c)
    "elastic_transform": ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06),
                          (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)),
    # downscale factor
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),
    # JPEG quality
    "jpeg_compression": (80, 65, 58, 50, 40),
    # multiplicative noise sigma
    "speckle_noise": (0.06, 0.1, 0.12, 0.16, 0.2),
    # gaussian sigma
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1),
    # (loc, scale, sigma, threshold, intensity, mud?)
    "spatter": ((0.62, 0.1, 0.7, 0.7, 0.5, 0), (0.65, 0.1, 0.8, 0.7, 0.5, 0),
                (0.65, 0.3, 1, 0.69, 0.5, 0), (0.65, 0.1, 0.7, 0.69, 0.6, 1),
                (0.65, 0.1, 0.5, 0.68, 0.6, 1)),
    # (saturation factor, added saturation)
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),
}
"""``{type: (constant of severity 1, ..., of severity 5)}``: CIFAR-10-C's, not ImageNet-C's
(each from the function of the same name in ``make_cifar_c.py``)."""

_CACHE_VERSION = "cifar10c-v1"


def _check(name: str, severity: int) -> None:
  if name not in CORRUPTIONS:
    raise ValueError(f"`name` must be one of {CORRUPTIONS}, got {name!r}.")
  if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) \
      or not 1 <= severity <= 5:
    raise ValueError(f"`severity` must be an int in 1..5, got {severity!r}.")


def corrupt(images: np.ndarray, name: str, severity: int, seed: int = 0) -> np.ndarray:
  """Applies one corruption at one severity to a batch of uint8 images.

  Args:
    images: uint8 ``(N, H, W, 3)`` or ``(N, H, W, 1)`` (H, W >= 8).
    name: one of :data:`CORRUPTIONS`.
    severity: 1..5.
    seed: with the type, severity and image index, seeds each image's
      ``np.random.Generator``: same inputs, same output.

  Returns:
    uint8 array shaped like ``images`` (rounded down, as the script's
    ``np.uint8``).

  Raises:
    ValueError: unknown ``name``, ``severity`` outside 1..5, or bad images.
  """
  _check(name, severity)
  images = np.asarray(images)
  if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3) \
      or min(images.shape[1:3]) < 8:
    raise ValueError("`images` must be uint8 (N, H, W, 3) or (N, H, W, 1) with H, W >= 8; got "
                     f"{images.dtype} {images.shape}.")
  gray = images.shape[-1] == 1
  constant = SEVERITY_CONSTANTS[name][severity - 1]
  fn = corruption_functions.FUNCTIONS[name]
  type_index = CORRUPTIONS.index(name)
  out = np.empty_like(images)
  for i, image in enumerate(images):
    rng = np.random.default_rng([seed, type_index, severity, i])
    x = np.repeat(image, 3, axis=-1) if gray else image
    y = np.clip(fn(x.astype(np.float64) / 255.0, constant, rng), 0, 1) * 255
    y = np.asarray(y, np.float64)
    out[i] = np.uint8(y.mean(-1, keepdims=True) if gray else y)
  return out


def _fingerprint(images: np.ndarray, seed: int) -> str:
  digest = hashlib.sha256(np.ascontiguousarray(images).tobytes())
  digest.update(f"{images.shape}|{seed}|{_CACHE_VERSION}".encode())
  return digest.hexdigest()[:16]


def corrupted_set(images: np.ndarray, name: str, severity: int, *, seed: int = 0,
                  cache_dir: Optional[os.PathLike] = None) -> np.ndarray:
  """:func:`corrupt`, cached as ``.npy`` (uint8) keyed by the images, seed and version.

  Args:
    images, name, severity, seed: as in :func:`corrupt`.
    cache_dir: where to cache (default ``$SAFE_OPTAX_CACHE/corruptions`` or
      ``~/.cache/safe_optax/corruptions``); ``None`` and no environment
      variable uses the default.
  """
  _check(name, severity)
  root = pathlib.Path(cache_dir or pathlib.Path(
      os.environ.get("SAFE_OPTAX_CACHE", pathlib.Path.home() / ".cache" / "safe_optax"))
      / "corruptions")
  path = root / f"{_fingerprint(np.asarray(images), seed)}-{name}-{severity}.npy"
  if path.exists():
    return np.load(path)
  out = corrupt(images, name, severity, seed)
  root.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp.npy")
  np.save(tmp, out)
  tmp.replace(path)
  return out


def corruption_accuracy(
    predict_fn: Callable[[np.ndarray], np.ndarray],
    images: np.ndarray,
    labels: np.ndarray,
    *,
    severities: Sequence[int] = (3, 5),
    names: Sequence[str] = CORRUPTIONS,
    seed: int = 0,
    cache_dir: Optional[os.PathLike] = None,
    progress: bool = False,
) -> dict[str, Any]:
  """Accuracy on every corruption and severity, and the mean over types per severity.

  Args:
    predict_fn: uint8 images ``(n, H, W, C)`` -> predicted labels ``(n,)``
      (batch inside it if needed; normalisation is its business).
    images, labels: the clean test set (uint8 images, int labels).
    severities: which severities (the paper reports 3 and 5).
    names: which corruption types (default all 19).
    seed, cache_dir: as in :func:`corrupted_set`.
    progress: show a tqdm bar.

  Returns:
    ``{'per_type': {name: {severity: acc}}, 'mean': {severity: acc},
    'num_examples': n, 'seed': seed}`` (severities as strings, JSON-ready).
  """
  for name in names:
    for severity in severities:
      _check(name, severity)
  labels = np.asarray(labels)
  jobs = [(n, s) for n in names for s in severities]
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    jobs = tqdm(jobs, desc="corruptions", leave=False)
  per_type: dict[str, dict[str, float]] = {n: {} for n in names}
  for name, severity in jobs:
    corrupted = corrupted_set(images, name, severity, seed=seed, cache_dir=cache_dir)
    per_type[name][str(severity)] = float(np.mean(np.asarray(predict_fn(corrupted)) == labels))
  mean = {str(s): float(np.mean([per_type[n][str(s)] for n in names])) for s in severities}
  return {"per_type": per_type, "mean": mean, "num_examples": int(len(labels)), "seed": seed}
