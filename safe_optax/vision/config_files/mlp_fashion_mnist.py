"""The 300-100 MLP on Fashion-MNIST (100 epochs, no augmentation): the preset ``mlp-fashion-mnist``.

Copy this file, edit ``get_config``, then run it::

  safe-optax-vision train --config mlp_fashion_mnist.py --config.sparsity=0.95 \\
      --data-dir DIR --workdir OUT
"""

from ml_collections import ConfigDict

from safe_optax.vision import config_files


def get_config() -> ConfigDict:
  """The preset ``mlp-fashion-mnist`` as a locked, typed ``ml_collections.ConfigDict``."""
  config = config_files.preset("mlp-fashion-mnist")
  # Edit fields here, e.g. config.method = "safe-plus"; config.sparsity = 0.98
  return config
