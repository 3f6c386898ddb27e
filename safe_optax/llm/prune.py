r"""Sequential block-wise post-training pruning of a LLaMA decoder (SAFE paper §4.2).

The engine embeds the calibration windows and walks the blocks in order. For
block ``l`` with inputs ``X_l`` (the *pruned* stream's outputs of block
``l - 1``) it computes the dense block's outputs ``Y_l = f_l(X_l)`` as
targets, records the activations entering each linear map, prunes the block's
seven matrices, and feeds ``f_l^{pruned}(X_l)`` to the next block. Only one
block's inputs and targets are held at a time.

Methods (``PruneConfig.method``):

* ``"magnitude"``: keep the largest ``|W|`` per matrix.
* ``"wanda"``: keep the largest :math:`|W_{ij}|\,\|X_j\|_2` per output row.
* ``"sparsegpt"``: OBS with :math:`H = 2XX^\top/n`, damping 1% of the mean
  diagonal, adaptive masks over 128-column lazy batches (Frantar & Alistarh;
  :func:`safe_optax.llm.sparsegpt.sparsegpt_prune`).
* ``"safe"`` / ``"safe-plus"``: minimise the block reconstruction loss
  :math:`\frac{1}{n}\|f_l(X; W) - Y_l\|^2` over the block's matrices with
  ``sam_perturb -> admm_penalty -> adam`` (the core transforms), then the
  final projection; SAFE+ projects with Wanda's saliency
  (:func:`safe_optax.wanda_saliency`), per output row.

Data parallel within a block: with more than one local device, every batch of
calibration windows (the SAFE minibatches, the chunks of the target and
statistics passes) is split over a ``'data'`` mesh of the local devices
(:func:`safe_optax.distributed.data_mesh`) and the block's parameters and
optimizer state are replicated, so ``jit`` runs each pass on every device and
sums the gradients and statistics across them. A batch that does not split
evenly over the devices runs replicated. One device runs exactly as before.

Several processes (``jax.distributed``, :func:`safe_optax.distributed.initialize`):
``prune_model(fixed_order=True)``, the default when there is more than one
process, splits the calibration windows over the processes and sums every
statistic and gradient over windows on one fixed tree
(:mod:`safe_optax.llm.fixed_order`), so any power-of-two process count prunes
bit for bit as one process with ``fixed_order=True`` does.

Structures: unstructured or N:M along the input dimension (``(in, out)``
kernels, the core's ``NM`` axis ``-2``). Unstructured masks are compared per
matrix (default for magnitude / SAFE) or per output row (default for Wanda /
SAFE+, as in Wanda; the official SAFE+ code uses one threshold per matrix):
``PruneConfig.grouping`` picks either. SparseGPT chooses its mask per lazy
batch of columns, as in its paper.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import distributed
from safe_optax.llm import fixed_order as fixed_order_lib
from safe_optax.llm import model as model_lib
from safe_optax.llm.block import block_fns
from safe_optax.llm.block import calibration_mesh
from safe_optax.llm.block import chunks
from safe_optax.llm.block import map_linears
from safe_optax.llm.block import merge_block
from safe_optax.llm.block import place
from safe_optax.llm.block import replicate
from safe_optax.llm.block import safe_block
from safe_optax.llm.block import split_block
from safe_optax.llm.prune_config import PruneConfig
from safe_optax.llm.prune_state import PruneState
from safe_optax.llm.sparsegpt import sparsegpt_prune


# ----------------------------------------------------------------------------- resumable state


def _identity(config: model_lib.LlamaConfig, calibration: np.ndarray, cfg: PruneConfig,
              extra: Optional[dict[str, Any]]) -> dict[str, Any]:
  """What must match for a saved run to be continued, flattened to ``{name: value}``."""
  identity = {f"prune_config.{k}": v for k, v in dataclasses.asdict(cfg).items()}
  identity.update({f"model_config.{k}": v for k, v in dataclasses.asdict(config).items()})
  identity["calibration_sha256"] = hashlib.sha256(
      np.ascontiguousarray(calibration, np.int64).tobytes()).hexdigest()
  identity["calibration_shape"] = list(calibration.shape)
  identity.update(extra or {})
  # Through JSON so tuples and lists compare as what was saved.
  return json.loads(json.dumps(identity, default=str))


# ----------------------------------------------------------------------------- engine


def prune_block(
    config: model_lib.LlamaConfig,
    block_params: dict[str, Any],
    inputs: jax.Array,
    targets: jax.Array,
    stats: dict[str, Any],
    cfg: PruneConfig,
    mesh: Optional[jax.sharding.Mesh] = None,
    fixed_order: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Prunes one block's seven matrices with ``cfg.method``; returns ``(params, info)``.

  ``mesh`` splits SAFE's minibatches over its devices (:func:`calibration_mesh`);
  ``fixed_order`` splits them over the processes instead, summing in a fixed
  order (:func:`safe_optax.llm.fixed_order.safe_block`).
  """
  linears, norms = split_block(block_params)
  num_rows = inputs.shape[0] * inputs.shape[1]
  input_norms = map_linears(lambda key: jnp.sqrt(stats[model_lib.LINEAR_INPUTS[key]]["sq"]))
  info: dict[str, Any] = {}
  if cfg.method == "magnitude":
    pruned, _ = safe_optax.project_topk(linears, **cfg.projection()._asdict())
  elif cfg.method == "wanda":
    scores = safe_optax.wanda_scores(linears, input_norms)
    pruned, _ = safe_optax.project_topk(linears, scores=scores, **cfg.projection()._asdict())
  elif cfg.method == "sparsegpt":
    pruned = map_linears(lambda key: sparsegpt_prune(
        linears[key[0]][key[1]]["kernel"].T, stats[model_lib.LINEAR_INPUTS[key]]["xtx"],
        num_rows, sparsity=cfg.sparsity, nm=cfg.nm, blocksize=cfg.blocksize,
        percdamp=cfg.percdamp).T)
  elif fixed_order:
    pruned, info = fixed_order_lib.safe_block(
        config, block_params, inputs, targets, cfg,
        input_norms if cfg.method == "safe-plus" else None)
  else:
    pruned, info = safe_block(config, block_params, inputs, targets, cfg,
                              input_norms if cfg.method == "safe-plus" else None, mesh)
  return merge_block(pruned, norms), info


def prune_model(
    config: model_lib.LlamaConfig,
    params: dict[str, Any],
    calibration: np.ndarray,
    cfg: PruneConfig,
    *,
    progress: bool = True,
    state_dir: Optional[os.PathLike] = None,
    identity: Optional[dict[str, Any]] = None,
    on_block: Optional[Callable[[int, dict[str, Any]], None]] = None,
    fixed_order: Optional[bool] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Prunes every block in order on the pruned stream (see the module docstring).

  With ``state_dir``, each pruned block, the stream (the next block's inputs)
  and the report entries are saved there as soon as the block is done
  (:class:`~safe_optax.llm.prune_state.PruneState`); a later call with the
  same ``state_dir`` continues from the next block and returns exactly what
  an uninterrupted run returns.
  It refuses (``ValueError`` naming the fields) when the saved run had a
  different ``cfg``, model config, calibration windows or ``identity``.

  Args:
    config: the model's architecture.
    params: its parameters (not modified).
    calibration: ``(nsamples, seqlen)`` token windows.
    cfg: the :class:`PruneConfig`.
    progress: show a tqdm bar over blocks.
    state_dir: folder for the resumable state; ``None`` keeps nothing.
    identity: extra JSON-able ``{name: value}`` that must match on resume
      (the CLI passes its pruning arguments, so errors name its flags).
    on_block: called as ``on_block(index, entry)`` after each block is pruned
      (and saved), e.g. to stop after a given block.
    fixed_order: split the windows over the processes and sum in a fixed
      order (:mod:`safe_optax.llm.fixed_order`); ``None``: when
      ``jax.process_count() > 1``. With several processes each keeps its own
      state in ``state_dir/process_<i>``.

  Returns:
    ``(pruned_params, report)``; the report has, per block, the seconds
    spent on the dense targets, activation statistics and pruning, and the
    relative reconstruction error ``||f^{pruned}(X) - Y||^2 / ||Y||^2``.

  Examples:
    >>> import numpy as np
    >>> from safe_optax.llm import model, prune
    >>> cfg = model.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                         num_layers=2, num_heads=4, num_kv_heads=2)
    >>> params = model.init_params(cfg)
    >>> calib = np.random.default_rng(0).integers(0, 32, (4, 8))
    >>> pruned, report = prune.prune_model(cfg, params, calib,
    ...                                    prune.PruneConfig("wanda"), progress=False)
    >>> float((pruned['layers_1']['mlp']['up_proj']['kernel'] == 0).mean())
    0.5
  """
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

  calibration = np.asarray(calibration)
  if calibration.ndim != 2 or not np.issubdtype(calibration.dtype, np.integer):
    raise ValueError(f"`calibration` must be a (nsamples, seqlen) integer array of token ids, "
                     f"got dtype {calibration.dtype} and shape {calibration.shape}.")
  if calibration.min() < 0 or calibration.max() >= config.vocab_size:
    raise ValueError(
        f"calibration token ids span [{calibration.min()}, {calibration.max()}] but the model's "
        f"vocab_size is {config.vocab_size}: mismatched tokenizer and config.")
  model = model_lib.Llama(config)
  forward, forward_with_stats = block_fns(config, with_hessian=cfg.method == "sparsegpt")
  embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method=model_lib.Llama.embed))
  # Two host buffers for the whole run: the current block's inputs and its dense
  # targets. Each window's output depends only on that window, so the pruned
  # block's outputs overwrite its inputs chunk by chunk.
  n = calibration.shape[0]
  fixed = jax.process_count() > 1 if fixed_order is None else fixed_order
  if fixed:
    fixed_order_lib.check_layout(n, cfg)
    identity = {**(identity or {}), "fixed_order": True}
    if state_dir is not None and jax.process_count() > 1:
      state_dir = os.path.join(state_dir, f"process_{jax.process_index()}")
  mesh = None if fixed else calibration_mesh()
  state = None if state_dir is None else PruneState(
      state_dir, _identity(config, calibration, cfg, identity))
  new_params = dict(params)
  blocks = [] if state is None else state.blocks()
  for entry in blocks:
    i = entry["block"]
    new_params[f"layers_{i}"] = state.load_block(i, params[f"layers_{i}"])
  x = None if not blocks else state.load_stream(len(blocks))
  if x is None:
    x = np.empty(calibration.shape + (config.hidden_size,), np.float32)
    for part in chunks(n, cfg.chunk):
      x[part] = embed(params, jnp.asarray(calibration[part], jnp.int32))
  targets = np.empty_like(x)
  bar = tqdm(range(len(blocks), config.num_layers), desc=f"prune {cfg.method}", unit="block",
             disable=not (progress and distributed.is_primary()), initial=len(blocks),
             total=config.num_layers)
  for i in bar:
    start = time.perf_counter()
    block_params = replicate(mesh, params[f"layers_{i}"])
    stats = None
    if fixed:
      targets[:], stats = fixed_order_lib.forward_pass(forward_with_stats, block_params, x,
                                                      with_stats=True)
    else:
      for part in chunks(n, cfg.chunk):
        out, st = forward_with_stats(block_params, place(mesh, x[part]))
        targets[part] = out
        stats = st if stats is None else optax.tree.add(stats, st)
    pruned_block, info = prune_block(config, block_params, x, targets, stats, cfg, mesh,
                                     fixed_order=fixed)
    jax.block_until_ready(pruned_block)
    seconds = time.perf_counter() - start
    if fixed:
      pruned_out, _ = fixed_order_lib.forward_pass(forward, pruned_block, x, with_stats=False)
    sq_error = sq_target = 0.0
    for part in chunks(n, cfg.chunk):
      out = pruned_out[part] if fixed else np.asarray(
          forward(replicate(mesh, pruned_block), place(mesh, x[part])), np.float32)
      sq_error += float(np.sum(np.square(out - targets[part]), dtype=np.float64))
      sq_target += float(np.sum(np.square(targets[part]), dtype=np.float64))
      x[part] = out
    error = sq_error / sq_target
    new_params[f"layers_{i}"] = pruned_block
    blocks.append({"block": i, "seconds": seconds, "relative_error": error, **info})
    if state is not None:
      state.save(pruned_block, x, blocks)
    bar.set_postfix(rel_err=f"{error:.3g}", s=f"{seconds:.1f}")
    if on_block is not None:
      on_block(i, blocks[-1])
  report = {
      "resumed_blocks": 0 if state is None else state.resumed_blocks,
      "blocks": blocks,
      "seconds_per_block_mean": float(np.mean([b["seconds"] for b in blocks])),
      "seconds_per_block_mean_excl_first": float(np.mean([b["seconds"] for b in blocks[1:]]))
      if len(blocks) > 1 else blocks[0]["seconds"],
  }
  return new_params, report
