"""Vision models (Flax Linen) for the CIFAR / MNIST experiments.

``ResNet`` (CIFAR v1; :func:`resnet20`, :func:`resnet32`, ``width=2`` for the
wide variants), ``VGG19`` with BatchNorm, the 784-300-100-10 ``MLP`` and ``LeNet5``. All
take ``__call__(x, train)``; pair them with :mod:`safe_optax.flax_utils` for
SAM / SAFE steps that keep the first pass's BatchNorm statistics.

Submodules (imported on demand, they pull in orbax / matplotlib):
:mod:`~safe_optax.vision.configs` (the paper's named presets),
:mod:`~safe_optax.methods` (the training-method registry),
:mod:`~safe_optax.vision.datasets` (a run's data),
:mod:`~safe_optax.vision.train_state`, :mod:`~safe_optax.vision.steps`
(``train_step``, ``eval_step``), :mod:`~safe_optax.vision.programs` (their
compiled programs), :mod:`~safe_optax.vision.train` (the loop,
``train_and_evaluate``), :mod:`~safe_optax.vision.finish` (final projection,
BNT, ``results.json``), :mod:`~safe_optax.vision.workdirs`,
:mod:`~safe_optax.vision.checkpoint`, :mod:`~safe_optax.vision.plots`,
:mod:`~safe_optax.vision.sweeps`, :mod:`~safe_optax.vision.evaluation` and
:mod:`~safe_optax.vision.cli` (the ``safe-optax-vision`` command);
docs/architecture.md says which module owns what.
"""

from safe_optax.vision.models import LeNet5
from safe_optax.vision.models import MLP
from safe_optax.vision.models import ResNet
from safe_optax.vision.models import ResNetBlock
from safe_optax.vision.models import VGG
from safe_optax.vision.models import VGG19
from safe_optax.vision.models import lenet5
from safe_optax.vision.models import mlp
from safe_optax.vision.models import resnet20
from safe_optax.vision.models import resnet32
from safe_optax.vision.models import vgg19

__all__ = ("LeNet5", "MLP", "ResNet", "ResNetBlock", "VGG", "VGG19", "lenet5", "mlp",
           "resnet20", "resnet32", "vgg19")
