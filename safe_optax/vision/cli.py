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
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

from absl import flags
from ml_collections import config_flags

import safe_optax
from safe_optax import experiment
from safe_optax import methods
from safe_optax.vision import config_files
from safe_optax.vision import configs
from safe_optax.vision import workdirs

_CONFIG_OVERRIDE = "--config."
_FROM_BASE = "(default: from --preset or --config)"
# By name, not __name__: `python -m safe_optax.vision.cli` runs this module as __main__.
_LOG = logging.getLogger("safe_optax.vision.cli")


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line, ``PROG: error: MESSAGE (see PROG --help)``."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
  """Options shared by ``train`` and ``sweep``: the preset or config file, data and overrides."""
  base = parser.add_mutually_exclusive_group(required=True)
  base.add_argument("--preset", choices=sorted(configs.PRESETS),
                    help="named paper configuration (required: this or --config)")
  base.add_argument("--config", metavar="FILE",
                    help="config file: a .py whose get_config() returns an ml_collections "
                         "ConfigDict (see safe_optax/vision/config_files/), or a run's "
                         "config.json; --config.KEY=VALUE overrides any field (required: "
                         "this or --preset)")
  # --config.KEY=VALUE tokens are left to ml_collections.config_flags (_dotted_overrides).
  parser.add_argument("--data-dir", required=True,
                      help="CIFAR pickles / image folder / .tar.gz, or MNIST idx files "
                           "(required)")
  parser.add_argument("--workdir", required=True, help="output folder (resumes if it has a "
                                                       "checkpoint) (required)")
  over = parser.add_argument_group(
      "overrides of the preset", "each one's default is the value of --preset or --config "
      "(the config field of the same name, e.g. --lr is learning_rate)")
  over.add_argument("--epochs", type=int, help=f"training epochs {_FROM_BASE}")
  over.add_argument("--dtype", choices=configs.DTYPES,
                    help="compute dtype (bfloat16: float32 weights, optimizer state, BN "
                         f"statistics) {_FROM_BASE}")
  over.add_argument("--matmul-precision", choices=configs.MATMUL_PRECISIONS,
                    help=f"precision of the convolutions and Dense layers {_FROM_BASE}")
  over.add_argument("--conv-impl", choices=configs.CONV_IMPLS,
                    help="convolutions as XLA's or as im2col matmuls (which a packed sweep "
                         f"batches as matmuls, not grouped convolutions) {_FROM_BASE}")
  over.add_argument("--batch-size", type=int, help=f"training batch size {_FROM_BASE}")
  over.add_argument("--lr", dest="learning_rate", type=float,
                    help=f"peak learning rate {_FROM_BASE}")
  over.add_argument("--warmup-epochs", type=int,
                    help="epochs of linear learning-rate warm-up (default: from --preset or "
                         "--config; a tenth of --epochs when that is shorter)")
  over.add_argument("--weight-decay", type=float, help=f"weight decay {_FROM_BASE}")
  over.add_argument("--penalty", type=float,
                    help="lambda (default: the penalty table of --preset or --config at the "
                         "run's sparsity)")
  over.add_argument("--admm-penalty", type=float,
                    help="ADMM's lambda (default: from --preset or --config, else --penalty)")
  over.add_argument("--rho", type=float, help=f"SAM radius {_FROM_BASE}")
  over.add_argument("--dual-every", type=int, help=f"K, steps between dual updates {_FROM_BASE}")
  over.add_argument("--rescale-dual", dest="rescale_dual", action="store_const", const=True,
                    help="keep the unscaled dual while the penalty ramps (Boyd et al. 2011; "
                         "off: the paper's update, see docs/dual_rescaling.md) (default: from "
                         "--preset or --config, off in every preset)")
  over.add_argument("--saliency", choices=configs.SALIENCIES, help=f"SAFE+ scores {_FROM_BASE}")
  over.add_argument("--structure", type=_structure, metavar="{%s,N:M}" % ",".join(
                        configs.STRUCTURES),
                    help="sparsity set: " + "; ".join(
                        f"{k}: {v}" for k, v in methods.STRUCTURE_HELP.items())
                    + "; N:M (e.g. 2:4, integers 0 < N < M): N kept in every M consecutive "
                      "weights along each kernel's input axis, sparsity 1 - N/M (then "
                      "--sparsity may be left out; methods with a sparsity schedule refuse it) "
                      f"{_FROM_BASE}")
  over.add_argument("--train-subset", type=int,
                    help="train on a seeded sample of this many examples (default: from "
                         "--preset or --config, all in every preset)")
  over.add_argument("--test-subset", type=int,
                    help="evaluate on a seeded sample of this many test examples (default: "
                         "from --preset or --config, all in every preset)")
  over.add_argument("--test-only-split", type=int, nargs=2, metavar=("N_TRAIN", "N_TEST"),
                    help="MNIST with only the t10k files: split them (e.g. 8000 2000) "
                         "(default: from --preset or --config, no split in every preset)")
  over.add_argument("--validation", type=int, metavar="N",
                    help="hold out N training examples and report accuracy on them instead "
                         "of the test set (for choosing hyperparameters) (default: from "
                         "--preset or --config, none in every preset)")
  over.add_argument("--gmp-update-every", type=int,
                    help=f"GMP: steps between mask updates {_FROM_BASE}")
  over.add_argument("--label-noise", type=float,
                    help=f"symmetric label-noise ratio {_FROM_BASE}")
  over.add_argument("--bnt-samples", type=int,
                    help=f"training images for BN re-estimation {_FROM_BASE}")
  over.add_argument("--eval-every", type=int, help=f"test evaluation every N epochs {_FROM_BASE}")
  over.add_argument("--log-every", type=int, metavar="N",
                    help=f"per-step scalars every N steps of an epoch {_FROM_BASE}")
  over.add_argument("--no-augment", dest="augment", action="store_const", const=False,
                    help="no pad-crop-flip augmentation (default: from --preset or --config: "
                         "on for CIFAR, off for MNIST)")
  _add_output_options(parser)


def _add_output_options(parser: argparse.ArgumentParser) -> None:
  """What every subcommand prints besides its result: progress bars and log messages."""
  experiment.add_output_options(parser)


def _structure(value: str) -> str:
  """``--structure``'s type: a named structure or N:M (:func:`safe_optax.methods.parse_structure`)."""
  try:
    methods.parse_structure(value)
  except ValueError:
    # Worded as argparse words a bad choice of the other flags.
    named = ", ".join(repr(name) for name in configs.STRUCTURES)
    raise argparse.ArgumentTypeError(
        f"invalid choice: {value!r} (choose from {named}, or N:M with integers 0 < N < M, "
        "e.g. 2:4)") from None
  return value


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
  parser.add_argument("--version", action="version",
                      version=f"safe-optax-vision {safe_optax.__version__}")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                              help="train, sweep or eval (COMMAND --help for its flags)")

  train_parser = sub.add_parser("train", help="train and evaluate one configuration")
  _add_run_options(train_parser)
  train_parser.add_argument("--method", choices=configs.METHODS,
                            help="training method (default: from --preset or --config, safe in "
                                 "every preset)")
  train_parser.add_argument("--sparsity", type=float, default=None,
                            help="target sparsity of the prunable weights, in (0, 1) (default: "
                                 "from --preset or --config; 1 - N/M with --structure N:M)")
  train_parser.add_argument("--seed", type=int,
                            help="seed of the initialisation, data order and augmentation "
                                 "(default: from --preset or --config, 0 in every preset)")
  train_parser.add_argument("--restart", action="store_true",
                            help="discard a run of other settings in --workdir and start over "
                                 "(default: resume a run of the same settings, refuse others)")
  train_parser.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                            default=None,
                            help="write TensorBoard event files in WORKDIR/tensorboard "
                                 "(default: when tensorboardX is installed)")
  _add_launch_options(train_parser)
  train_parser.set_defaults(func=train, parser=train_parser)

  sweep_parser = sub.add_parser(
      "sweep", help="methods x sparsities x seeds -> one table (mean +- standard error)")
  _add_run_options(sweep_parser)
  sweep_parser.add_argument("--methods", nargs="+", choices=configs.METHODS, required=True,
                            help="training methods (required; dense runs once per seed)")
  sweep_parser.add_argument("--sparsities", nargs="+", type=float, required=True,
                            help="target sparsities, each in (0, 1) (required)")
  sweep_parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                            help="training seeds; the table is mean +- standard error over "
                                 "them (default: 0 1 2)")
  sweep_parser.add_argument("--pack", type=int, default=1, metavar="N",
                            help="train up to N runs that differ only in the seed as one "
                            "vmapped program (one process) (default: %(default)s, no packing)")
  sweep_parser.add_argument("--checkpoint-seconds", type=float, default=None, metavar="S",
                            help="packs also checkpoint every S seconds (a lease cut short "
                            "loses at most about S) (default: at the end of each epoch only)")
  _add_launch_options(sweep_parser)
  sweep_parser.set_defaults(func=sweep, parser=sweep_parser)

  eval_parser = sub.add_parser(
      "eval", help="clean / corruption / PGD / Hessian evaluation of a finished run")
  eval_parser.add_argument("--workdir", required=True,
                           help="a finished `train` workdir (required)")
  eval_parser.add_argument("--data-dir", required=True,
                           help="the data it was trained on (required)")
  eval_parser.add_argument("--suite", default="clean,corruptions,pgd-linf,pgd-l2,hessian",
                           help="comma-separated subset of clean,corruptions,pgd-linf,pgd-l2,"
                                "hessian; corruptions need the `corruptions` extra "
                                "(default: %(default)s)")
  eval_parser.add_argument("--corruption-subset", type=int, default=1000,
                           help="corrupt a seeded sample of N of the evaluated test images "
                                "(CPU-generated, cached) (default: %(default)s)")
  eval_parser.add_argument("--test-subset", type=int, default=None,
                           help="clean and PGD accuracy on a seeded sample of N test images "
                                "(default: all)")
  eval_parser.add_argument("--seed", type=int, default=0,
                           help="seed of the subsets, the corruptions and PGD's random starts "
                                "(default: %(default)s)")
  _add_output_options(eval_parser)
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
  else:
    flag = "--sparsity" if flags_given.get("sparsity") is not None else "--config.sparsity"
    _nm_sparsity(parser, overrides, overrides.get("structure", base.structure), flag)
  try:
    return configs.override(base, overrides, name=name)
  except ValueError as err:
    _fail(parser, str(err))


def _nm_sparsity(parser: argparse.ArgumentParser, overrides: dict[str, Any], structure: str,
                 flag: str) -> None:
  """With an N:M ``structure`` the sparsity is ``1 - N/M``: set when not given, else checked.

  The config's validation refuses a contradicting sparsity naming the field;
  here the message names ``flag``, the option that gave it.
  """
  try:
    nm = methods.parse_structure(structure)
  except ValueError:
    return  # the config's validation names the field
  if not isinstance(nm, safe_optax.NM):
    return
  fixed = 1 - nm.n / nm.m
  given = overrides.setdefault("sparsity", fixed)
  if abs(given - fixed) > 1e-9:
    _fail(parser, f"argument {flag}: {given:g} conflicts with structure {structure}, which "
                  f"prunes exactly {fixed:g} (N of every M weights); leave out {flag} or "
                  f"pass {fixed:g}.")


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
  _LOG.info("loading %s from %s", config.dataset, data_dir)
  try:
    return datasets.load_dataset(config, data_dir)
  except (FileNotFoundError, ValueError) as err:
    _fail(parser, f"cannot load {config.dataset} from --data-dir '{data_dir}': {err}")


def _check_structure_fits(parser: argparse.ArgumentParser, config: configs.Config,
                          data: Any) -> None:
  """An N:M structure needs every prunable kernel's input axis divisible by M.

  Checked on the model's parameter shapes (``jax.eval_shape``: nothing runs)
  as soon as the data set gives the image shape, before anything compiles.
  """
  nm = methods.parse_structure(config.structure)
  if not isinstance(nm, safe_optax.NM):
    return
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from safe_optax.vision import models  # pylint: disable=import-outside-toplevel
  model = models.create_model(config, data.num_classes)
  image = jax.ShapeDtypeStruct((1, *data.train_images.shape[1:]), jnp.float32)
  params = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, train=False),
                          image)["params"]
  misfits = [f"{jax.tree_util.keystr(path, simple=True, separator='/')} {tuple(leaf.shape)}"
             for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if safe_optax.default_prunable(path, leaf) and leaf.shape[nm.axis] % nm.m]
  if misfits:
    _fail(parser, f"argument --structure: {config.structure} needs every prunable kernel's "
                  f"input axis (axis {nm.axis}) divisible by {nm.m}, but {config.model} on "
                  f"{config.dataset} has {', '.join(misfits)}; choose another M or model.")


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
  if config.method != "dense":
    _check_structure_fits(parser, config, data)
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
  for method in args.methods:  # every run's config, checked before any data loads
    for s in args.sparsities:
      try:
        base.replace(method=method, sparsity=0.0 if method == "dense" else s)
      except ValueError as err:
        _fail(parser, f"argument --methods/--sparsities: {method} at sparsity {s:g}: {err}")
  try:
    workdirs.check_creatable(args.workdir)
  except ValueError as err:
    _fail(parser, f"--workdir: {err}")
  data = _load(parser, base, args.data_dir)
  if set(args.methods) != {"dense"}:
    _check_structure_fits(parser, base, data)
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
  from safe_optax.vision import corruption_functions  # pylint: disable=import-outside-toplevel
  try:
    suite = evaluation.parse_suite(args.suite)
  except ValueError as err:
    parser.error(str(err))
  if "corruptions" in suite and not corruption_functions.available():
    parser.error(f"argument --suite: the corruptions need {corruption_functions.INSTALL_HINT}; "
                 "or leave corruptions out of --suite")
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
  from safe_optax import distributed  # pylint: disable=import-outside-toplevel
  _, args = _parse(argv)
  experiment.configure_logging(args.log_level)
  _join_runtime(args.parser, args)
  experiment.configure_logging(args.log_level, primary=distributed.is_primary())
  return args.func(args.parser, args)


if __name__ == "__main__":
  sys.exit(main())
