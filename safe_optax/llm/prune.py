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
import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax.llm import fixed_order as fixed_order_lib
from safe_optax.llm import model as model_lib
from safe_optax.llm.block import block_fns
from safe_optax.llm.block import calibration_mesh
from safe_optax.llm.block import check_pack
from safe_optax.llm.block import chunks
from safe_optax.llm.block import map_linears
from safe_optax.llm.block import merge_block
from safe_optax.llm.block import place
from safe_optax.llm.block import replicate
from safe_optax.llm.block import safe_block
from safe_optax.llm.block import safe_blocks
from safe_optax.llm.block import split_block
from safe_optax.llm.prune_config import PruneConfig
from safe_optax.llm.prune_state import PruneState
from safe_optax.llm.sparsegpt import sparsegpt_prune

_LOG = logging.getLogger(__name__)


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


def _input_norms(stats: dict[str, Any]) -> dict[str, Any]:
  """Wanda's ``||X_j||`` per linear map's input, from the block's statistics."""
  return map_linears(lambda key: jnp.sqrt(stats[model_lib.LINEAR_INPUTS[key]]["sq"]))


def prune_block(
    config: model_lib.LlamaConfig,
    block_params: dict[str, Any],
    inputs: jax.Array,
    targets: jax.Array,
    stats: dict[str, Any],
    cfg: PruneConfig,
    mesh: Optional[jax.sharding.Mesh] = None,
    fixed_order: bool = False,
    *,
    progress: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Prunes one block's seven matrices with ``cfg.method``; returns ``(params, info)``.

  ``mesh`` splits SAFE's minibatches over its devices (:func:`calibration_mesh`);
  ``fixed_order`` splits them over the processes instead, summing in a fixed
  order (:func:`safe_optax.llm.fixed_order.safe_block_fixed_order`). ``progress`` shows a
  bar of SAFE's steps.
  """
  linears, norms = split_block(block_params)
  num_rows = inputs.shape[0] * inputs.shape[1]
  input_norms = _input_norms(stats)
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
    pruned, info = fixed_order_lib.safe_block_fixed_order(
        config, block_params, inputs, targets, cfg,
        input_norms if cfg.method == "safe-plus" else None, progress=progress)
  else:
    pruned, info = safe_block(config, block_params, inputs, targets, cfg,
                              input_norms if cfg.method == "safe-plus" else None, mesh,
                              progress=progress)
  return merge_block(pruned, norms), info


def _check_calibration(config: model_lib.LlamaConfig, calibration: Any) -> np.ndarray:
  calibration = np.asarray(calibration)
  if calibration.ndim != 2 or not np.issubdtype(calibration.dtype, np.integer):
    raise ValueError(f"`calibration` must be a (nsamples, seqlen) integer array of token ids, "
                     f"got dtype {calibration.dtype} and shape {calibration.shape}.")
  if calibration.min() < 0 or calibration.max() >= config.vocab_size:
    raise ValueError(
        f"calibration token ids span [{calibration.min()}, {calibration.max()}] but the model's "
        f"vocab_size is {config.vocab_size}: mismatched tokenizer and config.")
  return calibration


@dataclasses.dataclass
class _Lane:
  """One calibration set's walk: its stream, dense targets, pruned blocks and saved state."""
  calibration: np.ndarray
  cfg: PruneConfig
  state: Optional[PruneState]
  params: dict[str, Any]
  blocks: list[dict[str, Any]]
  x: Optional[np.ndarray] = None
  targets: Optional[np.ndarray] = None

  def report(self) -> dict[str, Any]:
    """The per-block entries and their mean seconds, as :func:`prune_model` returns them."""
    blocks = self.blocks
    return {
        "resumed_blocks": 0 if self.state is None else self.state.resumed_blocks,
        "blocks": blocks,
        "seconds_per_block_mean": float(np.mean([b["seconds"] for b in blocks])),
        "seconds_per_block_mean_excl_first": float(np.mean([b["seconds"] for b in blocks[1:]]))
        if len(blocks) > 1 else blocks[0]["seconds"],
    }


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
    progress: show tqdm bars on stderr: one over the blocks and, for SAFE /
      SAFE+, one over each block's steps (process 0 only).
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
  calibration = _check_calibration(config, calibration)
  fixed = jax.process_count() > 1 if fixed_order is None else fixed_order
  if fixed:
    fixed_order_lib.check_layout(calibration.shape[0], cfg)
    identity = {**(identity or {}), "fixed_order": True}
    if state_dir is not None and jax.process_count() > 1:
      state_dir = os.path.join(state_dir, f"process_{jax.process_index()}")
  lanes = _walk(config, params, [calibration], [cfg], [state_dir], [identity], progress=progress,
                on_block=None if on_block is None else lambda i, entries: on_block(i, entries[0]),
                fixed=fixed)
  return lanes[0].params, lanes[0].report()


def prune_models(
    config: model_lib.LlamaConfig,
    params: dict[str, Any],
    calibrations: Sequence[np.ndarray],
    cfgs: Sequence[PruneConfig],
    *,
    progress: bool = True,
    state_dirs: Optional[Sequence[Optional[os.PathLike]]] = None,
    identities: Optional[Sequence[Optional[dict[str, Any]]]] = None,
    on_block: Optional[Callable[[int, list[dict[str, Any]]], None]] = None,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
  """:func:`prune_model` for several calibration sets of one model, in one walk (a pack).

  Lane ``i`` prunes ``params`` on ``calibrations[i]`` with ``cfgs[i]`` (equal
  but for ``seed``, e.g. the calibration seeds of one table row). The blocks
  are walked once: each lane computes its own targets and statistics, and
  SAFE / SAFE+ steps of every lane run together in one vmapped program
  (:func:`safe_optax.llm.block.safe_blocks`) on one device; with several local
  devices the lanes run one after another, each over the device mesh. Other
  methods prune lane by lane. Lane ``i``'s result is what
  ``prune_model(config, params, calibrations[i], cfgs[i])`` gives, up to the
  rounding of batched matrix products, which SAFE's first steps can scale up
  (:func:`~safe_optax.llm.block.safe_blocks`; tested: the same masks, weights
  within 1 % on a small model). Each block's entry records
  ``lanes``, ``pack`` (lanes whose SAFE steps ran as one program) and the
  walk's wall seconds for the block, shared by its lanes.

  ``state_dirs[i]`` keeps lane ``i``'s resumable state as :func:`prune_model`
  keeps it (one lane's state can be continued alone, and a lone run's in a
  pack). The lanes must stand at the same block; ``on_block(index, entries)``
  gets every lane's entry. One process only.

  Returns:
    ``[(pruned_params, report)]``, one per lane.
  """
  lanes = len(cfgs)
  if lanes == 0 or len(calibrations) != lanes:
    raise ValueError(f"`calibrations` and `cfgs` need one entry per lane (at least one), got "
                     f"{len(calibrations)} and {lanes}.")
  for name, value in (("state_dirs", state_dirs), ("identities", identities)):
    if value is not None and len(value) != lanes:
      raise ValueError(f"`{name}` needs one entry per lane ({lanes}), got {len(value)}.")
  if jax.process_count() > 1:
    raise ValueError("prune_models packs lanes in one process; with several processes prune "
                     "each calibration set with prune_model (fixed_order).")
  if cfgs[0].method in ("safe", "safe-plus"):
    check_pack(cfgs)
  elif any(c.method != cfgs[0].method for c in cfgs):
    raise ValueError("packed lanes share one `method`; got "
                     f"{sorted({c.method for c in cfgs})}.")
  calibrations = [_check_calibration(config, c) for c in calibrations]
  lanes = _walk(config, params, calibrations, list(cfgs), state_dirs or [None] * lanes,
                identities or [None] * lanes, progress=progress, on_block=on_block, fixed=False)
  return [(lane.params, lane.report()) for lane in lanes]


def _walk(config, params, calibrations, cfgs, state_dirs, identities, *, progress, on_block,
          fixed) -> list[_Lane]:
  """The block walk of :func:`prune_model` (one lane) and :func:`prune_models` (a pack)."""
  model = model_lib.Llama(config)
  forward, forward_with_stats = block_fns(config, with_hessian=cfgs[0].method == "sparsegpt")
  embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method=model_lib.Llama.embed))
  mesh = None if fixed else calibration_mesh()
  lanes = []
  for calibration, cfg, state_dir, identity in zip(calibrations, cfgs, state_dirs, identities):
    state = None if state_dir is None else PruneState(
        state_dir, _identity(config, calibration, cfg, identity))
    lane = _Lane(calibration, cfg, state, dict(params), [] if state is None else state.blocks())
    for entry in lane.blocks:
      i = entry["block"]
      lane.params[f"layers_{i}"] = state.load_block(i, params[f"layers_{i}"])
    lanes.append(lane)
  done = {len(lane.blocks) for lane in lanes}
  if len(done) > 1:
    raise ValueError("the packed lanes' saved states stand at different blocks ("
                     + ", ".join(f"{d}: {len(lane.blocks)}" for d, lane in zip(state_dirs, lanes))
                     + "); continue each alone with prune_model, or restart them.")
  first = done.pop()
  if first:
    _LOG.info("resuming from the saved state: %d of %d blocks done", first, config.num_layers)
  # Two host buffers per lane for the whole run: the current block's inputs and its
  # dense targets. Each window's output depends only on that window, so the pruned
  # block's outputs overwrite its inputs chunk by chunk.
  for lane in lanes:
    n = lane.calibration.shape[0]
    lane.x = None if not first else lane.state.load_stream(first)
    if lane.x is None:
      lane.x = np.empty(lane.calibration.shape + (config.hidden_size,), np.float32)
      for part in chunks(n, lane.cfg.chunk):
        lane.x[part] = embed(params, jnp.asarray(lane.calibration[part], jnp.int32))
    lane.targets = np.empty_like(lane.x)
  pack = (len(lanes) > 1 and mesh is None and cfgs[0].method in ("safe", "safe-plus"))
  progress = progress and distributed.is_primary()
  bar = experiment.progress(
      config.num_layers, initial=first, unit="block", enabled=progress,
      desc=f"prune {cfgs[0].method}" + (f" x{len(lanes)}" if len(lanes) > 1 else ""))
  for i in range(first, config.num_layers):
    start = time.perf_counter()
    block_params = replicate(mesh, params[f"layers_{i}"])
    all_stats = []
    for lane in lanes:
      stats = None
      if fixed:
        lane.targets[:], stats = fixed_order_lib.forward_pass(forward_with_stats, block_params,
                                                              lane.x, with_stats=True)
      else:
        for part in chunks(lane.calibration.shape[0], lane.cfg.chunk):
          out, st = forward_with_stats(block_params, place(mesh, lane.x[part]))
          lane.targets[part] = out
          stats = st if stats is None else optax.tree.add(stats, st)
      all_stats.append(stats)
    if pack:
      norms = None
      if cfgs[0].method == "safe-plus":
        norms = jax.tree.map(lambda *a: jnp.stack(a), *[_input_norms(s) for s in all_stats])
      kept = split_block(block_params)[1]
      pruned = [(merge_block(linears, kept), info) for linears, info in safe_blocks(
          config, block_params, np.stack([lane.x for lane in lanes]),
          np.stack([lane.targets for lane in lanes]), cfgs, norms, progress=progress)]
    else:
      pruned = [prune_block(config, block_params, lane.x, lane.targets, stats, lane.cfg, mesh,
                            fixed_order=fixed, progress=progress)
                for lane, stats in zip(lanes, all_stats)]
    jax.block_until_ready([pruned_block for pruned_block, _ in pruned])
    seconds = time.perf_counter() - start
    entries = []
    for lane, (pruned_block, info) in zip(lanes, pruned):
      n = lane.calibration.shape[0]
      if fixed:
        pruned_out, _ = fixed_order_lib.forward_pass(forward, pruned_block, lane.x,
                                                     with_stats=False)
      sq_error = sq_target = 0.0
      for part in chunks(n, lane.cfg.chunk):
        out = pruned_out[part] if fixed else np.asarray(
            forward(replicate(mesh, pruned_block), place(mesh, lane.x[part])), np.float32)
        sq_error += float(np.sum(np.square(out - lane.targets[part]), dtype=np.float64))
        sq_target += float(np.sum(np.square(lane.targets[part]), dtype=np.float64))
        lane.x[part] = out
      error = sq_error / sq_target
      lane.params[f"layers_{i}"] = pruned_block
      entry = {"block": i, "seconds": seconds, "relative_error": error, **info}
      if len(lanes) > 1:
        entry["lanes"] = len(lanes)  # walked together; "pack": SAFE's steps vmapped together
      lane.blocks.append(entry)
      entries.append(entry)
      if lane.state is not None:
        lane.state.save(pruned_block, lane.x, lane.blocks)
    worst = max(e["relative_error"] for e in entries)
    bar.update(1)
    bar.set_postfix_str(f"rel_err={worst:.3g}, s={seconds:.1f}")
    _LOG.info("block %d/%d pruned in %.1f s, relative error %.3g%s", i + 1, config.num_layers,
              seconds, worst, f" (the largest of {len(lanes)} seeds)" if len(lanes) > 1 else "")
    if on_block is not None:
      on_block(i, entries)
  bar.close()
  return lanes
