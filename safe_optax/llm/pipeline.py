"""Prune a checkpoint and export it, measure perplexity: what ``safe-optax-llm`` runs.

:func:`prune_and_export` takes one typed :class:`PruneRun` (the checkpoint,
the calibration text, the :class:`~safe_optax.llm.prune_config.PruneConfig`,
the calibration seeds, the output folder, the perplexity texts) and follows
a calibration window from the text to the export once:

1. the texts and output folders are checked (cheap, before the model loads);
   a folder whose ``report.json`` holds this export is left as it is, one
   with another export is refused unless ``restart``;
2. the tokenizer cuts ``nsamples`` windows of ``seqlen`` tokens per seed
   (:func:`safe_optax.llm.data.calibration_windows`);
3. the model is loaded and every block pruned in order on the pruned stream
   (:func:`safe_optax.llm.prune.prune_model`, or
   :func:`~safe_optax.llm.prune.prune_models` for several seeds in one walk),
   each block saved in ``OUT/prune_state`` as it finishes, so a rerun of an
   interrupted run continues from the next block;
4. process 0 writes each seed's Hugging Face folder
   (:func:`safe_optax.llm.export.save_safetensors`), scores the perplexity
   texts (:func:`evaluate`) and writes ``report.json`` last, then removes the
   state.

:func:`evaluate` is the perplexity protocol (``standard``: the whole text,
as SparseGPT and Wanda; ``short``: a prefix, for quick checks) that the
``ppl`` command, the notebooks and the benchmarks share.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import shutil
import time
from typing import Any, Optional

import jax

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax.llm import checkpoints
from safe_optax.llm import data
from safe_optax.llm import export
from safe_optax.llm import model as model_lib
from safe_optax.llm import prune as prune_lib
from safe_optax.llm.prune_config import PruneConfig

_LOG = logging.getLogger(__name__)

STATE_DIR = "prune_state"
"""The folder in ``out`` that holds an unfinished run's pruned blocks."""
REPORT = "report.json"


def versions() -> dict[str, Any]:
  """Versions of the packages a result depends on, the device and the machine.

  :func:`safe_optax.experiment.versions` with the LLM readers' packages
  (``None`` for one that is not installed).
  """
  return experiment.versions("safetensors", "gguf", "tokenizers")


@functools.lru_cache(maxsize=4)
def _apply_fn(config: model_lib.LlamaConfig):
  """One jitted forward per architecture, shared by every evaluation of a session."""
  return jax.jit(model_lib.Llama(config).apply)


def model_context(path: str) -> Optional[int]:
  """The checkpoint's context length (``max_position_embeddings``), ``None`` if it says none."""
  value = checkpoints.source_metadata(path).get("config.json", {}).get("max_position_embeddings")
  return None if value is None else int(value)


def evaluate(config: model_lib.LlamaConfig, params: Any, tokenizer: Any, text_path: str,
             seqlen: Optional[int] = None, max_tokens: Optional[int] = None, *,
             protocol: str = "standard", context: Optional[int] = None,
             flags: tuple[str, str] = ("--seqlen", "--max-tokens"),
             progress: bool = False) -> dict[str, Any]:
  """Perplexity of the model on a text under an evaluation protocol (:data:`data.PROTOCOLS`).

  ``"standard"``: the whole text, rows joined as SparseGPT and Wanda join
  them, windows of ``min(context, 2048)`` tokens (or ``seqlen``).
  ``"short"``: the first ``max_tokens`` (default 2,048) tokens of the text
  as it is, in windows of ``seqlen`` (default 512). ``flags`` names the
  options that set ``seqlen`` and ``max_tokens`` in error messages.
  ``progress`` shows a bar of the windows scored on stderr.

  Returns the protocol, the window length, the joined text's token count
  (standard), the tokens and windows scored, the perplexity and the seconds.
  """
  window = data.protocol_window(protocol, context, seqlen)
  text = data.read_text(text_path)
  if protocol == "standard":
    if max_tokens is not None:
      raise ValueError(f"{flags[1]} applies only to the short protocol: the standard protocol "
                       "scores the whole text.")
    tokens = data.tokenize(tokenizer, data.join_rows(text))
  else:
    max_tokens = data.SHORT_TOKENS if max_tokens is None else max_tokens
    # Tokenising only a prefix keeps a long text cheap; 8 characters per token is ample.
    tokens = data.tokenize(tokenizer, text, max_chars=8 * max_tokens + 1000)
  windows = data.eval_windows(tokens, window, max_tokens, flag=flags[0])
  apply = _apply_fn(config)
  logits_fn = lambda t: apply({"params": params}, t)
  start = time.perf_counter()
  ppl, nll = data.perplexity(logits_fn, windows, progress=progress)
  _LOG.info("perplexity %.4g on %s (%s protocol, %d windows of %d tokens)", ppl, text_path,
            protocol, windows.shape[0], window)
  return {"text": str(text_path), "protocol": protocol, "window": window, "seqlen": window,
          "context": context,
          "text_tokens": int(len(tokens)) if protocol == "standard" else None,
          "tokens": int(windows.size), "windows": int(windows.shape[0]), "perplexity": ppl,
          "mean_nll": nll, "seconds": time.perf_counter() - start}


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The texts a pruned model's perplexity is reported on, and the protocol (:func:`evaluate`).

  Attributes:
    texts: text files (or folders of ``*.txt``); none: no perplexity.
    protocol: ``"standard"`` or ``"short"`` (:data:`safe_optax.llm.data.PROTOCOLS`).
    seqlen: the window in tokens (``None``: the protocol's).
    max_tokens: tokens the short protocol scores (``None``: 2,048); the
      standard protocol scores the whole text and refuses it.
  """

  texts: tuple[str, ...] = ()
  protocol: str = "standard"
  seqlen: Optional[int] = None
  max_tokens: Optional[int] = None

  def __post_init__(self):
    object.__setattr__(self, "texts", tuple(str(t) for t in self.texts))
    if self.protocol not in data.PROTOCOLS:
      raise ValueError(f"`protocol` must be one of {data.PROTOCOLS}, got {self.protocol!r}.")
    if self.protocol == "standard" and self.max_tokens is not None:
      raise ValueError("`max_tokens` applies only to the short protocol: the standard protocol "
                       "scores the whole text.")
    for name in ("seqlen", "max_tokens"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or value < 2):
        raise ValueError(f"`{name}` must be an int >= 2 or None, got {value!r}.")
    if self.protocol == "short":
      tokens = data.SHORT_TOKENS if self.max_tokens is None else self.max_tokens
      window = data.SHORT_WINDOW if self.seqlen is None else self.seqlen
      if tokens < window:
        raise ValueError(f"`max_tokens` {tokens} is fewer than `seqlen` {window}: not one "
                         "window to evaluate.")


@dataclasses.dataclass(frozen=True)
class PruneRun:
  """One ``safe-optax-llm prune``: what to prune, on what, and where the export goes.

  Attributes:
    model: a Hugging Face folder or a ``.gguf`` file.
    calib: the calibration text (a file, or a folder of ``*.txt``).
    out: the output folder; with several ``seeds`` it must hold ``{seed}``.
    prune: the method and its hyperparameters. Each seed's run uses it with
      that ``seed`` (``dataclasses.replace(prune, seed=s)``).
    seeds: the calibration seeds (windows drawn and SAFE's minibatch order);
      ``None``: ``(prune.seed,)``. Several seeds are pruned in one walk of
      the blocks (:func:`safe_optax.llm.prune.prune_models`), one export each.
    nsamples, seqlen: calibration windows per seed, and their tokens.
    dtype: the computation dtype (``None``: float32).
    export_dtype: the written safetensors' precision (``None``: the source's).
    evaluation: the perplexity texts and protocol.
    fixed_order: sum over windows in the fixed order several processes use
      (always so under several processes).
    restart: discard the saved state and any finished export in ``out``.
    progress: tqdm bars on stderr.
    command: the command line, recorded in the report.
  """

  model: str
  calib: str
  out: str
  prune: PruneConfig
  seeds: Optional[tuple[int, ...]] = None
  nsamples: int = 128
  seqlen: int = 2048
  dtype: Optional[str] = None
  export_dtype: Optional[str] = None
  evaluation: Evaluation = Evaluation()
  fixed_order: bool = False
  restart: bool = False
  progress: bool = True
  command: Optional[str] = None

  def __post_init__(self):
    for name in ("model", "calib", "out"):
      object.__setattr__(self, name, str(getattr(self, name)))
    seeds = (self.prune.seed,) if self.seeds is None else tuple(self.seeds)
    object.__setattr__(self, "seeds", seeds)
    if not seeds or len(set(seeds)) != len(seeds):
      raise ValueError(f"`seeds` must be distinct and at least one, got {list(seeds)}.")
    if len(seeds) > 1:
      if "{seed}" not in self.out:
        raise ValueError(f"several `seeds` write one export each: put '{{seed}}' in `out` "
                         f"(e.g. {self.out}_seed{{seed}}), got {self.out!r}.")
      if self.fixed_order:
        raise ValueError("several `seeds` are pruned as one pack in one process; "
                         "`fixed_order` prunes one seed at a time.")
    if not isinstance(self.nsamples, int) or self.nsamples < 1:
      raise ValueError(f"`nsamples` must be an int >= 1, got {self.nsamples!r}.")
    if not isinstance(self.seqlen, int) or self.seqlen < 2:
      raise ValueError(f"`seqlen` must be an int >= 2, got {self.seqlen!r}.")
    if self.dtype is not None and self.dtype not in model_lib.DTYPES:
      raise ValueError(f"`dtype` must be one of {tuple(model_lib.DTYPES)} or None, "
                       f"got {self.dtype!r}.")
    if self.export_dtype is not None and self.export_dtype not in export.EXPORT_DTYPES:
      raise ValueError(f"`export_dtype` must be one of {tuple(export.EXPORT_DTYPES)} or None, "
                       f"got {self.export_dtype!r}.")

  def lane(self, seed: int) -> "PruneRun":
    """The run of one of ``seeds``: that seed alone, its ``out`` filled in."""
    return dataclasses.replace(self, seeds=(seed,), out=self.out.replace("{seed}", str(seed)),
                               prune=dataclasses.replace(self.prune, seed=seed))

  def lanes(self) -> list["PruneRun"]:
    """One run per seed, in order."""
    return [self.lane(seed) for seed in self.seeds]

  def fixed(self) -> bool:
    """Whether the sums over windows run in the fixed order (several processes: always)."""
    return self.fixed_order or jax.process_count() > 1

  def settings(self) -> dict[str, Any]:
    """What decides the pruned weights, by the ``prune`` command's names (one seed's run):
    the identity a resumed or finished run must share, and the report's ``args``."""
    p = self.prune
    return {"model": self.model, "method": p.method, "sparsity": p.sparsity,
            "nm": None if p.nm is None else list(p.nm), "grouping": p.grouping,
            "calib": self.calib, "nsamples": self.nsamples, "seqlen": self.seqlen,
            "epochs": p.epochs, "batch_size": p.batch_size, "lr": p.learning_rate,
            "lr_scale": p.lr_scale, "warmup_epochs": p.warmup_epochs, "rho": p.rho,
            "penalty": p.penalty, "dual_every": p.dual_every, "seed": p.seed,
            "dtype": self.dtype}

  def identity(self) -> dict[str, Any]:
    """:meth:`settings` by flag, with ``--fixed-order``: what the saved state must match."""
    identity = {"--" + k.replace("_", "-"): v for k, v in self.settings().items()}
    identity["--fixed-order"] = self.fixed()
    return json.loads(json.dumps(identity))  # as a saved state or report reads back

  def state_dirs(self) -> list[pathlib.Path]:
    """Each seed's folder of saved blocks."""
    return [pathlib.Path(lane.out) / STATE_DIR for lane in self.lanes()]


def make_folder(path: pathlib.Path, name: str) -> None:
  """Creates ``path`` (and its parents); ``ValueError`` naming ``name`` when it cannot."""
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise ValueError(f"{name} '{path}' cannot be created ({err.strerror or err}); "
                     "give a folder path whose parents are folders you can write.") from err


def finished_report(run: PruneRun) -> Optional[dict[str, Any]]:
  """The report of a finished export in ``run.out`` (one seed's) made by these settings, or None.

  Raises:
    ValueError: ``out`` holds a finished export of other settings, or a
      ``report.json`` that does not parse.
  """
  report_file = pathlib.Path(run.out) / REPORT
  if not report_file.exists():
    return None
  try:
    saved = json.loads(report_file.read_text())
    old = {"--" + k.replace("_", "-"): saved["args"].get(k) for k in run.settings()}
    old["--fixed-order"] = bool(saved.get("fixed_order", False))
  except (ValueError, KeyError, TypeError, AttributeError) as err:
    raise ValueError(f"--out '{run.out}' holds a report.json that does not parse ({err}); "
                     "rerun with --restart to replace that export, or give another --out.") from err
  new = run.identity()
  differing = [k for k in new if old[k] != new[k]]
  if differing:
    details = "; ".join(f"{k}: saved {old[k]!r}, now {new[k]!r}" for k in differing)
    raise ValueError(f"--out '{run.out}' holds a finished export with other pruning arguments "
                     f"({details}); give another --out, or --restart to replace it.")
  return saved


def _start_lane(run: PruneRun) -> Optional[dict[str, Any]]:
  """``restart`` and the finished check for one seed's ``out``: its report, or None."""
  out = pathlib.Path(run.out)
  state_dir = out / STATE_DIR
  # Several processes share OUT: process 0 alone removes, the others wait for it.
  if run.restart and distributed.is_primary():
    # The report goes first: a folder without it no longer claims a finished export.
    if (out / REPORT).exists():
      (out / REPORT).unlink()
    if state_dir.exists():
      shutil.rmtree(state_dir)
  distributed.barrier("safe_optax_llm_restart")
  finished = finished_report(run)
  if finished is not None:
    # A run killed between its report and this removal.
    if state_dir.exists() and distributed.is_primary():
      shutil.rmtree(state_dir)
    _LOG.info("'%s' already holds this export; nothing to prune (--restart prunes it again)",
              out)
    return finished
  make_folder(out, "--out")
  return None


def prune_and_export(run: PruneRun) -> list[dict[str, Any]]:
  """Prunes ``run.model`` for each of ``run.seeds`` and exports each (module docstring).

  Returns:
    Each seed's report (``report.json``), in the order of ``run.seeds``; a
    process other than 0 of a multi-process run gets
    ``[{"process": i, "seconds_total": s}]``.

  Raises:
    ValueError: a text, folder or setting that cannot work (before the model
      loads where it can be known then), or an ``out`` holding another export.
  """
  if len(run.seeds) > 1 and jax.process_count() > 1:
    raise ValueError("several `seeds` are pruned as one pack in one process; "
                     "several processes prune one seed at a time.")
  # Cheap checks first: a bad text path or output folder should not cost a model load.
  calib_text = data.read_text(run.calib)
  for text in run.evaluation.texts:
    data.read_text(text)
  lanes = run.lanes()
  finished = {lane.prune.seed: _start_lane(lane) for lane in lanes}
  pending = [lane for lane in lanes if finished[lane.prune.seed] is None]
  if not pending:
    return [finished[lane.prune.seed] for lane in lanes]
  export_dtype = run.export_dtype or checkpoints.source_dtype(run.model)
  tokenizer = checkpoints.load_tokenizer(run.model)
  calib_tokens = data.tokenize(tokenizer, calib_text)
  if len(calib_tokens) <= run.seqlen:
    raise ValueError(f"--calib '{run.calib}' has {len(calib_tokens)} tokens, too few for "
                     f"--seqlen {run.seqlen}; give a longer text or a smaller --seqlen.")
  calibrations = [data.calibration_windows(calib_tokens, run.nsamples, run.seqlen,
                                           lane.prune.seed) for lane in pending]
  _LOG.info("calibration: %d windows of %d tokens from %s (%d tokens) for seed %s",
            run.nsamples, run.seqlen, run.calib, len(calib_tokens),
            ", ".join(str(lane.prune.seed) for lane in pending))
  config, params = checkpoints.load_model(run.model, progress=run.progress)
  if run.dtype:
    config = dataclasses.replace(config, dtype=run.dtype)
  # Pruning only zeroes or refits weights of the same scale: a dense weight out of the
  # export's range fails now rather than after hours of pruning (the export checks again).
  export.check_range(export.hf_tensors(config, params)[0], export_dtype, "--export-dtype")
  start = time.perf_counter()
  state_dirs = [pathlib.Path(lane.out) / STATE_DIR for lane in pending]
  if len(pending) == 1:
    pruned = [prune_lib.prune_model(
        config, params, calibrations[0], pending[0].prune, progress=run.progress,
        state_dir=state_dirs[0], identity=pending[0].identity(),
        fixed_order=True if run.fixed_order else None)]
  else:
    pruned = prune_lib.prune_models(
        config, params, calibrations, [lane.prune for lane in pending],
        progress=run.progress, state_dirs=state_dirs,
        identities=[lane.identity() for lane in pending])
  total = time.perf_counter() - start
  _LOG.info("pruning took %.1f s", total)
  # Every process holds the same pruned model; process 0 alone writes and evaluates.
  distributed.barrier("safe_optax_llm_pruned")
  if not distributed.is_primary():
    return [{"process": jax.process_index(), "seconds_total": total}]
  context = model_context(run.model)
  pack = [lane.prune.seed for lane in pending] if len(pending) > 1 else None
  for lane, (lane_params, prune_report) in zip(pending, pruned):
    finished[lane.prune.seed] = _write_lane(lane, config, lane_params, prune_report, tokenizer,
                                            export_dtype, context, total, pack)
  return [finished[lane.prune.seed] for lane in lanes]


def block_matrices(path: Any, leaf: Any) -> bool:
  """The pruned leaves of a model: the blocks' linear maps (embeddings and norms stay dense).

  A ``prunable`` predicate for :func:`safe_optax.sparsity_report`.
  """
  return "layers_" in jax.tree_util.keystr(path) and leaf.ndim == 2


def _write_lane(run: PruneRun, config: model_lib.LlamaConfig, pruned: Any,
                prune_report: dict[str, Any], tokenizer: Any, export_dtype: str,
                context: Optional[int], total: float,
                pack: Optional[list[int]]) -> dict[str, Any]:
  """One seed's export, perplexities and ``report.json`` (last), then its state is removed."""
  out = pathlib.Path(run.out)
  sparsity = safe_optax.sparsity_report(pruned, prunable=block_matrices)
  export.save_safetensors(out, config, pruned, tokenizer, dtype=export_dtype,
                          prune_config=run.prune,
                          source_metadata=checkpoints.source_metadata(run.model))
  evaluation = run.evaluation
  report = {
      "command": run.command,
      "args": {**run.settings(), "out": run.out, "export_dtype": run.export_dtype,
               "eval": list(evaluation.texts) or None, "eval_protocol": evaluation.protocol,
               "eval_seqlen": evaluation.seqlen, "eval_tokens": evaluation.max_tokens,
               "fixed_order": run.fixed_order, "restart": run.restart},
      "prune_config": dataclasses.asdict(run.prune),
      "calibration": {"text": run.calib, "nsamples": run.nsamples, "seqlen": run.seqlen,
                      "seed": run.prune.seed},
      "processes": jax.process_count(),
      "fixed_order": run.fixed(),
      # The seeds pruned in one walk with this one (None: alone); their SAFE steps
      # ran as one program on one device (safe_optax.llm.prune.prune_models).
      "pack_seeds": pack,
      # Wall time of this process (of the whole pack) only; a resumed run's earlier
      # blocks are in "blocks".
      "seconds_total": total, "export_dtype": export_dtype, **prune_report,
      "sparsity": {"prunable": sparsity.sparsity, "overall": sparsity.overall_sparsity},
      "eval": [evaluate(config, pruned, tokenizer, text, evaluation.seqlen,
                        evaluation.max_tokens, protocol=evaluation.protocol, context=context,
                        flags=("--eval-seqlen", "--eval-tokens"), progress=run.progress)
               for text in evaluation.texts],
      "versions": versions(),
  }
  with experiment.atomic_write(out / REPORT) as tmp:
    tmp.write_text(json.dumps(report, indent=2) + "\n")
  # The export and report now hold everything the state was kept for.
  shutil.rmtree(out / STATE_DIR)
  _LOG.info("wrote %s (model.safetensors, sparsity.json, report.json)", out)
  return report
