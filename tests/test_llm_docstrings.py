"""Every public method and property of safe_optax.llm's classes has its own docstring.

``tests/test_docs.py::test_public_names_have_docstrings`` checks each module's
functions and classes; this adds what a reader of ``help(LlamaConfig)`` or
``help(PruneState)`` meets one level down.
"""

import importlib
import inspect
import pkgutil

import pytest

import safe_optax.llm

MODULES = sorted(info.name for info in pkgutil.iter_modules(safe_optax.llm.__path__)
                 if not info.name.startswith("_"))


def _public_members(module):
  """``(Class.name, member)`` for the public methods and properties the module's classes define."""
  for name, cls in vars(module).items():
    if name.startswith("_") or not inspect.isclass(cls) or cls.__module__ != module.__name__:
      continue
    for attr, member in vars(cls).items():
      if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(
          member, (property, staticmethod, classmethod))):
        yield f"{name}.{attr}", member


def test_the_modules_and_members_are_found():
  assert {"block", "checkpoints", "cli", "data", "export", "model", "prune"} <= set(MODULES)
  model = importlib.import_module("safe_optax.llm.model")
  assert {"LlamaConfig.dim_per_head", "Llama.embed"} <= dict(_public_members(model)).keys()


@pytest.mark.parametrize("module_name", MODULES)
def test_public_methods_have_docstrings(module_name):
  module = importlib.import_module(f"safe_optax.llm.{module_name}")
  # The member's own __doc__: inspect.getdoc would find a base class's (flax's setup).
  missing = [name for name, member in _public_members(module)
             if not (member.__doc__ or "").strip()]
  assert not missing, f"safe_optax.llm.{module_name}: no docstring for {missing}"
