"""Sphinx configuration: API reference from the docstrings, guide pages in Markdown.

Built in CI by ``tests/test_docs.py`` with ``sphinx-build -W --keep-going``
(every warning is an error). No extension needs the network.
"""

import os
import sys

# Document the checkout this file belongs to, even when another copy is installed.
sys.path.insert(0, os.path.abspath(".."))

import safe_optax  # noqa: E402  pylint: disable=wrong-import-position

project = "safe_optax"
author = "safe_optax developers"
copyright = "2026, safe_optax developers"  # pylint: disable=redefined-builtin
release = safe_optax.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# The API pages use explicit autodoc directives; autosummary only draws the
# summary tables, so the build writes no generated stub files into docs/.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
add_module_names = False

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = f"safe_optax {release}"
html_static_path = []


def _document_new_public_names(app, docname, source):
  """Appends autodoc entries for names in ``safe_optax.__all__`` that api.rst does not list.

  The API page is organised by hand; this keeps it complete when a name is
  added to ``__all__`` before someone files it under a section.
  """
  if docname != "api":
    return
  import inspect  # pylint: disable=import-outside-toplevel

  text = source[0]
  missing = [name for name in safe_optax.__all__
             if f":: {name}\n" not in text and f":: {name} " not in text]
  if not missing:
    return
  lines = ["", "Other public names", "------------------", "",
           ".. currentmodule:: safe_optax", ""]
  for name in missing:
    kind = "autoclass" if inspect.isclass(getattr(safe_optax, name)) else "autofunction"
    lines += [f".. {kind}:: {name}", ""]
    if kind == "autoclass":
      lines += ["   :members:", ""]
  source[0] = text + "\n".join(lines)


def setup(app):
  app.connect("source-read", _document_new_public_names)
  return {"parallel_read_safe": True}
