r"""SparseGPT (Frantar & Alistarh, 2023) on one linear map, in JAX.

Optimal Brain Surgeon with :math:`H = 2XX^\top/n` (damped), columns pruned
in order within lazy batches, each column's error spread over the later
columns through the Cholesky factor of :math:`H^{-1}`. A baseline of the
SAFE paper's LLM experiments (§4.2), used by :mod:`safe_optax.llm.prune`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def _inverse_hessian_chol(xtx: jax.Array, n: jax.Array, percdamp: float) -> jax.Array:
  """Upper Cholesky factor ``U`` of ``H^{-1}`` (``U^T U = H^{-1}``), ``H = 2XX^T/n + damp I``."""
  h = 2.0 * xtx / n
  dead = jnp.diag(h) == 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
  damp = percdamp * jnp.mean(jnp.diag(h))
  h = h + damp * jnp.eye(h.shape[0], dtype=h.dtype)
  hinv = jnp.linalg.inv(h)
  hinv = 0.5 * (hinv + hinv.T)
  return jnp.linalg.cholesky(hinv).T


def _sparsegpt_batch(w1, hinv1, prune_count, nm):
  """One lazy batch of columns: OBS column by column, errors returned for the rest."""
  rows, width = w1.shape
  diag = jnp.diag(hinv1)
  if nm is None:
    scores = (jnp.square(w1) / jnp.square(diag)[None, :]).reshape(-1)
    # Exactly ``prune_count`` smallest scores (stable ties: earlier entry pruned first).
    order = jnp.argsort(scores, stable=True)
    pruned = jnp.zeros(scores.shape, bool).at[order].set(jnp.arange(scores.size) < prune_count)
    mask0 = pruned.reshape(rows, width)
  else:
    mask0 = jnp.zeros((rows, width), bool)
  cols = jnp.arange(width)

  def body(i, carry):
    w1, err1, mask1 = carry
    if nm is not None:
      n, m = nm

      def group_mask(mask1):
        w_group = jax.lax.dynamic_slice(w1, (0, i), (rows, m))
        d_group = jax.lax.dynamic_slice(diag, (i,), (m,))
        score = jnp.square(w_group) / jnp.square(d_group)[None, :]
        rank = jnp.argsort(jnp.argsort(score, axis=1, stable=True), axis=1, stable=True)
        return jax.lax.dynamic_update_slice(mask1, rank < (m - n), (0, i))

      mask1 = jax.lax.cond(i % m == 0, group_mask, lambda mk: mk, mask1)
    w = w1[:, i]
    d = hinv1[i, i]
    q = jnp.where(mask1[:, i], 0.0, w)
    err = (w - q) / d
    row = jnp.where(cols >= i, hinv1[i, :], 0.0)
    w1 = w1 - err[:, None] * row[None, :]
    err1 = err1.at[:, i].set(err)
    return w1, err1, mask1

  w1, err1, mask1 = jax.lax.fori_loop(0, width, body, (w1, jnp.zeros_like(w1), mask0))
  return jnp.where(mask1, 0.0, w1), err1



def sparsegpt_prune(
    weight: jax.Array,
    xtx: jax.Array,
    num_rows: int,
    *,
    sparsity: float = 0.5,
    nm: Optional[tuple[int, int]] = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> jax.Array:
  r"""SparseGPT on one linear map ``y = W x`` (``weight`` in ``(out, in)`` layout).

  With :math:`H = 2XX^\top/n + \delta I` (:math:`\delta` = ``percdamp`` times
  the mean diagonal; dead inputs get :math:`H_{jj} = 1` and zero weights) and
  :math:`U` the upper Cholesky factor of :math:`H^{-1}`, columns are visited
  in order in lazy batches of ``blocksize``. At the start of each batch the
  mask prunes the ``sparsity`` fraction of the batch with the smallest
  :math:`w^2 / U_{jj}^2` (adaptive mask selection); N:M picks the ``m - n``
  smallest in each group of ``m`` when reaching it. Each column's pruning
  error :math:`e = (w - q)/U_{jj}` is spread over the later columns,
  :math:`W_{:, j:} \mathrel{-}= e\,U_{j, j:}`.

  Args:
    weight: ``(out, in)`` matrix.
    xtx: ``X^T X`` summed over the ``num_rows`` calibration rows, ``(in, in)``.
    num_rows: ``n``.
    sparsity: unstructured fraction pruned (ignored with ``nm``).
    nm: ``(n, m)`` keep ``n`` of every ``m`` inputs.
    blocksize: lazy batch width (128 in the paper).
    percdamp: damping fraction (0.01 in the paper).

  Returns:
    The pruned ``(out, in)`` weight.

  References:
    Frantar & Alistarh, `SparseGPT: Massive Language Models Can Be Accurately
    Pruned in One-Shot <https://arxiv.org/abs/2301.00774>`_, ICML 2023 (Alg. 1).
  """
  rows, cols = jnp.shape(weight)
  if nm is not None and (blocksize % nm[1] or cols % nm[1]):
    raise ValueError(f"N:M {nm} needs blocksize ({blocksize}) and in-features ({cols}) "
                     f"divisible by m.")
  if nm is None and not 0.0 <= sparsity < 1.0:
    raise ValueError(f"`sparsity` must be in [0, 1), got {sparsity}.")
  counts = tuple(0 if nm is not None else int(np.floor(rows * (min(s + blocksize, cols) - s)
                                                          * sparsity))
                 for s in range(0, cols, blocksize))
  return _sparsegpt_matrix(jnp.asarray(weight, jnp.float32), jnp.asarray(xtx, jnp.float32),
                           jnp.float32(num_rows), jnp.float32(percdamp),
                           jnp.asarray(counts, jnp.int32), nm=nm, blocksize=blocksize)


@functools.partial(jax.jit, static_argnames=("nm", "blocksize"))
def _sparsegpt_matrix(w, xtx, num_rows, percdamp, counts, *, nm, blocksize):
  """The whole matrix in one compilation (lazy batches unrolled, columns in a loop)."""
  h_chol = _inverse_hessian_chol(xtx, num_rows, percdamp)
  w = jnp.where((jnp.diag(xtx) == 0)[None, :], 0.0, w)
  cols = w.shape[1]
  for index, start in enumerate(range(0, cols, blocksize)):
    stop = min(start + blocksize, cols)
    q1, err1 = _sparsegpt_batch(w[:, start:stop], h_chol[start:stop, start:stop],
                                counts[index], nm)
    w = w.at[:, start:stop].set(q1)
    w = w.at[:, stop:].add(-err1 @ h_chol[start:stop, stop:])
  return w
