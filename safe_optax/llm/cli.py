"""The ``safe-optax-llm`` command: prune a LLaMA-family checkpoint, or measure perplexity.

::

  safe-optax-llm prune --model PATH --method safe-plus --sparsity 0.5 [--nm 2:4] \\
      --calib FILE --nsamples 128 --seqlen 2048 --out DIR [--eval FILE ...] \\
      [--eval-protocol standard|short]
  safe-optax-llm ppl --model PATH --text FILE [--protocol short [--max-tokens N]] [--seqlen L]

``--model`` is a Hugging Face folder (``config.json``, ``*.safetensors``,
``tokenizer.json``) or a ``.gguf`` file. ``prune`` writes ``DIR`` as a
Hugging Face folder (:func:`safe_optax.llm.export.save_safetensors`:
``model.safetensors``, ``config.json``, the tokenizer and generation files,
``sparsity.json`` with the method, structure, N:M pattern and per-tensor
sparsity) plus ``report.json`` (arguments, per-block seconds and
reconstruction errors, sparsity report, perplexities, package versions).
The safetensors keep the source's precision (bf16 stays bf16, f16 stays
f16, f32 stays f32; a quantised GGUF is written as float16) unless
``--export-dtype`` says otherwise.

Perplexity follows the standard protocol by default (the whole text, rows
joined with blank lines, non-overlapping windows of ``min(context, 2048)``
tokens: :mod:`safe_optax.llm.data`); ``--protocol short`` (``prune``:
``--eval-protocol short``) scores only the first 2,048 tokens for a quick
check. Every result records its protocol, window and token counts.

``prune --seed 0 1 2 --out DIR_{seed}`` prunes one model per calibration
seed in one walk of the blocks, the SAFE / SAFE+ steps of every seed as one
program (:func:`safe_optax.llm.prune.prune_models`); each ``DIR_<seed>`` is
what the one-seed command writes (its ``report.json`` adds ``pack_seeds``).

``prune`` is resumable: each pruned block and the stream state go to
``DIR/prune_state`` as it works, so rerunning an interrupted command (Ctrl-C,
a lost machine) continues from the next block with the same final result. A
rerun whose pruning arguments differ is refused, naming them, unless
``--restart``. The state folder is removed once the export is written.

Every file is written under a temporary name and renamed
(:func:`safe_optax.experiment.atomic_write`), ``report.json`` last: a folder
with ``report.json`` holds a finished export, which a rerun with other
pruning arguments refuses to replace unless ``--restart`` (a rerun with the
same ones says so and prunes nothing). Arguments, the output folder, the
texts and the calibration length are checked before the model is loaded, and
``--export-dtype float16`` refuses a model whose weights float16 cannot
hold. Errors and Ctrl-C print one line (exit 2 and 130), not a traceback.

Progress bars (loading, each block's SAFE / SAFE+ steps, the perplexity
windows) go to stderr unless ``--no-progress``; messages go through
:mod:`logging` (the ``safe_optax`` loggers, ``--log-level``, default INFO, to
stderr); the result is JSON on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import pathlib
import shutil
import sys
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax.llm import checkpoints
from safe_optax.llm import data
from safe_optax.llm import export
from safe_optax.llm import model as model_lib
from safe_optax.llm import prune as prune_lib
from safe_optax.llm import prune_config

# Named, not __name__: under ``python -m safe_optax.llm.cli`` this module is ``__main__``.
_LOG = logging.getLogger("safe_optax.llm.cli")

DESCRIPTION = """\
Prune a LLaMA-family checkpoint block by block (SAFE, SAFE+, magnitude, Wanda,
SparseGPT) and export it as a Hugging Face folder, or measure its perplexity.
--model is a Hugging Face folder (config.json, *.safetensors, tokenizer.json)
or a .gguf file."""

EPILOG = """\
examples:
  safe-optax-llm ppl --model MODEL.gguf --text wiki.test.raw
  safe-optax-llm prune --model MODEL.gguf --method safe-plus --sparsity 0.5 \\
      --calib valid.txt --nsamples 16 --seqlen 128 --out pruned/ --eval wiki.test.raw

The JSON result goes to stdout; progress bars and log messages to stderr.
'safe-optax-llm prune --help' and 'safe-optax-llm ppl --help' list each
command's options. Guide: docs/llm.md."""

PRUNE_DESCRIPTION = """\
Prune every transformer block in order on the pruned stream, then write OUT as
a Hugging Face folder (model.safetensors, config.json, tokenizer files,
sparsity.json) and report.json (arguments, per-block seconds and errors,
sparsity, perplexities, versions). Resumable: each pruned block is saved in
OUT/prune_state, and rerunning the same command continues from the next
block; a rerun with other pruning arguments is refused unless --restart."""

PPL_DESCRIPTION = """\
Perplexity of a checkpoint on a text. The standard protocol (SparseGPT's and
Wanda's) scores the whole text in windows of min(context, 2048) tokens; the
short one the first --max-tokens tokens in 512-token windows, for quick
checks."""


def versions() -> dict[str, Any]:
  """Versions of the packages a result depends on, the device and the machine.

  :func:`safe_optax.experiment.versions` with the LLM readers' packages
  (``None`` for one that is not installed).
  """
  return experiment.versions("safetensors", "gguf", "tokenizers")


def parse_nm(text: Optional[str]) -> Optional[tuple[int, int]]:
  """``"2:4"`` -> ``(2, 4)``; raises ``argparse.ArgumentTypeError`` on bad input."""
  if text is None:
    return None
  try:
    n, m = (int(part) for part in text.split(":"))
  except ValueError as err:
    raise argparse.ArgumentTypeError(f"--nm must look like N:M (e.g. 2:4), got {text!r}") from err
  if not 1 <= n < m:
    raise argparse.ArgumentTypeError(f"--nm needs 1 <= N < M, got {text!r}")
  return n, m


def _count(minimum: int):
  """An argparse type: an integer of at least ``minimum`` (the message names the flag)."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError as err:
      raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from err
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value
  return parse


def _non_negative(text: str) -> float:
  """An argparse type: a finite float >= 0."""
  try:
    value = float(text)
  except ValueError as err:
    raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from err
  if not (np.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
  return value


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


# The arguments that decide the pruned weights: a resumed run must have the same.
PRUNING_ARGS = ("model", "method", "sparsity", "nm", "grouping", "calib", "nsamples", "seqlen",
                "epochs", "batch_size", "lr", "lr_scale", "warmup_epochs", "rho", "penalty",
                "dual_every", "seed", "dtype")
STATE_DIR = "prune_state"


def _add_protocol_arguments(parser: argparse.ArgumentParser, protocol: str, seqlen: str,
                            tokens: str) -> None:
  """The perplexity protocol's three flags (``prune --eval-*`` and ``ppl`` name them apart)."""
  parser.add_argument(protocol, choices=data.PROTOCOLS, default="standard",
                      help="'standard': the whole text in windows of min(context, 2048) tokens, "
                           f"as SparseGPT and Wanda; 'short': its first {tokens} tokens in "
                           "512-token windows, for quick checks (default: %(default)s)")
  parser.add_argument(seqlen, type=_count(2), default=None, metavar="L",
                      help="evaluation window in tokens (default: the protocol's, "
                           f"min(context, 2048) or {data.SHORT_WINDOW})")
  parser.add_argument(tokens, type=_count(2), default=None, metavar="N",
                      help="tokens scored by the short protocol (default: "
                           f"{data.SHORT_TOKENS} with {protocol} short; the standard protocol "
                           "scores the whole text)")


def _fixed_order(args: argparse.Namespace) -> bool:
  # Several processes always sum in the fixed order; it changes the pruned weights' rounding.
  return bool(args.fixed_order or (args.num_processes or 1) > 1)


def _identity(args: argparse.Namespace) -> dict[str, Any]:
  """The pruning arguments by flag, as JSON has them (a finished report stores its args)."""
  identity = {"--" + k.replace("_", "-"): getattr(args, k) for k in PRUNING_ARGS}
  identity["--fixed-order"] = _fixed_order(args)
  return json.loads(json.dumps(identity))


def _make_folder(path: pathlib.Path, flag: str) -> None:
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise ValueError(f"{flag} '{path}' cannot be created ({err.strerror or err}); "
                     "give a folder path whose parents are folders you can write.") from err


def _finished(args: argparse.Namespace, out: pathlib.Path) -> Optional[dict[str, Any]]:
  """The report of a finished export in ``out`` made with these pruning arguments, or None.

  Raises:
    ValueError: ``out`` holds a finished export with other pruning arguments
      (and no ``--restart``), or a ``report.json`` that does not parse.
  """
  report_file = out / "report.json"
  if not report_file.exists():
    return None
  try:
    saved = json.loads(report_file.read_text())
    old = {"--" + k.replace("_", "-"): saved["args"].get(k) for k in PRUNING_ARGS}
    old["--fixed-order"] = bool(saved.get("fixed_order", False))
  except (ValueError, KeyError, TypeError, AttributeError) as err:
    raise ValueError(f"--out '{out}' holds a report.json that does not parse ({err}); rerun "
                     "with --restart to replace that export, or give another --out.") from err
  new = _identity(args)
  differing = [k for k in new if old[k] != new[k]]
  if differing:
    details = "; ".join(f"{k}: saved {old[k]!r}, now {new[k]!r}" for k in differing)
    raise ValueError(f"--out '{out}' holds a finished export with other pruning arguments "
                     f"({details}); give another --out, or --restart to replace it.")
  return saved


def _lane_args(args: argparse.Namespace, seed: int) -> argparse.Namespace:
  """The arguments of one calibration seed's prune: ``--seed`` one value, ``--out`` filled in."""
  return argparse.Namespace(**{**vars(args), "seed": seed,
                               "out": str(args.out).replace("{seed}", str(seed))})


def _start_lane(args: argparse.Namespace) -> Optional[dict[str, Any]]:
  """``--restart`` and the finished check for one seed's ``--out``: its report, or None."""
  out = pathlib.Path(args.out)
  state_dir = out / STATE_DIR
  # Several processes share OUT: process 0 alone removes, the others wait for it.
  if args.restart and distributed.is_primary():
    # The report goes first: a folder without it no longer claims a finished export.
    if (out / "report.json").exists():
      (out / "report.json").unlink()
    if state_dir.exists():
      shutil.rmtree(state_dir)
  distributed.barrier("safe_optax_llm_restart")
  finished = _finished(args, out)
  if finished is not None:
    # A run killed between its report and this removal.
    if state_dir.exists() and distributed.is_primary():
      shutil.rmtree(state_dir)
    _LOG.info("'%s' already holds this export; nothing to prune (--restart prunes it again)",
              out)
    return finished
  _make_folder(out, "--out")
  return None


def _prune_config(args: argparse.Namespace) -> prune_config.PruneConfig:
  return prune_config.PruneConfig(
      method=args.method, sparsity=args.sparsity, nm=args.nm, grouping=args.grouping,
      epochs=args.epochs,
      batch_size=args.batch_size, learning_rate=args.lr, warmup_epochs=args.warmup_epochs,
      rho=args.rho, penalty=args.penalty, dual_every=args.dual_every, lr_scale=args.lr_scale,
      seed=args.seed)


def _prune(args: argparse.Namespace) -> dict[str, Any]:
  # Cheap checks first: a bad text path or output folder should not cost a model load.
  calib_text = data.read_text(args.calib)
  for text in args.eval or []:
    data.read_text(text)
  lanes = [_lane_args(args, seed) for seed in args.seed]
  for lane in lanes:
    _prune_config(lane)  # a bad value fails here, before the model loads
  finished = {lane.seed: _start_lane(lane) for lane in lanes}
  pending = [lane for lane in lanes if finished[lane.seed] is None]
  if not pending:
    return _result(args, [finished[lane.seed] for lane in lanes])
  export_dtype = args.export_dtype or checkpoints.source_dtype(args.model)
  tokenizer = checkpoints.load_tokenizer(args.model)
  calib_tokens = data.tokenize(tokenizer, calib_text)
  if len(calib_tokens) <= args.seqlen:
    raise ValueError(f"--calib '{args.calib}' has {len(calib_tokens)} tokens, too few for "
                     f"--seqlen {args.seqlen}; give a longer text or a smaller --seqlen.")
  calibrations = [data.calibration_windows(calib_tokens, args.nsamples, args.seqlen, lane.seed)
                  for lane in pending]
  _LOG.info("calibration: %d windows of %d tokens from %s (%d tokens) for seed %s",
            args.nsamples, args.seqlen, args.calib, len(calib_tokens),
            ", ".join(str(lane.seed) for lane in pending))
  progress = not args.no_progress
  config, params = checkpoints.load_model(args.model, progress=progress)
  if args.dtype:
    config = dataclasses.replace(config, dtype=args.dtype)
  # Pruning only zeroes or refits weights of the same scale: a dense weight out of the
  # export's range fails now rather than after hours of pruning (the export checks again).
  export.check_range(export.hf_tensors(config, params)[0], export_dtype, "--export-dtype")
  start = time.perf_counter()
  state_dirs = [pathlib.Path(lane.out) / STATE_DIR for lane in pending]
  if len(pending) == 1:
    pruned = [prune_lib.prune_model(
        config, params, calibrations[0], _prune_config(pending[0]), progress=progress,
        state_dir=state_dirs[0], identity=_identity(pending[0]),
        fixed_order=True if args.fixed_order else None)]
  else:
    pruned = prune_lib.prune_models(
        config, params, calibrations, [_prune_config(lane) for lane in pending],
        progress=progress, state_dirs=state_dirs,
        identities=[_identity(lane) for lane in pending])
  total = time.perf_counter() - start
  _LOG.info("pruning took %.1f s", total)
  # Every process holds the same pruned model; process 0 alone writes and evaluates.
  distributed.barrier("safe_optax_llm_pruned")
  if not distributed.is_primary():
    return {"process": jax.process_index(), "seconds_total": total}
  context = model_context(args.model)
  for lane, (lane_params, prune_report) in zip(pending, pruned):
    finished[lane.seed] = _write_lane(lane, config, lane_params, prune_report, tokenizer,
                                      export_dtype, context, total,
                                      [p.seed for p in pending] if len(pending) > 1 else None)
  return _result(args, [finished[lane.seed] for lane in lanes])


def _write_lane(args: argparse.Namespace, config: model_lib.LlamaConfig, pruned: Any,
                prune_report: dict[str, Any], tokenizer: Any, export_dtype: str,
                context: Optional[int], total: float,
                pack: Optional[list[int]]) -> dict[str, Any]:
  """One seed's export, perplexities and ``report.json`` (last), then its state is removed."""
  out = pathlib.Path(args.out)
  cfg = _prune_config(args)
  # Only the blocks' matrices are pruned; the embedding (and untied head) stay dense.
  sparsity = safe_optax.sparsity_report(
      pruned,
      prunable=lambda path, leaf: "layers_" in jax.tree_util.keystr(path) and leaf.ndim == 2)
  checkpoints.save_safetensors(
      out, config, pruned, tokenizer, dtype=export_dtype, prune_config=cfg,
      source_metadata=checkpoints.source_metadata(args.model))
  report = {
      "command": args.command_line,
      "args": {k: v for k, v in vars(args).items() if k not in ("func", "command_line")},
      "prune_config": dataclasses.asdict(cfg),
      "calibration": {"text": str(args.calib), "nsamples": args.nsamples,
                      "seqlen": args.seqlen, "seed": args.seed},
      "processes": jax.process_count(),
      "fixed_order": _fixed_order(args),
      # The seeds pruned in one walk with this one (None: alone); their SAFE steps
      # ran as one program on one device (safe_optax.llm.prune.prune_models).
      "pack_seeds": pack,
      # Wall time of this process (of the whole pack) only; a resumed run's earlier
      # blocks are in "blocks".
      "seconds_total": total, "export_dtype": export_dtype, **prune_report,
      "sparsity": {"prunable": sparsity.sparsity, "overall": sparsity.overall_sparsity},
      "eval": [evaluate(config, pruned, tokenizer, text, args.eval_seqlen, args.eval_tokens,
                        protocol=args.eval_protocol, context=context,
                        flags=("--eval-seqlen", "--eval-tokens"), progress=not args.no_progress)
               for text in args.eval or []],
      "versions": versions(),
  }
  with experiment.atomic_write(out / "report.json") as tmp:
    tmp.write_text(json.dumps(report, indent=2) + "\n")
  # The export and report now hold everything the state was kept for.
  shutil.rmtree(out / STATE_DIR)
  _LOG.info("wrote %s (model.safetensors, sparsity.json, report.json)", out)
  return report


def _result(args: argparse.Namespace, reports: list[dict[str, Any]]) -> dict[str, Any]:
  """One seed: its report; several: ``{"seeds": [...], "reports": [...]}``."""
  if len(args.seed) == 1:
    return reports[0]
  return {"seeds": list(args.seed), "reports": [_summary(r) for r in reports]}


def _summary(result: dict[str, Any]) -> dict[str, Any]:
  """What ``main`` prints of a result: all but the per-block entries, versions and arguments."""
  return {k: v for k, v in result.items() if k not in ("blocks", "versions", "args")}


def _ppl(args: argparse.Namespace) -> dict[str, Any]:
  data.read_text(args.text)
  if args.json:
    _make_folder(pathlib.Path(args.json).parent, "--json's folder")
  progress = not args.no_progress
  config, params = checkpoints.load_model(args.model, progress=progress)
  if args.dtype:
    config = dataclasses.replace(config, dtype=args.dtype)
  tokenizer = checkpoints.load_tokenizer(args.model)
  result = evaluate(config, params, tokenizer, args.text, args.seqlen, args.max_tokens,
                    protocol=args.protocol, context=model_context(args.model),
                    progress=progress)
  result.update(model=str(args.model), dtype=config.dtype, versions=versions())
  if args.json:
    with experiment.atomic_write(args.json) as tmp:
      tmp.write_text(json.dumps(result, indent=2) + "\n")
  return result


def _add_output_options(parser: argparse.ArgumentParser) -> None:
  """What every command prints besides its result: progress bars and log messages."""
  group = parser.add_argument_group("output")
  experiment.add_output_options(group)


def build_parser() -> argparse.ArgumentParser:
  """The ``safe-optax-llm`` parser: ``prune`` and ``ppl``, each with its own options."""
  # Line breaks kept in the top-level text (its examples); the commands' prose is rewrapped.
  parser = argparse.ArgumentParser(prog="safe-optax-llm", description=DESCRIPTION,
                                   epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--version", action="version",
                      version=f"safe-optax-llm {safe_optax.__version__}")
  sub = parser.add_subparsers(dest="command", required=True, title="commands",
                              metavar="{prune,ppl}", help="what to do (required)")
  p = sub.add_parser("prune", help="prune a checkpoint block by block and export it",
                     description=PRUNE_DESCRIPTION)
  p.add_argument("--model", required=True,
                 help="Hugging Face folder (config.json, *.safetensors, tokenizer.json) or "
                      ".gguf file (required)")
  p.add_argument("--method", required=True, choices=prune_config.METHODS,
                 help="magnitude, wanda and sparsegpt prune in one shot; safe and safe-plus "
                      "minimise each block's reconstruction error with SAFE / SAFE+ steps "
                      "(required)")
  p.add_argument("--sparsity", type=float, default=None,
                 help="fraction of each block matrix pruned (default: 0.5; with --nm N:M, "
                      "1 - N/M)")
  p.add_argument("--nm", type=parse_nm, default=None, metavar="N:M",
                 help="keep N of every M weights along each matrix's input dimension, e.g. 2:4 "
                      "(default: unstructured)")
  p.add_argument("--grouping", choices=prune_config.GROUPINGS, default=None,
                 help="unstructured scores compete per matrix or per output row (default: "
                      "per_row for wanda and safe-plus, per_matrix otherwise)")
  p.add_argument("--calib", required=True,
                 help="calibration text file, or a folder of *.txt files (required)")
  p.add_argument("--nsamples", type=_count(1), default=128, metavar="N",
                 help="calibration windows drawn from --calib (default: %(default)s)")
  p.add_argument("--seqlen", type=_count(2), default=2048, metavar="L",
                 help="tokens per calibration window (default: %(default)s)")
  p.add_argument("--out", required=True,
                 help="output folder (safetensors + report.json); '{seed}' is replaced by the "
                      "seed (required)")
  safe = p.add_argument_group("SAFE / SAFE+ steps (--method safe, safe-plus)")
  safe.add_argument("--epochs", type=_count(1), default=30,
                    help="passes over the calibration windows for each block "
                         "(default: %(default)s)")
  safe.add_argument("--batch-size", type=_count(1), default=8,
                    help="calibration windows per step (default: %(default)s)")
  safe.add_argument("--lr", type=_non_negative, default=2e-4,
                    help="Adam's peak learning rate (default: %(default)s)")
  safe.add_argument("--lr-scale", choices=prune_config.LR_SCALES, default="none",
                    help="'rms': each matrix's step is lr x the RMS of its dense weights "
                         "(default: %(default)s)")
  safe.add_argument("--warmup-epochs", type=_count(0), default=2,
                    help="epochs of linear learning-rate warm-up, then linear decay to 0 "
                         "(default: %(default)s)")
  safe.add_argument("--rho", type=_non_negative, default=2e-4,
                    help="SAM's perturbation radius (default: %(default)s)")
  safe.add_argument("--penalty", type=_non_negative, default=1e-3,
                    help="ADMM penalty (lambda) pulling the weights towards their sparse "
                         "projection (default: %(default)s)")
  safe.add_argument("--dual-every", type=_count(1), default=32, metavar="K",
                    help="steps between ADMM dual updates (default: %(default)s)")
  p.add_argument("--seed", type=int, nargs="+", default=[0],
                 help="calibration seed (windows and SAFE's minibatch order); several values "
                      "prune one model per seed in one walk, SAFE / SAFE+ steps of all seeds "
                      "as one program, and need '{seed}' in --out (default: 0)")
  p.add_argument("--dtype", choices=tuple(model_lib.DTYPES), default=None,
                 help="computation dtype while pruning and evaluating (default: float32)")
  p.add_argument("--export-dtype", choices=tuple(checkpoints.EXPORT_DTYPES), default=None,
                 help="precision of the written safetensors (default: the source's; a "
                      "quantised GGUF counts as float16)")
  p.add_argument("--eval", action="append", metavar="TEXT",
                 help="text to report perplexity on, repeatable (default: none)")
  _add_protocol_arguments(p, "--eval-protocol", "--eval-seqlen", "--eval-tokens")
  p.add_argument("--fixed-order", action="store_true",
                 help="sum over calibration windows in the fixed order a multi-process run uses, "
                      "so one process gives its bits (default: off; on with several processes)")
  p.add_argument("--restart", action="store_true",
                 help=f"discard the saved state of an interrupted run in OUT/{STATE_DIR} and "
                      "a finished export in OUT (default: off: a rerun continues, and refuses "
                      "other pruning arguments)")
  _add_output_options(p)
  distributed.add_launch_arguments(p)
  p.set_defaults(func=_prune)
  q = sub.add_parser("ppl", help="perplexity of a checkpoint on a text",
                     description=PPL_DESCRIPTION)
  q.add_argument("--model", required=True,
                 help="Hugging Face folder (config.json, *.safetensors, tokenizer.json) or "
                      ".gguf file (required)")
  q.add_argument("--text", required=True,
                 help="text file, or a folder of *.txt files, to score (required)")
  _add_protocol_arguments(q, "--protocol", "--seqlen", "--max-tokens")
  q.add_argument("--dtype", choices=tuple(model_lib.DTYPES), default=None,
                 help="computation dtype (default: float32)")
  q.add_argument("--json", default=None, metavar="PATH",
                 help="also write the result to this file (default: stdout only)")
  _add_output_options(q)
  q.set_defaults(func=_ppl)
  return parser


def _check_sparsity(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """``--nm N:M`` fixes the sparsity at ``1 - N/M``; an explicit other ``--sparsity`` is an error."""
  if args.nm is None:
    args.sparsity = 0.5 if args.sparsity is None else args.sparsity
    return
  implied = 1.0 - args.nm[0] / args.nm[1]
  if args.sparsity is not None and not np.isclose(args.sparsity, implied):
    parser.error(f"--nm {args.nm[0]}:{args.nm[1]} prunes exactly {implied:g} of each matrix; "
                 f"--sparsity {args.sparsity:g} contradicts it (leave --sparsity out, or give "
                 f"{implied:g}).")
  args.sparsity = implied


def _check_seeds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Several ``--seed`` values: distinct, each with its own ``--out``, in one process."""
  if len(set(args.seed)) != len(args.seed):
    parser.error(f"--seed values must be distinct, got {' '.join(map(str, args.seed))}.")
  if len(args.seed) == 1:
    return
  if "{seed}" not in args.out:
    parser.error(f"--seed with several values writes one export per seed: put '{{seed}}' in "
                 f"--out (e.g. {args.out}_seed{{seed}}), got --out {args.out}.")
  if args.fixed_order or (args.num_processes or 1) > 1:
    parser.error("--seed with several values packs the seeds in one process; --fixed-order "
                 "and --num-processes prune one seed at a time.")


def _check_protocol(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """A token limit belongs to the short protocol, and must hold one window; refused before
  any model is loaded."""
  if args.command == "ppl":
    protocol, tokens, window = args.protocol, args.max_tokens, args.seqlen
    names = ("--protocol", "--max-tokens", "--seqlen")
  else:
    protocol, tokens, window = args.eval_protocol, args.eval_tokens, args.eval_seqlen
    names = ("--eval-protocol", "--eval-tokens", "--eval-seqlen")
  if protocol == "standard" and tokens is not None:
    parser.error(f"{names[1]} applies only to {names[0]} short: the standard protocol scores "
                 "the whole text.")
  if protocol == "short":
    tokens = data.SHORT_TOKENS if tokens is None else tokens
    window = data.SHORT_WINDOW if window is None else window
    if tokens < window:
      parser.error(f"{names[1]} {tokens} is fewer than {names[2]} {window}: not one window "
                   f"to evaluate; raise {names[1]} or lower {names[2]}.")


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of ``safe-optax-llm``: runs one command and prints its JSON result.

  Args:
    argv: the arguments after the program name (default: ``sys.argv[1:]``).

  Returns:
    The exit status: 0, 2 for an error (one line on stderr) or 130 for Ctrl-C.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  args = parser.parse_args(argv)
  experiment.configure_logging(args.log_level)
  if args.command == "prune":
    _check_sparsity(parser, args)
    _check_seeds(parser, args)
  _check_protocol(parser, args)
  if args.command == "prune":
    # Before anything touches a device.
    distributed.initialize_from_args(parser, args)
    experiment.configure_logging(args.log_level, primary=distributed.is_primary())
  args.command_line = " ".join(["safe-optax-llm"] + argv)
  try:
    result = args.func(args)
  except (OSError, ValueError) as err:
    print(f"safe-optax-llm {args.command}: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    states = [] if args.command != "prune" else [
        pathlib.Path(_lane_args(args, seed).out) / STATE_DIR for seed in args.seed]
    states = [str(state) for state in states if (state / "state.json").exists()]
    saved = (f"the finished blocks are saved in {', '.join(states)}; rerun the same command to "
             "resume" if states else "nothing was saved")
    print(f"safe-optax-llm {args.command}: interrupted; {saved}", file=sys.stderr)
    return 130
  if distributed.is_primary():
    print(json.dumps(_summary(result), indent=2, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
