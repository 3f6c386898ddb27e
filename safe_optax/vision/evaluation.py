"""The evaluation suite of a trained vision run: clean, corruptions, PGD, Hessian.

:func:`evaluate_workdir` reloads a finished ``safe-optax-vision train``
workdir (its ``results.json`` config and final Orbax checkpoint), rebuilds the
deployed model exactly as training did (final projection, then BatchNorm
re-estimation: :func:`safe_optax.vision.finish.deploy`, without rewriting
the run's files), and measures on the test split:

* ``clean``: accuracy;
* ``corruptions``: CIFAR-10-C-style accuracy per type at severities 3 and 5
  and their means (:mod:`safe_optax.vision.corruptions`);
* ``pgd-linf`` / ``pgd-l2``: PGD accuracy, 10 steps of eps/4, eps 1/255 and
  3/255, in pixel space (:mod:`safe_optax.vision.robustness`);
* ``hessian``: lambda_max of the training loss (inference mode) on the
  support of the sparse model and on all weights
  (:mod:`safe_optax.flatness`).

Results go to ``eval.json`` and ``eval.md`` in the workdir.

Under several processes the deployed model is rebuilt on the global mesh
(SAFE+'s scores and BNT read global batches, each process its rows); the
suite itself then runs in every process on its own devices, on a host copy
of the deployed model (no speed-up from more processes), and process 0 alone
writes the files.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from safe_optax import distributed
from safe_optax import experiment
from safe_optax import flatness
from safe_optax.vision import configs
from safe_optax.vision import corruptions
from safe_optax.vision import datasets
from safe_optax.vision import finish
from safe_optax.vision import input_pipeline
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import robustness
from safe_optax.vision import workdirs

SUITES = ("clean", "corruptions", "pgd-linf", "pgd-l2", "hessian")


def parse_suite(text: str) -> tuple[str, ...]:
  """``"clean,pgd-linf"`` -> ``("clean", "pgd-linf")``, validated.

  Examples:
    >>> parse_suite("clean, hessian")
    ('clean', 'hessian')
  """
  names = tuple(n.strip() for n in text.split(",") if n.strip())
  unknown = [n for n in names if n not in SUITES]
  if not names or unknown:
    raise ValueError(f"--suite must be a comma-separated subset of {SUITES}, got {text!r}.")
  return names


def _batched(fn, images: np.ndarray, batch_size: int) -> np.ndarray:
  return np.concatenate([np.asarray(fn(images[i:i + batch_size]))
                         for i in range(0, len(images), batch_size)])


@functools.partial(jax.jit, static_argnums=0)
def _predict(model: Any, variables: Any, mean: jax.Array, std: jax.Array,
             images: jax.Array) -> jax.Array:
  """Predicted classes of uint8 images (inference mode).

  The variables are arguments, not constants folded into the program (a
  closure over them would be), and the program is compiled once per model
  and batch shape.
  """
  pixels = images.astype(jnp.float32) / 255.0
  return jnp.argmax(model.apply(variables, (pixels - mean) / std, train=False), -1)


def evaluate_workdir(
    workdir: os.PathLike,
    *,
    data_dir: Optional[os.PathLike],
    dataset: Optional[input_pipeline.Dataset] = None,
    suite: Sequence[str] = SUITES,
    test_subset: Optional[int] = None,
    corruption_subset: Optional[int] = 1000,
    severities: Sequence[int] = (3, 5),
    corruption_names: Sequence[str] = corruptions.CORRUPTIONS,
    hessian_examples: int = 1000,
    batch_size: int = 500,
    seed: int = 0,
    cache_dir: Optional[os.PathLike] = None,
    progress: bool = True,
) -> dict[str, Any]:
  """Runs the evaluation ``suite`` on the finished run in ``workdir``.

  Args:
    workdir: a finished ``safe-optax-vision train`` workdir.
    data_dir: the data it was trained on.
    dataset: the already loaded data set instead (as for ``train_and_evaluate``).
    suite: a subset of :data:`SUITES`.
    test_subset: evaluate clean / PGD on a seeded sample of ``n`` test images
      (:func:`~safe_optax.vision.input_pipeline.sample_indices`; never the
      first ``n``, which in a class-sorted image folder are one class).
    corruption_subset: corrupt only a seeded sample of ``n`` of those images
      (each of the 19 x len(severities) sets is generated on the CPU, then
      cached).
    severities: corruption severities.
    corruption_names: corruption types (default all 19).
    hessian_examples: a seeded sample of this many training examples for
      lambda_max (in batches of ``batch_size``).
    batch_size: evaluation batch size.
    seed: seeds the subsets, corruptions, PGD random starts (unused by
      default) and the power-iteration start.
    cache_dir: corruption cache folder.
    progress: tqdm bars.

  Returns:
    The ``eval.json`` content.
  """
  start = time.perf_counter()
  workdir = pathlib.Path(workdir)
  suite = tuple(suite)
  for name in suite:
    if name not in SUITES:
      raise ValueError(f"`suite` entries must be in {SUITES}, got {name!r}.")
  results_file = workdir / "results.json"
  if not results_file.exists():
    raise FileNotFoundError(f"'{results_file}' not found: train the run first.")
  results, config = workdirs.read_results(
      workdir, way_out="rerun the training (train --restart) to write it again.")
  data = dataset if dataset is not None else datasets.load_dataset(config, data_dir)
  programs, state = programs_lib.restore_finished(config, workdir, data)
  params, model_state = finish.deploy(programs, config, state.params, state.model_state,
                                      data.train_images, data.train_labels,
                                      len(data.train_labels))
  if jax.process_count() > 1:
    # Replicated over every process's devices; the suite below runs on this process's own.
    params, model_state = jax.device_put(jax.device_get((params, model_state)),
                                         jax.local_devices()[0])
  progress = progress and distributed.is_primary()
  model = programs.model
  mean, std = (jnp.asarray(v, jnp.float32) for v in datasets.NORMALIZATION[config.dataset])

  def apply_fn(pixels: jax.Array) -> jax.Array:
    """Logits of pixel-space images in [0, 1]; the normalisation is part of the model."""
    return model.apply({"params": params, **model_state}, (pixels - mean) / std, train=False)

  predict = functools.partial(_predict, model, {"params": params, **model_state}, mean, std)
  rng = np.random.default_rng([seed, 1])
  test_indices = input_pipeline.sample_indices(len(data.test_labels), test_subset, rng)
  test_x, test_y = data.test_images[test_indices], data.test_labels[test_indices]
  corrupted = input_pipeline.sample_indices(len(test_y), corruption_subset, rng)
  out: dict[str, Any] = {"workdir": str(workdir), "config": configs.to_dict(config),
                         "suite": list(suite), "num_test": int(len(test_y)),
                         "test_indices": test_indices.tolist(),
                         "versions": experiment.versions(),
                         "sparsity": results["final"]["sparsity"]}
  if "clean" in suite:
    out["clean"] = float(np.mean(_batched(predict, test_x, batch_size) == test_y))
  if "corruptions" in suite:
    out["corrupted_indices"] = test_indices[corrupted].tolist()
    out["corruptions"] = corruptions.corruption_accuracy(
        lambda images: _batched(predict, images, batch_size), test_x[corrupted], test_y[corrupted],
        severities=severities, names=corruption_names, seed=seed, cache_dir=cache_dir,
        progress=progress)
  for norm in ("linf", "l2"):
    if f"pgd-{norm}" in suite:
      out[f"pgd-{norm}"] = robustness.pgd_accuracy(apply_fn, test_x, test_y, norm=norm,
                                                   batch_size=batch_size, seed=seed,
                                                   progress=progress)
  if "hessian" in suite:
    out["hessian"] = _hessian(model, params, model_state, data, config, hessian_examples,
                              batch_size, seed, mean, std, rng)
  out["wall_seconds"] = time.perf_counter() - start
  if distributed.is_primary():
    with open(workdir / "eval.json", "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
      f.write("\n")
    with open(workdir / "eval.md", "w", encoding="utf-8") as f:
      f.write(markdown_table([out]) + "\n")
  return out


def _hessian(model, params, model_state, data, config, examples, batch_size, seed, mean, std,
             rng):
  n = min(examples, len(data.train_labels)) // batch_size * batch_size
  if n == 0:
    raise ValueError(f"`hessian_examples` ({examples}) must hold at least one batch of "
                     f"{batch_size}.")
  keep = input_pipeline.sample_indices(len(data.train_labels), n, rng)
  x = (jnp.asarray(data.train_images[keep], jnp.float32) / 255.0 - mean) / std
  y = jnp.asarray(data.train_labels[keep])
  batches = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, n, batch_size)]

  def loss_fn(p, batch):
    logits = model.apply({"params": p, **model_state}, batch[0], train=False)
    return experiment.cross_entropy(logits, batch[1])

  support = flatness.support_mask(params) if config.method != "dense" else None
  # Called outside jit: the power iterations run in Python around one jitted Hessian-vector
  # product, which keeps XLA:CPU's fast convolutions (inside a while loop they are 20-60x
  # slower; safe_optax/_hessian.py).
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  full = flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=k1, max_iterations=100)
  kept = flatness.max_hessian_eigenvalue(loss_fn, params, batches, key=k2, max_iterations=100,
                                         support=support)
  return {"lambda_max": float(full.eigenvalue), "converged": bool(full.converged),
          "lambda_max_support": float(kept.eigenvalue),
          "converged_support": bool(kept.converged), "num_examples": n}


def markdown_table(evals: Sequence[dict[str, Any]]) -> str:
  """One row per evaluated run: method, sparsity, seed and every measured accuracy (%).

  Examples:
    >>> row = {"config": {"method": "safe", "sparsity": 0.9, "seed": 0}, "clean": 0.9,
    ...        "pgd-linf": {"adversarial": 0.5}}
    >>> print(markdown_table([row]))
    | method | sparsity | seed | clean | PGD l_inf |
    |---|---|---|---|---|
    | safe | 0.9 | 0 | 90.00 | 50.00 |
  """
  columns = []
  first = evals[0]
  if "clean" in first:
    columns.append(("clean", lambda e: e["clean"]))
  if "corruptions" in first:
    for s in first["corruptions"]["mean"]:
      columns.append((f"corrupted sev {s}", lambda e, s=s: e["corruptions"]["mean"][s]))
  for norm, label in (("linf", "PGD l_inf"), ("l2", "PGD l_2")):
    if f"pgd-{norm}" in first:
      columns.append((label, lambda e, n=norm: e[f"pgd-{n}"]["adversarial"]))
  header = "| method | sparsity | seed | " + " | ".join(c for c, _ in columns)
  if "hessian" in first:
    header += (" | " if columns else "") + "lambda_max | lambda_max (support)"
  lines = [header + " |", "|" + "---|" * (len(columns) + 3 + (2 if "hessian" in first else 0))]
  for e in evals:
    cfg = e["config"]
    cells = [cfg["method"], f"{cfg['sparsity']:g}", str(cfg["seed"])]
    cells += [f"{100 * fn(e):.2f}" for _, fn in columns]
    if "hessian" in e:
      cells += [f"{e['hessian']['lambda_max']:.3g}", f"{e['hessian']['lambda_max_support']:.3g}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
