"""Matplotlib curves of a vision run: accuracy and distance to the sparsity constraint."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from safe_optax import experiment


def plot_history(history: Sequence[dict[str, Any]], directory: os.PathLike,
                 title: str = "") -> list[str]:
  """Writes ``accuracy.png`` and ``distance.png`` from per-epoch metric records.

  Args:
    history: the ``metrics.jsonl`` records (``epoch``, ``train_accuracy``,
      ``test_accuracy``, ``test_accuracy_projected``, ``distance_to_projection``,
      ``distance_to_z``; missing keys are skipped).
    directory: where the PNG files go.
    title: figure title (e.g. the method and sparsity).

  Returns:
    The paths written.
  """
  # Figure objects save through their own Agg canvas: no pyplot, and the
  # caller's backend (a notebook's inline one) is left alone.
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  def series(key):
    points = [(r["epoch"], r[key]) for r in history if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]

  def save(fig, ax, ylabel, name):
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_lines():
      ax.legend()
    paths.append(os.path.join(directory, name))
    fig.tight_layout()
    with experiment.atomic_write(paths[-1]) as tmp:
      fig.savefig(tmp, dpi=100)

  paths: list[str] = []
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  for key, label in (("train_accuracy", "train (running)"), ("test_accuracy", "test, dense x"),
                     ("test_accuracy_projected", "test, Proj(x) (no BNT)")):
    xs, ys = series(key)
    if xs:
      ax.plot(xs, [100 * y for y in ys], marker="o", label=label)
  save(fig, ax, "accuracy (%)", "accuracy.png")

  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  positive = True
  for key, label in (("distance_to_projection", "||x - Proj(x)||"),
                     ("distance_to_z", "||x - z|| (ADMM)")):
    xs, ys = series(key)
    if xs:
      ax.plot(xs, ys, marker="o", label=label)
      positive = positive and min(ys) > 0
  # A persistent mask (GMP) reaches distance 0, which a log axis cannot show.
  ax.set_yscale("log" if positive else "linear")
  save(fig, ax, "distance", "distance.png")
  return paths
