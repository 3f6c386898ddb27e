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

import contextlib
import functools
import hashlib
import importlib.resources
import io
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import numpy as np

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
_CACHE_VERSION = "cifar10c-v1"


@functools.lru_cache(maxsize=None)
def _lib():
  """The imagecorruptions building blocks (imported on first use: it pulls numba, cv2)."""
  try:
    from imagecorruptions import corruptions as lib  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError(
        "safe_optax.vision.corruptions needs `imagecorruptions-imaug` (pip install --no-deps "
        "imagecorruptions-imaug opencv-python-headless scikit-image scipy numba), or the "
        "`vision` extra of safe_optax.") from err
  return lib


@contextlib.contextmanager
def _legacy_seed(seed: int) -> Iterator[None]:
  """Seeds NumPy's global state for a library helper that draws from it, then restores it."""
  state = np.random.get_state()
  np.random.seed(seed)
  try:
    yield
  finally:
    np.random.set_state(state)


def _gaussian(x: np.ndarray, sigma: float) -> np.ndarray:
  from skimage.filters import gaussian  # pylint: disable=import-outside-toplevel
  return gaussian(x, sigma=sigma, channel_axis=-1 if x.ndim == 3 else None)


def _clipped_zoom(img: np.ndarray, factor: float) -> np.ndarray:
  """Zooms the centre crop back to full size (the script's version, non-square allowed)."""
  from scipy.ndimage import zoom  # pylint: disable=import-outside-toplevel
  h, w = img.shape[:2]
  ch, cw = int(np.ceil(h / factor)), int(np.ceil(w / factor))
  top, left = (h - ch) // 2, (w - cw) // 2
  out = zoom(img[top:top + ch, left:left + cw], (factor, factor, 1), order=1)
  th, tw = (out.shape[0] - h) // 2, (out.shape[1] - w) // 2
  return out[th:th + h, tw:tw + w]


def _hsv(x: np.ndarray, channel: int, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
  import skimage.color  # pylint: disable=import-outside-toplevel
  hsv = skimage.color.rgb2hsv(x)
  hsv[..., channel] = np.clip(fn(hsv[..., channel]), 0, 1)
  return skimage.color.hsv2rgb(hsv)


def _pil(x: np.ndarray):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  return Image.fromarray(np.uint8(np.clip(x * 255, 0, 255)))


# Each function maps float RGB pixels in [0, 1] (H, W, 3) to float pixels in
# [0, 1], given its severity constant and the image's Generator.


def _gaussian_noise(x, c, rng):
  return x + rng.normal(size=x.shape, scale=c)


def _shot_noise(x, c, rng):
  return rng.poisson(x * c) / c


def _impulse_noise(x, c, rng):
  import skimage.util  # pylint: disable=import-outside-toplevel
  return skimage.util.random_noise(x, mode="s&p", amount=c, rng=int(rng.integers(2 ** 31)))


def _speckle_noise(x, c, rng):
  return x + x * rng.normal(size=x.shape, scale=c)


def _gaussian_blur(x, c, rng):
  del rng
  return _gaussian(x, c)


def _glass_blur(x, c, rng):
  h, w = x.shape[:2]
  blurred = np.uint8(_gaussian(x, c[0]) * 255)
  shuffled = _lib()._shuffle_pixels_njit_glass_blur(h, w, blurred, c, int(rng.integers(2 ** 31)))
  return _gaussian(shuffled / 255.0, c[0])


def _defocus_blur(x, c, rng):
  import cv2  # pylint: disable=import-outside-toplevel
  del rng
  kernel = _lib().disk(radius=c[0], alias_blur=c[1])
  return np.stack([cv2.filter2D(x[..., d], -1, kernel) for d in range(3)], axis=-1)


def _motion_blur(x, c, rng):
  angle = rng.uniform(-45, 45)
  return _lib()._motion_blur(x * 255.0, radius=c[0], sigma=c[1], angle=angle) / 255.0


def _zoom_blur(x, c, rng):
  del rng
  x = x.astype(np.float32)
  factors = np.arange(1, c, 0.01)
  out = sum(_clipped_zoom(x, f) for f in factors)
  return (x + out) / (len(factors) + 1)


def _snow(x, c, rng):
  import cv2  # pylint: disable=import-outside-toplevel
  x = x.astype(np.float32)
  h, w = x.shape[:2]
  layer = rng.normal(size=(h, w), loc=c[0], scale=c[1])
  layer = _clipped_zoom(layer[..., None], c[2])
  layer[layer < c[3]] = 0
  layer = np.clip(layer[..., 0], 0, 1)
  layer = _lib()._motion_blur(layer, radius=c[4], sigma=c[5], angle=rng.uniform(-135, -45))
  # The script round-trips the layer through an 8-bit PNG.
  layer = (np.round(np.clip(layer, 0, 1) * 255) / 255.0)[..., None]
  gray = cv2.cvtColor(x, cv2.COLOR_RGB2GRAY).reshape(h, w, 1)
  x = c[6] * x + (1 - c[6]) * np.maximum(x, gray * 1.5 + 0.5)
  return x + layer + np.rot90(layer, k=2)


@functools.lru_cache(maxsize=None)
def _frost_texture(index: int) -> np.ndarray:
  import cv2  # pylint: disable=import-outside-toplevel
  name = ("frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg")[index]
  ref = importlib.resources.files(_lib().__package__) / "frost" / name
  with importlib.resources.as_file(ref) as path:
    texture = cv2.imread(str(path))
  # The script shrinks the textures to a fifth for 32x32 images; RGB order.
  return cv2.resize(texture, (0, 0), fx=0.2, fy=0.2)[..., ::-1].astype(np.float32) / 255.0


def _frost(x, c, rng):
  import cv2  # pylint: disable=import-outside-toplevel
  h, w = x.shape[:2]
  texture = _frost_texture(int(rng.integers(5)))
  if texture.shape[0] <= h or texture.shape[1] <= w:  # images larger than CIFAR's
    scale = 1.0 + max(h / texture.shape[0], w / texture.shape[1])
    texture = cv2.resize(texture, (0, 0), fx=scale, fy=scale)
  top = int(rng.integers(0, texture.shape[0] - h))
  left = int(rng.integers(0, texture.shape[1] - w))
  return c[0] * x + c[1] * texture[top:top + h, left:left + w]


def _fog(x, c, rng):
  h, w = x.shape[:2]
  size = 1 << max(h - 1, w - 1, 1).bit_length()  # the script's mapsize=32 for CIFAR
  with _legacy_seed(int(rng.integers(2 ** 31))):
    fractal = _lib().plasma_fractal(mapsize=size, wibbledecay=c[1])[:h, :w]
  max_val = x.max()
  x = x + c[0] * fractal[..., None]
  return x * max_val / (max_val + c[0])


def _brightness(x, c, rng):
  del rng
  return _hsv(x, 2, lambda v: v + c)


def _contrast(x, c, rng):
  del rng
  means = np.mean(x, axis=(0, 1), keepdims=True)
  return (x - means) * c + means


def _elastic_transform(x, c, rng):
  import cv2  # pylint: disable=import-outside-toplevel
  from scipy.ndimage import map_coordinates  # pylint: disable=import-outside-toplevel
  from skimage.filters import gaussian  # pylint: disable=import-outside-toplevel
  x = x.astype(np.float32)
  h, w = x.shape[:2]
  size = min(h, w)
  alpha, sigma, affine = (size * v for v in c)
  centre = np.float32((h, w)) // 2
  square = min(h, w) // 3
  pts1 = np.float32([centre + square, [centre[0] + square, centre[1] - square],
                     centre - square])
  pts2 = pts1 + rng.uniform(-affine, affine, size=pts1.shape).astype(np.float32)
  x = cv2.warpAffine(x, cv2.getAffineTransform(pts1, pts2), (w, h),
                     borderMode=cv2.BORDER_REFLECT_101)
  dx = (gaussian(rng.uniform(-1, 1, size=(h, w)), sigma, mode="reflect", truncate=3)
        * alpha).astype(np.float32)[..., None]
  dy = (gaussian(rng.uniform(-1, 1, size=(h, w)), sigma, mode="reflect", truncate=3)
        * alpha).astype(np.float32)[..., None]
  cols, rows, chans = np.meshgrid(np.arange(w), np.arange(h), np.arange(3))
  indices = (np.reshape(rows + dy, (-1, 1)), np.reshape(cols + dx, (-1, 1)),
             np.reshape(chans, (-1, 1)))
  return map_coordinates(x, indices, order=1, mode="reflect").reshape(x.shape)


def _pixelate(x, c, rng):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  del rng
  h, w = x.shape[:2]
  image = _pil(x).resize((int(w * c), int(h * c)), Image.BOX).resize((w, h), Image.BOX)
  return np.asarray(image, np.float32) / 255.0


def _jpeg_compression(x, c, rng):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  del rng
  buffer = io.BytesIO()
  _pil(x).save(buffer, "JPEG", quality=c)
  return np.asarray(Image.open(buffer), np.float32) / 255.0


def _spatter(x, c, rng):
  import cv2  # pylint: disable=import-outside-toplevel
  x = x.astype(np.float32)
  liquid = rng.normal(size=x.shape[:2], loc=c[0], scale=c[1])
  liquid = _gaussian(liquid, c[2])
  liquid[liquid < c[3]] = 0
  if c[5] == 0:  # water drops
    liquid = (liquid * 255).astype(np.uint8)
    dist = 255 - cv2.Canny(liquid, 50, 150)
    dist = cv2.distanceTransform(dist, cv2.DIST_L2, 5)
    _, dist = cv2.threshold(dist, 20, 20, cv2.THRESH_TRUNC)
    dist = cv2.blur(dist, (3, 3)).astype(np.uint8)
    dist = cv2.equalizeHist(dist)
    kernel = np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]])
    dist = cv2.filter2D(dist, cv2.CV_8U, kernel)
    dist = cv2.blur(dist, (3, 3)).astype(np.float32)
    m = cv2.cvtColor(liquid * dist, cv2.COLOR_GRAY2BGRA)
    m /= np.maximum(np.max(m, axis=(0, 1)), 1e-12)  # an empty layer stays empty
    m *= c[4]
    # Pale turquoise (RGB 175, 238, 238); the BGR<->BGRA conversions only add
    # and drop an alpha channel, the colour order stays RGB as in the script.
    color = np.concatenate([v / 255.0 * np.ones_like(m[..., :1]) for v in (175, 238, 238)],
                           axis=2)
    color = cv2.cvtColor(color, cv2.COLOR_BGR2BGRA)
    x = cv2.cvtColor(x, cv2.COLOR_BGR2BGRA)
    return cv2.cvtColor(np.clip(x + m * color, 0, 1), cv2.COLOR_BGRA2BGR)
  m = np.where(liquid > c[3], 1, 0)
  m = _gaussian(m.astype(np.float32), c[4])
  m[m < 0.8] = 0
  mud = np.concatenate([v / 255.0 * np.ones_like(x[..., :1]) for v in (63, 42, 20)], axis=2)
  return x * (1 - m[..., None]) + mud * m[..., None]


def _saturate(x, c, rng):
  del rng
  return _hsv(x, 1, lambda s: s * c[0] + c[1])


_FUNCTIONS: dict[str, Callable[[np.ndarray, Any, np.random.Generator], np.ndarray]] = {
    name: globals()["_" + name] for name in CORRUPTIONS}


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
  fn = _FUNCTIONS[name]
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
