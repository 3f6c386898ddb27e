"""Config files of the vision trainer, the Flax-examples way: ``get_config()`` -> ``ConfigDict``.

Each preset of :data:`safe_optax.vision.configs.PRESETS` has a file here
(``mlp-mnist`` -> ``mlp_mnist.py``) whose ``get_config()`` returns the preset as
an ``ml_collections.ConfigDict`` (:func:`preset`); copy one, edit its fields and
pass it to ``safe-optax-vision train --config FILE``, with ``--config.KEY=VALUE``
overrides after it (read by ``ml_collections.config_flags``, each by its field's
type). ``--config`` also takes the ``config.json`` a run writes in its workdir,
so a run's resolved settings can be run again as they are.

The ConfigDicts are locked and typed: setting a field that does not exist,
or a value of another type, fails where it is written; :func:`load` checks the
result again against :class:`~safe_optax.vision.configs.Config`.

Examples:
  >>> from safe_optax.vision import config_files, configs
  >>> config = config_files.preset("mlp-mnist")
  >>> config.sparsity = 0.95
  >>> config.epochs = "ten"  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  TypeError: Could not override field 'epochs' (reference). ten is of original type ...
  >>> config_files.from_config_dict(config) == configs.get_config("mlp-mnist", sparsity=0.95)
  True
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import typing
from collections.abc import Mapping
from typing import Any, Union

import ml_collections
from ml_collections import config_dict

from safe_optax.vision import configs

DIRECTORY = pathlib.Path(__file__).resolve().parent
"""The folder of the preset files (inside the installed package)."""


def path(preset_name: str) -> pathlib.Path:
  """The config file of a preset: ``mlp-mnist`` -> ``.../config_files/mlp_mnist.py``.

  Raises:
    ValueError: an unknown preset.
  """
  if preset_name not in configs.PRESETS:
    raise ValueError(f"unknown preset {preset_name!r}; choose one of {sorted(configs.PRESETS)}.")
  return DIRECTORY / (preset_name.replace("-", "_") + ".py")


def to_config_dict(config: configs.Config) -> ml_collections.ConfigDict:
  """``config`` as a locked ``ml_collections.ConfigDict`` (``None`` fields typed placeholders).

  Args:
    config: a :class:`~safe_optax.vision.configs.Config`.

  Returns:
    A ``ConfigDict`` with one entry per field; assigning an unknown field or a
    value of another type raises.
  """
  values = {}
  for key, value in configs.to_dict(config).items():
    if value is None:
      (inner,) = [a for a in typing.get_args(configs.field_types()[key]) if a is not type(None)]
      value = config_dict.placeholder(typing.get_origin(inner) or inner)
    values[key] = value
  result = ml_collections.ConfigDict(values)
  result.lock()
  return result


def preset(preset_name: str) -> ml_collections.ConfigDict:
  """The preset ``preset_name`` as a ConfigDict (what each file's ``get_config()`` returns)."""
  path(preset_name)  # raises for an unknown name
  return to_config_dict(configs.PRESETS[preset_name])


def from_config_dict(values: Union[Mapping[str, Any], ml_collections.ConfigDict]
                     ) -> configs.Config:
  """A ConfigDict (or a plain mapping of fields) as a validated, type-checked ``Config``.

  Raises:
    ValueError: an unknown field, a value of the wrong type, or an invalid value.
  """
  if isinstance(values, ml_collections.ConfigDict):  # to_dict resolves field references
    values = values.to_dict()
  return configs.from_dict(values)


def load(file: os.PathLike) -> configs.Config:
  """The ``Config`` of a config file: a Python file with ``get_config()``, or a JSON file.

  Args:
    file: ``*.py`` whose ``get_config()`` returns a ConfigDict, a mapping of
      fields or a ``Config``; or ``*.json``, a mapping of fields (the
      ``config.json`` a run writes in its workdir).

  Returns:
    The validated ``Config``; fields a file leaves out take the ``Config``
    defaults.

  Raises:
    FileNotFoundError: no such file.
    ValueError: another suffix, no ``get_config``, an unknown field, a value
      of the wrong type or an invalid value (the message names the file).
  """
  file = pathlib.Path(file)
  if not file.is_file():
    raise FileNotFoundError(f"config file '{file}' does not exist.")
  try:
    if file.suffix == ".json":
      with open(file, encoding="utf-8") as f:
        return from_config_dict(json.load(f))
    if file.suffix != ".py":
      raise ValueError("a config file is a .py file with get_config() or a .json file, got "
                       f"suffix {file.suffix!r}.")
    spec = importlib.util.spec_from_file_location(f"safe_optax_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
    except SyntaxError as err:
      raise ValueError(f"line {err.lineno}: {err.msg}.") from None
    if not callable(getattr(module, "get_config", None)):
      raise ValueError("it defines no get_config().")
    try:
      values = module.get_config()
    except Exception as err:  # pylint: disable=broad-except
      # The file is the user's code: whatever it raises is reported as the file's error.
      raise ValueError(f"get_config() raised {type(err).__name__}: {err}") from None
    if isinstance(values, configs.Config):
      return configs.validate(values)
    return from_config_dict(values)
  except ValueError as err:
    raise ValueError(f"config file '{file}': {err}") from None
