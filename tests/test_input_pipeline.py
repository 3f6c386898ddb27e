"""Loaders on tiny generated files in every supported format, label noise, augmentation."""

import gzip
import io
import pickle
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from safe_optax.vision import input_pipeline as ip


def _write_cifar10_pickles(root, rng):
  root.mkdir()
  batches = []
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    data = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, 4).tolist()
    batches.append((data, labels))
    with open(root / name, "wb") as f:
      pickle.dump({"data": data, "labels": labels}, f)
  with open(root / "batches.meta", "wb") as f:
    pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
  return batches


def test_cifar10_pickles_decode_channel_last(tmp_path):
  batches = _write_cifar10_pickles(tmp_path / "cifar-10-batches-py", np.random.default_rng(0))
  data = ip.load_cifar(tmp_path / "cifar-10-batches-py")
  assert data.train_images.shape == (20, 32, 32, 3) and data.test_images.shape == (4, 32, 32, 3)
  first = batches[0][0][0].reshape(3, 32, 32).transpose(1, 2, 0)
  np.testing.assert_array_equal(data.train_images[0], first)
  np.testing.assert_array_equal(data.test_labels, batches[-1][1])
  assert data.classes[3] == "c3" and data.train_labels.dtype == np.int32


def test_cifar100_pickles_use_fine_labels(tmp_path):
  root = tmp_path / "cifar-100-python"
  root.mkdir()
  rng = np.random.default_rng(1)
  for name, n in (("train", 6), ("test", 3)):
    with open(root / name, "wb") as f:
      pickle.dump({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                   "fine_labels": list(range(n)), "coarse_labels": [0] * n}, f)
  with open(root / "meta", "wb") as f:
    pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)]}, f)
  data = ip.load_cifar(root)
  assert data.num_classes == 100
  np.testing.assert_array_equal(data.train_labels, np.arange(6))


def _png(array):
  buffer = io.BytesIO()
  Image.fromarray(array).save(buffer, format="PNG")
  return buffer.getvalue()


def _image_tree(rng):
  """{split: [(class, filename, image)]} with lossless PNG images."""
  return {split: [(cls, f"{i:04d}.png", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
                  for cls in ("cat", "dog") for i in range(n)]
          for split, n in (("train", 3), ("test", 2))}


def _check_images(data, tree):
  assert data.classes == ("cat", "dog")
  for split, images, labels in (("train", data.train_images, data.train_labels),
                                ("test", data.test_images, data.test_labels)):
    expected = sorted(tree[split], key=lambda item: (item[0], item[1]))
    np.testing.assert_array_equal(images, np.stack([im for _, _, im in expected]))
    np.testing.assert_array_equal(labels, [("cat", "dog").index(c) for c, _, _ in expected])


def test_image_folder_directory_and_tar_gz_agree(tmp_path):
  tree = _image_tree(np.random.default_rng(2))
  folder = tmp_path / "folder"
  archive = tmp_path / "images.tar.gz"
  with tarfile.open(archive, "w:gz") as tar:
    for split, items in tree.items():
      for cls, name, image in items:
        path = folder / split / cls / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_png(image))
        tar.add(path, arcname=f"{split}/{cls}/{name}")
  _check_images(ip.load_cifar(folder, cache_dir=tmp_path / "cache"), tree)
  _check_images(ip.load_cifar(archive, cache_dir=tmp_path / "cache"), tree)
  # Decoded once: the second load reads the cache.
  assert len(list((tmp_path / "cache").glob("*.npz"))) == 2
  _check_images(ip.load_cifar(archive, cache_dir=tmp_path / "cache"), tree)


def _write_idx(path, array, gz=True):
  header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(
      d.to_bytes(4, "big") for d in array.shape)
  payload = header + array.astype(np.uint8).tobytes()
  if gz:
    with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
      f.write(payload)
  else:
    path.write_bytes(payload)


def _write_t10k(directory, rng):
  """30 random 28x28 t10k images (gzipped idx) and labels (plain idx) in ``directory``."""
  images = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
  labels = rng.integers(0, 10, 30).astype(np.uint8)
  _write_idx(directory / "t10k-images-idx3-ubyte", images)
  _write_idx(directory / "t10k-labels-idx1-ubyte", labels, gz=False)
  return images, labels


def test_mnist_idx_full_and_test_only_split(tmp_path):
  images, labels = _write_t10k(tmp_path, np.random.default_rng(3))
  with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
    ip.load_mnist(tmp_path)
  split = ip.load_mnist(tmp_path, test_only_split=(20, 10), seed=5)
  assert split.train_images.shape == (20, 28, 28, 1) and split.test_images.shape == (10, 28, 28, 1)
  order = np.random.default_rng(5).permutation(30)
  np.testing.assert_array_equal(split.test_images[..., 0], images[order[20:]])
  _write_idx(tmp_path / "train-images-idx3-ubyte", images[:12])
  _write_idx(tmp_path / "train-labels-idx1-ubyte", labels[:12])
  full = ip.load_mnist(tmp_path)
  np.testing.assert_array_equal(full.train_labels, labels[:12])


def test_missing_and_malformed_sources_name_what_was_expected(tmp_path):
  with pytest.raises(FileNotFoundError, match="image folder"):
    ip.load_cifar(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="data_batch_1"):
    ip.load_cifar(tmp_path / "empty")
  partial = tmp_path / "partial"
  _write_cifar10_pickles(partial, np.random.default_rng(4))
  (partial / "test_batch").unlink()
  with pytest.raises(FileNotFoundError, match="test_batch"):
    ip.load_cifar(partial)


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_symmetric_label_noise_exact_ratio_and_always_another_class(ratio):
  labels = np.random.default_rng(6).integers(0, 10, 1000)
  noisy, corrupted = ip.symmetric_label_noise(labels, ratio, 10, seed=7)
  assert corrupted.sum() == round(ratio * 1000)
  np.testing.assert_array_equal(noisy != labels, corrupted)
  assert noisy.min() >= 0 and noisy.max() < 10
  again, _ = ip.symmetric_label_noise(labels, ratio, 10, seed=7)
  np.testing.assert_array_equal(noisy, again)


def test_epoch_order_is_a_seeded_permutation_covering_every_example():
  a, b = ip.epoch_order(1000, seed=1, epoch=3), ip.epoch_order(1000, seed=1, epoch=3)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.sort(a), np.arange(1000))
  assert not np.array_equal(a, ip.epoch_order(1000, seed=1, epoch=4))
  assert ip.num_batches(1000, 128) == 8 and ip.num_batches(1024, 128) == 8


def test_random_crop_flip_is_deterministic_and_a_shifted_window():
  images = jnp.asarray(np.random.default_rng(8).integers(1, 256, (16, 8, 8, 3)), jnp.uint8)
  key = jax.random.PRNGKey(0)
  out = ip.random_crop_flip(key, images, pad=2)
  np.testing.assert_array_equal(out, ip.random_crop_flip(key, images, pad=2))
  assert out.shape == images.shape and out.dtype == images.dtype
  padded = np.pad(np.asarray(images), ((0, 0), (2, 2), (2, 2), (0, 0)))
  for i in range(16):
    candidates = [padded[i, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
    candidates += [c[:, ::-1] for c in candidates]
    assert any(np.array_equal(np.asarray(out[i]), c) for c in candidates)
  assert not np.array_equal(out, ip.random_crop_flip(jax.random.PRNGKey(1), images, pad=2))


def test_normalize_matches_formula():
  images = jnp.asarray([[[[0, 255, 51]]]], jnp.uint8)
  out = ip.normalize(images, (0.5, 0.5, 0.2), (0.25, 0.5, 1.0))
  np.testing.assert_allclose(out[0, 0, 0], [-2.0, 1.0, 0.0], atol=1e-6)


def test_sample_indices_is_a_seeded_sample_of_a_class_sorted_set():
  labels = np.repeat(np.arange(10), 100)  # stored class by class, as image folders are
  first = ip.sample_indices(1000, 100, np.random.default_rng(0))
  assert len(first) == 100 and np.all(np.diff(first) > 0) and first[-1] < 1000
  assert len(set(labels[first])) == 10  # labels[:100] would be a single class
  np.testing.assert_array_equal(first, ip.sample_indices(1000, 100, np.random.default_rng(0)))
  assert not np.array_equal(first, ip.sample_indices(1000, 100, np.random.default_rng(1)))


@pytest.mark.parametrize("size", [None, 7, 9])
def test_sample_indices_everything_draws_nothing(size):
  rng = np.random.default_rng(0)
  np.testing.assert_array_equal(ip.sample_indices(7, size, rng), np.arange(7))
  np.testing.assert_array_equal(rng.permutation(5), np.random.default_rng(0).permutation(5))


def test_sample_indices_rejects_a_negative_size():
  with pytest.raises(ValueError, match="non-negative"):
    ip.sample_indices(5, -1, np.random.default_rng(0))


def _image_archive(tmp_path):
  tree = _image_tree(np.random.default_rng(6))
  archive = tmp_path / "images.tar.gz"
  with tarfile.open(archive, "w:gz") as tar:
    for split, items in tree.items():
      for cls, name, image in items:
        data = _png(image)
        info = tarfile.TarInfo(f"{split}/{cls}/{name}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
  return archive


@pytest.mark.parametrize("keep", [0.5, 0.95])
def test_a_truncated_tar_gz_names_the_file_and_says_truncated(tmp_path, keep):
  archive = _image_archive(tmp_path)
  data = archive.read_bytes()
  archive.write_bytes(data[:int(keep * len(data))])
  with pytest.raises(ValueError, match=r"truncated or corrupt") as err:
    ip.load_cifar(archive, cache_dir=tmp_path / "cache")
  assert str(archive) in str(err.value)
  assert not list((tmp_path / "cache").glob("*.npz"))  # nothing cached from a broken archive


def test_truncated_mnist_idx_and_cifar_pickles_name_the_file(tmp_path):
  rng = np.random.default_rng(7)
  images, labels = _write_t10k(tmp_path, rng)
  gz = tmp_path / "t10k-images-idx3-ubyte.gz"
  gz.write_bytes(gz.read_bytes()[:-40])  # a cut gzip stream: EOFError inside gzip
  with pytest.raises(ValueError, match="truncated or corrupt") as err:
    ip.load_mnist(tmp_path, test_only_split=(20, 10))
  assert str(gz) in str(err.value)
  _write_idx(tmp_path / "t10k-images-idx3-ubyte", images)
  raw = tmp_path / "t10k-labels-idx1-ubyte"
  raw.write_bytes(raw.read_bytes()[:-5])  # whole stream, fewer labels than the header says
  with pytest.raises(ValueError, match="truncated or corrupt") as err:
    ip.load_mnist(tmp_path, test_only_split=(20, 10))
  assert str(raw) in str(err.value)
  cifar = tmp_path / "cifar"
  _write_cifar10_pickles(cifar, rng)
  batch = cifar / "data_batch_3"
  batch.write_bytes(batch.read_bytes()[:100])
  with pytest.raises(ValueError, match="truncated or corrupt") as err:
    ip.load_cifar(cifar)
  assert str(batch) in str(err.value)
