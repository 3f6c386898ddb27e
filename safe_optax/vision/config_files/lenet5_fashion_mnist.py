"""LeNet-5 on Fashion-MNIST (30 epochs, no augmentation): the preset ``lenet5-fashion-mnist``.

Copy this file, edit ``get_config``, then run it::

  safe-optax-vision train --config lenet5_fashion_mnist.py --config.sparsity=0.95 \\
      --data-dir DIR --workdir OUT
"""

from ml_collections import ConfigDict

from safe_optax.vision import config_files


def get_config() -> ConfigDict:
  """The preset ``lenet5-fashion-mnist`` as a locked, typed ``ml_collections.ConfigDict``."""
  config = config_files.preset("lenet5-fashion-mnist")
  # Edit fields here, e.g. config.method = "safe-plus"; config.sparsity = 0.98
  return config
