"""``safe-optax-vision``: train one run, or sweep methods x sparsities x seeds.

Examples (shell)::

  safe-optax-vision train --preset resnet20x2-cifar10 --method safe --sparsity 0.95 \\
      --data-dir DIR --workdir OUT
  safe-optax-vision sweep --preset mlp-mnist --methods dense safe admm gmp magnitude \\
      --sparsities 0.9 0.95 0.98 --seeds 0 1 2 --data-dir ../shared/data/mnist \\
      --test-only-split 8000 2000 --epochs 20 --warmup-epochs 1 --workdir OUT

Several processes (one per host or per GPU) run the same command with the
same data and ``--workdir`` (a shared file system), each told its place::

  safe-optax-vision train ... --coordinator HOST0:PORT --num-processes 2 --process-id I

or through ``SAFE_OPTAX_COORDINATOR`` / ``SAFE_OPTAX_NUM_PROCESSES`` /
``SAFE_OPTAX_PROCESS_ID``, or nothing under SLURM (``srun``), Open MPI
(``mpirun``) and multi-host Cloud TPU, which JAX detects
(:func:`safe_optax.distributed.initialize`). Process 0 alone prints and writes
everything but the checkpoints.

A run's settings come from ``--preset NAME`` or from ``--config FILE`` (a
Python file whose ``get_config()`` returns an ``ml_collections.ConfigDict``, as
in :mod:`safe_optax.vision.config_files`, or the ``config.json`` a run wrote),
then, in this order, each overriding the one before:

1. ``--config.KEY=VALUE`` (or ``--config.KEY VALUE``) for any field of
   :class:`~safe_optax.vision.configs.Config`, read by the field's type
   (``ml_collections.config_flags``, as in the Flax examples);
2. the named flags (``--epochs``, ``--sparsity``, ``--method``, ...).

Every error is one line that names the flag or file and the way out, and the
arguments, the config and the workdir are checked before any data is loaded.

``--method dense`` (or a dense config) trains with sparsity 0. Example::

  safe-optax-vision train --config my_mlp.py --config.dual_every=16 --epochs 20 \\
      --data-dir DIR --workdir OUT

Each subcommand is one function (``train``, ``sweep``, ``evaluate``)
registered in :func:`build_parser`; a new one adds a subparser and a function.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

from absl import flags
from ml_collections import config_flags

from safe_optax import methods
from safe_optax.vision import config_files
from safe_optax.vision import configs
from safe_optax.vision import workdirs

_CONFIG_OVERRIDE = "--config."


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line, ``PROG: error: MESSAGE (see PROG --help)``."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
  """Options shared by ``train`` and ``sweep``: the preset or config file, data and overrides."""
  base = parser.add_mutually_exclusive_group(required=True)
  base.add_argument("--preset", choices=sorted(configs.PRESETS),
                    help="named paper configuration")
  base.add_argument("--config", metavar="FILE",
                    help="config file: a .py whose get_config() returns an ml_collections "
                         "ConfigDict (see safe_optax/vision/config_files/), or a run's "
                         "config.json; --config.KEY=VALUE overrides any field")
  # --config.KEY=VALUE tokens are left to ml_collections.config_flags (_dotted_overrides).
  parser.add_argument("--data-dir", required=True,
                      help="CIFAR pickles / image folder / .tar.gz, or MNIST idx files")
  parser.add_argument("--workdir", required=True, help="output folder (resumes if it has a "
                                                       "checkpoint)")
  over = parser.add_argument_group("overrides of the preset")
  over.add_argument("--epochs", type=int)
  over.add_argument("--dtype", choices=configs.DTYPES,
                    help="compute dtype (bfloat16: float32 weights, optimizer state, BN statistics)")
  over.add_argument("--matmul-precision", choices=configs.MATMUL_PRECISIONS,
                    help="precision of the convolutions and Dense layers")
  over.add_argument("--conv-impl", choices=configs.CONV_IMPLS,
                    help="convolutions as XLA's or as im2col matmuls (which a packed sweep "
                         "batches as matmuls, not grouped convolutions)")
  over.add_argument("--batch-size", type=int)
  over.add_argument("--lr", dest="learning_rate", type=float, help="peak learning rate")
  over.add_argument("--warmup-epochs", type=int)
  over.add_argument("--weight-decay", type=float)
  over.add_argument("--penalty", type=float, help="lambda (default: the preset's table)")
  over.add_argument("--admm-penalty", type=float, help="ADMM's lambda (default: --penalty)")
  over.add_argument("--rho", type=float, help="SAM radius")
  over.add_argument("--dual-every", type=int, help="K, steps between dual updates")
  over.add_argument("--rescale-dual", dest="rescale_dual", action="store_const", const=True,
                    help="keep the unscaled dual while the penalty ramps (Boyd et al. 2011; "
                         "off: the paper's update, see docs/dual_rescaling.md)")
  over.add_argument("--saliency", choices=configs.SALIENCIES, help="SAFE+ scores")
  over.add_argument("--structure", choices=configs.STRUCTURES,
                    help="sparsity set: " + "; ".join(
                        f"{k}: {v}" for k, v in methods.STRUCTURE_HELP.items()))
  over.add_argument("--train-subset", type=int, help="train on this many examples")
  over.add_argument("--test-subset", type=int, help="evaluate on this many test examples")
  over.add_argument("--test-only-split", type=int, nargs=2, metavar=("N_TRAIN", "N_TEST"),
                    help="MNIST with only the t10k files: split them (e.g. 8000 2000)")
  over.add_argument("--validation", type=int, metavar="N",
                    help="hold out N training examples and report accuracy on them instead "
                         "of the test set (for choosing hyperparameters)")
  over.add_argument("--gmp-update-every", type=int, help="GMP: steps between mask updates")
  over.add_argument("--label-noise", type=float, help="symmetric label-noise ratio")
  over.add_argument("--bnt-samples", type=int, help="training images for BN re-estimation")
  over.add_argument("--eval-every", type=int, help="test evaluation every N epochs")
  over.add_argument("--log-every", type=int, metavar="N",
                    help="per-step scalars every N steps of an epoch")
  over.add_argument("--no-augment", dest="augment", action="store_const", const=False,
                    help="no pad-crop-flip augmentation")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
  """Options of a multi-process launch (all three, or none for auto-detection)."""
  from safe_optax import distributed  # pylint: disable=import-outside-toplevel
  distributed.add_launch_arguments(parser)


def _join_runtime(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Joins JAX's distributed runtime before anything touches a device."""
  from safe_optax import distributed  # pylint: disable=import-outside-toplevel
  distributed.initialize_from_args(parser, args)


def _say(*args: Any, **kwargs: Any) -> None:
  """``print`` in process 0 only (every process computes the same)."""
  from safe_optax import distributed  # pylint: disable=import-outside-toplevel
  if distributed.is_primary():
    print(*args, **kwargs)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
  names = ("epochs", "batch_size", "learning_rate", "warmup_epochs", "weight_decay", "penalty",
           "admm_penalty",
           "rho", "dual_every", "saliency", "train_subset", "test_subset", "label_noise",
           "bnt_samples", "eval_every", "augment", "gmp_update_every", "validation", "log_every",
           "rescale_dual", "structure", "dtype", "matmul_precision", "conv_impl")
  values = {name: getattr(args, name) for name in names}
  if args.test_only_split is not None:
    values["test_only_split"] = tuple(args.test_only_split)
  return values


def build_parser() -> argparse.ArgumentParser:
  """The top-level parser: one subparser (and one function) per subcommand."""
  parser = _Parser(
      prog="safe-optax-vision",
      description="SAFE and baseline pruning of CIFAR / MNIST models (Flax, optax).")
  sub = parser.add_subparsers(dest="command", required=True)

  train_parser = sub.add_parser("train", help="train and evaluate one configuration")
  _add_run_options(train_parser)
  train_parser.add_argument("--method", choices=configs.METHODS,
                            help="training method (default: the preset's, safe)")
  train_parser.add_argument("--sparsity", type=float, default=None,
                            help="target sparsity of the prunable weights (default: preset)")
  train_parser.add_argument("--seed", type=int)
  train_parser.add_argument("--restart", action="store_true",
                            help="discard a run of other settings in --workdir and start over")
  train_parser.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                            default=None,
                            help="write TensorBoard event files in WORKDIR/tensorboard "
                                 "(default: when tensorboardX is installed)")
  _add_launch_options(train_parser)
  train_parser.set_defaults(func=train, parser=train_parser)

  sweep_parser = sub.add_parser(
      "sweep", help="methods x sparsities x seeds -> one table (mean +- standard error)")
  _add_run_options(sweep_parser)
  sweep_parser.add_argument("--methods", nargs="+", choices=configs.METHODS, required=True)
  sweep_parser.add_argument("--sparsities", nargs="+", type=float, required=True)
  sweep_parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  sweep_parser.add_argument("--pack", type=int, default=1, metavar="N",
                            help="train up to N runs that differ only in the seed as one "
                            "vmapped program (one process)")
  sweep_parser.add_argument("--checkpoint-seconds", type=float, default=None, metavar="S",
                            help="packs also checkpoint every S seconds (a lease cut short "
                            "loses at most about S)")
  _add_launch_options(sweep_parser)
  sweep_parser.set_defaults(func=sweep, parser=sweep_parser)

  eval_parser = sub.add_parser(
      "eval", help="clean / corruption / PGD / Hessian evaluation of a finished run")
  eval_parser.add_argument("--workdir", required=True, help="a finished `train` workdir")
  eval_parser.add_argument("--data-dir", required=True, help="the data it was trained on")
  eval_parser.add_argument("--suite", default="clean,corruptions,pgd-linf,pgd-l2,hessian",
                           help="comma-separated subset of clean,corruptions,pgd-linf,pgd-l2,"
                                "hessian")
  eval_parser.add_argument("--corruption-subset", type=int, default=1000,
                           help="corrupt a seeded sample of N of the evaluated test images "
                                "(CPU-generated, cached)")
  eval_parser.add_argument("--test-subset", type=int, default=None,
                           help="clean and PGD accuracy on a seeded sample of N test images "
                                "(default: all)")
  eval_parser.add_argument("--seed", type=int, default=0)
  eval_parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  _add_launch_options(eval_parser)
  eval_parser.set_defaults(func=evaluate, parser=eval_parser)
  return parser


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
  """One line on stderr, ``PROG: error: MESSAGE``, exit status 2 (no usage, no traceback)."""
  parser.exit(2, f"{parser.prog}: error: {message}\n")


def _dotted_overrides(parser: argparse.ArgumentParser, base: configs.Config,
                      tokens: Sequence[str]) -> dict[str, Any]:
  """The ``--config.KEY=VALUE`` tokens as typed field values, read by ``config_flags``.

  The tokens override a ConfigDict of ``base`` (``config_flags.DEFINE_config_dict``
  on a flag set of their own), so each value is read by its field's type.
  """
  if not tokens:
    return {}
  known = configs.field_types()
  for token in tokens:
    key = re.match(r"--config\.([^=]*)", token)
    if key is None:
      continue
    name = key.group(1)
    if name not in known:
      close = difflib.get_close_matches(name, known, n=3)
      hint = f"did you mean {' / '.join(close)}?" if close else f"known: {sorted(known)}."
      _fail(parser, f"argument {_CONFIG_OVERRIDE}{name}: unknown config field `{name}`; {hint}")
  argv = [parser.prog, *tokens]
  values = flags.FlagValues()
  try:
    config_flags.DEFINE_config_dict("config", config_files.to_config_dict(base),
                                    flag_values=values, sys_argv=argv)
    rest = values(argv)
  except (flags.Error, ValueError, TypeError, AttributeError, KeyError) as err:
    message = str(err).strip().splitlines()[0].removeprefix("flag ")
    missing = re.fullmatch(r"Missing value for flag (\S+)", message)
    if missing:
      message = f"{missing.group(1)}: expected a value ({missing.group(1)}=VALUE)"
    key = re.search(r"--config\.(\w+)", message)
    if key and key.group(1) in known:
      message += f" (config field `{key.group(1)}` is {configs.type_name(known[key.group(1)])})"
    _fail(parser, f"argument {message}")
  if len(rest) > 1:
    _fail(parser, f"unrecognized arguments: {' '.join(rest[1:])}")
  try:
    return {k: configs.coerce(k, v) for k, v in values["config"].override_values.items()}
  except ValueError as err:
    _fail(parser, f"argument {_CONFIG_OVERRIDE}: {err}")


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace,
            **fields: Any) -> configs.Config:
  """The run's config: the preset or ``--config`` file, then ``--config.KEY``, then the flags."""
  try:
    if args.config is not None:
      base, name = config_files.load(args.config), f"config file '{args.config}'"
    else:
      base, name = configs.PRESETS[args.preset], f"preset {args.preset!r}"
  except (ValueError, FileNotFoundError) as err:
    _fail(parser, f"argument --config: {err} Fix the file or pass another --config.")
  dotted = _dotted_overrides(parser, base, args.config_overrides)
  flags_given = {**_overrides(args), **fields}
  overrides = {**dotted, **{k: v for k, v in flags_given.items() if v is not None}}
  if overrides.get("method", base.method) == "dense":
    overrides["sparsity"] = 0.0  # dense training has no target sparsity
  try:
    return configs.override(base, overrides, name=name)
  except ValueError as err:
    _fail(parser, str(err))


def resolved_config(argv: Sequence[str]) -> configs.Config:
  """The :class:`~safe_optax.vision.configs.Config` that ``train`` would run with ``argv``.

  Args:
    argv: the arguments after ``safe-optax-vision`` (starting with ``train``).

  Returns:
    The validated config (nothing is loaded or trained).

  Raises:
    SystemExit: the arguments are invalid (the message is printed, as the
      command prints it).
  """
  parser, args = _parse(argv)
  if args.command != "train":
    parser.error("resolved_config takes the arguments of `train`")
  return _train_config(args.parser, args)


def _train_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> configs.Config:
  return _config(parser, args, method=args.method, seed=args.seed, sparsity=args.sparsity)


def _load(parser: argparse.ArgumentParser, config: configs.Config, data_dir: str):
  from safe_optax.vision import datasets  # pylint: disable=import-outside-toplevel
  try:
    return datasets.load_dataset(config, data_dir)
  except (FileNotFoundError, ValueError) as err:
    _fail(parser, f"cannot load {config.dataset} from --data-dir '{data_dir}': {err}")


def _interrupted(parser: argparse.ArgumentParser, err: KeyboardInterrupt) -> NoReturn:
  """Ctrl-C: one line instead of a traceback, exit status 130 (128 + SIGINT)."""
  from safe_optax.vision import checkpoint  # pylint: disable=import-outside-toplevel
  done = str(err) if isinstance(err, checkpoint.Interrupted) else "interrupted"
  parser.exit(130, f"{parser.prog}: {done}; rerun the same command to resume\n")


def train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """``train``: one run in ``--workdir``; prints the final accuracies and sparsity."""
  from safe_optax.vision import train as train_lib  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import metrics  # pylint: disable=import-outside-toplevel
  config = _train_config(parser, args)
  try:
    workdirs.check_workdir(args.workdir, config, restart=args.restart)
  except ValueError as err:
    _fail(parser, f"--workdir: {err}")
  if args.tensorboard and not metrics.tensorboard_available():
    _fail(parser, "--tensorboard needs tensorboardX: pip install tensorboardX, or leave out "
                  "--tensorboard.")
  data = _load(parser, config, args.data_dir)
  try:
    outcome = train_lib.train_and_evaluate(config, args.workdir, data_dir=args.data_dir,
                                           dataset=data, progress=not args.no_progress,
                                           restart=args.restart, tensorboard=args.tensorboard)
  except KeyboardInterrupt as err:
    _interrupted(parser, err)
  except ValueError as err:
    from safe_optax.vision import checkpoint  # pylint: disable=import-outside-toplevel
    if ("holds a run" not in str(err) and "holds checkpoints" not in str(err)
        and not isinstance(err, checkpoint.CorruptCheckpoint)):
      raise
    _fail(parser, str(err))
  final = outcome.results["final"]
  _say(json.dumps({"workdir": str(args.workdir), **final,
                    "images_per_second": outcome.results["images_per_second"],
                    "wall_seconds": outcome.results["wall_seconds"]}, indent=1))
  return 0


def sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """``sweep``: every (method, sparsity, seed) in its own sub-workdir, then one table
  (:func:`safe_optax.vision.sweeps.sweep`).

  Finished runs (with a ``results.json``) are read, not retrained, so an
  interrupted sweep continues where it stopped; a finished run of other
  settings in the same folder is refused with the differing settings named
  (:func:`safe_optax.vision.sweeps.run_or_load`). ``dense`` runs once per seed.
  """
  from safe_optax.vision import sweeps  # pylint: disable=import-outside-toplevel
  for s in args.sparsities:
    if not 0.0 < s < 1.0:
      parser.error(f"--sparsities must lie in (0, 1), got {s}")
  if args.pack < 1:
    parser.error(f"--pack must be a positive integer, got {args.pack}")
  if args.checkpoint_seconds is not None and args.checkpoint_seconds <= 0:
    parser.error(f"--checkpoint-seconds must be positive, got {args.checkpoint_seconds}")
  base = _config(parser, args)
  try:
    workdirs.check_creatable(args.workdir)
  except ValueError as err:
    _fail(parser, f"--workdir: {err}")
  data = _load(parser, base, args.data_dir)
  source = f"preset `{args.preset}`" if args.preset else f"config `{args.config}`"
  try:
    markdown = sweeps.sweep(base, args.methods, args.sparsities, args.seeds, args.workdir,
                            data=data, data_dir=args.data_dir, source=source,
                            progress=not args.no_progress, pack=args.pack,
                            checkpoint_seconds=args.checkpoint_seconds)
  except KeyboardInterrupt as err:
    _interrupted(parser, err)
  except ValueError as err:
    _fail(parser, str(err))
  _say(markdown)
  return 0


def evaluate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """``eval``: the suite on ``--workdir`` -> ``eval.json`` and ``eval.md`` there."""
  from safe_optax.vision import evaluation  # pylint: disable=import-outside-toplevel
  try:
    suite = evaluation.parse_suite(args.suite)
  except ValueError as err:
    parser.error(str(err))
  for flag, value in (("--test-subset", args.test_subset),
                      ("--corruption-subset", args.corruption_subset)):
    if value is not None and value < 1:
      parser.error(f"{flag} must be a positive number of test images, got {value}.")
  try:
    out = evaluation.evaluate_workdir(args.workdir, data_dir=args.data_dir, suite=suite,
                                      test_subset=args.test_subset,
                                      corruption_subset=args.corruption_subset, seed=args.seed,
                                      progress=not args.no_progress)
  except (FileNotFoundError, RuntimeError, ValueError) as err:
    _fail(parser, str(err))
  _say(evaluation.markdown_table([out]))
  return 0


def _parse(argv: Optional[Sequence[str]]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  """The parser and the parsed arguments; the ``--config.KEY`` tokens in ``config_overrides``.

  argparse declares no option per config field: what it does not know is left
  for ``config_flags`` (:func:`_dotted_overrides`), and must be ``--config.KEY``.
  """
  parser = build_parser()
  args, extras = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
  options = [t for t in extras if t.startswith("-") and not t.startswith(_CONFIG_OVERRIDE)]
  if options:
    args.parser.error(f"unrecognized arguments: {' '.join(options)}")
  if extras and not hasattr(args, "config"):
    args.parser.error(f"{_CONFIG_OVERRIDE}KEY overrides apply to train and sweep only")
  args.config_overrides = extras
  return parser, args


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of ``safe-optax-vision``."""
  _, args = _parse(argv)
  _join_runtime(args.parser, args)
  return args.func(args.parser, args)


if __name__ == "__main__":
  sys.exit(main())
