r"""Sharpness measures and loss landscapes for any parameter pytree and loss.

The paper's §4.1 evidence that SAFE finds *flat* sparse minima, made
measurable for any model:

* :func:`max_hessian_eigenvalue`: :math:`\lambda_{\max}` of the Hessian of the
  loss averaged over a fixed list of evaluation batches, by power iteration on
  Hessian-vector products (forward-over-reverse, ``jax.jvp`` of ``jax.grad``)
  with a relative tolerance and an iteration cap: called outside ``jax.jit``
  a Python loop over one jitted product per batch (one scalar to the host an
  iteration), inside ``jax.jit`` one ``lax.while_loop`` whose convolutions
  go through :func:`safe_optax.experimental.canonical_convs` (XLA:CPU would run a
  convolution's backward pass 20-60x slower inside a loop body);
* :func:`hessian_trace`: Hutchinson's estimate :math:`E_z[z^\top H z]`
  (reusing :func:`safe_optax.hutchinson_diagonal`);
* :func:`filter_normalized_direction`, :func:`loss_line` and
  :func:`loss_surface`: 1D and 2D loss landscapes along random
  filter-normalised directions (Li et al., 2018);
* :func:`plot_weight_histograms` / :func:`save_weight_histograms`: weight
  distributions (dense vs sparse), a PNG with matplotlib (imported only when
  called).

This module gathers them for import; they live by topic in
``safe_optax/_hessian.py`` (the Hessian measures), ``safe_optax/_landscape.py``
(the landscapes) and :mod:`safe_optax.plots` (the figures).

Conventions: ``loss_fn(params, batch) -> scalar`` is the mean loss of one
batch; ``batches`` is a non-empty sequence of batches with identical shapes
(every batch is a pytree of arrays), taken one at a time (a Python loop over
jitted products outside ``jax.jit``, a ``lax.scan`` inside), so the averaged
Hessian is :math:`H = \frac{1}{B}\sum_b \nabla^2 \ell(\theta; b)` and the
intermediate values of one batch are alive at a time.

``support`` restricts everything to a subset of the weights, e.g. the kept
weights of a sparse model: a pytree of bools (or 0/1 arrays) shaped like
``params`` -- the keep masks of :func:`safe_optax.finalize` broadcast to the
full tree, see :func:`support_mask`. The restricted Hessian is
:math:`P H P` with :math:`P = \mathrm{diag}(\text{support})`, i.e. the Hessian
of the loss as a function of the kept weights only, pruned weights frozen at
zero (their eigenvalues are reported as 0).

Examples:
  The top eigenvalue of a quadratic with Hessian ``diag(4, 1)``:

  >>> import jax, jax.numpy as jnp
  >>> from safe_optax import flatness
  >>> loss_fn = lambda p, b: 0.5 * jnp.sum(b * p['w'] ** 2)
  >>> batches = [jnp.array([3., 1.]), jnp.array([5., 1.])]  # mean diag(4, 1)
  >>> params = {'w': jnp.ones(2)}
  >>> result = jax.jit(lambda p: flatness.max_hessian_eigenvalue(
  ...     loss_fn, p, batches, key=jax.random.PRNGKey(0)))(params)
  >>> round(float(result.eigenvalue), 4)
  4.0

References:
  Li, Xu, Taylor, Studer, Goldstein, `Visualizing the Loss Landscape of
  Neural Nets <https://arxiv.org/abs/1712.09913>`_, NeurIPS 2018.

  Yao, Gholami, Keutzer, Mahoney, `PyHessian: Neural Networks Through the
  Lens of the Hessian <https://arxiv.org/abs/1912.07145>`_, 2020.
"""

from __future__ import annotations

from safe_optax._hessian import PowerIterationResult
from safe_optax._hessian import hessian_trace
from safe_optax._hessian import hessian_vector_product
from safe_optax._hessian import max_hessian_eigenvalue
from safe_optax._hessian import mean_loss
from safe_optax._hessian import support_mask
from safe_optax._landscape import filter_normalized_direction
from safe_optax._landscape import loss_line
from safe_optax._landscape import loss_surface
from safe_optax.plots import plot_weight_histograms
from safe_optax.plots import save_weight_histograms

__all__ = (
    "PowerIterationResult",
    "filter_normalized_direction",
    "hessian_trace",
    "hessian_vector_product",
    "loss_line",
    "loss_surface",
    "max_hessian_eigenvalue",
    "mean_loss",
    "plot_weight_histograms",
    "save_weight_histograms",
    "support_mask",
)
