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

Structures: unstructured or N:M along the input dimension (``(in, out)``
kernels, the core's ``NM`` axis ``-2``). Unstructured masks are compared per
matrix (default for magnitude / SAFE) or per output row (default for Wanda /
SAFE+, as in Wanda; the official SAFE+ code uses one threshold per matrix):
``PruneConfig.grouping`` picks either. SparseGPT chooses its mask per lazy
batch of columns, as in its paper.
"""

from __future__ import annotations

import dataclasses
import functools
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
from safe_optax.llm import model as model_lib
from safe_optax.llm.prune_state import PruneState
from safe_optax.llm.sparsegpt import sparsegpt_prune

METHODS = ("magnitude", "wanda", "sparsegpt", "safe", "safe-plus")
GROUPINGS = ("per_matrix", "per_row")
LR_SCALES = ("none", "rms")


@dataclasses.dataclass(frozen=True)
class PruneConfig:
  """What to prune and how; defaults are the paper's (§4.2, App. C).

  Attributes:
    method: one of ``METHODS``.
    sparsity: fraction of each matrix pruned (unstructured); ignored with ``nm``.
    nm: ``(n, m)`` to keep ``n`` of every ``m`` consecutive inputs (2:4, 4:8).
    grouping: where unstructured scores compete, ``"per_matrix"`` or
      ``"per_row"`` (each output row keeps the same count); ``None`` is
      per row for Wanda / SAFE+ and per matrix for magnitude / SAFE.
    epochs, batch_size, learning_rate, warmup_epochs, rho, penalty,
    dual_every: SAFE / SAFE+ (Adam betas 0.9 / 0.95, no weight decay,
      linear warm-up then linear decay to 0, constant ``lambda``).
    lr_scale: ``"none"`` (the paper: every matrix steps by ``learning_rate``)
      or ``"rms"``: each matrix's Adam step is multiplied by the RMS of its
      dense weights, so ``learning_rate`` is relative (a fraction of the
      matrix's typical weight per step). Adam moves a weight by at most about
      the learning rate per step, so an absolute rate tuned for a 7B model's
      weights can be too small to move a small model's weights far.
    blocksize, percdamp: SparseGPT's lazy batch width and damping.
    chunk: windows per forward call when computing targets and statistics.
    seed: shuffles SAFE's minibatches.
  """

  method: str
  sparsity: float = 0.5
  nm: Optional[tuple[int, int]] = None
  grouping: Optional[str] = None
  epochs: int = 30
  batch_size: int = 8
  learning_rate: float = 2e-4
  warmup_epochs: int = 2
  rho: float = 2e-4
  penalty: float = 1e-3
  dual_every: int = 32
  lr_scale: str = "none"
  blocksize: int = 128
  percdamp: float = 0.01
  chunk: int = 8
  seed: int = 0

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"`method` must be one of {METHODS}, got {self.method!r}.")
    if self.nm is not None:
      n, m = self.nm
      if not (isinstance(n, int) and isinstance(m, int) and 1 <= n < m):
        raise ValueError(f"`nm` must be (n, m) integers with 1 <= n < m, got {self.nm!r}.")
    elif not 0.0 <= self.sparsity < 1.0:
      raise ValueError(f"`sparsity` must be in [0, 1), got {self.sparsity}.")
    if self.grouping is not None:
      if self.grouping not in GROUPINGS:
        raise ValueError(f"`grouping` must be one of {GROUPINGS} or None, got {self.grouping!r}.")
      if self.nm is not None or self.method == "sparsegpt":
        raise ValueError("`grouping` applies to unstructured magnitude / wanda / safe / "
                         "safe-plus; N:M and SparseGPT choose their own groups.")
    for name in ("epochs", "batch_size", "dual_every", "blocksize", "chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if self.lr_scale not in LR_SCALES:
      raise ValueError(f"`lr_scale` must be one of {LR_SCALES}, got {self.lr_scale!r}.")
    if not isinstance(self.warmup_epochs, int) or self.warmup_epochs < 0:
      raise ValueError(f"`warmup_epochs` must be an int >= 0, got {self.warmup_epochs!r}.")
    for name in ("learning_rate", "rho", "penalty", "percdamp"):
      if getattr(self, name) < 0:
        raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")

  @property
  def target_sparsity(self) -> float:
    return 1.0 - self.nm[0] / self.nm[1] if self.nm else self.sparsity

  @property
  def per_row(self) -> bool:
    """Whether unstructured scores compete within each output row."""
    if self.grouping is None:
      return self.method in ("wanda", "safe-plus")
    return self.grouping == "per_row"

  def projection(self) -> safe_optax.Projection:
    """The sparsity set of this config: N:M, per output row, or per matrix.

    ``project_topk`` and ``finalize`` take it as ``**projection._asdict()``.

    Examples:
      >>> from safe_optax.llm.prune import PruneConfig
      >>> PruneConfig("magnitude").projection()
      Projection(sparsity=0.5, structure=PerLeaf(), prunable=None)
      >>> PruneConfig("wanda", nm=(2, 4)).projection().structure
      NM(n=2, m=4, axis=-2)
    """
    if self.nm is not None:
      return safe_optax.Projection(None, safe_optax.NM(*self.nm))
    if self.per_row:
      return safe_optax.Projection(self.sparsity, safe_optax.PerOutput())
    return safe_optax.Projection(self.sparsity, safe_optax.PerLeaf())


# ----------------------------------------------------------------------------- block helpers


def split_block(block_params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(linears, norms)``: the seven kernels (pruned) and the two norm scales (kept)."""
  linears = {group: dict(block_params[group]) for group in ("self_attn", "mlp")}
  norms = {k: v for k, v in block_params.items() if k not in linears}
  return linears, norms


def merge_block(linears: dict[str, Any], norms: dict[str, Any]) -> dict[str, Any]:
  return {**norms, **linears}


def _map_linears(fn: Callable[[tuple[str, str]], Any]) -> dict[str, Any]:
  """A linears-shaped tree ``{group: {linear: {'kernel': fn((group, linear))}}}``."""
  tree: dict[str, Any] = {}
  for group, linear in model_lib.LINEAR_INPUTS:
    tree.setdefault(group, {})[linear] = {"kernel": fn((group, linear))}
  return tree


class BlockStats(dict):
  """Per captured input: ``sq`` (sum of squares per feature), ``xtx``, and ``n`` rows."""


def _block_fns(config: model_lib.LlamaConfig, with_hessian: bool):
  block = model_lib.Block(config)

  @jax.jit
  def forward(block_params, x):
    return block.apply({"params": block_params}, x)

  @jax.jit
  def forward_with_stats(block_params, x):
    out, state = block.apply({"params": block_params}, x, mutable=["intermediates"])
    inter = state["intermediates"]
    acts = {
        "attn_in": inter["self_attn"]["attn_in"][0], "o_in": inter["self_attn"]["o_in"][0],
        "mlp_in": inter["mlp"]["mlp_in"][0], "down_in": inter["mlp"]["down_in"][0],
    }
    stats = {}
    for name, act in acts.items():
      flat = act.reshape(-1, act.shape[-1]).astype(jnp.float32)
      stats[name] = {"sq": jnp.sum(jnp.square(flat), axis=0)}
      if with_hessian:
        stats[name]["xtx"] = flat.T @ flat
    return out, stats

  return forward, forward_with_stats


def calibration_mesh() -> Optional[jax.sharding.Mesh]:
  """The ``'data'`` mesh over this process's devices, or ``None`` with one device."""
  devices = jax.local_devices()
  return distributed.data_mesh(devices) if len(devices) > 1 else None


def _place(mesh: Optional[jax.sharding.Mesh], batch: Any) -> Any:
  """A batch of windows split over the mesh (leading axis); as it is without a mesh."""
  if mesh is None:
    return batch
  return jax.tree.map(lambda x: jax.device_put(x, distributed.batch_sharding(mesh, len(x))),
                      batch)


def _replicate(mesh: Optional[jax.sharding.Mesh], tree: Any) -> Any:
  return tree if mesh is None else jax.device_put(tree, distributed.replicated(mesh))


def _chunks(size: int, chunk: int):
  for start in range(0, size, chunk):
    yield slice(start, min(start + chunk, size))


# ----------------------------------------------------------------------------- SAFE


def _safe_schedule(cfg: PruneConfig, steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up over ``warmup_epochs`` then linear decay to 0 (paper App. C)."""
  total = cfg.epochs * steps_per_epoch
  warmup = min(cfg.warmup_epochs * steps_per_epoch, total - 1)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, max(warmup, 1)),
       optax.linear_schedule(cfg.learning_rate, 0.0, max(total - warmup, 1))],
      [warmup])


def _scale_by_leaf(scales: Any) -> optax.GradientTransformation:
  """Multiplies each leaf's update by its entry of ``scales`` (a tree of scalars)."""

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, c: (u * c).astype(u.dtype), updates, scales), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def lr_scales(cfg: PruneConfig, linears: dict[str, Any]) -> Optional[dict[str, Any]]:
  """Per-matrix step multipliers for ``cfg.lr_scale``: ``None`` or the dense RMS of each kernel."""
  if cfg.lr_scale == "none":
    return None
  return jax.tree.map(lambda w: jnp.sqrt(jnp.mean(jnp.square(w.astype(jnp.float32)))), linears)


def safe_transform(
    cfg: PruneConfig, steps_per_epoch: int, input_norms: Optional[dict[str, Any]] = None,
    scales: Optional[dict[str, Any]] = None,
) -> optax.GradientTransformationExtraArgs:
  """``sam_perturb(rho) -> admm_penalty(...) -> adam(0.9, 0.95)``, all from the core.

  ``input_norms`` (a linears-shaped tree of ``||X_j||``) makes it SAFE+ with
  :func:`safe_optax.wanda_saliency`; ``None`` is SAFE (magnitude). Scores
  compete as ``cfg.grouping`` says. ``scales`` (from :func:`lr_scales`)
  multiplies each matrix's Adam step.
  """
  projection = cfg.projection()
  scores = None if input_norms is None else safe_optax.wanda_saliency(input_norms)
  parts = [
      safe_optax.sam_perturb(cfg.rho),
      safe_optax.admm_penalty(
          projection.sparsity, cfg.penalty, dual_every=cfg.dual_every,
          penalty_schedule="constant", structure=projection.structure,
          prunable=projection.prunable, scores=scores),
      optax.adam(_safe_schedule(cfg, steps_per_epoch), b1=0.9, b2=0.95),
  ]
  if scales is not None:
    parts.append(_scale_by_leaf(scales))
  return optax.chain(*parts)


@functools.lru_cache(maxsize=8)
def _safe_step(config: model_lib.LlamaConfig, cfg: PruneConfig, steps_per_epoch: int):
  """The jitted SAFE / SAFE+ block step, compiled once for every block of a model."""
  block = model_lib.Block(config)

  def loss_fn(linears, norms, x, y):
    out = block.apply({"params": merge_block(linears, norms)}, x)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

  @jax.jit
  def step(linears, norms, input_norms, scales, opt_state, x, y):
    # The transform is rebuilt inside the trace so this block's Wanda norms and
    # step scales are data, not constants baked into a per-block compilation.
    tx = safe_transform(cfg, steps_per_epoch, input_norms, scales)
    loss, grads = jax.value_and_grad(loss_fn)(linears, norms, x, y)
    grad_fn = lambda p, _: jax.grad(loss_fn)(p, norms, x, y)
    updates, opt_state = tx.update(grads, opt_state, linears, grad_fn=grad_fn)
    return optax.apply_updates(linears, updates), opt_state, loss

  return step


def safe_block(
    config: model_lib.LlamaConfig,
    block_params: dict[str, Any],
    inputs: jax.Array,
    targets: jax.Array,
    cfg: PruneConfig,
    input_norms: Optional[dict[str, Any]] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """SAFE / SAFE+ on one block's reconstruction loss, then the final projection.

  Minimises :math:`\\frac{1}{n}\\|f(X; W) - Y\\|^2` over the block's seven
  matrices (norm scales fixed) with :func:`safe_transform`, ``cfg.epochs``
  passes over shuffled minibatches of ``cfg.batch_size`` windows, then
  projects with :func:`safe_optax.finalize` (SAFE+: Wanda scores).

  Args:
    config: the model's architecture.
    block_params: the dense block's parameters.
    inputs, targets: ``(n, L, d)`` calibration inputs and dense targets.
    cfg: the :class:`PruneConfig`.
    input_norms: Wanda norms for SAFE+, ``None`` for SAFE.
    mesh: split each minibatch over this ``'data'`` mesh (:func:`calibration_mesh`).

  Returns:
    ``(pruned_linears, info)`` with the last minibatch loss of each epoch.
  """
  linears, norms = split_block(block_params)
  n = inputs.shape[0]
  batch = min(cfg.batch_size, n)
  steps_per_epoch = n // batch
  step = _safe_step(config, cfg, steps_per_epoch)
  projection = cfg.projection()
  params = linears
  scales = lr_scales(cfg, linears)
  opt_state = safe_transform(cfg, steps_per_epoch, input_norms, scales).init(params)
  params, norms, input_norms, scales, opt_state = _replicate(
      mesh, (params, norms, input_norms, scales, opt_state))
  rng = np.random.default_rng(cfg.seed)
  losses = []
  for _ in range(cfg.epochs):
    order = rng.permutation(n)
    for b in range(steps_per_epoch):
      idx = order[b * batch:(b + 1) * batch]
      params, opt_state, loss = step(params, norms, input_norms, scales, opt_state,
                                     *_place(mesh, (inputs[idx], targets[idx])))
    losses.append(float(loss))
  final_scores = None
  if input_norms is not None:
    final_scores = safe_optax.wanda_scores(params, input_norms)
  pruned, _ = safe_optax.finalize(params, **projection._asdict(), scores=final_scores)
  return pruned, {"epoch_last_loss": losses, "steps": cfg.epochs * steps_per_epoch}


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
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Prunes one block's seven matrices with ``cfg.method``; returns ``(params, info)``.

  ``mesh`` splits SAFE's minibatches over its devices (:func:`calibration_mesh`).
  """
  linears, norms = split_block(block_params)
  num_rows = inputs.shape[0] * inputs.shape[1]
  input_norms = _map_linears(lambda key: jnp.sqrt(stats[model_lib.LINEAR_INPUTS[key]]["sq"]))
  info: dict[str, Any] = {}
  if cfg.method == "magnitude":
    pruned, _ = safe_optax.project_topk(linears, **cfg.projection()._asdict())
  elif cfg.method == "wanda":
    scores = safe_optax.wanda_scores(linears, input_norms)
    pruned, _ = safe_optax.project_topk(linears, scores=scores, **cfg.projection()._asdict())
  elif cfg.method == "sparsegpt":
    pruned = _map_linears(lambda key: sparsegpt_prune(
        linears[key[0]][key[1]]["kernel"].T, stats[model_lib.LINEAR_INPUTS[key]]["xtx"],
        num_rows, sparsity=cfg.sparsity, nm=cfg.nm, blocksize=cfg.blocksize,
        percdamp=cfg.percdamp).T)
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
  forward, forward_with_stats = _block_fns(config, with_hessian=cfg.method == "sparsegpt")
  embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method=model_lib.Llama.embed))
  # Two host buffers for the whole run: the current block's inputs and its dense
  # targets. Each window's output depends only on that window, so the pruned
  # block's outputs overwrite its inputs chunk by chunk.
  n = calibration.shape[0]
  mesh = calibration_mesh()
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
    for part in _chunks(n, cfg.chunk):
      x[part] = embed(params, jnp.asarray(calibration[part], jnp.int32))
  targets = np.empty_like(x)
  bar = tqdm(range(len(blocks), config.num_layers), desc=f"prune {cfg.method}", unit="block",
             disable=not progress, initial=len(blocks), total=config.num_layers)
  for i in bar:
    start = time.perf_counter()
    block_params = _replicate(mesh, params[f"layers_{i}"])
    stats = None
    for part in _chunks(n, cfg.chunk):
      out, st = forward_with_stats(block_params, _place(mesh, x[part]))
      targets[part] = out
      stats = st if stats is None else optax.tree.add(stats, st)
    pruned_block, info = prune_block(config, block_params, x, targets, stats, cfg, mesh)
    jax.block_until_ready(pruned_block)
    seconds = time.perf_counter() - start
    sq_error = sq_target = 0.0
    for part in _chunks(n, cfg.chunk):
      out = np.asarray(forward(_replicate(mesh, pruned_block), _place(mesh, x[part])),
                       np.float32)
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
