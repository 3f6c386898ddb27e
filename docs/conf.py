"""Sphinx configuration: API reference from the docstrings, guide pages in Markdown.

Built in CI by ``tests/test_docs.py`` with ``sphinx-build -W --keep-going``
(every warning is an error). No extension needs the network.
"""

import os
import re
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


def _public_names(module):
  """``module.__all__``, or the functions and classes the module defines."""
  import inspect  # pylint: disable=import-outside-toplevel

  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [name for name, obj in vars(module).items()
          if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
          and obj.__module__ == module.__name__]


def _document_new_public_names(app, docname, source):
  """Appends autodoc entries for public names that api.rst does not list yet.

  The API page is organised by hand; this keeps it complete when a name is
  added to a documented module's public API before someone files it under a
  section.
  """
  if docname != "api":
    return
  import importlib  # pylint: disable=import-outside-toplevel
  import inspect  # pylint: disable=import-outside-toplevel

  text = source[0]
  lines = []
  for module_name in ("safe_optax", "safe_optax.flax_utils", "safe_optax.vision.models",
                      "safe_optax.vision.input_pipeline"):
    module = importlib.import_module(module_name)
    missing = [name for name in _public_names(module)
               if f":: {name}\n" not in text and f":: {name} " not in text]
    if not missing:
      continue
    title = f"Other public names in ``{module_name}``"
    lines += ["", title, "-" * len(title), "", f".. currentmodule:: {module_name}", ""]
    for name in missing:
      obj = getattr(module, name)
      is_class = inspect.isclass(obj)
      kind = "autoclass" if is_class else "autofunction" if callable(obj) else "autodata"
      lines += [f".. {kind}:: {name}", ""]
      if is_class:
        lines += ["   :members:", ""]
  source[0] = text + "\n".join(lines)


# A Markdown link to a file outside docs/, such as ``[report](../results/README.md)``,
# resolves on GitHub as written; Sphinx would look for a page of that name.
_OUTSIDE_LINK = re.compile(r"\]\((\.\./[^)#\s]+)\)")


def _link_files_outside_docs(app, docname, source):
  """Turns links to repository files outside docs/ into downloads (MyST ``path:``).

  The pages keep plain relative links, which read the same on GitHub; a link to
  a folder or a missing file is left alone, so the build fails on it.
  """
  page_dir = os.path.dirname(app.env.doc2path(docname))

  def _rewrite(match):
    target = match.group(1)
    if os.path.isfile(os.path.join(page_dir, target)):
      return f"](path:{target})"
    return match.group(0)

  source[0] = _OUTSIDE_LINK.sub(_rewrite, source[0])


def setup(app):
  app.connect("source-read", _document_new_public_names)
  app.connect("source-read", _link_files_outside_docs)
  return {"parallel_read_safe": True}
