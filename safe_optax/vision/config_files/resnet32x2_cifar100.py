"""ResNet-32, width 2, on CIFAR-100 (300 epochs; a paper row): the preset ``resnet32x2-cifar100``.

Copy this file, edit ``get_config``, then run it::

  safe-optax-vision train --config resnet32x2_cifar100.py --config.sparsity=0.95 \\
      --data-dir DIR --workdir OUT
"""

from ml_collections import ConfigDict

from safe_optax.vision import config_files


def get_config() -> ConfigDict:
  """The preset ``resnet32x2-cifar100`` as a locked, typed ``ml_collections.ConfigDict``."""
  config = config_files.preset("resnet32x2-cifar100")
  # Edit fields here, e.g. config.method = "safe-plus"; config.sparsity = 0.98
  return config
