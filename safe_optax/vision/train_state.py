"""The training state of the vision trainer: what changes during training, what a checkpoint holds."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from safe_optax.vision import metrics as metrics_lib


class EpochMetrics(NamedTuple):
  """Running sums over the current epoch, kept on the device (no per-step syncs)."""

  loss_sum: jax.Array
  """Sum over examples of the training loss (clean pass)."""
  correct: jax.Array
  """Correctly classified training examples (clean pass, augmented)."""
  count: jax.Array
  """Training examples used so far in this epoch."""
  log: metrics_lib.StepLog
  """This epoch's per-step scalars (:class:`~safe_optax.vision.metrics.StepLogger`)."""


def zero_metrics(log: Optional[metrics_lib.StepLog] = None) -> EpochMetrics:
  """The running sums at the start of an epoch: zeros, and ``log`` (default an empty log)."""
  # Host zeros: device_put places them on any sharding, one over several processes included.
  return EpochMetrics(np.zeros([], np.float32), np.zeros([], np.int32), np.zeros([], np.int32),
                      metrics_lib.empty_log() if log is None else log)


class TrainState(NamedTuple):
  """Everything that changes during training (what a checkpoint holds)."""

  step: jax.Array
  """Steps taken (int32); fixes the epoch and the position in it."""
  rng: jax.Array
  """The run's augmentation key; step ``t`` uses ``fold_in(rng, t)``."""
  params: Any
  """The ``'params'`` collection."""
  model_state: Any
  """The other collections, ``{'batch_stats': ...}`` or ``{}``."""
  opt_state: Any
  """The optax state."""
  metrics: EpochMetrics
  """Running sums of the current epoch."""
