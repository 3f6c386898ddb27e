"""ResNet-20, width 1, on CIFAR-10 (200 epochs; CPU-sized): the preset ``resnet20-cifar10``.

Copy this file, edit ``get_config``, then run it::

  safe-optax-vision train --config resnet20_cifar10.py --config.sparsity=0.95 \\
      --data-dir DIR --workdir OUT
"""

from ml_collections import ConfigDict

from safe_optax.vision import config_files


def get_config() -> ConfigDict:
  """The preset ``resnet20-cifar10`` as a locked, typed ``ml_collections.ConfigDict``."""
  config = config_files.preset("resnet20-cifar10")
  # Edit fields here, e.g. config.method = "safe-plus"; config.sparsity = 0.98
  return config
