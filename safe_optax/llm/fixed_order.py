r"""Block pruning over several processes with the bits of one: every sum in a fixed order.

The engine's default passes (:mod:`safe_optax.llm.block`) sum a batch of
calibration windows inside one XLA program, and split over devices they sum
with an all-reduce: both orders depend on the layout, so two processes and
one disagree in the last bits, and a weight at the top-k threshold can flip.
Here the unit of work is one window, computed by the same jitted program
(shape ``(1, L, d)``) wherever it runs, and every sum over windows (the
activation statistics, SAFE's minibatch loss and both of SAM's gradients) is
:func:`safe_optax.distributed.tree_sum`'s binary tree: each process sums its
contiguous block of windows (a subtree), the blocks' sums are gathered and
combined on the same tree (:func:`safe_optax.distributed.allgather_sum`).
Outputs (the dense targets, the pruned stream) are gathered row by row, so
every process holds the whole stream. The optimizer update then runs eagerly
in every process on the same global gradient, and every process ends with
the same pruned block, bit for bit, as one process running this module.

Requirements: the process count is a power of two that divides the number of
calibration windows and SAFE's batch size. Each process uses one device.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax.llm import model as model_lib
from safe_optax.llm.block import lr_scales
from safe_optax.llm.block import merge_block
from safe_optax.llm.block import safe_transform
from safe_optax.llm.block import split_block
from safe_optax.llm.prune_config import PruneConfig


def check_layout(num_windows: int, cfg: PruneConfig) -> None:
  """Refuses, naming the numbers, a run whose windows or batches do not split over the processes."""
  distributed.process_items(num_windows, "calibration windows (--nsamples)")
  if cfg.method in ("safe", "safe-plus"):
    distributed.process_items(min(cfg.batch_size, num_windows), "windows a batch (--batch-size)")


def forward_pass(fn: Callable[..., Any], block_params: Any, x: np.ndarray,
                 with_stats: bool) -> tuple[np.ndarray, Optional[Any]]:
  """``fn`` on every window of ``x`` (this process's block of them), gathered.

  Returns ``(outputs of every window, statistics summed in the fixed order)``
  (``None`` without ``with_stats``).
  """
  rows = distributed.process_items(x.shape[0], "calibration windows (--nsamples)")
  outs, stats = [], []
  for i in range(rows.start, rows.stop):
    result = fn(block_params, x[i:i + 1])
    out = result[0] if with_stats else result
    outs.append(np.asarray(out, np.float32))
    if with_stats:
      stats.append(result[1])
  gathered = distributed.allgather_rows(np.concatenate(outs))
  if not with_stats:
    return gathered, None
  return gathered, distributed.allgather_sum(distributed.tree_sum(stats))


@functools.lru_cache(maxsize=8)
def _window_grad(config: model_lib.LlamaConfig):
  """``(linears, norms, x, y, scale) -> (loss, grads)`` of one window's share of the batch loss."""
  block = model_lib.Block(config)

  def loss_fn(linears, norms, x, y, scale):
    out = block.apply({"params": merge_block(linears, norms)}, x)
    return jnp.sum(jnp.square(out.astype(jnp.float32) - y)) * scale

  return jax.jit(jax.value_and_grad(loss_fn))


def safe_block_fixed_order(
    config: model_lib.LlamaConfig,
    block_params: dict[str, Any],
    inputs: np.ndarray,
    targets: np.ndarray,
    cfg: PruneConfig,
    input_norms: Optional[dict[str, Any]] = None,
    *,
    progress: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """:func:`safe_optax.llm.block.safe_block` with every minibatch sum in the fixed order.

  The same loss (the mean over the minibatch), schedule, transforms and final
  projection; each process computes its windows of every minibatch.
  ``progress`` shows a bar of the steps, advanced once per epoch.
  """
  linears, norms = split_block(block_params)
  n, length, width = inputs.shape
  batch = min(cfg.batch_size, n)
  steps_per_epoch = n // batch
  rows = distributed.process_items(batch, "windows a batch (--batch-size)")
  # The batch mean, as the sum of each window's share (a constant factor per window).
  scale = jnp.float32(1.0 / (batch * length * width))
  window_grad = _window_grad(config)
  scales = lr_scales(cfg, linears)
  tx = safe_transform(cfg, steps_per_epoch, input_norms, scales)
  params, opt_state = linears, tx.init(linears)
  rng = np.random.default_rng(cfg.seed)
  losses = []
  bar = experiment.progress(cfg.epochs * steps_per_epoch, desc=f"{cfg.method} steps",
                            unit="step", enabled=progress, leave=False)
  for epoch in range(cfg.epochs):
    order = rng.permutation(n)
    for b in range(steps_per_epoch):
      mine = order[b * batch:(b + 1) * batch][rows]

      def loss_and_grad(p, mine=mine):
        parts = [window_grad(p, norms, inputs[i:i + 1], targets[i:i + 1], scale) for i in mine]
        return distributed.allgather_sum(distributed.tree_sum(parts))

      loss, grads = loss_and_grad(params)
      updates, opt_state = tx.update(
          grads, opt_state, params, grad_fn=lambda p, _, f=loss_and_grad: f(p)[1],
          dual_due=safe_optax.experimental.is_dual_step(epoch * steps_per_epoch + b,
                                                        cfg.dual_every))
      params = optax.apply_updates(params, updates)
    losses.append(float(loss))
    bar.update(steps_per_epoch)
  bar.close()
  final_scores = None
  if input_norms is not None:
    final_scores = safe_optax.wanda_scores(params, input_norms)
  pruned, _ = safe_optax.finalize(params, **cfg.projection()._asdict(), scores=final_scores)
  return pruned, {"epoch_last_loss": losses, "steps": cfg.epochs * steps_per_epoch}
