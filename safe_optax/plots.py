"""Matplotlib figures of parameter pytrees: the weight distributions of several models.

Model-agnostic (any pytree, the prunable leaves of
:func:`safe_optax.default_prunable` or a ``prunable`` rule), so it sits beside
:mod:`safe_optax.flatness`, below the experiment modules; the training curves
of a vision run are :mod:`safe_optax.vision.plots`. matplotlib is imported
only when a function is called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from safe_optax import _prunable

__all__ = ("plot_weight_histograms", "save_weight_histograms")


def plot_weight_histograms(
    ax: Any,
    named_params: Mapping[str, Any],
    *,
    prunable: _prunable.Prunable = None,
    bins: int = 100,
    value_range: Optional[tuple[float, float]] = None,
    title: str = "Prunable weights",
) -> None:
  """Draws overlaid histograms of the prunable weights of several models on ``ax``.

  One histogram per model (e.g. ``{'dense': ..., 'SAFE': ..., 'ADMM': ...}``),
  log-scaled counts so the exact zeros of a sparse model and the tails stay
  visible; the legend gives each model's fraction of zeros.

  Args:
    ax: a matplotlib ``Axes``.
    named_params: ``{label: params}``.
    prunable: which leaves are weights (default: ndim >= 2).
    bins: number of bins.
    value_range: histogram range; default: the range of all weights.
    title: axes title.
  """
  if not named_params:
    raise ValueError("`named_params` must name at least one model.")
  values = {}
  for label, params in named_params.items():
    resolved = _prunable.resolve(params, prunable)
    values[label] = np.concatenate([np.asarray(leaf, np.float32).ravel() for leaf, flag in
                                    zip(resolved.leaves, resolved.flags) if flag])
  if value_range is None:
    value_range = (min(float(v.min()) for v in values.values()),
                   max(float(v.max()) for v in values.values()))
  for label, v in values.items():
    ax.hist(v, bins=bins, range=value_range, histtype="step", log=True,
            label=f"{label} ({np.mean(v == 0):.0%} zeros)")
  ax.set_xlabel("weight value")
  ax.set_ylabel("count (log)")
  ax.set_title(title)
  ax.legend(fontsize="small")


def save_weight_histograms(named_params: Mapping[str, Any], path: os.PathLike,
                           **kwargs: Any) -> None:
  """Saves :func:`plot_weight_histograms` as an image (PNG); matplotlib is imported here.

  Args:
    named_params: ``{label: params}``.
    path: output file (``.png``).
    **kwargs: ``prunable``, ``bins``, ``value_range``, ``title`` of
      :func:`plot_weight_histograms`.

  Examples:
    >>> import os, tempfile, jax.numpy as jnp
    >>> path = os.path.join(tempfile.mkdtemp(), "weights.png")
    >>> dense = {"w": jnp.arange(-3.0, 3.0).reshape(2, 3)}
    >>> save_weight_histograms({"dense": dense}, path, bins=6)
    >>> open(path, "rb").read(8)[1:4]  # the PNG signature
    b'PNG'
  """
  # A Figure object saves through its own Agg canvas: no pyplot, and the
  # caller's backend (a notebook's inline one) is left alone.
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(5, 3.5))
  plot_weight_histograms(fig.subplots(), named_params, **kwargs)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
