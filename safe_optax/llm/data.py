r"""Text for calibration and evaluation: token windows and perplexity.

* :func:`calibration_windows`: ``nsamples`` random windows of ``seqlen``
  tokens (the paper draws 128 x 2048 from C4), reproducible from ``seed``.
* :func:`eval_windows` and :func:`perplexity`: non-overlapping windows from
  the start of a text, perplexity ``exp(mean NLL)`` over each window's
  next-token predictions.

Two evaluation protocols (:data:`PROTOCOLS`):

* ``"standard"``, SparseGPT's and Wanda's: the whole text, its rows joined as
  ``"\n\n".join(rows)`` (:func:`join_rows`), cut into non-overlapping windows
  of ``min(context, 2048)`` tokens (:func:`protocol_window`), the last partial
  window dropped.
* ``"short"``, for quick checks: the text as it is, its first
  ``max_tokens`` tokens (default 2,048) in 512-token windows.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from safe_optax import experiment

PROTOCOLS = ("standard", "short")
STANDARD_MAX_WINDOW = 2048  # SparseGPT's and Wanda's window: the model's context, at most 2,048
SHORT_WINDOW = 512
SHORT_TOKENS = 2048


def read_text(path: os.PathLike) -> str:
  """A text file, or every ``*.txt`` of a folder (sorted, blank line between), LF line ends.

  Raises ``FileNotFoundError`` for a missing path and ``ValueError`` for an
  empty (or all-whitespace) text.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    files = sorted(path.glob("*.txt"))
    if not files:
      raise FileNotFoundError(f"no *.txt files in '{path}'.")
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
  elif path.is_file():
    text = path.read_text(encoding="utf-8", errors="replace")
  else:
    raise FileNotFoundError(f"text file or folder not found at '{path}'.")
  if not text.strip():
    raise ValueError(f"the text at '{path}' is empty.")
  return text.replace("\r\n", "\n")


def tokenize(tokenizer: Any, text: str, max_chars: Optional[int] = None) -> np.ndarray:
  """Token ids of ``text`` (optionally only its first ``max_chars`` characters)."""
  if max_chars is not None:
    text = text[:max_chars]
  return np.asarray(tokenizer.encode(text).ids, np.int32)


def join_rows(text: str) -> str:
  r"""The text as SparseGPT and Wanda build it from a Hugging Face split: ``"\n\n".join(rows)``.

  The rows of a WikiText split are the lines of its ``.raw`` file, each with
  its line end, so a file's rows are its lines (line ends kept).

  Examples:
    >>> join_rows(" = A = \n B .\n")
    ' = A = \n\n\n B .\n'
  """
  return "\n\n".join(text.splitlines(keepends=True))


def protocol_window(protocol: str, context: Optional[int], seqlen: Optional[int] = None) -> int:
  """The window length of a protocol: ``seqlen`` when given, else its default.

  ``"standard"``: ``min(context, 2048)`` (2,048 when the context is unknown);
  ``"short"``: 512.
  """
  if protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}.")
  if seqlen is not None:
    if not isinstance(seqlen, (int, np.integer)) or seqlen < 2:
      raise ValueError(f"the window length must be an int >= 2, got {seqlen!r}.")
    return int(seqlen)
  if protocol == "short":
    return SHORT_WINDOW
  return STANDARD_MAX_WINDOW if context is None else min(int(context), STANDARD_MAX_WINDOW)


def calibration_windows(tokens: np.ndarray, nsamples: int, seqlen: int, seed: int) -> np.ndarray:
  """``(nsamples, seqlen)`` windows starting at seeded uniform random offsets.

  Examples:
    >>> import numpy as np
    >>> from safe_optax.llm.data import calibration_windows
    >>> w = calibration_windows(np.arange(100), nsamples=3, seqlen=8, seed=0)
    >>> w.shape, bool((np.diff(w, axis=1) == 1).all())
    ((3, 8), True)
  """
  for name, value in (("nsamples", nsamples), ("seqlen", seqlen)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
  if len(tokens) <= seqlen:
    raise ValueError(
        f"the calibration text has {len(tokens)} tokens, too few for seqlen={seqlen}.")
  starts = np.random.default_rng(seed).integers(0, len(tokens) - seqlen, size=nsamples)
  return np.stack([tokens[s:s + seqlen] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, seqlen: int, max_tokens: Optional[int] = None, *,
                 flag: str = "seqlen") -> np.ndarray:
  """Non-overlapping ``(n, seqlen)`` windows from the start (a ragged tail is dropped).

  Raises ``ValueError`` naming ``flag`` (the option that sets ``seqlen``) when
  the text is shorter than one window, and naming ``max_tokens`` when that
  budget is.
  """
  if max_tokens is not None and max_tokens < seqlen:
    raise ValueError(f"max_tokens={max_tokens} is fewer than seqlen={seqlen}: not one window.")
  if len(tokens) < seqlen:
    raise ValueError(f"the evaluation text has {len(tokens)} tokens, fewer than seqlen={seqlen} "
                     f"(one window): give a longer text or a smaller {flag}.")
  if max_tokens is not None:
    tokens = tokens[:max_tokens]
  count = len(tokens) // seqlen
  return np.asarray(tokens[: count * seqlen], np.int32).reshape(count, seqlen)


def perplexity(
    logits_fn: Callable[[jax.Array], jax.Array], windows: np.ndarray, *, progress: bool = False
) -> tuple[float, float]:
  r"""Perplexity :math:`\exp(\frac{1}{N}\sum -\log p(t_{i+1} | t_{\le i}))` over windows.

  Args:
    logits_fn: jitted ``tokens (1, L) -> logits (1, L, vocab)``.
    windows: ``(n, L)`` token windows, each evaluated on its own.
    progress: show a bar of the windows scored on stderr.

  Returns:
    ``(perplexity, mean_nll)``.
  """
  total, count = 0.0, 0
  bar = experiment.progress(len(windows), desc="perplexity", unit="window", enabled=progress)
  for window in windows:
    tokens = jnp.asarray(window[None])
    nll = _window_nll(logits_fn(tokens), tokens)
    total += float(nll)
    count += window.shape[0] - 1
    bar.update(1)
  bar.close()
  mean = total / count
  return float(np.exp(mean)), mean


@jax.jit
def _window_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).sum()
