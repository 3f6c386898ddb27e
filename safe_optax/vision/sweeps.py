"""Many runs of the vision trainer: one folder per run, lambda chosen on a validation split.

The pieces that the ``sweep`` command and the evidence benchmarks
(``benchmarks/claims/sparsity_sweep.py``, ``benchmarks/claims/label_noise.py``) share:

* :func:`run_dir` names a run's folder by every setting that differs between
  the runs of a sweep; :func:`run_or_load` trains a configuration there, or
  reads its finished ``results.json`` after checking that the recorded
  configuration is the one asked for (a folder of another run is refused, so
  stale results are never reused);
* :func:`select_hyperparameters` trains each penalty method with every
  ``lambda`` of a grid (and, when given a grid, CrAM with every ``rho``) on a
  validation split carved from the training data (``Config.validation``; the
  test set is never looked at) and keeps the value with the best mean
  validation accuracy of the final sparse model;
* :func:`convergence` says whether a finished run converged: the training
  loss's change over the last 10 % of epochs, ``||x - z||`` and the accuracy
  that the final projection costs.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from safe_optax import distributed
from safe_optax.vision import configs
from safe_optax.vision import methods

SAFE_FAMILY = tuple(name for name, m in methods.REGISTRY.items() if m.penalty_field == "penalty")
"""Methods whose lambda is ``Config.penalty`` (cosine ramp by default)."""
PENALTY_METHODS = SAFE_FAMILY + tuple(name for name, m in methods.REGISTRY.items()
                                      if m.penalty_field not in (None, "penalty"))
"""Methods with a lambda to choose (ADMM's is ``Config.admm_penalty``)."""
TUNED_METHODS = PENALTY_METHODS + tuple(name for name, m in methods.REGISTRY.items()
                                        if m.penalty_field is None and m.tuned_field)
"""Methods with a hyperparameter a sweep chooses: the penalty methods' lambda, CrAM's rho."""
DEFAULT_RHO = configs.Config.rho
"""The SAM radius a run folder does not name (another one adds ``-rho<value>``)."""


def penalty_field(method: str) -> str:
  """The config field that holds ``method``'s lambda.

  Examples:
    >>> penalty_field("admm"), penalty_field("safe")
    ('admm_penalty', 'penalty')
  """
  field = methods.get(method).penalty_field
  if field is None:
    raise ValueError(f"method {method!r} has no penalty; penalty methods: "
                     f"{list(PENALTY_METHODS)}.")
  return field


def tuned_field(method: str) -> str:
  """The config field a sweep chooses for ``method``: its lambda's, or CrAM's ``rho``.

  Examples:
    >>> tuned_field("admm"), tuned_field("safe"), tuned_field("cram")
    ('admm_penalty', 'penalty', 'rho')
  """
  field = methods.get(method).selected_field
  if field is None:
    raise ValueError(f"method {method!r} has no hyperparameter to choose; tuned methods: "
                     f"{list(TUNED_METHODS)}.")
  return field


def run_dir(root: os.PathLike, config: configs.Config) -> pathlib.Path:
  """``root/[noise<r>-]<method>-s<sparsity>[-perleaf][-lam<lambda>][-rho<rho>][-rescaled]-seed<seed>``.

  ``-lam``: a penalty method's lambda; ``-rho``: CrAM's radius (its tuned
  value), or another SAM-type method's when it is not the default
  ``Config.rho``; ``-rescaled``: a SAFE-family run with ``rescale_dual``
  (another update, so another folder); ``-perleaf``: ``structure="per_leaf"``
  (another sparsity set).

  Examples:
    >>> c = configs.get_config("mlp-mnist", method="admm", sparsity=0.9, admm_penalty=0.01)
    >>> run_dir("out", c).as_posix()
    'out/admm-s0.9-lam0.01-seed0'
    >>> run_dir("out", c.replace(method="cram", rho=0.05)).as_posix()
    'out/cram-s0.9-rho0.05-seed0'
    >>> run_dir("out", c.replace(method="safe", penalty=1.0, rho=0.02)).as_posix()
    'out/safe-s0.9-lam1-rho0.02-seed0'
    >>> run_dir("out", c.replace(method="gmp", structure="per_leaf")).as_posix()
    'out/gmp-s0.9-perleaf-seed0'
  """
  name = f"{config.method}-s{config.sparsity:g}"
  if config.structure != "global" and config.method != "dense":
    name += "-" + config.structure.replace("_", "")
  if config.label_noise > 0:
    name = f"noise{config.label_noise:g}-{name}"
  if config.method in PENALTY_METHODS:
    name += f"-lam{methods.penalty(config):g}"
  entry = methods.get(config.method)
  if entry.uses_grad_fn and (entry.tuned_field == "rho" or config.rho != DEFAULT_RHO):
    name += f"-rho{config.rho:g}"
  if config.rescale_dual and config.method in SAFE_FAMILY:
    name += "-rescaled"
  return pathlib.Path(root) / f"{name}-seed{config.seed}"


def differing_settings(recorded: configs.Config, requested: configs.Config) -> list[str]:
  """Names of the config fields whose values differ, sorted.

  Examples:
    >>> a = configs.get_config("mlp-mnist")
    >>> differing_settings(a, a.replace(epochs=30, learning_rate=0.05))
    ['epochs', 'learning_rate']
  """
  old, new = configs.to_dict(recorded), configs.to_dict(requested)
  return sorted(k for k in new if old.get(k) != new[k])


def run_or_load(config: configs.Config, workdir: os.PathLike, *, data: Any,
                data_dir: os.PathLike, progress: bool = False) -> dict[str, Any]:
  """Trains ``config`` in ``workdir``, or reads the run already finished there.

  Returns:
    The run's ``results.json`` content.

  Raises:
    ValueError: ``workdir`` holds a finished run of another configuration
      (the message names the differing settings).
  """
  from safe_optax.vision import train as train_lib  # pylint: disable=import-outside-toplevel
  results_file = pathlib.Path(workdir) / "results.json"
  if results_file.exists():
    with open(results_file, encoding="utf-8") as f:
      results = json.load(f)
    differ = differing_settings(configs.from_dict(results["config"]), config)
    if differ:
      raise ValueError(f"'{workdir}' holds a finished run with other settings ({differ}); "
                       "use another --workdir or delete that folder.")
    return results
  if distributed.is_primary():
    print(f"  training {pathlib.Path(workdir).name}", file=sys.stderr, flush=True)
  return train_lib.train_and_evaluate(config, workdir, data_dir=data_dir, dataset=data,
                                      progress=progress).results


def convergence(results: dict[str, Any]) -> dict[str, Any]:
  """Has a finished run converged? Its loss plateau, ``||x - z||`` and projection cost.

  ``loss_change_last_tenth`` is the mean training loss of the second-to-last
  tenth of the epochs minus that of the last tenth, relative to the last
  (about 0 on a plateau); ``constraint_distance`` is ``||x - z||`` of the
  ADMM-type methods at the end; ``projection_cost`` is the test (or
  validation) accuracy of the dense iterate minus that of the projected model.
  """
  history = results["history"]
  losses = np.asarray([h["train_loss"] for h in history], np.float64)
  tail = max(1, len(losses) // 10)
  out: dict[str, Any] = {
      "final_train_loss": float(losses[-1]),
      "loss_change_last_tenth": float(
          (losses[-2 * tail:-tail].mean() - losses[-tail:].mean())
          / max(losses[-tail:].mean(), 1e-12)) if len(losses) >= 2 * tail else None,
      "distance_to_projection": history[-1].get("distance_to_projection"),
      "constraint_distance": history[-1].get("distance_to_z"),
  }
  final = results["final"]
  if "sparse_accuracy_before_bnt" in final:
    out["projection_cost"] = final["dense_accuracy"] - final["sparse_accuracy_before_bnt"]
  return out


def record(config: configs.Config, results: dict[str, Any]) -> dict[str, Any]:
  """One row of a sweep: the settings, the reported accuracy and :func:`convergence`."""
  final = results["final"]
  penalty = methods.penalty(config)
  return {"method": config.method, "sparsity": config.sparsity, "seed": config.seed,
          "noise": config.label_noise, "penalty": penalty,
          "rho": config.rho if methods.get(config.method).uses_grad_fn else None,
          "rescale_dual": config.rescale_dual and config.method in SAFE_FAMILY,
          "structure": config.structure,
          "accuracy": final.get("sparse_accuracy", final["dense_accuracy"]),
          "accuracy_before_bnt": final.get("sparse_accuracy_before_bnt"),
          "dense_accuracy": final["dense_accuracy"], "achieved_sparsity": final["sparsity"],
          "images_per_second": results["images_per_second"],
          "steady_images_per_second": results.get("steady_images_per_second"),
          "wall_seconds": results["wall_seconds"],
          "evaluated_on": results["data"].get("evaluated_on", "test"),
          **convergence(results)}


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
  training diverges (:class:`~safe_optax.vision.train.TrainingDiverged`) is
  recorded as such and cannot win. The value is the method's
  :func:`tuned_field`: lambda for the penalty methods (a grid is required
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
    that sit at an end of their grid, where the optimum may lie outside it. Each ``grid`` row has the
    tried ``value`` (and, for a penalty method, the same as ``penalty``).
  """
  from safe_optax.vision import train as train_lib  # pylint: disable=import-outside-toplevel
  val_base = base.replace(validation=validation)
  missing = [m for m in methods if m in PENALTY_METHODS and not grids.get(m)]
  if missing:
    raise ValueError(f"no lambda grid for {missing}; give one per penalty method.")
  tuned = [m for m in methods if m in PENALTY_METHODS or (m in TUNED_METHODS and grids.get(m))]
  data = train_lib.load_dataset(val_base, data_dir) if tuned else None
  rows, chosen = [], {}
  for method in tuned:
    field = tuned_field(method)
    if len(set(grids[method])) == 1 and not score_single:
      # One value: nothing to choose, so no validation run is spent on it.
      chosen.update({key(method, s): float(grids[method][0]) for s in sparsities})
      continue
    for s in sparsities:
      scored = []
      for lam in sorted(grids[method]):
        runs = []
        for seed in seeds:
          config = val_base.replace(method=method, sparsity=s, seed=seed,
                                    **(method_overrides or {}).get(method, {}),
                                    **{field: lam})
          try:
            results = run_or_load(config, run_dir(root, config), data=data, data_dir=data_dir,
                                  progress=progress)
          except train_lib.TrainingDiverged as err:
            # A lambda that makes training diverge is a grid point that lost, not a crash.
            runs.append({"method": method, "sparsity": s, "seed": seed, "field": field,
                         "value": lam, "diverged": {"step": err.step,
                                                    "last_finite_loss": err.last_finite_loss}})
            continue
          runs.append(record(config, results))
        diverged = any("diverged" in r for r in runs)
        mean = None if diverged else float(np.mean([r["accuracy"] for r in runs]))
        row = {"method": method, "sparsity": s, "field": field, "value": lam}
        if method in PENALTY_METHODS:
          row["penalty"] = lam
        rows.append({**row, "validation_accuracy_mean": mean, "diverged": diverged,
                     "runs": runs})
        if not diverged:
          scored.append((mean, -lam))
      if not scored:
        name = "lambda" if method in PENALTY_METHODS else field
        raise ValueError(f"every {name} of {sorted(grids[method])} diverged for {method} at "
                         f"sparsity {s:g}; extend the grid downwards.")
      chosen[key(method, s)] = -max(scored)[1]
  # A lambda at an end of its grid may not be the optimum: the grid should be extended.
  fixed = sorted(m for m in tuned if len(set(grids[m])) == 1 and not score_single)
  edges = sorted(k for k, lam in chosen.items() if k.split("@")[0] not in fixed
                 and lam in (min(grids[k.split("@")[0]]), max(grids[k.split("@")[0]])))
  return {"validation_examples": validation, "seeds": list(seeds),
          "criterion": "mean validation accuracy of the final sparse model",
          "grid": rows, "chosen": chosen, "fields": {m: tuned_field(m) for m in tuned},
          "fixed": fixed, "at_grid_edge": edges}


def _rho_crossed(methods_: Sequence[str]) -> list[str]:
  """The methods :func:`select_with_rho` trains at every rho: SAM-type penalty methods."""
  return [m for m in methods_ if m in PENALTY_METHODS and methods.get(m).uses_grad_fn]


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
  return {m: {"rescale_dual": True} for m in methods_ if rescale and m in SAFE_FAMILY}


def key(method: str, sparsity: float) -> str:
  """The key of :func:`select_hyperparameters`'s ``chosen``: ``"safe@0.9"``."""
  return f"{method}@{sparsity:g}"


def chosen_overrides(selection: Optional[dict[str, Any]], method: str,
                     sparsity: float) -> dict[str, float]:
  """``{field: chosen value}`` for a method the selection tuned, ``{}`` otherwise."""
  if selection is None or method not in TUNED_METHODS:
    return {}
  k = key(method, sparsity)
  rho = {"rho": selection["chosen_rho"][k]} if k in selection.get("chosen_rho", {}) else {}
  if method in PENALTY_METHODS:  # always selected: a missing choice is an error
    return {penalty_field(method): selection["chosen"][k], **rho}
  return {tuned_field(method): selection["chosen"][k]} if k in selection["chosen"] else {}
