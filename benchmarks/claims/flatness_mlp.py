"""The paper's §4.1 (Fig. 1) on real data: dense vs SAFE vs ADMM, MLP 784-300-100-10.

Data (``--dataset``): ``mnist`` = the official MNIST test set split 8,000
train / 2,000 test (``load_mnist(test_only_split=(8000, 2000))``; the 60k
training files are not available offline), or ``fashion_mnist`` = the full
60k / 10k Fashion-MNIST (Debian ``dataset-fashion-mnist``).

1. **Selection** (``--select``): each penalty method's ``lambda`` is chosen on
   a validation split carved from the training data (``--validation``
   examples, never the test set): every value of ``--safe-grid`` (SAFE,
   cosine ramp) and ``--admm-grid`` (ADMM, constant) is trained on the rest
   for ``--select-seeds`` seeds, and the one with the best mean validation
   accuracy of the final sparse model wins. Without ``--select`` the
   ``--safe-penalty`` / ``--admm-penalty`` values are used.
2. **Final runs**: dense SGD, SAFE (:func:`safe_optax.safe`) and ADMM
   (:func:`safe_optax.admm`) at ``--sparsity`` on the whole training split,
   ``--seeds`` seeds, then on each final model (after
   :func:`safe_optax.finalize` for SAFE and ADMM):

   * lambda_max of the training-loss Hessian by power iteration
     (:func:`safe_optax.flatness.max_hessian_eigenvalue`) on fixed training
     batches: over all weights, over the sparse model's support (kept
     weights), and of the dense iterate before the projection;
   * the Hutchinson trace over all weights and over the support;
   * 1D and 2D loss landscapes along filter-normalised random directions (on
     the support for the sparse models, all weights for the dense one);
   * weight histograms (Fig. 1 a-b);
   * convergence: the per-epoch training loss (its change over the last 10 %
     of epochs), ``||x - z||`` (:func:`safe_optax.constraint_distance`) and
     ``||x - Proj(x)||`` of the final iterate, relative to ``||x||``.

Every run of a method is one ``jax.jit`` call (a ``lax.scan`` over all steps).
All methods share the recipe (SGD momentum 0.9, warm-up + cosine learning
rate, weight decay, batch 128) and, per seed, the initialisation and data
order. Writes ``flatness_<dataset>.{json,md,png}`` to ``--out``.

  python -m benchmarks.claims.flatness_mlp --dataset mnist --select --out results/flatness_mnist
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import flatness
from safe_optax import methods
from safe_optax.experiment import (batch_order, cross_entropy, mean_se, scan_trainer,
                                   steps_per_epoch, versions)
from safe_optax.vision import input_pipeline, models
from safe_optax.vision import datasets
from safe_optax.vision import steps as steps_lib
from benchmarks import harness

METHODS = ("dense", "safe", "admm")
PENALTY_METHODS = ("safe", "admm")
SHARED_DATA = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"
DATA_DIRS = {"mnist": str(SHARED_DATA / "mnist"),
             "fashion_mnist": "/usr/share/datasets/fashion-mnist"}
SPLITS = {"mnist": (8000, 2000), "fashion_mnist": None}


@dataclasses.dataclass(frozen=True)
class Config(methods.Hyperparams):
  """Everything that determines the run (written to the JSON): the methods'
  :class:`~safe_optax.methods.Hyperparams` (this study's defaults below) and its own settings."""

  dataset: str = "mnist"
  data_dir: Optional[str] = None  # None: DATA_DIRS[dataset]
  split_seed: int = 0
  epochs: int = 100
  seeds: int = 3
  batch_size: int = 128
  warmup_epochs: int = 2
  safe_penalty: float = 0.1  # SAFE ramps it (cosine), ADMM keeps its own constant
  admm_penalty: Optional[float] = 1e-2
  select: bool = False
  validation: int = 2000  # training examples held out for the selection
  select_seeds: int = 2
  safe_grid: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)
  admm_grid: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1)
  hessian_examples: int = 2000  # training examples the Hessian / landscapes are measured on
  hessian_batches: int = 4
  power_tol: float = 1e-4
  power_max_iterations: int = 200
  trace_probes: int = 50
  line_points: int = 41
  surface_points: int = 17
  landscape_radius: float = 1.0

  def resolved_data_dir(self) -> str:
    return self.data_dir or DATA_DIRS[self.dataset]


def make_train_fn(method: str, config: Config, penalty: Optional[float], n_train: int,
                  model: models.MLP):
  """``train(params, order, x, y) -> (params, opt_state, epoch_losses)``, one jitted scan.

  The optimizer is the registry's (:func:`safe_optax.methods.make_optimizer`) for
  ``method`` with lambda ``penalty``; the run is :func:`safe_optax.experiment.scan_trainer`.
  """
  steps_epoch = steps_per_epoch(n_train, config.batch_size)
  hp = dataclasses.replace(config, method=method, penalty=penalty, admm_penalty=penalty)
  tx = methods.make_optimizer(methods.validate(hp), steps_epoch)

  def loss_fn(params, x, y):
    return cross_entropy(model.apply({"params": params}, x), y)

  return scan_trainer(loss_fn, tx, uses_grad_fn=methods.get(method).uses_grad_fn,
                      epochs=config.epochs, steps_per_epoch=steps_epoch)


def measure(model, params, dense_iterate, support, batches, key,
            config: Config) -> dict[str, Any]:
  """lambda_max (all weights, support, dense iterate), traces, 1D and 2D landscapes."""
  def loss_fn(p, batch):
    x, y = batch
    return cross_entropy(model.apply({"params": p}, x), y)

  @jax.jit
  def run(params, dense_iterate, support, key):
    k_full, k_support, k_iter, k_trace, k_trace_all, k_d1, k_d2 = jax.random.split(key, 7)
    power = dict(tol=config.power_tol, max_iterations=config.power_max_iterations)
    full = flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=k_full, **power)
    restricted = flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=k_support,
                                                 support=support, **power)
    iterate = flatness.max_hessian_eigenvalue(loss_fn, dense_iterate, batches, key=k_iter,
                                              **power)
    trace = flatness.hessian_trace(loss_fn, params, batches, key=k_trace,
                                   num_probes=config.trace_probes, support=support)
    trace_all = flatness.hessian_trace(loss_fn, params, batches, key=k_trace_all,
                                       num_probes=config.trace_probes)
    d1 = flatness.filter_normalized_direction(k_d1, params, support=support)
    d2 = flatness.filter_normalized_direction(k_d2, params, support=support)
    alphas = jnp.linspace(-config.landscape_radius, config.landscape_radius, config.line_points)
    grid = jnp.linspace(-config.landscape_radius, config.landscape_radius,
                        config.surface_points)
    line = flatness.loss_line(loss_fn, params, batches, d1, alphas)
    surface = flatness.loss_surface(loss_fn, params, batches, (d1, d2), grid, grid)
    return full, restricted, iterate, trace, trace_all, line, surface

  full, restricted, iterate, trace, trace_all, line, surface = run(
      params, dense_iterate, support, key)
  out: dict[str, Any] = {}
  for name, result in (("lambda_max", full), ("lambda_max_support", restricted),
                       ("lambda_max_iterate", iterate)):
    out[name] = float(result.eigenvalue)
    out[name + "_iterations"] = int(result.num_iterations)
    out[name + "_converged"] = bool(result.converged)
  out.update(trace_support=float(trace), trace=float(trace_all),
             line=np.asarray(line).tolist(), surface=np.asarray(surface).tolist())
  return out


def accuracy(model, params, x, y) -> float:
  logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, x)
  return float(jnp.mean(jnp.argmax(logits, -1) == y))


def load(config: Config) -> dict[str, Any]:
  """Normalised train / test arrays of ``config.dataset``."""
  data = input_pipeline.load_mnist(config.resolved_data_dir(),
                                   test_only_split=SPLITS[config.dataset],
                                   seed=config.split_seed)
  mean, std = datasets.NORMALIZATION[config.dataset]
  norm = lambda im: input_pipeline.normalize(im, mean, std)
  return {"x_train": norm(data.train_images), "y_train": jnp.asarray(data.train_labels),
          "x_test": norm(data.test_images), "y_test": jnp.asarray(data.test_labels)}


def convergence(params, opt_state, epoch_losses, config: Config) -> dict[str, Any]:
  """Has the run converged? Loss plateau and distance to the sparse set."""
  losses = np.asarray(epoch_losses, np.float64)
  tail = max(1, len(losses) // 10)
  prunable = jax.tree.map(lambda x, m: x if m else None, params,
                          safe_optax.prunable_mask(params))
  norm_x = float(optax.tree.norm(prunable))
  out = {
      "epoch_losses": losses.tolist(),
      "final_train_loss": float(losses[-1]),
      # Mean loss of the last 10 % of epochs relative to the 10 % before: ~0 on a plateau.
      "loss_change_last_tenth": float((losses[-2 * tail:-tail].mean() - losses[-tail:].mean())
                                      / max(losses[-tail:].mean(), 1e-12))
      if len(losses) >= 2 * tail else None,
      "prunable_norm": norm_x,
      "distance_to_projection": float(steps_lib.distance_to_projection(params,
                                                                          config.sparsity)),
  }
  if config_has_admm(opt_state):
    out["constraint_distance"] = float(safe_optax.constraint_distance(params, opt_state))
  return out


def config_has_admm(opt_state) -> bool:
  """Whether the optimizer state holds an ``ADMMState`` (SAFE, ADMM; not dense SGD)."""
  return any(isinstance(s, safe_optax.ADMMState) for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, safe_optax.ADMMState)))


def train_runs(method: str, penalty: Optional[float], config: Config, data: dict[str, Any],
                seeds: list[int], model) -> list[tuple[int, Any, Any, Any, float]]:
  n_train = int(data["x_train"].shape[0])
  train_fn = make_train_fn(method, config, penalty, n_train, model)
  runs = []
  for seed in seeds:
    params = model.init(jax.random.PRNGKey(seed), data["x_train"][:1])["params"]
    order = jnp.asarray(batch_order(seed, n_train, batch_size=config.batch_size,
                                    epochs=config.epochs))
    t0 = time.perf_counter()
    trained, opt_state, losses = jax.block_until_ready(
        train_fn(params, order, data["x_train"], data["y_train"]))
    runs.append((seed, trained, opt_state, losses, time.perf_counter() - t0))
  return runs


def select(config: Config, data: dict[str, Any], model, progress) -> dict[str, Any]:
  """Each penalty method's lambda by validation accuracy of the final sparse model."""
  n = int(data["x_train"].shape[0])
  rest, held_out = input_pipeline.validation_split(n, config.validation, config.split_seed)
  split = {"x_train": data["x_train"][rest], "y_train": data["y_train"][rest],
           "x_test": data["x_train"][held_out], "y_test": data["y_train"][held_out]}
  grids = {"safe": config.safe_grid, "admm": config.admm_grid}
  table: dict[str, list[dict[str, Any]]] = {}
  chosen = {}
  for method in PENALTY_METHODS:
    table[method] = []
    for penalty in grids[method]:
      accs, dists, losses = [], [], []
      for _, trained, opt_state, epoch_losses, _ in train_runs(
          method, penalty, config, split, list(range(config.select_seeds)), model):
        final, _ = safe_optax.finalize(trained, config.sparsity)
        accs.append(accuracy(model, final, split["x_test"], split["y_test"]))
        dists.append(float(safe_optax.constraint_distance(trained, opt_state)))
        losses.append(float(epoch_losses[-1]))
        progress.update()
      mean, se = mean_se(accs)
      table[method].append({"penalty": penalty, "validation_accuracy": accs,
                            "mean": mean, "se": se, "constraint_distance": dists,
                            "final_train_loss": losses})
      progress.set_postfix_str(f"{method} lambda {penalty:g}: val {mean:.4f}")
    chosen[method] = max(table[method], key=lambda r: r["mean"])["penalty"]
  return {"validation_examples": int(config.validation),
          "train_examples": int(len(rest)), "seeds": list(range(config.select_seeds)),
          "criterion": "mean validation accuracy of the final sparse model",
          "grid": table, "chosen": chosen}


def run(config: Config, progress: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
  """Selects (optionally), trains and measures every method and seed.

  Returns (results JSON, {method: (final params, dense iterate) of seed 0}).
  """
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

  start = time.perf_counter()
  data = load(config)
  model = models.mlp()
  selection = None
  if config.select:
    n_select = sum(len(g) for g in (config.safe_grid, config.admm_grid)) * config.select_seeds
    bar = tqdm(total=n_select, desc="selection", disable=not progress, file=sys.stderr)
    selection = select(config, data, model, bar)
    bar.close()
    config = dataclasses.replace(config, safe_penalty=selection["chosen"]["safe"],
                                 admm_penalty=selection["chosen"]["admm"])
  penalties = {"dense": None, "safe": config.safe_penalty, "admm": config.admm_penalty}
  per = config.hessian_examples // config.hessian_batches
  # The fixed Hessian / landscape set: the first examples of the (shuffled) training split.
  batches = [(data["x_train"][i * per:(i + 1) * per], data["y_train"][i * per:(i + 1) * per])
             for i in range(config.hessian_batches)]
  runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
  seed0: dict[str, Any] = {}
  bar = tqdm(total=len(METHODS) * config.seeds, desc="runs", disable=not progress,
             file=sys.stderr)
  for method in METHODS:
    for seed, trained, opt_state, losses, train_s in train_runs(
        method, penalties[method], config, data, list(range(config.seeds)), model):
      if method == "dense":
        final, support = trained, None  # all weights
      else:
        final, keep = safe_optax.finalize(trained, config.sparsity)
        support = flatness.support_mask(final, keep)
      entry = {
          "seed": seed,
          "train_seconds": train_s,
          "test_accuracy": accuracy(model, final, data["x_test"], data["y_test"]),
          "test_accuracy_before_projection": accuracy(model, trained, data["x_test"],
                                                      data["y_test"]),
          "sparsity": safe_optax.sparsity_report(final).sparsity,
          **convergence(trained, opt_state, losses, config),
      }
      entry.update(measure(model, final, trained, support, batches,
                           jax.random.PRNGKey(1000 + seed), config))
      runs[method].append(entry)
      if seed == 0:
        seed0[method] = (final, trained)
      bar.update()
      bar.set_postfix_str(f"{method} seed {seed}: lambda_max {entry['lambda_max']:.3g}")
  bar.close()
  summary = {}
  for method in METHODS:
    summary[method] = {}
    for name in ("test_accuracy", "test_accuracy_before_projection", "lambda_max",
                 "lambda_max_support", "lambda_max_iterate", "trace", "trace_support",
                 "sparsity", "final_train_loss", "loss_change_last_tenth",
                 "distance_to_projection", "prunable_norm", "constraint_distance"):
      values = [r[name] for r in runs[method] if r.get(name) is not None]
      if values:
        mean, se = mean_se(values)
        summary[method][name] = {"mean": mean, "se": se}
  per_seed = {}
  for name in ("lambda_max", "lambda_max_support", "lambda_max_iterate", "trace"):
    values = {m: [r[name] for r in runs[m]] for m in PENALTY_METHODS}
    per_seed[name] = [s < a for s, a in zip(values["safe"], values["admm"])]
  results = {
      "benchmark": "flatness_mlp",
      "command": "python " + " ".join(sys.argv),
      "config": dataclasses.asdict(config),
      "data": {"train": int(data["x_train"].shape[0]), "test": int(data["x_test"].shape[0]),
               "dir": config.resolved_data_dir()},
      "versions": versions(),
      "selection": selection,
      "summary": summary,
      "safe_below_admm_per_seed": per_seed,
      "runs": runs,
      "wall_seconds": time.perf_counter() - start,
  }
  return results, seed0


def _pm(stat: dict[str, Any], digits: int = 2) -> str:
  se = "" if stat["se"] is None else f" ± {stat['se']:.{digits}f}"
  return f"{stat['mean']:.{digits}f}{se}"


def plot(results: dict[str, Any], seed0: dict[str, Any], path: pathlib.Path) -> None:
  """Fig. 1: weight histograms (dense vs SAFE, ADMM), 1D landscapes, 2D contours (seed 0)."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  config = results["config"]
  labels = {"dense": "dense", "safe": "SAFE", "admm": "ADMM"}
  colors = {"dense": "C0", "safe": "C1", "admm": "C2"}
  fig = Figure(figsize=(25, 4.8))
  axes = fig.subplots(1, 5)
  flatness.plot_weight_histograms(axes[0], {labels[m]: seed0[m][1] for m in METHODS},
                                  title="dense iterates before projection (seed 0)")
  flatness.plot_weight_histograms(axes[1], {labels[m]: seed0[m][0] for m in METHODS},
                                  title="final models (seed 0)")
  r = config["landscape_radius"]
  alphas = np.linspace(-r, r, config["line_points"])
  for method in METHODS:
    for i, run in enumerate(results["runs"][method]):
      axes[2].plot(alphas, run["line"], color=colors[method], alpha=1.0 if i == 0 else 0.35,
                   label=labels[method] if i == 0 else None)
  axes[2].set_xlabel("alpha (filter-normalised direction)")
  axes[2].set_ylabel("training loss")
  axes[2].set_title(f"1D landscapes ({config['seeds']} seeds)")
  axes[2].legend()
  grid = np.linspace(-r, r, config["surface_points"])
  surfaces = {m: np.asarray(results["runs"][m][0]["surface"]) for m in PENALTY_METHODS}
  vmax = max(float(s.max()) for s in surfaces.values())
  levels = np.linspace(0, vmax, 25)
  for ax, method in zip(axes[3:], ("admm", "safe")):
    cs = ax.contour(grid, grid, surfaces[method], levels=levels)
    ax.clabel(cs, fontsize=6)
    s = results["summary"][method]
    ax.set_title(f"{labels[method]} 2D (seed 0)\nlambda_max {_pm(s['lambda_max'], 3)} "
                 f"(kept {_pm(s['lambda_max_support'], 3)})")
  fig.suptitle(f"MLP 784-300-100-10, {config['dataset']} ({results['data']['train']} / "
               f"{results['data']['test']}), {config['sparsity']:.0%} sparsity, "
               f"{config['epochs']} epochs, {config['seeds']} seeds; lambda SAFE "
               f"{config['safe_penalty']:g} (cosine), ADMM {config['admm_penalty']:g}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def format_table(results: dict[str, Any]) -> str:
  def fmt(stat, scale=1.0, digits=3):
    if stat is None:
      return "–"
    se = "" if stat["se"] is None else f" ± {stat['se'] * scale:.{digits}f}"
    return f"{stat['mean'] * scale:.{digits}f}{se}"

  lines = ["| method | test acc (%) | lambda_max, all weights | lambda_max, kept weights | "
           "lambda_max, dense iterate | trace, all | trace, kept | final train loss | "
           "loss change, last 10 % | ‖x − z‖ / ‖x‖ |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for method in METHODS:
    s = results["summary"][method]
    rel = None
    if "constraint_distance" in s:
      rel = {"mean": s["constraint_distance"]["mean"] / s["prunable_norm"]["mean"], "se": None}
    lines.append(
        f"| {method} | {fmt(s['test_accuracy'], 100, 2)} | {fmt(s['lambda_max'])} | "
        f"{fmt(s['lambda_max_support']) if method != 'dense' else '–'} | "
        f"{fmt(s['lambda_max_iterate'])} | {fmt(s['trace'], digits=2)} | "
        f"{fmt(s['trace_support'], digits=2) if method != 'dense' else '–'} | "
        f"{fmt(s['final_train_loss'], digits=4)} | {fmt(s.get('loss_change_last_tenth'))} | "
        f"{fmt(rel, digits=4)} |")
  return "\n".join(lines)


def format_selection(selection: Optional[dict[str, Any]]) -> str:
  if selection is None:
    return "No selection run: lambdas given on the command line."
  lines = [f"Lambda chosen on {selection['validation_examples']} held-out training examples "
           f"(trained on the other {selection['train_examples']}, seeds "
           f"{selection['seeds']}; {selection['criterion']}):", "",
           "| method | lambda | validation acc (%) | ‖x − z‖ |", "|---|---|---|---|"]
  for method, rows in selection["grid"].items():
    for row in rows:
      mark = " **(chosen)**" if row["penalty"] == selection["chosen"][method] else ""
      lines.append(f"| {method} | {row['penalty']:g}{mark} | {100 * row['mean']:.2f} | "
                   f"{np.mean(row['constraint_distance']):.3g} |")
  return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/flatness_mnist")
  parser.add_argument("--dataset", choices=sorted(DATA_DIRS), default=Config.dataset)
  parser.add_argument("--data-dir", default=None, help="default: the dataset's shared copy")
  parser.add_argument("--epochs", type=int, default=Config.epochs)
  parser.add_argument("--seeds", type=int, default=Config.seeds)
  parser.add_argument("--safe-penalty", type=float, default=Config.safe_penalty)
  parser.add_argument("--admm-penalty", type=float, default=Config.admm_penalty)
  parser.add_argument("--select", action="store_true",
                      help="choose both lambdas on a validation split first")
  parser.add_argument("--validation", type=int, default=Config.validation)
  parser.add_argument("--select-seeds", type=int, default=Config.select_seeds)
  parser.add_argument("--safe-grid", type=float, nargs="+", default=list(Config.safe_grid))
  parser.add_argument("--admm-grid", type=float, nargs="+", default=list(Config.admm_grid))
  parser.add_argument("--rho", type=float, default=Config.rho)
  parser.add_argument("--surface-points", type=int, default=Config.surface_points)
  parser.add_argument("--hessian-examples", type=int, default=Config.hessian_examples)
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  config = Config(dataset=args.dataset, data_dir=args.data_dir, epochs=args.epochs,
                  seeds=args.seeds, safe_penalty=args.safe_penalty,
                  admm_penalty=args.admm_penalty, select=args.select,
                  validation=args.validation, select_seeds=args.select_seeds,
                  safe_grid=tuple(args.safe_grid), admm_grid=tuple(args.admm_grid),
                  rho=args.rho, surface_points=args.surface_points,
                  hessian_examples=args.hessian_examples)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results, seed0 = run(config, progress=not args.no_progress)
  stem = f"flatness_{config.dataset}"
  harness.write_json(out / f"{stem}.json", results)
  plot(results, seed0, out / f"{stem}.png")
  table = format_table(results)
  selection = format_selection(results["selection"])
  (out / f"{stem}.md").write_text(
      f"Command: `{results['command']}`\n\n{selection}\n\n{table}\n")
  print(selection + "\n\n" + table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
