"""The end of a vision run: final projection, BatchNorm re-estimation, ``results.json``.

After the last training step, :func:`finish` evaluates the dense iterate,
projects it onto the sparsity set (:func:`deploy`: the run's
:func:`~safe_optax.methods.projection`; SAFE+ with the scores it
trained with, :func:`final_scores`), re-estimates the BatchNorm statistics of
the sparse model on ``bnt_samples`` training images (:func:`bnt_batches`,
:func:`safe_optax.flax_utils.recalibrate_batch_stats`), evaluates it again,
and writes ``results.json`` (config, versions, data sizes, final accuracies,
sparsity report, throughput, per-epoch history), the plots, and the
deployed model as safetensors (:func:`export_sparse_model`).

:func:`deploy` alone is the deployed model, which
:mod:`~safe_optax.vision.evaluation` rebuilds from a finished run's last
checkpoint without rewriting anything.

The functions take the run's jitted ``programs``
(:func:`safe_optax.vision.programs.build_programs`): ``mesh``, ``model``, ``eval``,
``project``, ``prepare`` and ``scores``, and the training set in host memory;
every batch is a global batch of which each process gathers only its rows
(:func:`~safe_optax.vision.datasets.gather_batch`), so several processes
compute what one would. Only process 0 writes ``results.json``, the plots and
the safetensors, each under a temporary name renamed into place
(:func:`safe_optax.experiment.atomic_write`), ``results.json`` last.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax import flax_utils
from safe_optax import methods
from safe_optax.vision import configs
from safe_optax.vision import datasets
from safe_optax.vision import input_pipeline
from safe_optax.vision import plots
from safe_optax.vision import workdirs

SCORE_BATCHES = 8
"""Batches of training data whose mean gradient gives SAFE+'s final scores."""


def evaluate(eval_fn: Callable[..., Any], params: Any, model_state: Any, images: np.ndarray,
             labels: np.ndarray, batch_size: int, *,
             mesh: Optional[Mesh] = None) -> dict[str, float]:
  """Accuracy and mean loss over a whole split, in fixed-size padded batches (one compile).

  Args:
    eval_fn: ``eval_fn(params, model_state, images, labels, valid) -> (correct, loss_sum)``
      (:func:`safe_optax.vision.steps.eval_step`, jitted).
    params, model_state: the model's variables.
    images, labels: the split (uint8 images, int labels) in host memory.
    batch_size: examples per call; the last batch is padded and masked.
    mesh: the data mesh the batches are sharded over, each process giving
      its rows (default :func:`safe_optax.distributed.data_mesh`).

  Returns:
    ``{"accuracy", "loss"}``.

  Examples:
    >>> import numpy as np
    >>> count = lambda p, s, x, y, valid: (np.sum(valid & (y == 0)), 0.0)  # predicts class 0
    >>> evaluate(count, None, None, np.zeros((5, 1)), np.array([0, 0, 1, 0, 2]), 2)
    {'accuracy': 0.6, 'loss': 0.0}
  """
  mesh = distributed.data_mesh() if mesh is None else mesh
  rows = distributed.process_rows(mesh, batch_size)
  correct, loss, n = 0, 0.0, len(labels)
  results = []
  for start in range(0, n, batch_size):
    # This process's rows of the padded batch: examples start + rows, masked past n.
    positions = np.arange(start + rows.start, start + rows.stop)
    valid = positions < n
    x, y = images[positions[valid]], labels[positions[valid]]
    pad = len(positions) - len(y)
    if pad:
      x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
      y = np.concatenate([y, np.zeros(pad, y.dtype)])
    results.append(eval_fn(params, model_state,
                           *distributed.global_batch(mesh, (x, y, valid), batch_size)))
  for c, l in jax.device_get(results):
    correct += int(c)
    loss += float(l)
  return {"accuracy": correct / n, "loss": loss / n}


def score_fn(apply_fn: Callable[..., Any], saliency: str,
             prepare: Callable[..., jax.Array]) -> Callable[..., Any]:
  """``scores(params, model_state, images, labels, key)``: one batch's SNIP gradient or
  OBD Hessian diagonal (jit it once per run; the batch is an argument, so it is not a
  compile-time constant of the program)."""
  def scores(params, model_state, images, labels, key):
    batch = (prepare(images, None), labels)
    grad_fn = flax_utils.sam_grad_fn(apply_fn, model_state, batch, experiment.cross_entropy)
    if saliency == "snip":
      return grad_fn(params, 0)
    return safe_optax.hutchinson_diagonal(grad_fn, params, key)
  return scores


def final_scores(programs: Any, config: configs.Config, params: Any, model_state: Any,
                 images: np.ndarray, labels: np.ndarray, num_train: int) -> Any:
  """SAFE+'s final projection uses the same metric P as training (SNIP or OBD scores).

  The mean over :data:`SCORE_BATCHES` training batches (a data stream of its
  own: the pseudo-epoch ``epochs + 1``) of ``programs.scores``; ``images``
  and ``labels`` are the training set in host memory.
  """
  order = input_pipeline.epoch_order(num_train, config.seed, config.epochs + 1).astype(np.int32)
  batches = [order[i * config.batch_size:(i + 1) * config.batch_size]
             for i in range(min(SCORE_BATCHES, num_train // config.batch_size or 1))]
  total = None
  for i, idx in enumerate(batches):
    batch = datasets.gather_batch(programs.mesh, (images, labels), idx)
    part = programs.scores(params, model_state, *batch, jax.random.PRNGKey(i))
    total = part if total is None else optax.tree.add(total, part)
  total = jax.tree.map(lambda t: t / len(batches), total)
  if config.saliency == "snip":
    return safe_optax.snip_scores(params, total)
  return safe_optax.obd_scores(params, total)


def bnt_batches(programs: Any, config: configs.Config, images: np.ndarray,
                num_train: int) -> Iterator[jax.Array]:
  """Augmented, normalised training batches covering ``bnt_samples`` examples once.

  ``images`` is the training set in host memory; each batch is a global batch
  sharded over ``programs.mesh``, augmented as a whole.
  """
  n = min(config.bnt_samples, num_train)
  # A data stream of its own: the pseudo-epoch just past the last training epoch.
  order = input_pipeline.epoch_order(num_train, config.seed, config.epochs)[:n].astype(np.int32)
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), config.epochs)
  for i, start in enumerate(range(0, n, config.batch_size)):
    (batch,) = datasets.gather_batch(programs.mesh, (images,),
                                     order[start:start + config.batch_size])
    yield programs.prepare(batch, jax.random.fold_in(key, i) if config.augment else None)


def recalibrate(programs: Any, config: configs.Config, params: Any, model_state: Any,
                images: np.ndarray, num_train: int) -> Any:
  """The BatchNorm statistics of ``params`` re-estimated on :func:`bnt_batches` (BNT)."""
  if not model_state:
    return model_state
  return flax_utils.recalibrate_batch_stats(
      programs.model.apply, params, model_state,
      bnt_batches(programs, config, images, num_train))


def deploy(programs: Any, config: configs.Config, params: Any, model_state: Any,
           images: np.ndarray, labels: np.ndarray, num_train: int) -> tuple[Any, Any]:
  """The deployed model: ``(sparse params, model state after BNT)``.

  ``images`` and ``labels`` are the training set in host memory (SAFE+'s
  final scores and BNT read batches of it).

  The dense params and state for ``method='dense'``; otherwise the final
  projection (:func:`~safe_optax.methods.projection`, with
  :func:`final_scores` for SAFE+), then :func:`recalibrate`.

  Raises:
    RuntimeError: the projected parameters are not finite (training diverged).
  """
  if config.method == "dense":
    return params, model_state
  if config.method == "safe-plus":
    scores = final_scores(programs, config, params, model_state, images, labels, num_train)
    sparse_params, _ = safe_optax.finalize(params, **methods.projection(config), scores=scores)
  else:
    sparse_params = programs.project(params)
  if not all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(sparse_params)):
    raise RuntimeError(f"training diverged: the final {config.method} parameters are not "
                       "finite.")
  return sparse_params, recalibrate(programs, config, sparse_params, model_state, images,
                                    num_train)


def _named_arrays(tree: Any) -> dict[str, np.ndarray]:
  """``tree``'s leaves as host arrays named by their ``/``-joined paths (as sparsity reports)."""
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
              np.asarray(jax.device_get(leaf))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def export_sparse_model(workdir: os.PathLike, config: configs.Config, sparse_params: Any,
                        model_state: Any, report: safe_optax.SparsityReport) -> list[pathlib.Path]:
  """Writes the deployed model as safetensors in ``workdir`` (next to ``results.json``).

  Files (:data:`~safe_optax.vision.workdirs.EXPORT_FILES`), each tensor named
  by its ``/``-joined Flax path (``Dense_0/kernel``, as in the sparsity report):

  * ``sparse_params.safetensors``: every parameter after the final projection;
  * ``masks.safetensors``: a ``bool`` array per prunable leaf, ``True`` where
    the weight is nonzero (the entries the sparsity counts as kept);
  * ``<collection>.safetensors`` per non-empty model-state collection,
    ``batch_stats.safetensors`` for BatchNorm models: the statistics after BNT.

  Every file carries the same string metadata: ``format``, ``safe_optax_version``,
  ``model``, ``dataset``, ``method``, ``structure``, ``target_sparsity`` (the
  requested sparsity), ``sparsity`` (the measured one, over prunable leaves)
  and ``config`` (the run's configuration as JSON). Read them with
  ``safetensors.numpy.load_file`` and ``safetensors.safe_open(...).metadata()``.

  Args:
    workdir: the run's folder.
    config: the run's configuration.
    sparse_params, model_state: the deployed model (:func:`deploy`).
    report: ``safe_optax.sparsity_report(sparse_params)``.

  Returns:
    The written files.

  Raises:
    ImportError: ``safetensors`` is not installed.
  """
  try:
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError("exporting the sparse model needs safetensors: pip install "
                      "safetensors (or safe-optax[vision]).") from err
  metadata = {
      "format": workdirs.EXPORT_FORMAT, "safe_optax_version": safe_optax.__version__,
      "model": config.model, "dataset": config.dataset, "method": config.method,
      "structure": repr(methods.projection(config)["structure"]),
      "target_sparsity": repr(config.sparsity), "sparsity": repr(report.sparsity),
      "config": json.dumps(configs.to_dict(config)),
  }
  params = _named_arrays(sparse_params)
  tensors = {"sparse_params": params,
             "masks": {leaf.path: params[leaf.path] != 0 for leaf in report.leaves
                       if leaf.prunable}}
  tensors.update({collection: _named_arrays(tree) for collection, tree in model_state.items()})
  written = []
  for name, flat in tensors.items():
    if flat:
      written.append(pathlib.Path(workdir) / f"{name}.safetensors")
      with experiment.atomic_write(written[-1]) as tmp:
        save_file(flat, str(tmp), metadata=metadata)
  return written


def throughput(history: list[dict[str, Any]]) -> dict[str, Any]:
  """Training images and seconds of the whole run, from its per-epoch records.

  Summed over every process that trained a part of the run (resumes included),
  so finishing a run again keeps its record. The steady rate leaves out each
  process's first epoch, which compiles the step.

  Examples:
    >>> epoch = {"train_examples": 100, "trained_images": 100}
    >>> throughput([{**epoch, "epoch": 0, "epoch_seconds": 3.0, "includes_compile": True},
    ...             {**epoch, "epoch": 1, "epoch_seconds": 1.0, "includes_compile": False}])
    {'train_seconds': 4.0, 'trained_images': 200, 'images_per_second': 50.0,
     'steady_images_per_second': 100.0}
  """
  def rate(records):
    seconds = sum(r["epoch_seconds"] for r in records)
    return sum(r["trained_images"] for r in records) / seconds if seconds else None

  return {"train_seconds": sum(r["epoch_seconds"] for r in history),
          "trained_images": sum(r["trained_images"] for r in history),
          "images_per_second": rate(history),
          # Without the first epoch of each process, which includes the compilation.
          "steady_images_per_second": rate([r for r in history if not r["includes_compile"]])}


def finish(programs: Any, config: configs.Config, params: Any, model_state: Any,
           data: input_pipeline.Dataset, history: list[dict[str, Any]],
           workdir: pathlib.Path, *, wall_seconds: float) -> tuple[Any, Any, dict[str, Any]]:
  """Final projection, BNT, evaluation, ``results.json`` and plots of a finished run.

  Args:
    programs: the run's jitted programs.
    config: the run's configuration.
    params, model_state: the final (dense) training state's variables.
    data: the data set in host memory (its ``test_*`` split is evaluated; its
      training set feeds SAFE+'s final scores and BNT).
    history: the per-epoch records (``metrics.jsonl``).
    workdir: where ``results.json`` and the plots go (process 0 writes them).
    wall_seconds: this process's wall time, recorded as such.

  Returns:
    ``(sparse params, model state after BNT, results)``; ``results`` is the
    ``results.json`` content.
  """
  num_train = len(data.train_labels)

  def evaluate_split(params, model_state):
    return evaluate(programs.eval, params, model_state, data.test_images, data.test_labels,
                    config.eval_batch_size, mesh=programs.mesh)

  # The last epoch's record (train.py's epoch_record) evaluated these very params on this
  # split, and Proj(params) with the same statistics: its numbers, not two more passes.
  last = history[-1] if history else {}
  recorded = (last.get("step") == config.epochs * input_pipeline.num_batches(
      num_train, config.batch_size) and "test_loss" in last)
  if recorded:
    dense = {"accuracy": last["test_accuracy"], "loss": last["test_loss"]}
  else:
    dense = evaluate_split(params, model_state)
  final: dict[str, Any] = {"dense_accuracy": dense["accuracy"], "dense_loss": dense["loss"]}
  sparse_params, sparse_state = deploy(programs, config, params, model_state,
                                       data.train_images, data.train_labels, num_train)
  if config.method != "dense":
    # SAFE+'s deployed projection uses its final scores, not the record's magnitude projection.
    if recorded and config.method != "safe-plus" and "test_accuracy_projected" in last:
      before = {"accuracy": last["test_accuracy_projected"]}
    else:
      before = evaluate_split(sparse_params, model_state)
    after = evaluate_split(sparse_params, sparse_state)
    final.update(sparse_accuracy_before_bnt=before["accuracy"],
                 sparse_accuracy=after["accuracy"], sparse_loss=after["loss"],
                 bnt_samples=min(config.bnt_samples, num_train) if sparse_state else 0)
  report = safe_optax.sparsity_report(sparse_params)
  final["sparsity"] = report.sparsity
  results = {
      "config": configs.to_dict(config),
      "versions": experiment.versions(),
      "data": {"num_train": num_train, "num_test": len(data.test_labels),
               "evaluated_on": "test" if config.validation is None else "validation",
               "num_classes": data.num_classes,
               "steps_per_epoch": input_pipeline.num_batches(num_train, config.batch_size)},
      "final": final,
      "sparsity_report": report.as_dict(),
      # This process's wall time (for a resumed or re-finished run, not the run's).
      "wall_seconds": wall_seconds,
      **throughput(history),
      "history": history,
  }
  if distributed.is_primary():
    plots.plot_history(history, workdir, title=f"{config.model} {config.method} "
                                               f"sparsity {config.sparsity:g}")
    export_sparse_model(workdir, config, sparse_params, sparse_state, report)
    # Last, and whole: results.json marks the run finished, so it never stands beside a
    # missing or partial export.
    with experiment.atomic_write(pathlib.Path(workdir) / "results.json") as tmp:
      tmp.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
  return sparse_params, sparse_state, results
