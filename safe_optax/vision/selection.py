"""Hyperparameters of the vision methods chosen on a validation split, never the test set.

:func:`select_hyperparameters` trains each penalty method with every
``lambda`` of a grid (and, when given a grid, CrAM with every ``rho``) on a
validation split carved from the training data (``Config.validation``) and
keeps the value with the best mean validation accuracy of the final sparse
model; :func:`select_with_rho` crosses lambda with SAM's radius. The runs are
:func:`safe_optax.vision.sweeps.run_or_load`'s, in the sweep's folders.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from safe_optax import methods as methods_lib
from safe_optax.vision import configs
from safe_optax.vision import datasets
from safe_optax.vision import sweeps
from safe_optax.vision import workdirs


def select_hyperparameters(base: configs.Config, methods: Sequence[str],
                           sparsities: Sequence[float], grids: dict[str, Sequence[float]], *,
                           validation: int, seeds: Sequence[int], root: os.PathLike,
                           data_dir: os.PathLike, progress: bool = False,
                           method_overrides: Optional[dict[str, dict[str, Any]]] = None,
                           score_single: bool = False) -> dict[str, Any]:
  """Chooses each penalty method's lambda (and CrAM's rho) per sparsity on a validation split.

  Every ``(method, sparsity, value, seed)`` is trained on the training data
  minus ``validation`` held-out examples (``base.replace(validation=...)``;
  label noise, if ``base`` has it, is on the held-out labels too) and scored by
  the validation accuracy of its final sparse model; the value with the best
  mean over ``seeds`` wins (the smaller value on a tie). A value whose
  training diverges (:class:`~safe_optax.vision.workdirs.TrainingDiverged`) is
  recorded as such and cannot win. The value is the method's
  :func:`sweeps.tuned_field`: lambda for the penalty methods (a grid is required
  for each), ``rho`` for CrAM / CrAM+ (tuned only when ``grids`` has one;
  otherwise they keep ``base.rho``).

  Args:
    base: the configuration every run starts from.
    methods: the methods to tune (others are ignored).
    sparsities: target sparsities.
    grids: ``{method: values}``: lambdas for each penalty method in
      ``methods``, optionally rhos for ``"cram"`` / ``"cram-plus"``.
    validation: held-out training examples.
    seeds: training seeds per grid point.
    root: folder of the selection runs (one sub-folder per run).
    data_dir: where the data set is.
    progress: tqdm bars.
    method_overrides: ``{method: {config field: value}}`` applied to that
      method's runs, e.g. ``{"safe": {"rescale_dual": True}}``.
    score_single: train and score one-value grids too.

  A one-value grid is not a selection: that value is used without any
  validation run and the method is listed in ``fixed`` (unless
  ``score_single``, which :func:`select_with_rho` sets: it needs the score).

  Returns:
    ``{"grid": [...], "chosen": {"<method>@<sparsity>": value},
    "fields": {"<method>": field}, "fixed": [...], "at_grid_edge":
    ["<method>@<sparsity>", ...], ...}``: ``at_grid_edge`` lists the choices
    that sit at an end of their grid, where the optimum may lie outside it. Each
    ``grid`` row has the tried ``value`` (and, for a penalty method, the same as
    ``penalty``).
  """
  val_base = base.replace(validation=validation)
  missing = [m for m in methods if m in sweeps.PENALTY_METHODS and not grids.get(m)]
  if missing:
    raise ValueError(f"no lambda grid for {missing}; give one per penalty method.")
  tuned = [m for m in methods if m in sweeps.PENALTY_METHODS
           or (m in sweeps.TUNED_METHODS and grids.get(m))]
  data = datasets.load_dataset(val_base, data_dir) if tuned else None
  rows, chosen = [], {}
  for method in tuned:
    field = sweeps.tuned_field(method)
    if len(set(grids[method])) == 1 and not score_single:
      # One value: nothing to choose, so no validation run is spent on it.
      chosen.update({key(method, s): float(grids[method][0]) for s in sparsities})
      continue
    for s in sparsities:
      for lam in sorted(grids[method]):
        runs = []
        for seed in seeds:
          config = val_base.replace(method=method, sparsity=s, seed=seed,
                                    **(method_overrides or {}).get(method, {}),
                                    **{field: lam})
          try:
            results = sweeps.run_or_load(config, sweeps.run_dir(root, config), data=data,
                                         data_dir=data_dir, progress=progress)
          except workdirs.TrainingDiverged as err:
            # A lambda that makes training diverge is a grid point that lost, not a crash.
            runs.append({"method": method, "sparsity": s, "seed": seed, "field": field,
                         "value": lam, "diverged": sweeps.divergence(err)})
            continue
          runs.append(sweeps.record(config, results))
        diverged = any("diverged" in r for r in runs)
        mean = None if diverged else float(np.mean([r["accuracy"] for r in runs]))
        row = {"method": method, "sparsity": s, "field": field, "value": lam}
        if method in sweeps.PENALTY_METHODS:
          row["penalty"] = lam
        rows.append({**row, "validation_accuracy_mean": mean, "diverged": diverged,
                     "runs": runs})
      # Fails here, before the remaining runs, when every value diverged.
      choose(rows[-len(grids[method]):], grids)
  fixed = sorted(m for m in tuned if len(set(grids[m])) == 1 and not score_single)
  picked, edges = choose(rows, grids, fixed)
  chosen.update(picked)
  return {"validation_examples": validation, "seeds": list(seeds),
          "criterion": "mean validation accuracy of the final sparse model",
          "grid": rows, "chosen": chosen, "fields": {m: sweeps.tuned_field(m) for m in tuned},
          "fixed": fixed, "at_grid_edge": edges}


def choose(rows: Sequence[dict[str, Any]], grids: dict[str, Sequence[float]],
           fixed: Sequence[str] = ()) -> tuple[dict[str, float], list[str]]:
  """The choice from scored grid rows: per (method, sparsity) the best mean validation accuracy,
  the smaller value on a tie, a diverged value never; and the choices at an end of their grid.

  ``fixed``: methods given one value (not chosen, so never "at an edge").
  """
  chosen: dict[str, float] = {}
  for method, s in dict.fromkeys((r["method"], r["sparsity"]) for r in rows):
    scored = [(r["validation_accuracy_mean"], -r["value"]) for r in rows
              if r["method"] == method and r["sparsity"] == s and not r["diverged"]]
    if not scored:
      name = "lambda" if method in sweeps.PENALTY_METHODS else sweeps.tuned_field(method)
      raise ValueError(f"every {name} of {sorted(grids[method])} diverged for {method} at "
                       f"sparsity {s:g}; with every value of {method}'s grid diverged there is "
                       "nothing to choose: extend the grid downwards.")
    chosen[key(method, s)] = -max(scored)[1]
  # A value at an end of its grid may not be the optimum: the grid should be extended.
  edges = sorted(k for k, v in chosen.items() if k.split("@")[0] not in fixed
                 and v in (min(grids[k.split("@")[0]]), max(grids[k.split("@")[0]])))
  return chosen, edges


def merged_selection(rows: Sequence[dict[str, Any]], grids: dict[str, Sequence[float]],
                     validation: int, seeds: Sequence[int]) -> dict[str, Any]:
  """A selection from scored grid rows (reused and new), chosen by :func:`choose` (the rule of
  :func:`select_hyperparameters`), in :func:`select_hyperparameters`'s layout."""
  chosen, edges = choose(rows, grids)
  return {"validation_examples": validation, "seeds": list(seeds),
          "criterion": "mean validation accuracy of the final sparse model",
          "grid": sorted(rows, key=lambda r: (r["method"], r["sparsity"], r["value"])),
          "chosen": chosen, "fields": {m: sweeps.tuned_field(m) for m in {r["method"] for r in rows}},
          "fixed": [], "at_grid_edge": edges}


def reuse_problem(earlier: dict[str, Any], selection: dict[str, Any], base: configs.Config,
                  methods: Sequence[str], *, validation: int, seeds: Sequence[int],
                  method_overrides: Optional[dict[str, dict[str, Any]]] = None) -> Optional[str]:
  """Why ``selection`` (one of the file ``earlier``'s) cannot be extended by
  :func:`extend_selection` for ``base`` (None: it can).

  Its runs must have the same base config, validation split and seeds, and
  each of ``methods``' finished runs the ``rescale_dual`` and (for the SAM-type
  penalty methods, whose rho is not the tuned value) the SAM radius that
  ``method_overrides`` asks for.
  """
  if (configs.from_dict(earlier["config"]) != base
      or selection["validation_examples"] != validation or selection["seeds"] != list(seeds)):
    return "its config, validation split or selection seeds differ from this run's"
  if any("value" not in r or "field" not in r for r in selection["grid"]):
    return "its grid rows lack 'value' and 'field' (a file older than safe_optax 0.1.0)"
  return _overrides_problem(selection, base, methods, method_overrides or {})


def transfer_problem(earlier: dict[str, Any], selection: dict[str, Any], base: configs.Config,
                     methods: Sequence[str], sparsities: Sequence[float],
                     method_overrides: Optional[dict[str, dict[str, Any]]] = None
                     ) -> Optional[str]:
  """Why ``selection`` (one of the file ``earlier``'s) cannot give the hyperparameters of runs
  of ``base`` at another budget (None: it can): the longer run of a convergence check.

  The file's base config must be ``base`` but for the epochs; the selection
  must have chosen for every penalty method of ``methods`` at every sparsity;
  and its runs must match ``method_overrides`` as :func:`reuse_problem`'s do
  (``rescale_dual``; the SAM radius unless the selection chose it).
  """
  if configs.from_dict(earlier["config"]).replace(epochs=base.epochs) != base:
    return "its preset, split or settings differ from this run's beyond the epochs"
  missing = [m for m in methods if m in sweeps.PENALTY_METHODS
             and any(key(m, s) not in selection["chosen"] for s in sparsities)]
  if missing:
    return f"it chose nothing for {missing}"
  return _overrides_problem(selection, base, methods, method_overrides or {},
                            rho_chosen="rho_grid" in selection)


def _overrides_problem(selection: dict[str, Any], base: configs.Config, methods: Sequence[str],
                       overrides: dict[str, dict[str, Any]], *, rho_chosen: bool = False
                       ) -> Optional[str]:
  """Why the selection's finished runs differ from ``overrides`` in ``rescale_dual`` or (unless
  the selection chose rho) the SAM radius of the SAM-type penalty methods; None if they do not."""
  if any(bool(run.get("rescale_dual")) != bool(overrides.get(r["method"], {}).get("rescale_dual"))
         for r in selection["grid"] if r["method"] in methods
         for run in r["runs"] if "diverged" not in run):
    return "its runs differ in --rescale-dual"
  if not rho_chosen and any(
      run.get("rho") is not None and run["rho"] != overrides.get(r["method"], {}).get("rho", base.rho)
      for r in selection["grid"] if r["method"] in _rho_crossed(methods)
      for run in r["runs"] if "diverged" not in run):
    return "its runs used another SAM radius rho"
  return None


def _score_one(base: configs.Config, method: str, sparsity: float, value: float, *,
               validation: int, seeds: Sequence[int], root: os.PathLike, data_dir: os.PathLike,
               progress: bool, overrides: dict[str, Any]) -> dict[str, Any]:
  """One grid value's row, as :func:`select_hyperparameters` records it, a diverged one too."""
  try:
    return select_hyperparameters(base, [method], [sparsity], {method: [value]},
                                  validation=validation, seeds=seeds, root=root,
                                  data_dir=data_dir, progress=progress,
                                  method_overrides={method: overrides},
                                  score_single=True)["grid"][0]
  except ValueError as err:
    if "diverged" not in str(err):
      raise
  # A value that diverged lost; its runs keep diverged.json, so this reads them back untrained.
  field, runs = sweeps.tuned_field(method), []
  for seed in seeds:
    config = base.replace(validation=validation, method=method, sparsity=sparsity, seed=seed,
                          **overrides, **{field: value})
    try:
      sweeps.run_or_load(config, sweeps.run_dir(root, config), data=None, data_dir=data_dir)
    except workdirs.TrainingDiverged as err:
      runs.append({"method": method, "sparsity": sparsity, "seed": seed, "field": field,
                   "value": value, "diverged": sweeps.divergence(err)})
  return {"method": method, "sparsity": sparsity, "field": field, "value": value,
          "penalty": value, "validation_accuracy_mean": None, "diverged": True, "runs": runs}


def extend_selection(base: configs.Config, earlier: dict[str, Any], methods: Sequence[str],
                     sparsities: Sequence[float], grids: dict[str, Sequence[float]], *,
                     validation: int, seeds: Sequence[int], root: os.PathLike,
                     data_dir: os.PathLike, progress: bool = False,
                     method_overrides: Optional[dict[str, dict[str, Any]]] = None
                     ) -> dict[str, Any]:
  """:func:`select_hyperparameters` over ``grids`` that trains only the values the scored rows
  of the selection ``earlier`` lack (the edge rule's extensions of a committed grid).

  ``earlier``'s rows must come from the same runs (check with
  :func:`reuse_problem`); rows of values outside ``grids`` are dropped.
  """
  old_rows = earlier["grid"]
  rows = []
  for method in [m for m in methods if grids.get(m)]:
    for s in sparsities:
      old = [r for r in old_rows if r["method"] == method and np.isclose(r["sparsity"], s)
             and r["value"] in grids[method]]
      for value in sorted(set(grids[method]) - {r["value"] for r in old}):
        rows.append(_score_one(base, method, s, value, validation=validation, seeds=seeds,
                               root=root, data_dir=data_dir, progress=progress,
                               overrides=(method_overrides or {}).get(method, {})))
      rows += [{**r, "sparsity": s} for r in old]
  return merged_selection(rows, grids, validation, seeds)


def _rho_crossed(methods_: Sequence[str]) -> list[str]:
  """The methods :func:`select_with_rho` trains at every rho: SAM-type penalty methods."""
  return [m for m in methods_ if m in sweeps.PENALTY_METHODS and methods_lib.get(m).uses_grad_fn]


def with_rho(overrides: Optional[dict[str, dict[str, Any]]], methods_: Sequence[str],
             rho: float) -> dict[str, dict[str, Any]]:
  """``overrides`` plus ``{"rho": rho}`` for the SAM-type penalty methods (the SAFE family).

  ADMM takes no SAM step and CrAM's rho is its own tuned value, so neither
  changes (their runs keep their folders).

  Examples:
    >>> with_rho({"safe": {"rescale_dual": True}}, ["safe", "admm", "cram"], 0.05)
    {'safe': {'rescale_dual': True, 'rho': 0.05}}
  """
  out = {m: dict(v) for m, v in (overrides or {}).items()}
  for m in _rho_crossed(methods_):
    out[m] = {**out.get(m, {}), "rho": rho}
  return out


def select_with_rho(base: configs.Config, methods_: Sequence[str], sparsities: Sequence[float],
                    grids: dict[str, Sequence[float]], rhos: Sequence[float], *,
                    method_overrides: Optional[dict[str, dict[str, Any]]] = None,
                    **kwargs: Any) -> dict[str, Any]:
  """:func:`select_hyperparameters` once per SAM radius, then the best (rho, value) pair.

  The SAM-type penalty methods (SAFE and its family) are trained at every
  ``rho`` of ``rhos`` with every lambda of their grid; per method and
  sparsity the pair with the best mean validation accuracy wins (the smaller
  rho on a tie). ADMM takes no SAM step, so its choice is the one of any rho
  (its runs are the same folders); CrAM's rho is its own tuned value and is
  not crossed with ``rhos``. ``kwargs`` go to :func:`select_hyperparameters`.

  Returns:
    A selection like :func:`select_hyperparameters`'s (``chosen`` holds the
    winning pair's value) plus ``chosen_rho`` (``{"<method>@<sparsity>": rho}``
    for the SAM-type methods), ``rho_grid`` and ``by_rho`` (each rho's own
    selection). ``at_grid_edge`` also lists ``"<method>@<sparsity> rho"`` when
    the chosen rho is an end of ``rhos``.
  """
  if not rhos or any(r < 0 for r in rhos):
    raise ValueError(f"`rhos` must be a non-empty list of SAM radii >= 0, got {list(rhos)}.")
  by_rho, failed = {}, {}
  for rho in sorted(rhos):
    try:
      by_rho[rho] = select_hyperparameters(base, methods_, sparsities, grids,
                                           method_overrides=with_rho(method_overrides,
                                                                     methods_, rho),
                                           score_single=True, **kwargs)
    except ValueError as err:
      if "diverged" not in str(err):
        raise
      failed[rho] = str(err)  # every lambda diverged at this radius: it loses
  if not by_rho:
    raise ValueError(f"every rho of {sorted(rhos)} diverged at every lambda: {failed}")
  first = by_rho[min(by_rho)]
  chosen, chosen_rho, edges = dict(first["chosen"]), {}, list(first["at_grid_edge"])
  for k in first["chosen"]:
    method = k.split("@")[0]
    if method not in _rho_crossed(methods_):
      continue
    scored = []
    for rho, selection in by_rho.items():
      means = [r["validation_accuracy_mean"] for r in selection["grid"]
               if r["method"] == method and key(method, r["sparsity"]) == k
               and r["validation_accuracy_mean"] is not None]
      if means:
        scored.append((max(means), -rho))
    rho = -max(scored)[1]
    chosen_rho[k], chosen[k] = rho, by_rho[rho]["chosen"][k]
    edges = [e for e in edges if e != k] + [e for e in by_rho[rho]["at_grid_edge"] if e == k]
    if len(rhos) > 1 and rho in (min(rhos), max(rhos)):
      edges.append(f"{k} rho")
  return {**first, "chosen": chosen, "chosen_rho": chosen_rho, "rho_grid": sorted(rhos),
          "at_grid_edge": sorted(edges), "by_rho": {f"{r:g}": v for r, v in by_rho.items()},
          "rho_all_diverged": {f"{r:g}": e for r, e in failed.items()},
          "grid": [row for r in sorted(by_rho) for row in
                   ({**g, "rho": r} for g in by_rho[r]["grid"])]}


def rescaled_dual(methods_: Sequence[str], rescale: bool) -> dict[str, dict[str, Any]]:
  """``{method: {"rescale_dual": True}}`` for the SAFE-family methods when ``rescale``.

  The per-method overrides of a sweep run with ``--rescale-dual``: other
  methods keep their configs (and folders), so their runs are shared with a
  sweep without it.

  Examples:
    >>> rescaled_dual(["safe", "admm", "gmp"], True)
    {'safe': {'rescale_dual': True}}
    >>> rescaled_dual(["safe"], False)
    {}
  """
  return {m: {"rescale_dual": True} for m in methods_ if rescale and m in sweeps.SAFE_FAMILY}


def key(method: str, sparsity: float) -> str:
  """The key of :func:`select_hyperparameters`'s ``chosen``: ``"safe@0.9"``."""
  return f"{method}@{sparsity:g}"


def chosen_overrides(selection: Optional[dict[str, Any]], method: str,
                     sparsity: float) -> dict[str, float]:
  """``{field: chosen value}`` for a method the selection tuned, ``{}`` otherwise."""
  if selection is None or method not in sweeps.TUNED_METHODS:
    return {}
  k = key(method, sparsity)
  rho = {"rho": selection["chosen_rho"][k]} if k in selection.get("chosen_rho", {}) else {}
  if method in sweeps.PENALTY_METHODS:  # always selected: a missing choice is an error
    return {sweeps.penalty_field(method): selection["chosen"][k], **rho}
  return {sweeps.tuned_field(method): selection["chosen"][k]} if k in selection["chosen"] else {}
