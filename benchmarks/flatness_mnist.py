"""The paper's §4.1 on real data: dense vs SAFE vs ADMM, MLP 784-300-100-10 on MNIST.

Trains ``safe_optax.vision.mlp()`` on the official MNIST test set split
8,000 train / 2,000 test (``load_mnist(test_only_split=(8000, 2000))``; the
60k training files are not available offline) with dense SGD, SAFE
(``safe_optax.safe``) and ADMM (``safe_optax.admm``) at 90% sparsity, then on
each final model (after :func:`safe_optax.finalize` for SAFE and ADMM):

* lambda_max of the training-loss Hessian by power iteration
  (:func:`safe_optax.flatness.max_hessian_eigenvalue`) on fixed training
  batches: over all weights, and restricted to the sparse model's support;
* the Hutchinson trace over the support;
* 1D and 2D loss landscapes along filter-normalised random directions (on the
  support for the sparse models, all weights for the dense one);
* weight histograms.

Every run of a method is one ``jax.jit`` call (a ``lax.scan`` over all steps).
All methods share the recipe (SGD momentum 0.9, warm-up + cosine learning
rate, weight decay, batch 128) and, per seed, the initialisation and data
order. Writes ``flatness_mnist.json`` and ``flatness_mnist.png`` to ``--out``.

  python benchmarks/flatness_mnist.py --out results/flatness
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import safe_optax
from safe_optax import flatness
from safe_optax.demo import batch_order, mean_se, versions
from safe_optax.vision import input_pipeline, models

METHODS = ("dense", "safe", "admm")
MNIST_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines the run (written to the JSON)."""

  data_dir: str = str(MNIST_DIR)
  split: tuple[int, int] = (8000, 2000)
  split_seed: int = 0
  sparsity: float = 0.9
  epochs: int = 30
  seeds: int = 3
  batch_size: int = 128
  learning_rate: float = 0.1
  warmup_epochs: int = 2
  momentum: float = 0.9
  weight_decay: float = 1e-4
  penalty: float = 1e-2  # the same lambda for both; SAFE ramps it (cosine), ADMM keeps it constant
  rho: float = 0.1
  dual_every: int = 32
  hessian_examples: int = 2000  # training examples the Hessian / landscapes are measured on
  hessian_batches: int = 4
  power_tol: float = 1e-4
  power_max_iterations: int = 200
  trace_probes: int = 50
  line_points: int = 41
  surface_points: int = 17
  landscape_radius: float = 1.0


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_optimizer(method: str, config: Config, total_steps: int, steps_epoch: int):
  lr = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_epochs * steps_epoch, total_steps, 0.0)
  if method == "dense":
    return optax.chain(optax.add_decayed_weights(config.weight_decay),
                       optax.sgd(lr, momentum=config.momentum))
  common = dict(penalty=config.penalty, total_steps=total_steps, dual_every=config.dual_every,
                momentum=config.momentum, weight_decay=config.weight_decay)
  if method == "safe":
    return safe_optax.safe(lr, config.sparsity, rho=config.rho, **common)
  return safe_optax.admm(lr, config.sparsity, **common)


def make_train_fn(method: str, config: Config, n_train: int, model: models.MLP):
  steps_epoch = n_train // config.batch_size
  total_steps = config.epochs * steps_epoch
  tx = make_optimizer(method, config, total_steps, steps_epoch)

  def loss_fn(params, x, y):
    return cross_entropy(model.apply({"params": params}, x), y)

  def train(params, order, x_train, y_train):
    def step(carry, idx):
      params, opt_state = carry
      xb, yb = x_train[idx], y_train[idx]
      loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
      grad_fn = lambda p, _: jax.grad(loss_fn)(p, xb, yb)  # same minibatch for SAM
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
      return (optax.apply_updates(params, updates), opt_state), loss

    (params, _), losses = lax.scan(step, (params, tx.init(params)), order)
    return params, losses.reshape(config.epochs, steps_epoch).mean(axis=1)

  return jax.jit(train)


def measure(model, params, support, batches, key, config: Config) -> dict[str, Any]:
  """lambda_max (all weights, support), trace (support), 1D and 2D landscapes."""
  def loss_fn(p, batch):
    x, y = batch
    return cross_entropy(model.apply({"params": p}, x), y)

  @jax.jit
  def run(params, support, key):
    k_full, k_support, k_trace, k_d1, k_d2 = jax.random.split(key, 5)
    full = flatness.max_hessian_eigenvalue(
        loss_fn, params, batches, key=k_full, tol=config.power_tol,
        max_iterations=config.power_max_iterations)
    restricted = flatness.max_hessian_eigenvalue(
        loss_fn, params, batches, key=k_support, tol=config.power_tol,
        max_iterations=config.power_max_iterations, support=support)
    trace = flatness.hessian_trace(loss_fn, params, batches, key=k_trace,
                                   num_probes=config.trace_probes, support=support)
    d1 = flatness.filter_normalized_direction(k_d1, params, support=support)
    d2 = flatness.filter_normalized_direction(k_d2, params, support=support)
    alphas = jnp.linspace(-config.landscape_radius, config.landscape_radius, config.line_points)
    grid = jnp.linspace(-config.landscape_radius, config.landscape_radius,
                        config.surface_points)
    line = flatness.loss_line(loss_fn, params, batches, d1, alphas)
    surface = flatness.loss_surface(loss_fn, params, batches, (d1, d2), grid, grid)
    return full, restricted, trace, line, surface

  full, restricted, trace, line, surface = run(params, support, key)
  return {
      "lambda_max": float(full.eigenvalue),
      "lambda_max_iterations": int(full.num_iterations),
      "lambda_max_converged": bool(full.converged),
      "lambda_max_support": float(restricted.eigenvalue),
      "lambda_max_support_iterations": int(restricted.num_iterations),
      "lambda_max_support_converged": bool(restricted.converged),
      "trace_support": float(trace),
      "line": np.asarray(line).tolist(),
      "surface": np.asarray(surface).tolist(),
  }


def accuracy(model, params, x, y) -> float:
  logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, x)
  return float(jnp.mean(jnp.argmax(logits, -1) == y))


def run(config: Config, progress: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
  """Trains and measures every method and seed; returns (results JSON, params of seed 0)."""
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

  start = time.perf_counter()
  data = input_pipeline.load_mnist(config.data_dir, test_only_split=config.split,
                                   seed=config.split_seed)
  norm = lambda im: input_pipeline.normalize(im, input_pipeline.MNIST_MEAN,
                                             input_pipeline.MNIST_STD)
  x_train, y_train = norm(data.train_images), jnp.asarray(data.train_labels)
  x_test, y_test = norm(data.test_images), jnp.asarray(data.test_labels)
  n_train = int(x_train.shape[0])
  # The fixed Hessian / landscape set: the first examples of the training split.
  per = config.hessian_examples // config.hessian_batches
  batches = [(x_train[i * per:(i + 1) * per], y_train[i * per:(i + 1) * per])
             for i in range(config.hessian_batches)]
  model = models.mlp()
  train_fns = {m: make_train_fn(m, config, n_train, model) for m in METHODS}
  runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
  seed0_params: dict[str, Any] = {}
  bar = tqdm(total=len(METHODS) * config.seeds, desc="runs", disable=not progress,
             file=sys.stderr)
  for seed in range(config.seeds):
    params = model.init(jax.random.PRNGKey(seed), x_train[:1])["params"]
    order = jnp.asarray(batch_order(seed, config, n_train))
    for method in METHODS:
      t0 = time.perf_counter()
      trained, epoch_losses = train_fns[method](params, order, x_train, y_train)
      trained = jax.block_until_ready(trained)
      train_s = time.perf_counter() - t0
      if method == "dense":
        final, support = trained, None  # all weights
      else:
        final, keep = safe_optax.finalize(trained, config.sparsity)
        support = flatness.support_mask(final, keep)
      entry = {
          "seed": seed,
          "train_seconds": train_s,
          "final_train_loss": float(epoch_losses[-1]),
          "test_accuracy": accuracy(model, final, x_test, y_test),
          "test_accuracy_before_projection": accuracy(model, trained, x_test, y_test),
          "sparsity": safe_optax.sparsity_report(final).sparsity,
      }
      entry.update(measure(model, final, support, batches, jax.random.PRNGKey(1000 + seed),
                           config))
      runs[method].append(entry)
      if seed == 0:
        seed0_params[method] = final
      bar.update()
      bar.set_postfix_str(f"{method} seed {seed}: lambda_max {entry['lambda_max']:.3g}")
  bar.close()
  summary = {}
  for method in METHODS:
    summary[method] = {}
    for name in ("test_accuracy", "lambda_max", "lambda_max_support", "trace_support",
                 "sparsity"):
      mean, se = mean_se([r[name] for r in runs[method]])
      summary[method][name] = {"mean": mean, "se": se}
  lam = {m: [r["lambda_max"] for r in runs[m]] for m in ("safe", "admm")}
  lam_s = {m: [r["lambda_max_support"] for r in runs[m]] for m in ("safe", "admm")}
  results = {
      "benchmark": "flatness_mnist",
      "command": "python " + " ".join(sys.argv),
      "config": dataclasses.asdict(config),
      "versions": versions(),
      "summary": summary,
      "safe_below_admm_per_seed": [s < a for s, a in zip(lam["safe"], lam["admm"])],
      "safe_below_admm_support_per_seed": [s < a for s, a in zip(lam_s["safe"], lam_s["admm"])],
      "runs": runs,
      "wall_seconds": time.perf_counter() - start,
  }
  return results, seed0_params


def _pm(stat: dict[str, Any]) -> str:
  se = "" if stat["se"] is None else f" +- {stat['se']:.2f}"
  return f"{stat['mean']:.2f}{se}"


def plot(results: dict[str, Any], seed0_params: dict[str, Any], path: pathlib.Path) -> None:
  """Weight histograms, 1D landscapes, 2D contours of ADMM and SAFE (seed 0), lambda_max."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  config = results["config"]
  labels = {"dense": "dense", "safe": "SAFE", "admm": "ADMM"}
  fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
  flatness.plot_weight_histograms(axes[0], {labels[m]: seed0_params[m] for m in METHODS},
                                  title="weights (seed 0)")
  r = config["landscape_radius"]
  alphas = np.linspace(-r, r, config["line_points"])
  for method in METHODS:
    for i, run in enumerate(results["runs"][method]):
      axes[1].plot(alphas, run["line"], color={"dense": "C0", "safe": "C1", "admm": "C2"}[method],
                   alpha=1.0 if i == 0 else 0.35, label=labels[method] if i == 0 else None)
  axes[1].set_xlabel("alpha (filter-normalised direction)")
  axes[1].set_ylabel("training loss")
  axes[1].set_title(f"1D landscapes ({config['seeds']} seeds)")
  axes[1].legend()
  grid = np.linspace(-r, r, config["surface_points"])
  surfaces = {m: np.asarray(results["runs"][m][0]["surface"]) for m in ("admm", "safe")}
  vmax = max(float(s.max()) for s in surfaces.values())
  levels = np.linspace(0, vmax, 25)
  for ax, method in zip(axes[2:], ("admm", "safe")):
    cs = ax.contour(grid, grid, surfaces[method], levels=levels)
    ax.clabel(cs, fontsize=6)
    s = results["summary"][method]
    ax.set_title(f"{labels[method]} 2D (seed 0)\nlambda_max {_pm(s['lambda_max'])} "
                 f"(support {_pm(s['lambda_max_support'])})")
  fig.suptitle(f"MLP 784-300-100-10, MNIST 8k/2k, {config['sparsity']:.0%} sparsity, "
               f"{config['epochs']} epochs, {config['seeds']} seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def format_table(results: dict[str, Any]) -> str:
  def fmt(stat, scale=1.0, digits=2):
    se = "" if stat["se"] is None else f" +- {stat['se'] * scale:.{digits}f}"
    return f"{stat['mean'] * scale:.{digits}f}{se}"

  lines = ["| method | test acc (%) | lambda_max | lambda_max (support) | trace (support) |",
           "|---|---|---|---|---|"]
  for method in METHODS:
    s = results["summary"][method]
    lines.append(f"| {method} | {fmt(s['test_accuracy'], 100)} | {fmt(s['lambda_max'])} | "
                 f"{fmt(s['lambda_max_support'])} | {fmt(s['trace_support'], digits=1)} |")
  return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/flatness")
  parser.add_argument("--epochs", type=int, default=Config.epochs)
  parser.add_argument("--seeds", type=int, default=Config.seeds)
  parser.add_argument("--penalty", type=float, default=Config.penalty)
  parser.add_argument("--rho", type=float, default=Config.rho)
  parser.add_argument("--surface-points", type=int, default=Config.surface_points)
  parser.add_argument("--hessian-examples", type=int, default=Config.hessian_examples)
  parser.add_argument("--data-dir", default=Config.data_dir)
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  config = Config(epochs=args.epochs, seeds=args.seeds, penalty=args.penalty, rho=args.rho,
                  data_dir=args.data_dir, surface_points=args.surface_points,
                  hessian_examples=args.hessian_examples)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results, seed0_params = run(config, progress=not args.no_progress)
  (out / "flatness_mnist.json").write_text(json.dumps(results, indent=1))
  plot(results, seed0_params, out / "flatness_mnist.png")
  table = format_table(results)
  (out / "flatness_mnist.md").write_text(
      f"Command: `{results['command']}`\n\n{table}\n")
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
