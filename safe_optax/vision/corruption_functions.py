"""The 19 CIFAR-10-C image functions, one per type of :mod:`~safe_optax.vision.corruptions`.

Each takes one float image in ``[0, 1]`` (``H, W, 3``), its severity's
constant from :data:`~safe_optax.vision.corruptions.SEVERITY_CONSTANTS` and a
``np.random.Generator``, and returns the corrupted float image (clipped by the
caller), as the function of the same name in Hendrycks' ``make_cifar_c.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import importlib.util
import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


INSTALL_HINT = ('the `corruptions` extra: pip install "safe-optax[corruptions]" (on a machine '
                'without libGL: pip install --no-deps imagecorruptions-imaug beside '
                'opencv-python-headless scikit-image scipy numba; see docs/vision.md)')
"""What to install for the corruptions, for error messages."""


def available() -> bool:
  """Whether ``imagecorruptions`` can be imported (checked without importing it).

  Examples:
    >>> isinstance(available(), bool)
    True
  """
  return importlib.util.find_spec("imagecorruptions") is not None


@functools.lru_cache(maxsize=None)
def _lib():
  """The imagecorruptions building blocks (imported on first use: it pulls numba, cv2)."""
  try:
    from imagecorruptions import corruptions as lib  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError(f"safe_optax.vision.corruptions needs {INSTALL_HINT}.") from err
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


FUNCTIONS: dict[str, Callable[[np.ndarray, Any, np.random.Generator], np.ndarray]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "defocus_blur": _defocus_blur,
    "glass_blur": _glass_blur,
    "motion_blur": _motion_blur,
    "zoom_blur": _zoom_blur,
    "snow": _snow,
    "frost": _frost,
    "fog": _fog,
    "brightness": _brightness,
    "contrast": _contrast,
    "elastic_transform": _elastic_transform,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
    "speckle_noise": _speckle_noise,
    "gaussian_blur": _gaussian_blur,
    "spatter": _spatter,
    "saturate": _saturate,
}
"""Each CIFAR-10-C type -> ``fn(image in [0, 1], severity constant, rng)`` (float, unclipped)."""
