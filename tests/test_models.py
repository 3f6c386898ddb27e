"""Tests for the Linen vision models (`safe_optax.vision`).

Architecture checks run on abstract values (`jax.eval_shape`), so even VGG-19
costs no FLOPs: the prunable kernel counts are the spec (ResNet-20x2/C10
1,081,440, VGG-19-BN/C10 20,548,288, MLP 266,200), output shapes on CIFAR
(N, 32, 32, 3) and MNIST (N, 28, 28, 1) inputs, the stride / stage layout of
the ResNet, and the default prunable selection (kernels only). The BatchNorm
wiring (batch statistics and momentum 0.9 in training mode, running averages
in eval mode) is checked numerically on shrunken instances of the same modules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import safe_optax
from safe_optax import vision
from safe_optax.vision import MLP, VGG, VGG19, LeNet5, ResNet, resnet20, resnet32

CIFAR = (3, 32, 32, 3)
MNIST = (3, 28, 28, 1)


def abstract_variables(model, shape):
  init = functools.partial(model.init, train=False)
  return jax.eval_shape(init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct(shape, jnp.float32))


@functools.lru_cache(maxsize=None)
def cached_variables(name, shape):
  """Abstract variables of ``MODELS[name]`` (tracing VGG-19 costs ~0.5 s; do it once)."""
  return abstract_variables(MODELS[name][0](), shape)


def leaves_with_names(tree):
  return [("/".join(str(k.key) for k in path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def kernel_count(params):
  return sum(leaf.size for name, leaf in leaves_with_names(params) if name.endswith("/kernel"))


def resnet_kernel_count(blocks, width, in_channels=3, classes=10):
  """Independent count from the architecture description (3x3 convs, 1x1 projections)."""
  widths = [16 * width, 32 * width, 64 * width]
  total, cin = 9 * in_channels * widths[0], widths[0]
  for cout in widths:
    for _ in range(blocks):
      total += 9 * cin * cout + 9 * cout * cout + (cin * cout if cin != cout else 0)
      cin = cout
  return total + cin * classes


MODELS = {
    "resnet20x2": (lambda: resnet20(num_classes=10, width=2), CIFAR),
    "vgg19": (lambda: VGG19(num_classes=10), CIFAR),
    "mlp": (lambda: MLP(), MNIST),
    "lenet5": (lambda: LeNet5(), MNIST),
}


@pytest.mark.parametrize("name, expected", [
    ("resnet20x2", 1_081_440), ("vgg19", 20_548_288), ("mlp", 266_200),
    ("lenet5", 5 * 5 * 1 * 6 + 5 * 5 * 6 * 16 + 400 * 120 + 120 * 84 + 84 * 10)])
def test_kernel_counts_are_the_spec(name, expected):
  params = cached_variables(name, MODELS[name][1])["params"]
  assert kernel_count(params) == expected


@pytest.mark.parametrize("blocks, width, make", [
    (3, 1, lambda: resnet20()), (3, 2, lambda: resnet20(width=2)),
    (5, 1, lambda: resnet32()), (5, 2, lambda: resnet32(width=2))])
def test_resnet_counts_match_independent_formula(blocks, width, make):
  params = abstract_variables(make(), CIFAR)["params"]
  assert kernel_count(params) == resnet_kernel_count(blocks, width)
  if (blocks, width) == (3, 1):
    assert kernel_count(params) == 270_896  # the ResNet-20 of the pruning literature


def test_resnet20x2_layer_shapes():
  params = cached_variables("resnet20x2", CIFAR)["params"]
  shapes = {name: leaf.shape for name, leaf in leaves_with_names(params)}
  kernels = [s for n, s in shapes.items() if n.endswith("/kernel")]
  assert len(kernels) == 1 + 9 * 2 + 2 + 1  # stem, 18 block convs, 2 projections, Dense
  assert shapes["conv_init/kernel"] == (3, 3, 3, 32)
  assert shapes["ResNetBlock_3/conv_proj/kernel"] == (1, 1, 32, 64)
  assert shapes["ResNetBlock_6/conv_proj/kernel"] == (1, 1, 64, 128)
  assert "ResNetBlock_4/conv_proj/kernel" not in shapes  # identity shortcut inside a stage
  assert shapes["Dense_0/kernel"] == (128, 10) and shapes["Dense_0/bias"] == (10,)
  # Convs feed BatchNorm, so they carry no bias; every BN has scale and bias.
  assert not [n for n in shapes if "Conv" in n and n.endswith("/bias")]
  assert not [n for n in shapes if n.startswith("conv") and n.endswith("/bias")]
  bn = [s for n, s in shapes.items() if ("BatchNorm" in n or "norm_proj" in n or "bn_init" in n)]
  assert len(bn) == 2 * (1 + 18 + 2)


def test_resnet_stage_resolutions():
  """Stride 2 at the entry of stages 2 and 3 only: 32 -> 32, 16, 8."""
  model = resnet20(width=2)
  variables = cached_variables("resnet20x2", CIFAR)
  apply = functools.partial(model.apply, train=False, capture_intermediates=True,
                            mutable=["intermediates"])
  _, inter = jax.eval_shape(apply, variables, jax.ShapeDtypeStruct(CIFAR, jnp.float32))
  spatial = [inter["intermediates"][f"ResNetBlock_{i}"]["__call__"][0].shape
             for i in range(9)]
  assert spatial == [(3, 32, 32, 32)] * 3 + [(3, 16, 16, 64)] * 3 + [(3, 8, 8, 128)] * 3


def test_vgg19_layer_shapes():
  params = cached_variables("vgg19", CIFAR)["params"]
  shapes = {name: leaf.shape for name, leaf in leaves_with_names(params)}
  convs = [shapes[f"Conv_{i}/kernel"] for i in range(16)]
  assert [c[3] for c in convs] == [64] * 2 + [128] * 2 + [256] * 4 + [512] * 8
  assert all(c[:2] == (3, 3) for c in convs)
  assert [shapes[f"Dense_{i}/kernel"] for i in range(3)] == [(512, 512), (512, 512), (512, 10)]
  assert "Conv_16/kernel" not in shapes and "Dense_3/kernel" not in shapes
  assert not [n for n in shapes if n.startswith("Conv") and n.endswith("/bias")]
  assert all(f"Dense_{i}/bias" in shapes for i in range(3))


def test_mlp_layer_shapes():
  params = cached_variables("mlp", MNIST)["params"]
  shapes = {name: leaf.shape for name, leaf in leaves_with_names(params)}
  assert shapes == {"Dense_0/kernel": (784, 300), "Dense_0/bias": (300,),
                    "Dense_1/kernel": (300, 100), "Dense_1/bias": (100,),
                    "Dense_2/kernel": (100, 10), "Dense_2/bias": (10,)}


def test_lenet5_layer_shapes():
  params = cached_variables("lenet5", MNIST)["params"]
  shapes = {name: leaf.shape for name, leaf in leaves_with_names(params)}
  # 28x28 -> conv 'SAME' 28x28x6 -> pool 14x14 -> conv 'VALID' 10x10x16 -> pool 5x5x16 = 400.
  assert shapes == {"Conv_0/kernel": (5, 5, 1, 6), "Conv_0/bias": (6,),
                    "Conv_1/kernel": (5, 5, 6, 16), "Conv_1/bias": (16,),
                    "Dense_0/kernel": (400, 120), "Dense_0/bias": (120,),
                    "Dense_1/kernel": (120, 84), "Dense_1/bias": (84,),
                    "Dense_2/kernel": (84, 10), "Dense_2/bias": (10,)}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [CIFAR, MNIST], ids=["cifar", "mnist"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_output_shapes(name, shape, train):
  model = MODELS[name][0]()
  variables = cached_variables(name, shape)
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  if train:
    apply = functools.partial(model.apply, train=True, mutable=["batch_stats"])
    logits, new_state = jax.eval_shape(apply, variables, x)
    # Training mode updates exactly the existing running statistics.
    expected = variables.get("batch_stats")
    if expected is None:
      assert new_state == {}
    else:
      assert jax.tree.structure(new_state["batch_stats"]) == jax.tree.structure(expected)
      assert jax.tree.map(lambda a: a.shape, new_state["batch_stats"]) == jax.tree.map(
          lambda a: a.shape, expected)
  else:
    logits = jax.eval_shape(functools.partial(model.apply, train=False), variables, x)
  assert logits.shape == (shape[0], 10) and logits.dtype == jnp.float32


@pytest.mark.parametrize("make", [lambda: resnet20(num_classes=100, width=2),
                                  lambda: VGG19(num_classes=100), lambda: MLP(num_classes=100)])
def test_num_classes(make):
  model = make()
  variables = abstract_variables(model, CIFAR)
  logits = jax.eval_shape(functools.partial(model.apply, train=False), variables,
                          jax.ShapeDtypeStruct(CIFAR, jnp.float32))
  assert logits.shape == (CIFAR[0], 100)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_prunable_selection_is_exactly_the_kernels(name):
  params = cached_variables(name, MODELS[name][1])["params"]
  mask = safe_optax.prunable_mask(params)
  selected = {n for n, flag in leaves_with_names(mask) if flag}
  kernels = {n for n, _ in leaves_with_names(params) if n.endswith("/kernel")}
  assert selected == kernels
  # Biases and BN scale/bias are all left dense (and do exist).
  others = {n for n, _ in leaves_with_names(params)} - kernels
  assert others and all(n.endswith(("/bias", "/scale")) for n in others)
  assert sum(leaf.size for (n, leaf) in leaves_with_names(params) if n in selected) == \
      kernel_count(params)


def test_batchnorm_train_and_eval_modes():
  """Train: running mean <- 0.9 * mean + 0.1 * batch mean (var likewise, eps 1e-5 aside).

  Eval: running averages, so each example's logits do not depend on the others.
  Runs a shrunken ResNet (one block per stage, 8x8 inputs) with numpy-drawn
  weights: random initialisers inside jit cost seconds of XLA compile on CPU.
  """
  model = ResNet(blocks_per_stage=1, width=1)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 3)) + 0.5
  rng = np.random.default_rng(0)
  variables = jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(np.float32),
                           abstract_variables(model, x.shape))
  variables["batch_stats"] = jax.tree.map(np.abs, variables["batch_stats"])  # var > 0

  @jax.jit
  def run(variables, x):
    _, state = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return state, model.apply(variables, x, train=False), model.apply(variables, x[:1],
                                                                      train=False)

  state, eval_all, eval_one = run(variables, x)
  old = variables["batch_stats"]["bn_init"]
  kernel = np.asarray(variables["params"]["conv_init"]["kernel"], np.float64)
  padded = np.pad(np.asarray(x, np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
  conv_out = sum(np.einsum("nhwc,co->nhwo", padded[:, i:i + 8, j:j + 8], kernel[i, j])
                 for i in range(3) for j in range(3))
  new = state["batch_stats"]["bn_init"]
  np.testing.assert_allclose(new["mean"], 0.9 * old["mean"] + 0.1 * conv_out.mean((0, 1, 2)),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(new["var"], 0.9 * old["var"] + 0.1 * conv_out.var((0, 1, 2)),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(eval_all[:1], eval_one, rtol=1e-5, atol=1e-5)
  assert not np.allclose(new["mean"], old["mean"], atol=1e-3)  # the update is not a no-op


def test_package_reexports():
  assert vision.resnet20 is resnet20 and vision.VGG19 is VGG19 and vision.MLP is MLP
  assert isinstance(vision.vgg19(), VGG) and vision.mlp().features == (300, 100)
