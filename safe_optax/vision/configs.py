"""Named training presets for the paper's image-classification rows (SPEC §3).

A :class:`Config` is a frozen dataclass: everything that determines a run,
seeds included, written verbatim to ``results.json``. Presets follow the
paper's recipe (SGD lr 0.1 with 5 linear warm-up epochs then a cosine decay
that reaches 0 at the last step, momentum 0.9, weight decay 1e-4, batch 128,
SAM radius 0.1, dual update every 32 steps, cosine-ramped penalty, 200 epochs
for ResNet-20 and 300 for ResNet-32 / VGG-19) with the paper's best penalty
``lambda`` per model and sparsity (Table of best lambdas, App. B).

Examples:
  >>> from safe_optax.vision import configs
  >>> config = configs.get_config("resnet20x2-cifar10", method="safe", sparsity=0.99)
  >>> config.epochs, config.width, config.resolved_penalty()
  (200, 2, 0.01)
  >>> configs.get_config("vgg19-cifar10", sparsity=0.95).resolved_penalty()
  0.0001
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, Optional, Union

from safe_optax import methods
from safe_optax.vision import models

METHODS = tuple(methods.REGISTRY)
"""Training methods understood by :func:`safe_optax.vision.train.train_and_evaluate`
(the names of :data:`safe_optax.methods.REGISTRY`)."""

MODELS = ("resnet8", "resnet20", "resnet32", "vgg19", "mlp", "lenet5")
"""``resnet8`` (one block per stage) is a small model for smoke tests."""

DATASETS = ("cifar10", "cifar100", "mnist", "fashion_mnist")
SALIENCIES = methods.SALIENCIES
DTYPES = ("float32", "bfloat16")
"""Compute dtypes of :attr:`Config.dtype`."""
MATMUL_PRECISIONS = ("default", "high", "highest")
"""Values of :attr:`Config.matmul_precision` (``jax.lax.Precision``'s names)."""
CONV_IMPLS = models.CONV_IMPLS
"""Values of :attr:`Config.conv_impl` (:data:`safe_optax.vision.models.CONV_IMPLS`)."""
STRUCTURES = tuple(methods.STRUCTURES)
"""Named sparsity sets of :attr:`Config.structure`: one top-k over all prunable leaves
(:class:`~safe_optax.Global`), the same fraction in each (:class:`~safe_optax.PerLeaf`) or
a fraction per leaf from its shape (:class:`~safe_optax.ERK`). ``"N:M"`` (e.g. ``"2:4"``,
:class:`~safe_optax.NM`, with ``sparsity`` ``1 - N/M``) is allowed too
(:func:`safe_optax.methods.parse_structure`)."""


@dataclasses.dataclass(frozen=True)
class Config(methods.Hyperparams):
  """A complete vision training run: the :class:`~safe_optax.methods.Hyperparams` of its
  method, the model, the data and the loop.

  ``penalty=None`` takes ``lambda`` from ``penalty_table``: the first
  ``(max_sparsity, lambda)`` entry whose ``max_sparsity >= sparsity``.
  """

  model: str = "resnet20"
  width: int = 1
  dtype: str = "float32"
  """The model's compute dtype: ``"bfloat16"`` runs convolutions, Dense layers and BatchNorm
  in bfloat16, while the parameters (the master weights), the optimizer state, the BatchNorm
  statistics, the projection's scores and the loss stay float32."""
  matmul_precision: str = "default"
  """``precision`` of every convolution and Dense layer (``jax.lax.Precision``): ``default``
  is TF32 for float32 on recent NVIDIA GPUs and one bfloat16 pass for bfloat16 (both
  accumulating in float32), full float32 on CPU; ``highest`` is full float32 everywhere."""
  conv_impl: str = "xla"
  """How convolutions are computed: ``xla`` (``lax.conv_general_dilated``) or ``im2col``
  (:func:`safe_optax.vision.models.im2col_conv`: shifted slices and one matmul, which a
  packed step batches as a matmul rather than a grouped convolution). Same parameters and
  outputs up to the order of the sums."""
  mlp_features: tuple[int, ...] = (300, 100)
  dataset: str = "cifar10"
  batch_size: int = 128
  eval_batch_size: int = 500
  augment: bool = True
  label_noise: float = 0.0
  train_subset: Optional[int] = None
  test_subset: Optional[int] = None
  test_only_split: Optional[tuple[int, int]] = None
  """MNIST with only the t10k files: ``(n_train, n_test)`` split of them (e.g. 8000, 2000)."""
  validation: Optional[int] = None
  """Hold out this many training examples (a sample seeded by ``data_seed``) and evaluate on
  them instead of the test set: the split on which hyperparameters are chosen. Label noise,
  when set, is applied before the split, so the validation labels are as noisy as the
  training labels."""
  bnt_samples: int = 10_000
  data_seed: int = 0
  """Seeds the training subset, the t10k split and the label noise (fixed across seeds)."""
  eval_every: int = 1
  checkpoint_every: int = 1
  log_every: int = 50
  """Per-step scalars (loss, learning rate, ``lambda_t``, ...) every this many steps of an epoch,
  kept on the device and written with the epoch's record (:mod:`safe_optax.vision.metrics`)."""

  def replace(self, **overrides: Any) -> "Config":
    """A validated copy with ``overrides`` applied (``None`` values are ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
    if unknown:
      raise ValueError(f"unknown config fields {sorted(unknown)}; known: "
                       f"{sorted(f.name for f in dataclasses.fields(self))}.")
    return validate(dataclasses.replace(self, **overrides))


def validate(config: Config) -> Config:
  """Checks every field; raises ``ValueError`` naming the field and what is allowed.

  The method's fields are :func:`safe_optax.methods.validate`'s; the rest are checked here.
  """
  methods.check_one_of(config.model, "model", MODELS)
  methods.check_one_of(config.dataset, "dataset", DATASETS)
  methods.check_one_of(config.dtype, "dtype", DTYPES)
  methods.check_one_of(config.matmul_precision, "matmul_precision", MATMUL_PRECISIONS)
  methods.check_one_of(config.conv_impl, "conv_impl", CONV_IMPLS)
  methods.validate(config)
  if not isinstance(config.augment, bool):
    raise ValueError(f"`augment` must be True or False, got {config.augment!r}.")
  for name in ("width", "batch_size", "eval_batch_size", "bnt_samples", "eval_every",
               "checkpoint_every", "log_every"):
    methods.check_positive_int(getattr(config, name), name)
  if not 0.0 <= config.label_noise <= 1.0:
    raise ValueError(f"`label_noise` must be in [0, 1], got {config.label_noise}.")
  for name in ("train_subset", "test_subset", "validation"):
    value = getattr(config, name)
    if value is not None:
      methods.check_positive_int(value, name)
  if config.validation is not None and config.train_subset is not None and (
      config.validation >= config.train_subset):
    raise ValueError(f"`validation` ({config.validation}) must be smaller than `train_subset` "
                     f"({config.train_subset}): the rest is the training split.")
  if config.test_only_split is not None and config.dataset not in ("mnist", "fashion_mnist"):
    raise ValueError("`test_only_split` applies to MNIST / Fashion-MNIST idx files only.")
  return config


# Best lambda per model and sparsity (paper, App. B): (max sparsity, lambda).
_RESNET20_C10 = ((0.98, 1e-3), (1.0, 1e-2))
_RESNET32_C100 = ((0.95, 1e-3), (1.0, 1e-2))
_VGG19_C10 = ((0.95, 1e-4), (0.98, 1e-3), (1.0, 1e-2))
_VGG19_C100 = ((1.0, 1e-3),)
# Not given in the paper for the MLP; chosen on a validation split of the
# 8k MNIST training part (6k/2k, 20 epochs, 95%, seed 0; lambda in 1e-3, 1e-2,
# 1e-1; the selection run is in git history,
# results/vision/mnist_lambda_validation.json). The cosine ramp keeps lambda_t small
# for most of training, so SAFE wants a larger lambda than ADMM.
_MLP = ((1.0, 1e-1),)
_MLP_ADMM = 1e-2

PRESETS: Mapping[str, Config] = {
    "resnet20x2-cifar10": Config(model="resnet20", width=2, dataset="cifar10", epochs=200,
                                 penalty_table=_RESNET20_C10),
    "resnet20-cifar10": Config(model="resnet20", width=1, dataset="cifar10", epochs=200,
                               penalty_table=_RESNET20_C10),
    "resnet32x2-cifar100": Config(model="resnet32", width=2, dataset="cifar100", epochs=300,
                                  penalty_table=_RESNET32_C100),
    "vgg19-cifar10": Config(model="vgg19", dataset="cifar10", epochs=300,
                            penalty_table=_VGG19_C10),
    "vgg19-cifar100": Config(model="vgg19", dataset="cifar100", epochs=300,
                             penalty_table=_VGG19_C100),
    "mlp-mnist": Config(model="mlp", dataset="mnist", epochs=100, augment=False,
                        penalty_table=_MLP, admm_penalty=_MLP_ADMM),
    "mlp-fashion-mnist": Config(model="mlp", dataset="fashion_mnist", epochs=100,
                                augment=False, penalty_table=_MLP, admm_penalty=_MLP_ADMM),
    "lenet5-fashion-mnist": Config(model="lenet5", dataset="fashion_mnist", epochs=30,
                                   warmup_epochs=2, augment=False, penalty_table=_MLP,
                                   admm_penalty=_MLP_ADMM),
}
"""The paper's rows (plus ``resnet20-cifar10``, the x1 model for CPU-sized runs)."""


def get_config(preset: str, **overrides: Any) -> Config:
  """The preset named ``preset`` with ``overrides`` (``None`` values are ignored).

  A run whose ``epochs`` does not exceed the preset's warm-up, with no
  ``warmup_epochs`` given, warms up for ``epochs // 10`` epochs instead (with a
  warning saying so), so a short run needs no extra flags.

  Raises:
    ValueError: unknown preset or field, or an invalid value.
  """
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
  return override(PRESETS[preset], overrides, name=f"preset {preset!r}")


def override(base: Config, overrides: Mapping[str, Any], *, name: str = "the config") -> Config:
  """``base`` with ``overrides`` applied at once and validated (``None`` values are ignored).

  As :func:`get_config` does for a preset: a run whose ``epochs`` does not
  exceed ``base``'s warm-up, with no ``warmup_epochs`` given, warms up for
  ``epochs // 10`` epochs instead (with a warning naming ``name``).

  Raises:
    ValueError: an unknown field, or an invalid value.

  Examples:
    >>> override(PRESETS["mlp-mnist"], {"epochs": 20, "seed": None}).epochs
    20
  """
  epochs = overrides.get("epochs")
  if (epochs is not None and overrides.get("warmup_epochs") is None
      and isinstance(epochs, int) and not isinstance(epochs, bool)):
    overrides = {**overrides,
                 "warmup_epochs": methods.fit_warmup(base.warmup_epochs, epochs, name=name)}
  return base.replace(**overrides)


def to_dict(config: Config) -> dict[str, Any]:
  """The fields as a plain dict (what ``results.json`` and ``config.json`` record).

  Tuples stay tuples here; ``json.dump`` writes them as lists, which
  :func:`from_dict` turns back into tuples.

  Examples:
    >>> import json
    >>> config = get_config("mlp-mnist", sparsity=0.9)
    >>> to_dict(config)["mlp_features"]
    (300, 100)
    >>> from_dict(json.loads(json.dumps(to_dict(config)))) == config
    True
  """
  return dataclasses.asdict(config)


def from_dict(values: Mapping[str, Any]) -> Config:
  """Inverse of :func:`to_dict`: lists become tuples again, every value is type-checked.

  Fields left out take the :class:`Config` defaults (not a preset's).

  Raises:
    ValueError: an unknown field, a value of the wrong type (the message names
      the field and its type) or an invalid value.

  Examples:
    >>> from_dict({"model": "mlp", "epochs": 3, "warmup_epochs": 1}).epochs
    3
    >>> from_dict({"epochs": "3"})
    Traceback (most recent call last):
    ...
    ValueError: config field `epochs` must be int, got '3'.
  """
  hints = field_types()
  converted = {}
  for key, value in values.items():
    if key not in hints:
      raise ValueError(f"unknown config field {key!r}; known: {sorted(hints)}.")
    converted[key] = coerce(key, value)
  return validate(Config(**converted))


@functools.lru_cache(maxsize=1)
def field_types() -> dict[str, Any]:
  """Each :class:`Config` field's type annotation, e.g. ``{"penalty": Optional[float], ...}``."""
  return typing.get_type_hints(Config)


def type_name(hint: Any) -> str:
  """A field type as a reader writes it: ``int``, ``float or None``, ``tuple[int, ...]``."""
  if typing.get_origin(hint) is Union:
    return " or ".join(type_name(a) if a is not type(None) else "None"
                       for a in typing.get_args(hint))
  return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def coerce(key: str, value: Any) -> Any:
  """``value`` checked against the type of field ``key``: lists become tuples, ints floats.

  Raises:
    ValueError: ``value`` does not fit the field's type (the message names the
      field and the type).
  """
  hint = field_types()[key]
  try:
    return _coerce(value, hint)
  except TypeError:
    raise ValueError(f"config field `{key}` must be {type_name(hint)}, got {value!r}."
                     ) from None


def _coerce(value: Any, hint: Any) -> Any:
  """``value`` as type ``hint`` (``TypeError`` when it does not fit)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is Union:
    if value is None and type(None) in args:
      return None
    (inner,) = [a for a in args if a is not type(None)]
    return _coerce(value, inner)
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise TypeError(hint)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_coerce(v, args[0]) for v in value)
    if len(value) != len(args):
      raise TypeError(hint)
    return tuple(_coerce(v, a) for v, a in zip(value, args))
  # bool is an int to Python, never to a config field.
  if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
    return value
  raise TypeError(hint)
