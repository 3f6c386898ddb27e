"""One transformer block: its parameters, its jitted passes, and SAFE / SAFE+ on it.

The helpers :mod:`safe_optax.llm.prune`'s engine walks the blocks with: split
a block into its seven prunable matrices and the norms it keeps, the jitted
forward pass (with the activation statistics Wanda and SparseGPT need), the
placement of calibration batches over the local devices (data parallel
within a block), and :func:`safe_block`, which minimises the block's
reconstruction loss with ``sam_perturb -> admm_penalty -> adam`` and projects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax.llm import model as model_lib
from safe_optax.llm.prune_config import PruneConfig

# ----------------------------------------------------------------------------- block helpers


def split_block(block_params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(linears, norms)``: the seven kernels (pruned) and the two norm scales (kept)."""
  linears = {group: dict(block_params[group]) for group in ("self_attn", "mlp")}
  norms = {k: v for k, v in block_params.items() if k not in linears}
  return linears, norms


def merge_block(linears: dict[str, Any], norms: dict[str, Any]) -> dict[str, Any]:
  """A block's parameters from its ``(linears, norms)``: the inverse of :func:`split_block`."""
  return {**norms, **linears}


def map_linears(fn: Callable[[tuple[str, str]], Any]) -> dict[str, Any]:
  """A linears-shaped tree ``{group: {linear: {'kernel': fn((group, linear))}}}``."""
  tree: dict[str, Any] = {}
  for group, linear in model_lib.LINEAR_INPUTS:
    tree.setdefault(group, {})[linear] = {"kernel": fn((group, linear))}
  return tree


def block_fns(config: model_lib.LlamaConfig, with_hessian: bool):
  """The jitted passes of one block: ``(forward, forward_with_stats)``.

  Args:
    config: the model's architecture.
    with_hessian: also sum ``X^T X`` of each linear map's input (SparseGPT's
      Hessian), not only the squares Wanda needs.

  Returns:
    ``forward(block_params, x) -> y`` and ``forward_with_stats(block_params,
    x) -> (y, stats)``, where ``stats[name]`` has ``"sq"``, the sum over rows
    of each input feature's square, and with ``with_hessian`` ``"xtx"``, for
    the inputs ``attn_in``, ``o_in``, ``mlp_in`` and ``down_in``
    (:data:`~safe_optax.llm.model.LINEAR_INPUTS`).
  """
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


def place(mesh: Optional[jax.sharding.Mesh], batch: Any) -> Any:
  """A batch of windows split over the mesh (leading axis); as it is without a mesh."""
  if mesh is None:
    return batch
  return jax.tree.map(lambda x: jax.device_put(x, distributed.batch_sharding(mesh, len(x))),
                      batch)


def replicate(mesh: Optional[jax.sharding.Mesh], tree: Any) -> Any:
  """A tree copied whole onto every device of the mesh; as it is without a mesh."""
  return tree if mesh is None else jax.device_put(tree, distributed.replicated(mesh))


def chunks(size: int, chunk: int) -> Iterator[slice]:
  """Consecutive slices of at most ``chunk`` items covering ``range(size)``.

  Examples:
    >>> list(chunks(5, 2))
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
  """
  for start in range(0, size, chunk):
    yield slice(start, min(start + chunk, size))


# ----------------------------------------------------------------------------- SAFE


def safe_schedule(cfg: PruneConfig, steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up over ``warmup_epochs`` then linear decay to 0 (paper App. C)."""
  total = cfg.epochs * steps_per_epoch
  warmup = min(cfg.warmup_epochs * steps_per_epoch, total - 1)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, max(warmup, 1)),
       optax.linear_schedule(cfg.learning_rate, 0.0, max(total - warmup, 1))],
      [warmup])


def scale_by_leaf(scales: Any) -> optax.GradientTransformation:
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
      optax.adam(safe_schedule(cfg, steps_per_epoch), b1=0.9, b2=0.95),
  ]
  if scales is not None:
    parts.append(scale_by_leaf(scales))
  return optax.chain(*parts)


def safe_step(config: model_lib.LlamaConfig, cfg: PruneConfig, steps_per_epoch: int,
              pack: bool = False):
  """The jitted SAFE / SAFE+ block step, compiled once for every block and seed.

  ``cfg.seed`` only orders the minibatches on the host, so it is not part of
  the compiled step: every seed of a process shares one program.

  ``pack=True``: the same step vmapped over a leading lane axis of the
  weights, Wanda norms, optimizer state, windows, targets and minibatch
  indices (one lane per calibration set, :func:`safe_blocks`); the dense
  norms and step scales are shared.
  """
  return _compiled_step(config, dataclasses.replace(cfg, seed=0), steps_per_epoch, pack)


@functools.lru_cache(maxsize=8)
def _compiled_step(config: model_lib.LlamaConfig, cfg: PruneConfig, steps_per_epoch: int,
                   pack: bool):
  """:func:`safe_step`, cached on its seed-free arguments."""
  block = model_lib.Block(config)

  def loss_fn(linears, norms, x, y):
    out = block.apply({"params": merge_block(linears, norms)}, x)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y))

  # Two programs, picked by the host's step counter: the one for steps without a
  # dual update does not carry the projection (see safe_optax.admm_penalty's dual_due).
  # ``idx`` given: ``x`` and ``y`` are the block's device-resident windows and
  # targets, and the minibatch is gathered here (one device); ``None``: they are
  # the minibatch, placed over the mesh by the caller.
  def step(linears, norms, input_norms, scales, opt_state, x, y, idx=None, *, dual_due):
    if idx is not None:
      x, y = x[idx], y[idx]
    # The transform is rebuilt inside the trace so this block's Wanda norms and
    # step scales are data, not constants baked into a per-block compilation.
    tx = safe_transform(cfg, steps_per_epoch, input_norms, scales)
    loss, grads = jax.value_and_grad(loss_fn)(linears, norms, x, y)
    grad_fn = lambda p, _: jax.grad(loss_fn)(p, norms, x, y)
    updates, opt_state = tx.update(grads, opt_state, linears, grad_fn=grad_fn, dual_due=dual_due)
    return optax.apply_updates(linears, updates), opt_state, loss

  if not pack:
    return jax.jit(step, static_argnames="dual_due")

  @functools.partial(jax.jit, static_argnames="dual_due")
  def packed(linears, norms, input_norms, scales, opt_state, x, y, idx, *, dual_due):
    lanes = jax.vmap(functools.partial(step, dual_due=dual_due),
                     in_axes=(0, None, 0, None, 0, 0, 0, 0))
    return lanes(linears, norms, input_norms, scales, opt_state, x, y, idx)

  return packed


def _run_steps(step, state, inputs, targets, epoch_order: Callable[[], np.ndarray],
               cfg: PruneConfig, steps_per_epoch: int,
               mesh: Optional[jax.sharding.Mesh], progress: bool) -> tuple[Any, list[Any]]:
  """``cfg.epochs`` epochs of ``step``; returns the final weights and each epoch's last loss.

  ``epoch_order()`` gives an epoch's minibatch indices, ``(steps_per_epoch,
  ...)``. Without a mesh the state, windows and targets go to the device once,
  each epoch's indices in one transfer, and the step gathers its minibatch
  there; the loop runs under a transfer guard, so a step that moved anything
  between host and device implicitly (a numpy batch, a Python scalar, a loss
  read back) would raise instead of slowing every step down. With a mesh the
  host gathers each minibatch and splits it over the mesh.

  ``progress`` shows a bar of the steps, advanced an epoch at a time once the
  loop has waited for that epoch anyway: no extra wait or transfer.
  """
  bar = experiment.progress(cfg.epochs * steps_per_epoch, desc=f"{cfg.method} steps",
                            unit="step", enabled=progress, leave=False)
  if mesh is None:
    state, inputs, targets = jax.device_put((state, inputs, targets))
    guard = jax.transfer_guard("disallow")
  else:
    state, guard = replicate(mesh, state), contextlib.nullcontext()
  params, norms, input_norms, scales, opt_state = state
  losses = []
  with guard:
    for epoch in range(cfg.epochs):
      order = epoch_order()
      if mesh is None:
        order = jax.device_put(list(order))
      for b in range(steps_per_epoch):
        data = ((inputs, targets, order[b]) if mesh is None else
                place(mesh, (inputs[order[b]], targets[order[b]])))
        params, opt_state, loss = step(
            params, norms, input_norms, scales, opt_state, *data,
            dual_due=safe_optax.experimental.is_dual_step(epoch * steps_per_epoch + b,
                                                          cfg.dual_every))
      if losses:
        # Waits (no transfer) for the epoch before: at most two epochs of steps in flight.
        losses[-1].block_until_ready()
        bar.update(steps_per_epoch)
      losses.append(loss)  # read once, after the loop
  losses = jax.device_get(losses)
  bar.update(steps_per_epoch)
  bar.close()
  return params, losses


def _project(cfg: PruneConfig, params: dict[str, Any],
             input_norms: Optional[dict[str, Any]]) -> dict[str, Any]:
  """The final projection: magnitude (SAFE) or Wanda scores (SAFE+)."""
  final_scores = None
  if input_norms is not None:
    final_scores = safe_optax.wanda_scores(params, input_norms)
  pruned, _ = safe_optax.finalize(params, **cfg.projection()._asdict(), scores=final_scores)
  return pruned


def safe_block(
    config: model_lib.LlamaConfig,
    block_params: dict[str, Any],
    inputs: jax.Array,
    targets: jax.Array,
    cfg: PruneConfig,
    input_norms: Optional[dict[str, Any]] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    *,
    progress: bool = False,
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
    progress: show a bar of the steps on stderr (advanced once per epoch).

  Returns:
    ``(pruned_linears, info)`` with the last minibatch loss of each epoch.
  """
  linears, norms = split_block(block_params)
  n = inputs.shape[0]
  batch = min(cfg.batch_size, n)
  steps_per_epoch = n // batch
  scales = lr_scales(cfg, linears)
  opt_state = safe_transform(cfg, steps_per_epoch, input_norms, scales).init(linears)
  rng = np.random.default_rng(cfg.seed)
  params, losses = _run_steps(
      safe_step(config, cfg, steps_per_epoch),
      (linears, norms, input_norms, scales, opt_state),
      inputs, targets,
      lambda: rng.permutation(n)[:steps_per_epoch * batch].reshape(steps_per_epoch, batch),
      cfg, steps_per_epoch, mesh, progress)
  return _project(cfg, params, input_norms), {
      "epoch_last_loss": [float(loss) for loss in losses],
      "steps": cfg.epochs * steps_per_epoch}


def check_pack(cfgs: Sequence[PruneConfig]) -> None:
  """Configs that can share one packed program: SAFE or SAFE+, equal but for ``seed``.

  Raises:
    ValueError: naming the fields that differ, or the method.
  """
  if not cfgs:
    raise ValueError("a pack needs at least one PruneConfig, got none.")
  if cfgs[0].method not in ("safe", "safe-plus"):
    raise ValueError(f"only SAFE and SAFE+ steps are packed (method 'safe' or 'safe-plus'), "
                     f"got {cfgs[0].method!r}.")
  first = dataclasses.asdict(dataclasses.replace(cfgs[0], seed=0))
  for cfg in cfgs[1:]:
    other = dataclasses.asdict(dataclasses.replace(cfg, seed=0))
    differing = sorted(k for k in first if first[k] != other[k])
    if differing:
      raise ValueError(f"packed PruneConfigs may differ only in `seed`; these differ too: "
                       f"{', '.join(differing)}.")


def safe_blocks(
    config: model_lib.LlamaConfig,
    block_params: dict[str, Any],
    inputs: np.ndarray,
    targets: np.ndarray,
    cfgs: Sequence[PruneConfig],
    input_norms: Optional[dict[str, Any]] = None,
    *,
    progress: bool = False,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
  """:func:`safe_block` for several calibration sets of one block at once, on one device.

  Lane ``i`` runs SAFE / SAFE+ from the same dense block on its own windows
  ``inputs[i]`` and targets ``targets[i]``, with its own Wanda norms, optimizer
  state and minibatch order (``cfgs[i].seed``). All lanes step together in one
  vmapped program (:func:`safe_step` with ``pack=True``), meant for an
  accelerator that one lane's small matrices leave mostly idle (what it gains
  there: ``benchmarks/perf/llm_safe_step.py --packs``); on a CPU it costs what
  the lanes cost in turn (measured). Each lane gives what ``safe_block(config,
  block_params, inputs[i], targets[i], cfgs[i], input_norms[i])`` gives, up to
  the rounding of batched matrix products (tested). SAFE's first steps can
  scale that rounding up: at the dense start the reconstruction gradient is
  itself rounding noise for the kept weights, which Adam's first, sign-like
  steps (and SAM) scale up to full steps, so a lane and its lone run can
  part by more than rounding (measured on SmolLM2:
  ``benchmarks/perf/results/llm_pack_smoke_cpu.json``).

  Args:
    inputs, targets: ``(lanes, n, L, d)``.
    cfgs: one per lane, equal but for ``seed`` (:func:`check_pack`).
    input_norms: Wanda norms with a leading lane axis for SAFE+, ``None`` for SAFE.
    progress: show a bar of the steps on stderr (advanced once per epoch).

  Returns:
    ``[(pruned_linears, info)]``, one per lane.
  """
  cfgs = list(cfgs)
  check_pack(cfgs)
  lanes = len(cfgs)
  if inputs.shape[0] != lanes or targets.shape != inputs.shape:
    raise ValueError(f"`inputs` and `targets` need the same shape with a leading axis of one "
                     f"lane per config ({lanes}), got {inputs.shape} and {targets.shape}.")
  cfg = cfgs[0]  # all but the seeds, which only order each lane's minibatches
  linears, norms = split_block(block_params)
  n = inputs.shape[1]
  batch = min(cfg.batch_size, n)
  steps_per_epoch = n // batch
  scales = lr_scales(cfg, linears)
  lane_norms = [None if input_norms is None else jax.tree.map(lambda a, i=i: a[i], input_norms)
                for i in range(lanes)]
  stack = lambda trees: jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)
  opt_state = stack([safe_transform(cfg, steps_per_epoch, norms_i, scales).init(linears)
                     for norms_i in lane_norms])
  rngs = [np.random.default_rng(c.seed) for c in cfgs]

  def epoch_order():  # (steps, lanes, batch): each lane draws from its own generator
    return np.stack([rng.permutation(n)[:steps_per_epoch * batch].reshape(steps_per_epoch, batch)
                     for rng in rngs], axis=1)

  params, losses = _run_steps(
      safe_step(config, cfg, steps_per_epoch, pack=True),
      (stack([linears] * lanes), norms, input_norms, scales, opt_state),
      inputs, targets, epoch_order, cfg, steps_per_epoch, None, progress)
  results = []
  for i in range(lanes):
    lane_params = jax.tree.map(lambda a, i=i: a[i], params)
    results.append((_project(cfg, lane_params, lane_norms[i]), {
        "epoch_last_loss": [float(loss[i]) for loss in losses],
        "steps": cfg.epochs * steps_per_epoch, "pack": lanes}))
  return results
