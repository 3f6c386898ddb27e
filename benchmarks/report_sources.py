"""Read a claim folder (``results/<claim>/claim.json`` and the run JSON it names) into report rows.

``claim.json`` names what is compared (methods, sparsities, files) and the
paper's numbers; it holds none of our results. Every value, budget and
hyperparameter in a row is read here from the run files the benchmarks wrote,
and checked against the tuning declared in ``benchmarks/claims/tuning.py``.

``claim.json``: ``order``, ``title``, ``short`` (the README's summary line),
``paper``, ``metric``, ``caveats`` and ``rows``; every other key is a default
of each row. A row names its ``label``, ``source`` (a key of ``READERS``),
``file``, ``ours`` and ``baselines``, and what its source reads (``sparsity``,
``metric``, ``files`` per method, ``selection``: the file whose validation
selection chose a value). Shared by every source:

- ``shorter`` (with ``shorter_files`` / ``shorter_selection`` for sweeps): the
  same settings at a shorter budget, for the convergence rule;
- ``budget_check``: the label of the row this one repeats at a shorter budget
  (counted once in the README's summary);
- ``not_evidence``: why the row is shown for completeness only.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Optional

from benchmarks.claims import tuning

NAMES = {"safe": "SAFE", "safe-plus": "SAFE+", "admm": "ADMM", "gmp": "GMP", "cram": "CrAM",
         "magnitude": "magnitude", "wanda": "Wanda", "sparsegpt": "SparseGPT",
         "dense": "dense", "imp-sam": "IMP+SAM"}
PENALIZED = ("safe", "safe-plus", "admm")
SAM_METHODS = ("safe", "safe-plus")  # the penalty methods that take SAM's step (and its rho)


@dataclasses.dataclass
class Arm:
  """One method in one row: its value per seed at one budget, and where its settings came from."""
  name: str
  values: dict[int, Optional[float]]  # None: the run diverged
  budget: str
  hyper: list[str] = dataclasses.field(default_factory=list)
  flags: set[str] = dataclasses.field(default_factory=set)  # "unchosen": a value given without a choice
  grids: dict[str, tuple[float, list[float]]] = dataclasses.field(default_factory=dict)
  effort: Optional[int] = None  # values tried for the main hyperparameter; None: nothing to tune
  unfinished: list[str] = dataclasses.field(default_factory=list)  # picks the edge rule would extend
  distance: Optional[float] = None  # mean ||x - z|| at the end (ADMM-type methods)
  shorter: Optional["Arm"] = None   # the same method at a shorter budget
  shorter_same_hyper: bool = True
  settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # what must match across budgets


@dataclasses.dataclass
class Row:
  label: str
  paper: str
  ours: Arm
  baselines: list[Arm]
  higher_is_better: bool
  points: bool  # values are accuracy points (the budget rule applies)
  digits: int
  note: str = ""  # what the row is when it is not evidence (claim.json's "not_evidence")
  budget_check: str = ""  # the label of the row this one repeats at a shorter budget


@dataclasses.dataclass
class Claim:
  order: int
  title: str
  short: str
  paper: str
  metric: str
  higher_is_better: bool
  rows: list[Row]
  caveats: list[str]


def _load(path: pathlib.Path) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _mean(values: list[float]) -> Optional[float]:
  return sum(values) / len(values) if values else None


def _percent(accuracy: Optional[float]) -> Optional[float]:
  """Accuracy in %, None for a run that diverged (the report scores it by its declared rule)."""
  return None if accuracy is None else 100 * accuracy


def _grid_note(arm: Arm, name: str, value: float, grid: list[float], where: str,
               on: str = "validation", bound: Optional[tuple[float, str]] = None) -> None:
  """Record how a value was picked from its grid: inside it, at an edge, or not chosen at all.

  ``bound``: ``(value, why)`` of the range's bound, where an end pick is settled, not an edge.
  """
  grid = sorted(set(grid))
  if value not in grid:
    raise ValueError(f"{name} {value:g} is not in its selection grid {grid} ({where})")
  arm.grids[name] = (value, grid)
  if len(grid) == 1:
    arm.flags.add("unchosen")
    arm.hyper.append(f"{name} {value:g}, NOT CHOSEN ({where})")
    return
  edge = value in (grid[0], grid[-1])
  shown = "{" + ", ".join(f"{g:g}" for g in grid) + "}"
  at_bound = bound is not None and value == bound[0]
  arm.hyper.append(f"{name} {value:g} ∈ {shown} on {on} ({where})"
                   + (f", at the range's bound ({bound[1]})" if at_bound else
                      " AT GRID EDGE" if edge else ""))


def _chosen_lambda(arm: Arm, sel: dict, method: str, key: str, value: float, file: str,
                   where: str) -> None:
  """A penalty method's λ from a validation selection: the run's value must be the one chosen."""
  chosen = sel["chosen"][key]
  if abs(chosen - value) > 1e-12:
    raise ValueError(f"{file}: {method} ran with lambda {value:g}, selection chose {chosen:g}")
  _grid_note(arm, "λ", value, [g.get("value", g.get("penalty")) for g in sel["grid"]
                               if g["method"] == method] or [value], where)


def _attach_shorter(arm: Arm, shorter: Arm) -> None:
  """The same method at a shorter budget, for the convergence rule; its settings must match."""
  arm.shorter = shorter
  arm.shorter_same_hyper = shorter.settings == arm.settings


# A run's config fields that may differ between two budgets of the same settings.
BUDGET_FIELDS = ("epochs", "seed", "eval_every", "checkpoint_every", "log_every")
# Config fields added after some committed runs, with the behaviour those runs had (the field's
# default, tests/test_report.py checks): a file that predates a field ran with this value. Each
# field named the one behaviour the code had before it: global top-k (`structure`, 824b6fc),
# the unscaled-dual update off (`rescale_dual`, 7daaa5d), float32 compute at the default
# precision (`dtype`, `matmul_precision`, e322c77), XLA's convolution (`conv_impl`).
ADDED_FIELDS = {"conv_impl": "xla", "structure": "global", "rescale_dual": False,
                "dtype": "float32", "matmul_precision": "default"}


def _config_settings(config: dict[str, Any]) -> dict[str, Any]:
  """A run config's fields that two budgets of the same settings share (all but the budget's)."""
  return {**ADDED_FIELDS, **{k: v for k, v in config.items() if k not in BUDGET_FIELDS}}


def _only(values: set, what: str) -> Any:
  if len(values) != 1:
    raise ValueError(f"{what} differs between seeds: {sorted(values, key=str)}")
  return next(iter(values))


# --- sparsity_sweep.py's sweep.json -------------------------------------------------------------

def _sweep_budget(sweep: dict) -> str:
  c = sweep["config"]
  subset = f" on {c['train_subset']} images" if c.get("train_subset") else ""
  return f"{c['epochs']} epochs{subset}"


def _sweep_arm(folder: pathlib.Path, name: str, method: str, sparsity: float, file: str,
               selection: Optional[str]) -> Arm:
  sweep = _load(folder / file)
  runs = [r for r in sweep["runs"]
          if r["method"] == method and abs(r["sparsity"] - sparsity) < 1e-9]
  if not runs:
    raise ValueError(f"{file} has no {method} run at sparsity {sparsity}")
  arm = Arm(name, {r["seed"]: _percent(r["accuracy"]) for r in runs}, _sweep_budget(sweep))
  config = sweep["config"]
  if method in PENALIZED or method == "cram":
    field = "rho" if method == "cram" else "penalty"
    value = _only({r[field] for r in runs}, f"{method}'s {field}")
    arm.settings[field] = value
    source = _load(folder / (selection or file))
    sel = source["selection"]
    grid = [g.get("value", g.get(field)) for g in sel.get("grid", [])
            if g["method"] == method and abs(g["sparsity"] - sparsity) < 1e-9]
    chosen = sel["chosen"][f"{method}@{sparsity:g}"]
    if abs(chosen - value) > 1e-12:
      raise ValueError(f"{file}: {method} ran with {field} {value:g}, its selection chose {chosen:g}")
    symbol = "ρ" if method == "cram" else "λ"
    where = f"`{selection}`, chosen at {_sweep_budget(source)}" if selection else f"`{file}`"
    _grid_note(arm, symbol, value, grid or [value], where)
  if method in ("safe", "safe-plus"):
    rho = _only({r.get("rho", config["rho"]) for r in runs}, "rho")
    arm.settings.update(rho=rho, rescale_dual=bool(runs[0].get("rescale_dual")))
    arm.hyper.append(f"ρ {rho:g} (the paper's value, not tuned)")
    if runs[0].get("rescale_dual"):
      arm.hyper.append("`rescale_dual`")
  if method == "gmp":
    end = _only({r.get("gmp_end_fraction", config["gmp_end_fraction"]) for r in runs}, "GMP's end")
    every = config["gmp_update_every"]
    arm.settings.update(end=end, every=every)
    sel = sweep.get("selection") or {}
    if sel.get("fields", {}).get("gmp") == "gmp_end_fraction":  # benchmarks/claims/gmp_selection.py
      if abs(sel["chosen"][f"gmp@{sparsity:g}"] - end) > 1e-12:
        raise ValueError(f"{file}: GMP ran with end {end:g}, its selection chose another")
      at = f", chosen at {sel['epochs']} epochs" if sel.get("epochs", config["epochs"]) != config["epochs"] else ""
      _grid_note(arm, "schedule end", end, [g["value"] for g in sel["grid"]
                                            if abs(g.get("sparsity", sparsity) - sparsity) < 1e-9],
                 f"`{file}`{at}")
      arm.hyper.append(f"update every {every} steps: fixed, not tuned")
    else:
      arm.hyper.append(f"schedule end {end:g}, update every {every} steps: defaults, NOT TUNED")
  if method in PENALIZED:
    arm.distance = _mean([r["constraint_distance"] for r in runs if r.get("constraint_distance") is not None])
  return arm


def _sweep_row(folder: pathlib.Path, r: dict) -> Row:
  names = r.get("names", {})
  arms = []
  for name in [r["ours"], *r["baselines"]]:
    method = r.get("methods", {}).get(name, name)
    arm = _sweep_arm(folder, names.get(name, NAMES.get(name, name)), method, r["sparsity"],
                     r.get("files", {}).get(name, r["file"]), r.get("selection", {}).get(name))
    if "shorter" in r:
      _attach_shorter(arm, _sweep_arm(folder, arm.name, method, r["sparsity"],
                                      r.get("shorter_files", {}).get(name, r["shorter"]),
                                      r.get("shorter_selection", {}).get(name)))
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], True, True, 2)


# --- label_noise.py --------------------------------------------------------------------------------

def _noise_arm(folder: pathlib.Path, file: str, method: str, noise: float) -> Arm:
  """One method at one noise ratio of a ``label_noise.py`` file: its accuracy per seed and the
  settings a budget keeps."""
  data = _load(folder / file)
  c = data["config"]
  runs = [x for x in data["runs"] if x["method"] == method and abs(x["noise"] - noise) < 1e-9]
  if not runs:
    raise ValueError(f"{file} has no {method} run at noise {noise}")
  split = c.get("test_only_split")
  arm = Arm(NAMES[method], {x["seed"]: _percent(x["accuracy"]) for x in runs},
            f"{c['epochs']} epochs" + (f" on {split[0]} images" if split else ""))
  arm.settings = {**_config_settings(c), "noise": noise,
                  "penalty": _only({x["penalty"] for x in runs}, f"{method}'s lambda")}
  if method in SAM_METHODS:
    arm.settings["rho"] = _only({x.get("rho", c["rho"]) for x in runs}, "rho")
    arm.settings["rescale_dual"] = _only({bool(x.get("rescale_dual")) for x in runs},
                                         "rescale_dual")
  arm.distance = _mean([x["constraint_distance"] for x in runs
                        if x.get("constraint_distance") is not None])
  return arm


def _noise_row(folder: pathlib.Path, r: dict) -> Row:
  """A ``label_noise.py`` row; ``selection``: the file whose selection a fixed-λ run used."""
  source_file = r.get("selection", r["file"])
  sel = _load(folder / source_file)["selection"][f"{r['noise']:g}"]
  where = (f"`{pathlib.Path(sel['file']).name}`, chosen at {sel['epochs']} epochs"
           if "file" in sel else f"`{source_file}`")
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    arm = _noise_arm(folder, r["file"], method, r["noise"])
    _chosen_lambda(arm, sel, method, f"{method}@0.9", arm.settings["penalty"], r["file"], where)
    if method in SAM_METHODS:
      if "rho_grid" in sel:
        _grid_note(arm, "ρ", arm.settings["rho"], sel["rho_grid"], where)
      else:
        arm.hyper.append(f"ρ {arm.settings['rho']:g} (the paper's value, not tuned)")
      if arm.settings["rescale_dual"]:
        arm.hyper.append("`rescale_dual`")
    if "shorter" in r:
      _attach_shorter(arm, _noise_arm(folder, r["shorter"], method, r["noise"]))
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], True, True, 2)


# --- flatness_mlp.py ---------------------------------------------------------------------------------

FLATNESS_SETTINGS = ("dataset", "split_seed", "sparsity", "batch_size", "learning_rate",
                     "warmup_epochs", "momentum", "weight_decay", "dual_every")


def _flatness_arm(folder: pathlib.Path, file: str, method: str, metric: str) -> Arm:
  """One method of a ``flatness_mlp.py`` file: its value per seed and the settings a budget keeps."""
  data = _load(folder / file)
  c = data["config"]
  scale = 100.0 if metric == "test_accuracy" else 1.0
  runs = data["runs"][method]
  arm = Arm(NAMES[method], {x["seed"]: scale * x[metric] for x in runs},
            f"{c['epochs']} epochs on {data['data']['train']} images")
  arm.settings = {k: c[k] for k in FLATNESS_SETTINGS}
  arm.settings["train"] = data["data"]["train"]
  if method in PENALIZED:
    arm.settings["penalty"] = c[f"{method}_penalty"]
  if method == "safe":
    arm.settings["rho"] = c["rho"]
  arm.distance = _mean([x["constraint_distance"] for x in runs if x.get("constraint_distance") is not None])
  return arm


def _flatness_row(folder: pathlib.Path, r: dict) -> Row:
  """A ``flatness_mlp.py`` row; ``selection``: the file whose λ selection a fixed-λ run used."""
  source = _load(folder / r.get("selection", r["file"]))
  sel = source["selection"]
  where = (f"`{r['selection']}`, chosen at {source['config']['epochs']} epochs"
           if "selection" in r else f"`{r['file']}`")
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    arm = _flatness_arm(folder, r["file"], method, r["metric"])
    if method in PENALIZED and abs(arm.settings["penalty"] - sel["chosen"][method]) > 1e-12:
      raise ValueError(f"{r['file']}: {method} ran with lambda {arm.settings['penalty']:g}, "
                       f"its selection chose {sel['chosen'][method]:g}")
    _grid_note(arm, "λ", sel["chosen"][method], [g["penalty"] for g in sel["grid"][method]], where)
    if method == "safe":
      arm.hyper.append(f"ρ {arm.settings['rho']:g} (the paper's value, not tuned)")
    if "shorter" in r:
      _attach_shorter(arm, _flatness_arm(folder, r["shorter"], method, r["metric"]))
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], r["higher_is_better"],
             r["metric"] == "test_accuracy", r.get("digits", 2))


# --- dual_rescaling.py -------------------------------------------------------------------------------

def _dual_row(folder: pathlib.Path, r: dict) -> Row:
  data = _load(folder / r["file"])
  a = data["args"]
  budget = f"{a['epochs']} epochs on {a['train_subset']} images"
  arms = []
  for variant in ("rescaled", "paper"):
    runs = [x for x in data["runs"] if x["variant"] == variant and x["penalty"] == r["penalty"]]
    arm = Arm("SAFE, paper's dual" if variant == "paper" else "SAFE, rescaled dual", {x["seed"]: _percent(x["accuracy"]) for x in runs}, budget,
              [f"λ {r['penalty']:g}, fixed: a mechanism check"])
    arm.distance = _mean([x["constraint_distance"] for x in runs if x.get("constraint_distance") is not None])
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], True, True, 2)


# --- the LLM study -------------------------------------------------------------------------------------

def _block_study_notes(arm: Arm, folder: pathlib.Path, method: str, structure: str, n: int,
                       lr: float, penalty: float) -> None:
  """Where SAFE / SAFE+'s lr and lambda came from: the block-0 study's grid at ``n`` windows."""
  tried = [x for x in _load(folder / "block_selection_block0.json")["runs"].values()
           if x["method"] == method and x["structure"] == structure and x["n"] == n
           and x["lr_scale"] == "none"]
  # The grid is the step count with the most settings tried; longer runs carry its choice.
  counts = {k: len({(x["lr"], x["penalty"]) for x in tried if x["steps"] == k})
            for k in {x["steps"] for x in tried}}
  if not counts:
    arm.flags.add("unchosen")
    arm.hyper.append(f"lr {lr:g}, λ {penalty:g}: NOT CHOSEN at {n} calibration windows")
    return
  grid_steps = max(counts, key=lambda k: (counts[k], -k))
  where = f"at {grid_steps} steps, `block_selection_block0.json`"
  for symbol, key, value in (("lr", "lr", lr), ("λ", "penalty", penalty)):
    _grid_note(arm, symbol, value, [x[key] for x in tried if x["steps"] == grid_steps], where,
               on="held-out block-0 error")
  # A setting the study no longer picks (an extension of its grid won) is not a choice.
  pick = min((x for x in tried if x["steps"] == grid_steps), key=lambda x: x["held_out_error"])
  if (pick["lr"], pick["penalty"]) != (lr, penalty):
    arm.flags.add("unchosen")
    arm.hyper.append(f"NOT THE PICK: the study's best is lr {pick['lr']:g}, "
                     f"λ {pick['penalty']:g}")


def _llm_row(folder: pathlib.Path, r: dict) -> Row:
  results = _load(folder / "results.json")
  by_name = {x["name"]: x for x in results["runs"]}
  b = results["budget"]
  budget = (f"{b['nsamples']} x {b['seqlen']} calibration tokens, "
            f"{b['eval_tokens']} evaluation tokens")
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    run = by_name[r["runs"][method]]
    arm = Arm(NAMES[run["method"]],
              {run["calibration"]["seed"]: run["eval"][r["eval"]]["perplexity"]}, budget)
    if run["method"] in PENALIZED:
      p = run["prune_config"]
      steps = p["epochs"] * (b["nsamples"] // p["batch_size"])
      _block_study_notes(arm, folder, run["method"], run["structure"], b["nsamples"],
                         p["learning_rate"], p["penalty"])
      arm.hyper.append(f"{steps} steps per block")
    else:
      arm.hyper.append("one-shot")
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], False, False, 2)


def _block_row(folder: pathlib.Path, r: dict) -> Row:
  data = _load(folder / r["file"])
  budget = f"{data['steps']} steps, {data['windows']} x {data['seqlen']} calibration tokens"
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    values = {int(s): v[method] for s, v in data["seeds"].items() if method in v}
    arm = Arm(NAMES[method], values, budget)
    if method in PENALIZED:
      _block_study_notes(arm, folder, method, "50%", data["windows"], data["learning_rate"],
                         data["penalty"])
    else:
      arm.hyper.append("one-shot")
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], False, False, 4)


def _standard_row(folder: pathlib.Path, r: dict) -> Row:
  """``llm_standard.py``'s pieces: one perplexity per method and calibration seed; missing: pending."""
  from benchmarks.claims import llm_standard  # pylint: disable=import-outside-toplevel  (imports JAX)
  files = folder / r["dir"]
  size = r["calibration"]
  structure = r.get("structure", "50pct")  # or "2of4": llm_standard.py --nm 2:4
  done = sorted(files.glob("*.ppl.json"))
  budget = f"{size.replace('x', ' x ')} calibration tokens, standard protocol"
  if done:
    first = _load(done[0])
    budget += f" ({first['tokens']} tokens in {first['window']}-token windows)"
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    # The script's own naming (magnitude's one run stands in every seed).
    names = {s: llm_standard.piece_name(method, structure, size, s) for s in r["seeds"]}
    values = {s: _load(files / f"{n}.ppl.json")["perplexity"] for s, n in names.items()
              if (files / f"{n}.ppl.json").exists()}
    arm = Arm(NAMES[method], values, budget)
    prune = files / f"{names[r['seeds'][0]]}.prune.json"
    if method in PENALIZED and prune.exists():
      p = _load(prune)["prune_config"]
      calib = _load(prune)["calibration"]
      steps = p["epochs"] * (calib["nsamples"] // p["batch_size"])
      study = _load(folder / r["selection"])
      pick = study["selected"][method]
      where = f"held-out block-0 error, `{r['selection']}`"
      bound = ((pick["steps_bound"], pick["steps_bound_why"]) if "steps_bound" in pick
               else None)
      for symbol, value, grid, end in (("lr", p["learning_rate"], pick["lr_grid"], None),
                                       ("λ", p["penalty"], pick["penalty_grid"], None),
                                       ("steps", pick["steps"], pick["steps_grid"], bound)):
        _grid_note(arm, symbol, value, grid, where, bound=end)
      # A study file without the field is the unstructured one (llm_block_studies.py select).
      chosen_at = study.get("structure", "50pct")
      if chosen_at != structure:
        arm.flags.add("unchosen")
        arm.hyper.append(f"NOT CHOSEN for {structure.replace('of', ':')} (the "
                         f"{chosen_at.replace('pct', ' %').replace('of', ':')} study's picks)")
      arm.hyper.append(f"{steps} steps per block")
    elif method in PENALIZED:
      arm.hyper.append("not run yet")
    else:
      arm.hyper.append("one-shot" + (", no calibration: one run for every seed"
                                     if method == "magnitude" else ""))
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], False, False, 2)


# --- cifar_gpu.py ----------------------------------------------------------------------------------------

def _cifar_row(folder: pathlib.Path, r: dict) -> Row:
  data = _load(folder / r["file"])["runs"]
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    seeds = data[method]
    epochs = _only({v["epochs_done"] for v in seeds.values()}, f"{method}'s epochs")
    arm = Arm(NAMES[method], {int(s): 100 * v["final"]["sparse_accuracy"] for s, v in seeds.items()},
              f"{epochs} epochs")
    config = _load(folder / "runs" / f"{method}-s0.9-seed0" / "config.json")
    if method == "gmp":
      arm.hyper.append(f"schedule end {config['gmp_end_fraction']:g}, update every "
                       f"{config['gmp_update_every']} steps: defaults, NOT TUNED")
    elif method in PENALIZED:
      value = config["penalty"]
      if value is None:  # the paper's per-sparsity table: the first row whose bound covers it
        value = next(lam for bound, lam in config["penalty_table"] if config["sparsity"] <= bound)
      arm.hyper.append(f"λ {value:g}, the paper's value, NOT CHOSEN here")
      arm.distance = _mean([v["last_distance_to_projection"] for v in seeds.values()])
    arms.append(arm)
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], True, True, 2)


# --- robustness_mnist.py ----------------------------------------------------------------------------

ROBUSTNESS = {"clean": lambda e: 100 * e["clean"],
              "corruptions-3": lambda e: 100 * e["corruptions"]["mean"]["3"],
              "corruptions-5": lambda e: 100 * e["corruptions"]["mean"]["5"],
              "pgd-linf": lambda e: 100 * e["pgd-linf"]["adversarial"],
              "pgd-l2": lambda e: 100 * e["pgd-l2"]["adversarial"],
              "lambda_max": lambda e: e["hessian"]["lambda_max_support"]}


def _robustness_arm(folder: pathlib.Path, file: str, method: str, metric: str) -> Arm:
  """One method of a ``robustness_mnist.py`` file: its value per seed and the settings a budget keeps."""
  data = _load(folder / file)
  evals = data["evals"][method]
  c = evals[0]["config"]
  arm = Arm(NAMES[method], {e["config"]["seed"]: None if "diverged" in e else ROBUSTNESS[metric](e)
                           for e in evals}, f"{c['epochs']} epochs")
  value = c["admm_penalty"] if method == "admm" else c["penalty"]
  if value is None:
    value = next(lam for bound, lam in c["penalty_table"] if c["sparsity"] <= bound)
  arm.settings = {**_config_settings(c), "penalty": value}
  if method == "safe":
    arm.settings.update(rho=c["rho"], rescale_dual=bool(c.get("rescale_dual")))
  arm.distance = _mean([e["constraint_distance"] for e in evals
                        if e.get("constraint_distance") is not None])
  return arm


def _robustness_row(folder: pathlib.Path, r: dict) -> Row:
  data = _load(folder / r["file"])
  arms = []
  for method in [r["ours"], *r["baselines"]]:
    arm = _robustness_arm(folder, r["file"], method, r["metric"])
    value = arm.settings["penalty"]
    sel = data.get("selection")
    if sel is None:
      arm.hyper.append(f"λ {value:g}, the preset's value, NOT CHOSEN here")
      arm.flags.add("unchosen")
    else:
      where = (f"`{pathlib.Path(sel['file']).name}`, chosen at {sel['epochs']} epochs"
               if "file" in sel else f"`{r['file']}`")
      _chosen_lambda(arm, sel, method, f"{method}@{data['sparsity']:g}", value, r["file"], where)
      if method == "safe":
        arm.hyper.append(f"ρ {arm.settings['rho']:g} (the paper's value, not tuned)")
        if arm.settings["rescale_dual"]:
          arm.hyper.append("`rescale_dual`")
    if "shorter" in r:
      _attach_shorter(arm, _robustness_arm(folder, r["shorter"], method, r["metric"]))
    arms.append(arm)
  lower = r["metric"] == "lambda_max"
  return Row(r["label"], r.get("paper", ""), arms[0], arms[1:], not lower, not lower,
             r.get("digits", 3 if lower else 2))


READERS: dict[str, Callable[[pathlib.Path, dict], Row]] = {
    "robustness": _robustness_row,
    "sweep": _sweep_row, "label_noise": _noise_row, "flatness": _flatness_row,
    "dual_rescaling": _dual_row, "llm": _llm_row, "llm_block": _block_row,
    "llm_standard": _standard_row, "cifar": _cifar_row}
CLAIM_KEYS = ("order", "title", "short", "paper", "metric", "rows", "caveats", "higher_is_better")


def load_claim(folder: pathlib.Path,
               declaration: Callable[[str, str, str], dict] = tuning.declared) -> Claim:
  """A claim's rows: each row of ``claim.json`` read with the claim's defaults (source, file, methods).

  ``declaration(claim folder, row label, method name)`` gives the declared
  tuning of each method (``benchmarks/claims/tuning.py`` unless a test passes another).
  """
  spec = _load(folder / "claim.json")
  defaults = {k: v for k, v in spec.items() if k not in CLAIM_KEYS}
  rows = []
  for row in spec["rows"]:
    r = {**defaults, **row}
    if r["source"] not in READERS:
      raise ValueError(f"{folder}/claim.json: source {r['source']!r} is not one of {sorted(READERS)}")
    row = READERS[r["source"]](folder, r)
    row.note = r.get("not_evidence", "")
    row.budget_check = r.get("budget_check", "")
    tuning.apply(folder.name, row, declaration)
    rows.append(row)
  labels = {row.label: row for row in rows}
  for row in rows:
    if row.budget_check and (row.budget_check not in labels
                             or labels[row.budget_check].ours.budget == row.ours.budget):
      raise ValueError(f"{folder}/claim.json: row {row.label!r} is a budget check of "
                       f"{row.budget_check!r}, which must be another row of the claim at "
                       f"another budget")
  return Claim(spec["order"], spec["title"], spec["short"], spec["paper"], spec["metric"],
               spec.get("higher_is_better", True), rows, spec.get("caveats", []))
