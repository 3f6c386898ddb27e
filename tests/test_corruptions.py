"""Tests for safe_optax.vision.corruptions on a handful of generated 32x32 images."""

import sys

import numpy as np
import pytest

from safe_optax.vision import corruptions


def images(n=3, size=32, channels=3, seed=0):
  """Smooth gradients plus texture: blur, noise and colour changes all show."""
  rng = np.random.default_rng(seed)
  yy, xx = np.mgrid[:size, :size] / size
  base = np.stack([xx, yy, (xx + yy) / 2][:channels], -1)
  out = [np.clip(0.2 + 0.6 * base + 0.1 * rng.normal(size=base.shape), 0, 1) for _ in range(n)]
  return np.uint8(np.asarray(out) * 255)


def rms(a, b):
  return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2)))


@pytest.mark.slow
def test_all_types_shapes_dtypes_and_determinism():
  x = images()
  assert len(corruptions.CORRUPTIONS) == 19
  for name in corruptions.CORRUPTIONS:
    for severity in (1, 5):
      y = corruptions.corrupt(x, name, severity, seed=7)
      assert y.dtype == np.uint8 and y.shape == x.shape, name
      assert rms(y, x) > 0.5, (name, severity)  # the image changed
    np.testing.assert_array_equal(y, corruptions.corrupt(x, name, 5, seed=7))
  # Random corruptions depend on the seed; each image has its own stream.
  a = corruptions.corrupt(x, "shot_noise", 3, seed=1)
  assert not np.array_equal(a, corruptions.corrupt(x, "shot_noise", 3, seed=2))
  np.testing.assert_array_equal(a[1:], corruptions.corrupt(x, "shot_noise", 3, seed=1)[1:])
  one = corruptions.corrupt(np.repeat(x[:1], 2, 0), "shot_noise", 3, seed=1)
  assert not np.array_equal(one[0], one[1])


def test_gaussian_noise_constants_are_cifars():
  assert corruptions.SEVERITY_CONSTANTS["gaussian_noise"] == (0.04, 0.06, 0.08, 0.09, 0.10)
  grey = np.full((4, 32, 32, 3), 128, np.uint8)
  for severity, sigma in enumerate((0.04, 0.06, 0.08, 0.09, 0.10), start=1):
    y = corruptions.corrupt(grey, "gaussian_noise", severity, seed=0)
    # uint8 truncation shifts the mean by half a level; the spread is sigma.
    assert np.std(y / 255.0) == pytest.approx(sigma, rel=0.04)
  # CIFAR-10-C, not ImageNet-C (whose severity-1 sigma is 0.08).
  assert corruptions.SEVERITY_CONSTANTS["shot_noise"][0] == 500
  assert corruptions.SEVERITY_CONSTANTS["jpeg_compression"] == (80, 65, 58, 50, 40)


@pytest.mark.parametrize("name", ["gaussian_noise", "impulse_noise", "speckle_noise",
                                  "contrast", "gaussian_blur", "fog"])
def test_severity_is_monotone(name):
  x = images(n=4)
  sizes = [rms(corruptions.corrupt(x, name, s, seed=3), x) for s in range(1, 6)]
  assert all(a < b for a, b in zip(sizes, sizes[1:])), sizes


def test_grayscale_and_other_sizes():
  x = images(n=2, size=28, channels=1)
  for name in ("gaussian_blur", "frost", "fog", "elastic_transform"):
    y = corruptions.corrupt(x, name, 4, seed=0)
    assert y.shape == x.shape and y.dtype == np.uint8


def test_cache_and_accuracy(tmp_path):
  x = images(n=4)
  labels = np.array([0, 1, 0, 1])
  first = corruptions.corrupted_set(x, "contrast", 5, seed=0, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("*.npy"))) == 1
  np.testing.assert_array_equal(first, corruptions.corrupted_set(x, "contrast", 5, seed=0,
                                                                 cache_dir=tmp_path))
  # A "classifier" that predicts 1 when the mean pixel is above the clean mean: it
  # depends on the corruption, so per-type accuracies differ and are averaged.
  threshold = x.mean()
  predict = lambda imgs: (imgs.reshape(len(imgs), -1).mean(1) > threshold).astype(int)
  names = ("brightness", "contrast", "gaussian_noise")
  result = corruptions.corruption_accuracy(predict, x, labels, severities=(3, 5), names=names,
                                           cache_dir=tmp_path)
  assert set(result["per_type"]) == set(names)
  for s in ("3", "5"):
    want = np.mean([np.mean(predict(corruptions.corrupt(x, n, int(s))) == labels)
                    for n in names])
    assert result["mean"][s] == pytest.approx(want)
  assert result["per_type"]["brightness"]["5"] == 0.5  # brighter: all predicted 1


@pytest.mark.parametrize("args, match", [
    (("blur", 3), "name"), (("fog", 0), "severity"), (("fog", 6), "severity"),
    (("fog", 2.0), "severity"),
])
def test_bad_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    corruptions.corrupt(images(n=1), *args)


def test_bad_images():
  with pytest.raises(ValueError, match="images"):
    corruptions.corrupt(images(n=1).astype(np.float32), "fog", 1)
  with pytest.raises(ValueError, match="images"):
    corruptions.corrupt(images(n=1)[..., :2], "fog", 1)


def test_missing_imagecorruptions_names_the_corruptions_extra(monkeypatch):
  """Without imagecorruptions the error says which extra to install (not `vision`)."""
  from safe_optax.vision import corruption_functions  # pylint: disable=import-outside-toplevel
  corruption_functions._lib.cache_clear()  # pylint: disable=protected-access
  monkeypatch.setitem(sys.modules, "imagecorruptions", None)  # `import` now raises ImportError
  assert not corruption_functions.available()
  try:
    with pytest.raises(ImportError) as info:
      corruptions.corrupt(images(n=1), "fog", 1)
  finally:
    corruption_functions._lib.cache_clear()  # pylint: disable=protected-access
  message = str(info.value)
  assert 'pip install "safe-optax[corruptions]"' in message
  assert "--no-deps" in message and "opencv-python-headless" in message
  assert "`vision` extra" not in message
  # Corruptions that need no imagecorruptions helper still work without it.
  assert corruptions.corrupt(images(n=1), "contrast", 1).dtype == np.uint8
