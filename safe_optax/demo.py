"""Real-data demo: dense vs SAFE vs ADMM vs one-shot magnitude pruning on digits.

Trains a 64-128-64-10 MLP (plain JAX, dict params) on scikit-learn's bundled
``load_digits`` (1,797 8x8 images, no download) with a fixed stratified split,
and compares, at each requested sparsity of the three weight matrices (global
scope; biases stay dense):

* ``dense``: SGD with momentum, no pruning (reference);
* ``magnitude``: the dense model, then one-shot :func:`safe_optax.finalize`;
* ``admm``: :func:`safe_optax.admm` (constant penalty), then ``finalize``;
* ``safe``: :func:`safe_optax.safe` (SAM + cosine-ramped penalty), then ``finalize``.

All methods share the optimiser recipe (SGD momentum 0.9, cosine learning rate
with a short linear warm-up, weight decay, batch 64), the initialisation and
the data order of each seed (one permutation per epoch, drawn with NumPy from
the seed); the optimizers are :mod:`safe_optax.methods`' registry, built from
the demo's :class:`Config`, a :class:`~safe_optax.methods.Hyperparams`. A whole
training run is one ``jax.jit`` call (:func:`safe_optax.experiment.scan_trainer`),
a ``lax.scan`` over every minibatch step, so there are no per-step host
round-trips.

Run ``python -m safe_optax.demo`` (or ``safe-optax-demo``); ``--help`` lists
the flags. Accuracy is reported as mean +- standard error over seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import experiment
from safe_optax import methods

METHODS = ("dense", "magnitude", "admm", "safe")
LAYERS = (64, 128, 64, 10)
# By name, not __name__: `python -m safe_optax.demo` runs this module as __main__.
_LOG = logging.getLogger("safe_optax.demo")


@dataclasses.dataclass(frozen=True)
class Config(methods.Hyperparams):
  """Everything that determines a demo run (written to the JSON output).

  The methods' settings are :class:`~safe_optax.methods.Hyperparams` fields
  (with the demo's defaults below); ``method`` and ``sparsity`` are set per
  run from :data:`METHODS` and ``sparsities``.
  """

  sparsities: tuple[float, ...] = (0.9,)
  epochs: int = 40
  seeds: int = 3
  first_seed: int = 0
  split_seed: int = 0
  test_fraction: float = 0.25
  batch_size: int = 64
  learning_rate: float = 0.05
  warmup_epochs: int = 2
  momentum: float = 0.9
  weight_decay: float = 5e-4
  # Chosen on a validation split carved from the training split (3 seeds, 40
  # epochs, sparsity 0.9 / 0.95 / 0.98, best mean accuracy after projection):
  # SAFE lambda in {0.01, 0.03, 0.1, 0.3, 1} x rho in {0.02, 0.05, 0.1, 0.2},
  # ADMM lambda in {0.003, 0.01, 0.03, 0.1, 0.3}. SAFE's cosine ramp keeps
  # lambda_t small for most of training, so it wants a larger lambda than ADMM.
  penalty: Optional[float] = 1.0
  admm_penalty: Optional[float] = 0.03
  rho: float = 0.05
  dual_every: int = 16
  layers: tuple[int, ...] = LAYERS
  fast_compile: bool = False  # XLA backend optimisation level 0: quicker compiles, slower steps


# ----------------------------------------------------------------------------- data


def load_data(config: Config) -> dict[str, np.ndarray]:
  """Digits, stratified split (``split_seed``), standardised with training statistics."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel

  x, y = load_digits(return_X_y=True)
  x_train, x_test, y_train, y_test = train_test_split(
      x.astype(np.float32), y.astype(np.int32), test_size=config.test_fraction,
      stratify=y, random_state=config.split_seed,
  )
  mean = x_train.mean(axis=0)
  std = x_train.std(axis=0) + 1e-3  # some border pixels are (almost) always 0
  return {
      "x_train": (x_train - mean) / std, "y_train": y_train,
      "x_test": (x_test - mean) / std, "y_test": y_test,
  }


# ----------------------------------------------------------------------------- model


def init_mlp(seed: int, layers: Sequence[int] = LAYERS) -> dict[str, dict[str, jax.Array]]:
  """He-normal kernels ``(in, out)`` and zero biases, as a nested dict.

  Drawn with NumPy from ``seed`` (cheaper than compiling JAX's threefry
  sampler into every training program).
  """
  rng = np.random.default_rng([seed, 1])
  params = {}
  for i, (d_in, d_out) in enumerate(zip(layers[:-1], layers[1:])):
    kernel = rng.standard_normal((d_in, d_out)) * math.sqrt(2.0 / d_in)
    params[f"dense{i}"] = {
        "kernel": jnp.asarray(kernel, jnp.float32),
        "bias": jnp.zeros((d_out,), jnp.float32),
    }
  return params


def mlp(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
  """Logits of the ReLU MLP."""
  n = len(params)
  for i in range(n):
    layer = params[f"dense{i}"]
    x = x @ layer["kernel"] + layer["bias"]
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def loss_fn(params, x, y) -> jax.Array:
  """Mean softmax cross-entropy of the MLP's logits ``mlp(params, x)`` against labels ``y``."""
  return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


@jax.jit
def accuracy(params, x, y) -> jax.Array:
  """Fraction of the examples ``x`` whose argmax logit is the label ``y`` (jitted)."""
  return jnp.mean(jnp.argmax(mlp(params, x), axis=-1) == y)


# ----------------------------------------------------------------------------- training


def make_train_fn(method: str, sparsity: Optional[float], config: Config, n_train: int):
  """Returns ``train(params, order, x_train, y_train) -> (params, opt_state, epoch_losses)``.

  The optimizer is the registry's (:func:`safe_optax.methods.make_optimizer`)
  for ``method`` at ``sparsity``; the run is
  :func:`safe_optax.experiment.scan_trainer`'s, one jitted ``lax.scan`` over
  :func:`safe_optax.experiment.batch_order`'s steps.
  """
  steps_epoch = experiment.steps_per_epoch(n_train, config.batch_size)
  hp = dataclasses.replace(config, method=method, sparsity=sparsity or 0.0)
  tx = methods.make_optimizer(methods.validate(hp), steps_epoch)
  return experiment.scan_trainer(loss_fn, tx, uses_grad_fn=methods.get(method).uses_grad_fn,
                                 epochs=config.epochs, steps_per_epoch=steps_epoch)


# ----------------------------------------------------------------------------- driver


def _sparsity_entry(params) -> dict[str, Any]:
  report = safe_optax.sparsity_report(params)
  return {"sparsity": report.sparsity, "prunable_size": report.prunable_size,
          "prunable_nonzero": report.prunable_nonzero}


def run(config: Config, progress: bool = True) -> dict[str, Any]:
  """Runs every method, sparsity and seed; returns the JSON-ready results."""
  start = time.perf_counter()
  data = load_data(config)
  x_train, y_train = jnp.asarray(data["x_train"]), jnp.asarray(data["y_train"])
  x_test, y_test = jnp.asarray(data["x_test"]), jnp.asarray(data["y_test"])
  n_train = int(x_train.shape[0])
  seeds = [config.first_seed + i for i in range(config.seeds)]
  orders = {seed: jnp.asarray(experiment.batch_order(seed, n_train, batch_size=config.batch_size,
                                                       epochs=config.epochs))
            for seed in seeds}
  inits = {seed: init_mlp(seed, config.layers) for seed in seeds}

  jobs = [("dense", None)] + [(m, s) for s in config.sparsities for m in ("admm", "safe")]
  bar = experiment.progress(len(jobs) * len(seeds), desc="runs", unit="run", enabled=progress,
                            leave=False)
  runs: list[dict[str, Any]] = []
  compile_s: dict[str, float] = {}
  compiler_options = {"xla_backend_optimization_level": 0} if config.fast_compile else None
  for method, sparsity in jobs:
    name = method if sparsity is None else f"{method}@{sparsity:g}"
    t0 = time.perf_counter()
    train = make_train_fn(method, sparsity, config, n_train).lower(
        inits[seeds[0]], orders[seeds[0]], x_train, y_train).compile(compiler_options)
    compile_s[name] = time.perf_counter() - t0
    for seed in seeds:
      bar.set_postfix_str(f"{name} seed {seed}")
      t0 = time.perf_counter()
      params, _, epoch_losses = jax.block_until_ready(
          train(inits[seed], orders[seed], x_train, y_train))
      train_s = time.perf_counter() - t0
      trained_acc = float(accuracy(params, x_test, y_test))
      base = {"seed": seed, "train_seconds": train_s,
              "final_train_loss": float(epoch_losses[-1]),
              "epoch_train_loss": [float(v) for v in np.asarray(epoch_losses)]}
      if method == "dense":
        runs.append({"method": "dense", "sparsity_target": 0.0, "test_accuracy": trained_acc,
                     **_sparsity_entry(params), **base})
        # One-shot magnitude pruning of this dense model at every sparsity.
        for s in config.sparsities:
          pruned, _ = safe_optax.finalize(params, s)
          runs.append({"method": "magnitude", "sparsity_target": s,
                       "test_accuracy": float(accuracy(pruned, x_test, y_test)),
                       "test_accuracy_before_projection": trained_acc,
                       **_sparsity_entry(pruned), **base})
      else:
        pruned, _ = safe_optax.finalize(params, sparsity)
        runs.append({"method": method, "sparsity_target": sparsity,
                     "test_accuracy": float(accuracy(pruned, x_test, y_test)),
                     "test_accuracy_before_projection": trained_acc,
                     **_sparsity_entry(pruned), **base})
      bar.update(1)
  bar.close()

  summary = []
  for method in METHODS:
    targets = [0.0] if method == "dense" else list(config.sparsities)
    for s in targets:
      rows = [r for r in runs if r["method"] == method and r["sparsity_target"] == s]
      acc, acc_se = experiment.mean_se([r["test_accuracy"] for r in rows])
      summary.append({
          "method": method, "sparsity_target": s, "seeds": len(rows),
          "test_accuracy_mean": acc, "test_accuracy_se": acc_se,
          "test_accuracy_before_projection_mean": (
              experiment.mean_se([r["test_accuracy_before_projection"] for r in rows])[0]
              if method != "dense" else None),
          "achieved_sparsity": [r["sparsity"] for r in rows],
          "train_seconds_mean": float(np.mean([r["train_seconds"] for r in rows])),
      })
  return {
      "demo": "safe_optax.demo (load_digits MLP 64-128-64-10)",
      "versions": experiment.versions("sklearn"),
      "config": dataclasses.asdict(config),
      "data": {"n_train": n_train, "n_test": int(x_test.shape[0]),
               "steps_per_epoch": experiment.steps_per_epoch(n_train, config.batch_size)},
      "compile_seconds": compile_s,
      "total_seconds": time.perf_counter() - start,
      "summary": summary,
      "runs": runs,
  }


def format_table(results: dict[str, Any]) -> str:
  """The summary as a fixed-width text table."""
  header = (f"{'method':<10} {'target':>6}  {'test acc % (mean ± s.e.)':>24}  "
            f"{'before proj %':>13}  {'achieved sparsity':>17}  {'train s/seed':>12}")
  lines = [header, "-" * len(header)]
  for row in results["summary"]:
    se = row["test_accuracy_se"]
    acc = f"{100 * row['test_accuracy_mean']:6.2f} ± {100 * se:4.2f}" if se is not None else (
        f"{100 * row['test_accuracy_mean']:6.2f} ± n/a ")
    before = row["test_accuracy_before_projection_mean"]
    before = f"{100 * before:6.2f}" if before is not None else "-"
    achieved = sorted(set(round(a, 6) for a in row["achieved_sparsity"]))
    achieved = "/".join(f"{a:.4f}" for a in achieved)
    lines.append(f"{row['method']:<10} {row['sparsity_target']:>6.3g}  {acc:>24}  {before:>13}  "
                 f"{achieved:>17}  {row['train_seconds_mean']:>12.2f}")
  return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[Config, argparse.Namespace]:
  """The demo's flags as a validated :class:`Config`, before any data is loaded.

  Args:
    argv: the command-line arguments without the program name (``None``: ``sys.argv``).

  Returns:
    ``(config, args)``: the run's settings (every sparse method checked at
    every sparsity by the method registry) and the parsed flags, for the
    output options (``--json``, ``--no-progress``).
  """
  defaults = Config()
  parser = argparse.ArgumentParser(
      prog="safe-optax-demo",
      description="Dense vs SAFE vs ADMM vs one-shot magnitude pruning of an MLP on "
                  "scikit-learn's digits (8x8, bundled; no download).")
  parser.add_argument("--sparsity", type=float, nargs="+", default=list(defaults.sparsities),
                      help="target sparsities of the weight matrices (default: "
                           f"{' '.join(map(str, defaults.sparsities))})")
  parser.add_argument("--epochs", type=int, default=defaults.epochs,
                      help="training epochs (default: %(default)s)")
  parser.add_argument("--seeds", type=int, default=defaults.seeds,
                      help="number of training seeds; mean ± s.e. over them (default: %(default)s)")
  parser.add_argument("--first-seed", type=int, default=defaults.first_seed,
                      help="seeds are first-seed, first-seed+1, ... (default: %(default)s)")
  parser.add_argument("--split-seed", type=int, default=defaults.split_seed,
                      help="seed of the stratified train/test split (default: %(default)s)")
  parser.add_argument("--penalty", type=float, default=defaults.penalty,
                      help="SAFE's lambda, cosine-ramped (default: %(default)s)")
  parser.add_argument("--admm-penalty", type=float, default=None,
                      help=f"ADMM's constant lambda (default: {defaults.admm_penalty})")
  parser.add_argument("--rho", type=float, default=defaults.rho,
                      help="SAFE's SAM radius (default: %(default)s)")
  parser.add_argument("--dual-every", type=int, default=defaults.dual_every,
                      help="K, steps between dual updates (default: %(default)s)")
  parser.add_argument("--lr", type=float, default=defaults.learning_rate,
                      help="peak learning rate (default: %(default)s)")
  parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                      help="weight decay (default: %(default)s)")
  parser.add_argument("--fast-compile", action="store_true",
                      help="compile with XLA optimisation level 0 (for short smoke runs) "
                           "(default: off, full optimisation)")
  parser.add_argument("--json", metavar="PATH", default=None,
                      help="write versions, config and per-seed results to PATH "
                           "(default: no file, the table only)")
  experiment.add_output_options(parser)
  parser.add_argument("--version", action="version",
                      version=f"safe-optax-demo {safe_optax.__version__}")
  args = parser.parse_args(argv)
  for s in args.sparsity:
    if not 0.0 <= s < 1.0:
      parser.error(f"--sparsity values must lie in [0, 1), got {s}")
  if args.epochs < 1 or args.seeds < 1:
    parser.error("--epochs and --seeds must be positive")
  warmup = methods.fit_warmup(defaults.warmup_epochs, args.epochs, name="the demo")
  config = dataclasses.replace(
      defaults, sparsities=tuple(args.sparsity), epochs=args.epochs, warmup_epochs=warmup,
      seeds=args.seeds,
      first_seed=args.first_seed, split_seed=args.split_seed, penalty=args.penalty,
      admm_penalty=defaults.admm_penalty if args.admm_penalty is None else args.admm_penalty,
      rho=args.rho, dual_every=args.dual_every, learning_rate=args.lr,
      weight_decay=args.weight_decay, fast_compile=args.fast_compile,
  )
  for method in METHODS[2:]:  # the trained sparse methods: what the registry will build
    for s in config.sparsities:
      try:
        methods.validate(dataclasses.replace(config, method=method, sparsity=s))
      except ValueError as err:
        parser.error(f"{method} at sparsity {s:g}: {err}")
  return config, args


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Command-line entry point (``safe-optax-demo`` / ``python -m safe_optax.demo``)."""
  config, args = parse_args(argv)
  # The informational lines go to stderr through logging; the table is the result, on stdout.
  experiment.configure_logging(args.log_level)
  _LOG.info("safe_optax %s demo: digits MLP %s, %d epochs, %d seed(s), sparsity %s, SAFE "
            "lambda=%s rho=%s, ADMM lambda=%s, K=%d", safe_optax.__version__,
            "-".join(map(str, config.layers)), config.epochs, config.seeds,
            list(config.sparsities), config.penalty, config.rho, config.admm_penalty,
            config.dual_every)
  results = run(config, progress=not args.no_progress)
  print(format_table(results))
  compile_total = sum(results["compile_seconds"].values())
  _LOG.info("n_train=%d n_test=%d; compile %.1f s, total %.1f s (%s)",
            results["data"]["n_train"], results["data"]["n_test"], compile_total,
            results["total_seconds"], results["versions"]["backend"])
  if args.json:
    import os  # pylint: disable=import-outside-toplevel

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
      f.write("\n")
    _LOG.info("wrote %s", args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
