"""Flax Linen models for the CIFAR / MNIST experiments of SAFE.

Shaped like the google/flax examples (``nn.compact`` modules, ``ModuleDef``
factories, ``__call__(x, train)``), with the architectures of the pruning
literature:

* :class:`ResNet`: CIFAR ResNet v1 (He et al., 2016, Sec. 4.2): a 3x3 stem
  conv, 3 stages of ``blocks_per_stage`` basic blocks of widths
  ``(w, 2w, 4w)``, stride 2 at the entry of stages 2 and 3 with a 1x1 conv +
  BN projection shortcut, global average pooling and a Dense classifier.
  :func:`resnet20` / :func:`resnet32` have 3 / 5 blocks per stage; ``width=2``
  doubles the channels (ResNet-20x2: 1,081,440 prunable kernel weights).
* :class:`VGG`: VGG-19 with BatchNorm (conv stages 64x2, 128x2, 256x4,
  512x4, 512x4, a 2x2 max-pool after each) and a 512-512-classes Dense head,
  no dropout (20,548,288 kernel weights on CIFAR-10).
* :class:`MLP`: LeNet-300-100 (784-300-100-10, 266,200 kernel weights).
* :class:`LeNet5`: LeNet-5 for 28x28 inputs (conv 5x5 x6 'SAME' - max-pool -
  conv 5x5 x16 - max-pool - Dense 120-84-classes; 61,470 kernel weights), a
  small conv net for CPU-sized MNIST / Fashion-MNIST experiments.

Convolutions followed by BatchNorm have no bias; Dense layers have biases.
``conv_impl="im2col"`` computes every convolution as :func:`im2col_conv` (the
same parameters and outputs): under ``jax.vmap`` over runs' kernels, as in a
packed step, a convolution becomes a grouped convolution, and im2col a batched
matmul instead.
BatchNorm uses ``momentum=0.9, epsilon=1e-5`` (PyTorch's defaults) and the
batch statistics in training mode, so call ``apply`` with
``mutable=['batch_stats']`` when ``train=True`` (see
:mod:`safe_optax.flax_utils`).

Examples:
  >>> import functools, jax, jax.numpy as jnp
  >>> from safe_optax.vision import resnet20
  >>> model = resnet20(num_classes=10, width=2)
  >>> init = functools.partial(model.init, train=False)
  >>> variables = jax.eval_shape(init, jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))
  >>> sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(variables['params'])[0]
  ...     if p[-1].key == 'kernel')
  1081440
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from safe_optax.vision.configs import Config

ModuleDef = Any

__all__ = ("CONV_IMPLS", "LeNet5", "MLP", "ResNet", "ResNetBlock", "VGG", "VGG19",
           "im2col_conv", "lenet5", "mlp", "resnet20", "resnet32", "vgg19")

BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5

# He-normal (fan_out), as torchvision / the CIFAR ResNet reference code.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")

CONV_IMPLS = ("xla", "im2col")
"""How the conv models compute a convolution: ``xla`` (``lax.conv_general_dilated``) or
``im2col`` (:func:`im2col_conv`)."""


def im2col_conv(lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding: Any,
                lhs_dilation: Optional[Sequence[int]] = None,
                rhs_dilation: Optional[Sequence[int]] = None, dimension_numbers: Any = None,
                feature_group_count: int = 1, batch_group_count: int = 1,
                precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
  """``lax.conv_general_dilated`` for NHWC inputs and HWIO kernels, as slices and one matmul.

  The padded input's ``kh * kw`` strided windows are laid side by side on the
  channel axis (``[B, H', W', kh*kw*C]``) and multiplied by the kernel reshaped
  to ``[kh*kw*C, O]``. The arguments are ``lax.conv_general_dilated``'s, so Flax's
  ``nn.Conv(conv_general_dilated=im2col_conv)`` takes it; the values and
  gradients are the same up to the order of the sums.

  Raises:
    ValueError: what it does not cover, by name: dimension numbers other than
      NHWC / HWIO / NHWC, dilation, or feature / batch groups.
  """
  if lhs.ndim != 4 or rhs.ndim != 4:
    raise ValueError(f"im2col_conv takes 2-D convolutions (4-D lhs and rhs), got lhs "
                     f"{lhs.shape}, rhs {rhs.shape}")
  expected = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, ("NHWC", "HWIO", "NHWC"))
  if dimension_numbers is None or jax.lax.conv_dimension_numbers(
      lhs.shape, rhs.shape, dimension_numbers) != expected:
    raise ValueError(f"im2col_conv takes dimension_numbers NHWC / HWIO / NHWC, got "
                     f"{dimension_numbers!r}")
  for name, value in (("lhs_dilation", lhs_dilation), ("rhs_dilation", rhs_dilation)):
    if value is not None and any(d != 1 for d in value):
      raise ValueError(f"im2col_conv takes no dilation, got {name}={tuple(value)}")
  for name, value in (("feature_group_count", feature_group_count),
                      ("batch_group_count", batch_group_count)):
    if value != 1:
      raise ValueError(f"im2col_conv takes no groups, got {name}={value}")
  kh, kw, channels, out = rhs.shape
  sh, sw = window_strides
  pads = (jax.lax.padtype_to_pads(lhs.shape[1:3], (kh, kw), window_strides, padding)
          if isinstance(padding, str) else padding)
  x = jnp.pad(lhs, ((0, 0), tuple(pads[0]), tuple(pads[1]), (0, 0)))
  # A window larger than the padded image has no output position (0 rows or columns).
  out_h, out_w = max(0, (x.shape[1] - kh) // sh + 1), max(0, (x.shape[2] - kw) // sw + 1)
  if out_h == 0 or out_w == 0:
    # Slicing to an empty window would wrap around (a negative stop): no columns at all.
    columns = jnp.zeros((x.shape[0], out_h, out_w, kh * kw * channels), x.dtype)
  else:
    columns = jnp.concatenate(
        [x[:, i:i + sh * (out_h - 1) + 1:sh, j:j + sw * (out_w - 1) + 1:sw, :]
         for i in range(kh) for j in range(kw)], axis=-1)
  return jnp.einsum("bhwk,ko->bhwo", columns, rhs.reshape(kh * kw * channels, out),
                    precision=precision, preferred_element_type=preferred_element_type)


def _conv_function(conv_impl: str) -> Any:
  """``nn.Conv``'s ``conv_general_dilated`` for ``conv_impl`` (``None``: Flax's default)."""
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f"conv_impl must be one of {CONV_IMPLS}, got {conv_impl!r}")
  return im2col_conv if conv_impl == "im2col" else None


def _norm(train: bool, dtype: Any, axis_name: Optional[str]) -> ModuleDef:
  return functools.partial(
      nn.BatchNorm, use_running_average=not train, momentum=BN_MOMENTUM,
      epsilon=BN_EPSILON, dtype=dtype, axis_name=axis_name,
  )


class ResNetBlock(nn.Module):
  """Basic block: conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU.

  The shortcut is the identity, or a 1x1 conv (with ``strides``) + BN when the
  shape changes (option B of He et al.).
  """

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = nn.relu(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm()(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return nn.relu(residual + y)


class ResNet(nn.Module):
  """CIFAR ResNet v1: 3 stages of widths ``(w, 2w, 4w)``, ``w = 16 * width``.

  Attributes:
    blocks_per_stage: basic blocks per stage (3 for ResNet-20, 5 for ResNet-32).
    num_classes: outputs of the final Dense layer.
    width: channel multiplier (1: 16/32/64, 2: 32/64/128).
    dtype: computation dtype (parameters and BatchNorm statistics stay float32).
    precision: ``precision`` of every convolution and Dense layer (a ``jax.lax.Precision``).
    bn_axis_name: ``axis_name`` for cross-replica BatchNorm (``pmap`` users).
  """

  blocks_per_stage: int
  num_classes: int = 10
  width: int = 1
  dtype: Any = jnp.float32
  precision: Any = None
  bn_axis_name: Optional[str] = None
  conv_impl: str = "xla"

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(nn.Conv, use_bias=False, padding="SAME", dtype=self.dtype,
                             precision=self.precision, kernel_init=conv_init,
                             conv_general_dilated=_conv_function(self.conv_impl))
    norm = _norm(train, self.dtype, self.bn_axis_name)
    widths = (16 * self.width, 32 * self.width, 64 * self.width)
    x = conv(widths[0], (3, 3), name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    for stage, filters in enumerate(widths):
      for block in range(self.blocks_per_stage):
        strides = (2, 2) if stage > 0 and block == 0 else (1, 1)
        x = ResNetBlock(filters, conv=conv, norm=norm, strides=strides)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, precision=self.precision)(x)
    return jnp.asarray(x, jnp.float32)


def resnet20(num_classes: int = 10, width: int = 1, **kwargs: Any) -> ResNet:
  """ResNet-20 (3 blocks per stage); ``width=2`` is the ResNet-20x2 of SAFE."""
  return ResNet(blocks_per_stage=3, num_classes=num_classes, width=width, **kwargs)


def resnet32(num_classes: int = 10, width: int = 1, **kwargs: Any) -> ResNet:
  """ResNet-32 (5 blocks per stage)."""
  return ResNet(blocks_per_stage=5, num_classes=num_classes, width=width, **kwargs)


VGG19_STAGES: tuple[tuple[int, ...], ...] = (
    (64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4)


class VGG(nn.Module):
  """VGG with BatchNorm for 32x32 inputs: 3x3 conv-BN-ReLU stages, 2x2 max-pool after each.

  The pooling pads ('SAME'), which changes nothing on 32x32 inputs and lets
  28x28 inputs reach a 1x1 map too. The head is Dense(512)-ReLU-Dense(512)-
  ReLU-Dense(classes) on the flattened features, without dropout.

  Attributes:
    stages: output channels of the convs, one tuple per stage.
    num_classes: outputs of the final Dense layer.
    hidden: width of the two hidden Dense layers.
    dtype: computation dtype (parameters and BatchNorm statistics stay float32).
    precision: ``precision`` of every convolution and Dense layer (a ``jax.lax.Precision``).
    bn_axis_name: ``axis_name`` for cross-replica BatchNorm.
  """

  stages: Sequence[Sequence[int]] = VGG19_STAGES
  num_classes: int = 10
  hidden: int = 512
  dtype: Any = jnp.float32
  precision: Any = None
  bn_axis_name: Optional[str] = None
  conv_impl: str = "xla"

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(nn.Conv, kernel_size=(3, 3), use_bias=False, padding="SAME",
                             dtype=self.dtype, precision=self.precision, kernel_init=conv_init,
                             conv_general_dilated=_conv_function(self.conv_impl))
    norm = _norm(train, self.dtype, self.bn_axis_name)
    for stage in self.stages:
      for filters in stage:
        x = nn.relu(norm()(conv(filters)(x)))
      x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, precision=self.precision)(x))
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, precision=self.precision)(x))
    x = nn.Dense(self.num_classes, dtype=self.dtype, precision=self.precision)(x)
    return jnp.asarray(x, jnp.float32)


VGG19 = functools.partial(VGG, stages=VGG19_STAGES)
"""VGG-19 with BatchNorm (16 convs + 3 Dense): ``VGG19(num_classes=10)``."""


def vgg19(num_classes: int = 10, **kwargs: Any) -> VGG:
  """VGG-19-BN for CIFAR (20,548,288 kernel weights with 10 classes)."""
  return VGG(stages=VGG19_STAGES, num_classes=num_classes, **kwargs)


class MLP(nn.Module):
  """LeNet-300-100: flatten, Dense(300)-ReLU-Dense(100)-ReLU-Dense(classes).

  ``train`` is accepted for a uniform interface and unused (no BN / dropout).
  """

  features: Sequence[int] = (300, 100)
  num_classes: int = 10
  dtype: Any = jnp.float32
  precision: Any = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape((x.shape[0], -1))
    for width in self.features:
      x = nn.relu(nn.Dense(width, dtype=self.dtype, precision=self.precision)(x))
    x = nn.Dense(self.num_classes, dtype=self.dtype, precision=self.precision)(x)
    return jnp.asarray(x, jnp.float32)


def mlp(num_classes: int = 10, **kwargs: Any) -> MLP:
  """The 784-300-100-10 MLP (266,200 kernel weights on MNIST)."""
  return MLP(num_classes=num_classes, **kwargs)


class LeNet5(nn.Module):
  """LeNet-5 (LeCun et al., 1998) with ReLU and max-pooling, for 28x28 inputs.

  conv 5x5 x6 ('SAME', so 28x28 keeps its size) - ReLU - 2x2 max-pool - conv
  5x5 x16 ('VALID') - ReLU - 2x2 max-pool - Dense(120)-ReLU-Dense(84)-ReLU-
  Dense(classes). All layers have biases; no BatchNorm, so ``train`` is
  accepted for a uniform interface and unused.
  """

  num_classes: int = 10
  dtype: Any = jnp.float32
  precision: Any = None
  conv_impl: str = "xla"

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    dense = functools.partial(nn.Dense, dtype=self.dtype, precision=self.precision)
    conv = functools.partial(nn.Conv, dtype=self.dtype, precision=self.precision,
                             conv_general_dilated=_conv_function(self.conv_impl))
    x = nn.relu(conv(6, (5, 5), padding="SAME")(x))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(conv(16, (5, 5), padding="VALID")(x))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(dense(120)(x))
    x = nn.relu(dense(84)(x))
    x = dense(self.num_classes)(x)
    return jnp.asarray(x, jnp.float32)


def lenet5(num_classes: int = 10, **kwargs: Any) -> LeNet5:
  """LeNet-5 for 28x28 images (61,470 kernel weights with 10 classes)."""
  return LeNet5(num_classes=num_classes, **kwargs)


def create_model(config: "Config", num_classes: int) -> nn.Module:
  """The Linen model of ``config.model`` (with its ``width``, ``mlp_features``, ``dtype``
  and ``matmul_precision``).

  Examples:
    >>> from safe_optax.vision import configs
    >>> create_model(configs.get_config("mlp-mnist"), 10)
    MLP(
        # attributes
        features = (300, 100)
        num_classes = 10
        dtype = float32
        precision = Precision.DEFAULT
    )
  """
  numerics = {"dtype": getattr(jnp, config.dtype),
              "precision": jax.lax.Precision(config.matmul_precision)}
  _conv_function(config.conv_impl)  # an unknown conv_impl fails here, not at the first call
  convs = {**numerics, "conv_impl": config.conv_impl}
  if config.model == "resnet8":
    return ResNet(blocks_per_stage=1, num_classes=num_classes, width=config.width, **convs)
  if config.model == "resnet20":
    return resnet20(num_classes, width=config.width, **convs)
  if config.model == "resnet32":
    return resnet32(num_classes, width=config.width, **convs)
  if config.model == "vgg19":
    return vgg19(num_classes, **convs)
  if config.model == "lenet5":
    return lenet5(num_classes, **convs)
  return MLP(features=tuple(config.mlp_features), num_classes=num_classes, **numerics)
