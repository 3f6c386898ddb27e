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
import json
import pathlib
import sys
from typing import Any, Optional, Sequence

import numpy as np

import safe_optax
from safe_optax import distributed
from safe_optax import experiment
from safe_optax.llm import checkpoints
from safe_optax.llm import data
from safe_optax.llm import export
from safe_optax.llm import model as model_lib
from safe_optax.llm import pipeline
from safe_optax.llm import prune_config

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


def prune_run(args: argparse.Namespace) -> pipeline.PruneRun:
  """The :class:`~safe_optax.llm.pipeline.PruneRun` that ``prune``'s arguments ask for."""
  cfg = prune_config.PruneConfig(
      method=args.method, sparsity=args.sparsity, nm=args.nm, grouping=args.grouping,
      epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr,
      warmup_epochs=args.warmup_epochs, rho=args.rho, penalty=args.penalty,
      dual_every=args.dual_every, lr_scale=args.lr_scale, seed=args.seed[0])
  evaluation = pipeline.Evaluation(tuple(args.eval or ()), args.eval_protocol, args.eval_seqlen,
                                   args.eval_tokens)
  return pipeline.PruneRun(
      model=args.model, calib=args.calib, out=args.out, prune=cfg, seeds=tuple(args.seed),
      nsamples=args.nsamples, seqlen=args.seqlen, dtype=args.dtype,
      export_dtype=args.export_dtype, evaluation=evaluation, fixed_order=args.fixed_order,
      restart=args.restart, progress=not args.no_progress, command=args.command_line)


def _prune(args: argparse.Namespace) -> dict[str, Any]:
  """One seed: its report; several: ``{"seeds": [...], "reports": [...]}``."""
  reports = pipeline.prune_and_export(prune_run(args))
  if len(reports) == 1:
    return reports[0]
  return {"seeds": list(args.seed), "reports": [_summary(r) for r in reports]}


def _summary(result: dict[str, Any]) -> dict[str, Any]:
  """What ``main`` prints of a result: all but the per-block entries, versions and arguments."""
  return {k: v for k, v in result.items() if k not in ("blocks", "versions", "args")}


def _ppl(args: argparse.Namespace) -> dict[str, Any]:
  data.read_text(args.text)
  if args.json:
    pipeline.make_folder(pathlib.Path(args.json).parent, "--json's folder")
  progress = not args.no_progress
  config, params = checkpoints.load_model(args.model, progress=progress)
  if args.dtype:
    config = dataclasses.replace(config, dtype=args.dtype)
  tokenizer = checkpoints.load_tokenizer(args.model)
  result = pipeline.evaluate(config, params, tokenizer, args.text, args.seqlen, args.max_tokens,
                             protocol=args.protocol, context=pipeline.model_context(args.model),
                             progress=progress)
  result.update(model=str(args.model), dtype=config.dtype, versions=pipeline.versions())
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
  p.add_argument("--export-dtype", choices=tuple(export.EXPORT_DTYPES), default=None,
                 help="precision of the written safetensors (default: the source's; a "
                      "quantised GGUF counts as float16)")
  p.add_argument("--eval", action="append", metavar="TEXT",
                 help="text to report perplexity on, repeatable (default: none)")
  _add_protocol_arguments(p, "--eval-protocol", "--eval-seqlen", "--eval-tokens")
  p.add_argument("--fixed-order", action="store_true",
                 help="sum over calibration windows in the fixed order a multi-process run uses, "
                      "so one process gives its bits (default: off; on with several processes)")
  p.add_argument("--restart", action="store_true",
                 help="discard the saved state of an interrupted run in "
                      f"OUT/{pipeline.STATE_DIR} and a finished export in OUT (default: off: "
                      "a rerun continues, and refuses other pruning arguments)")
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
    states = [] if args.command != "prune" else prune_run(args).state_dirs()
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
