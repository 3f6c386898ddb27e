r"""Adversarial robustness: PGD in pixel space with per-example norm balls.

Projected gradient descent (Madry et al., 2018) on the cross-entropy, for
images in **pixel space** ``[0, 1]``: the model's normalisation belongs inside
``apply_fn``, so the ball and the valid range are those of the actual pixels.
Each example has its own ball :math:`\|\delta_i\| \le \epsilon`; every step is

.. math::
  x_i \leftarrow \Pi_{[0,1]}\Big(x^0_i + \Pi_{\epsilon}\big(x_i + \alpha\,
  s(\nabla_{x_i} \ell) - x^0_i\big)\Big)

with :math:`s(g) = \mathrm{sign}(g)` under :math:`\ell_\infty` and
:math:`s(g) = g / \|g_i\|_2` (per example) under :math:`\ell_2`; the
projection :math:`\Pi_\epsilon` clips each coordinate (:math:`\ell_\infty`)
or rescales each example's perturbation to norm at most :math:`\epsilon`
(:math:`\ell_2`), after **every** step, then the pixels are clipped to
``[0, 1]``. Clipping to the box never leaves the ball: it only shrinks each
coordinate of the perturbation towards 0 (the clean image is in the box).
The paper's settings: 10 steps of ``eps / 4``, :math:`\ell_\infty`
``eps = 1/255`` and :math:`\ell_2` ``eps = 3/255``.

Unlike the official SAFE code, which attacks *normalised* images, clips them
to ``[0, 1]`` and projects the whole batch onto one :math:`\ell_2` ball, this
attacks pixels, clips pixels and projects each example.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> from safe_optax.vision.robustness import pgd_attack
  >>> w = jax.random.normal(jax.random.PRNGKey(0), (12, 3))
  >>> apply_fn = lambda x: x.reshape(len(x), -1) @ w  # normalisation would go here
  >>> images = jax.random.uniform(jax.random.PRNGKey(1), (4, 2, 2, 3))
  >>> labels = jnp.argmax(apply_fn(images), -1)  # all correct before the attack
  >>> adv = pgd_attack(apply_fn, images, labels, norm='l2', eps=0.5)
  >>> bool(jnp.all(jnp.linalg.norm((adv - images).reshape(4, -1), axis=1) <= 0.5 + 1e-6))
  True
  >>> bool(jnp.all((adv >= 0) & (adv <= 1)))
  True

References:
  Madry, Makelov, Schmidt, Tsipras, Vladu, `Towards Deep Learning Models
  Resistant to Adversarial Attacks <https://arxiv.org/abs/1706.06083>`_,
  ICLR 2018.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

__all__ = ("NORMS", "PAPER_EPS", "accuracy", "pgd_attack", "pgd_accuracy", "project")

NORMS = ("linf", "l2")
"""The norms of the perturbation balls that :func:`project` and :func:`pgd_attack` take."""
PAPER_EPS = {"linf": 1.0 / 255.0, "l2": 3.0 / 255.0}
"""The SAFE paper's radii (pixel units in [0, 1])."""
_TINY = 1e-12  # guards the division by a zero gradient / perturbation norm

ApplyFn = Callable[[jax.Array], jax.Array]


def _per_example_norm(x: jax.Array) -> jax.Array:
  """l2 norm of each example, shaped ``(N, 1, ..., 1)`` to broadcast."""
  return jnp.sqrt(jnp.sum(x * x, axis=tuple(range(1, x.ndim)), keepdims=True))


def project(delta: jax.Array, norm: str, eps: float) -> jax.Array:
  """Projects each example's perturbation ``delta[i]`` onto its ``eps``-ball.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax.vision.robustness import project
    >>> project(jnp.array([[3., 4.], [0.3, 0.4]]), 'l2', 1.0)  # per example, not per batch
    Array([[0.6, 0.8],
           [0.3, 0.4]], dtype=float32)
  """
  _check_norm(norm)
  if norm == "linf":
    return jnp.clip(delta, -eps, eps)
  n = _per_example_norm(delta)
  return delta * jnp.minimum(1.0, eps / jnp.maximum(n, _TINY))


def _check_norm(norm: str) -> None:
  if norm not in NORMS:
    raise ValueError(f"`norm` must be one of {NORMS}, got {norm!r}.")


def _random_start(key: jax.Array, shape: tuple[int, ...], norm: str, eps) -> jax.Array:
  if norm == "linf":
    return jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) * eps
  # Uniform in the l2 ball: a Gaussian direction, radius eps * u^(1/d).
  k_dir, k_rad = jax.random.split(key)
  direction = jax.random.normal(k_dir, shape)
  direction = direction / jnp.maximum(_per_example_norm(direction), _TINY)
  dim = int(np.prod(shape[1:]))
  radius = jax.random.uniform(k_rad, (shape[0],) + (1,) * (len(shape) - 1)) ** (1.0 / dim)
  return direction * radius * eps


@functools.partial(jax.jit, static_argnames=("apply_fn", "norm", "num_steps", "random_start"))
def pgd_attack(
    apply_fn: ApplyFn,
    images: jax.Array,
    labels: jax.Array,
    *,
    norm: str = "linf",
    eps: float = PAPER_EPS["linf"],
    step_size: Optional[float] = None,
    num_steps: int = 10,
    random_start: bool = False,
    key: Optional[jax.Array] = None,
) -> jax.Array:
  """PGD adversarial examples in pixel space, one norm ball per example (jitted).

  Args:
    apply_fn: ``apply_fn(images) -> logits`` on float pixels in ``[0, 1]``,
      normalisation included (e.g. ``lambda x: model.apply(variables,
      normalize(x), train=False)``). Static under jit: pass the same function
      object to avoid recompiling.
    images: float images in ``[0, 1]``, ``(N, ...)``.
    labels: int labels ``(N,)``; the attack increases their cross-entropy.
    norm: ``"linf"`` or ``"l2"``.
    eps: ball radius in pixel units.
    step_size: step length; default ``eps / 4``.
    num_steps: PGD steps (the projection follows every step).
    random_start: start from a uniform point of the ball (needs ``key``).
    key: PRNG key for the random start.

  Returns:
    Adversarial images, same shape, in ``[0, 1]``, each within ``eps`` of its
    clean image in the chosen norm.

  Raises:
    ValueError: an unknown ``norm``, a non-positive ``num_steps``, or
      ``random_start`` without ``key``.
  """
  _check_norm(norm)
  if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f"`num_steps` must be a positive int, got {num_steps!r}.")
  if random_start and key is None:
    raise ValueError("`random_start=True` needs a PRNG `key`.")
  clean = jnp.asarray(images, jnp.float32)
  eps = jnp.asarray(eps, jnp.float32)
  alpha = eps / 4.0 if step_size is None else jnp.asarray(step_size, jnp.float32)

  def loss(x):
    logits = apply_fn(x)
    # A sum, so each example's gradient is its own loss's gradient.
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

  grad = jax.grad(loss)
  adv = clean
  if random_start:
    adv = jnp.clip(clean + _random_start(key, clean.shape, norm, eps), 0.0, 1.0)

  def step(_, x):
    g = grad(x)
    if norm == "linf":
      direction = jnp.sign(g)
    else:
      direction = g / jnp.maximum(_per_example_norm(g), _TINY)
    x = x + alpha * direction
    return jnp.clip(clean + project(x - clean, norm, eps), 0.0, 1.0)

  # Unrolled (num_steps is static): inside a loop body XLA:CPU runs the input-gradient
  # convolutions without its Eigen kernels, about 4x slower here (safe_optax/_hessian.py).
  return lax.fori_loop(0, num_steps, step, adv, unroll=True)


def accuracy(apply_fn: ApplyFn, images: jax.Array, labels: jax.Array) -> jax.Array:
  """Top-1 accuracy of ``apply_fn`` on ``images`` (a float32 scalar)."""
  return jnp.mean(jnp.argmax(apply_fn(images), -1) == labels)


def pgd_accuracy(
    apply_fn: ApplyFn,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    norm: str = "linf",
    eps: Optional[float] = None,
    batch_size: int = 500,
    num_steps: int = 10,
    step_size: Optional[float] = None,
    random_start: bool = False,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, float]:
  """Clean and PGD accuracy over a data set, attacked batch by batch.

  Args:
    apply_fn: as in :func:`pgd_attack`.
    images: uint8 ``(N, H, W, C)`` or float pixels in ``[0, 1]``.
    labels: ``(N,)`` ints.
    norm, num_steps, step_size, random_start: as in :func:`pgd_attack`.
    eps: radius; default the paper's (``1/255`` for l_inf, ``3/255`` for l_2).
    batch_size: examples per attack batch (the last one may be short).
    seed: seeds the random starts (one key per batch).
    progress: show a tqdm bar.

  Returns:
    ``{'clean': accuracy, 'adversarial': accuracy, 'eps': eps, 'norm': norm}``.
  """
  _check_norm(norm)
  if batch_size < 1:
    raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}.")
  eps = PAPER_EPS[norm] if eps is None else float(eps)
  images = np.asarray(images)
  pixels = images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else images
  labels = np.asarray(labels)
  correct_clean = correct_adv = 0
  batch_acc = jax.jit(accuracy, static_argnums=0)
  starts = range(0, len(labels), batch_size)
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    starts = tqdm(starts, desc=f"PGD {norm}", leave=False)
  for i, start in enumerate(starts):
    x = jnp.asarray(pixels[start:start + batch_size])
    y = jnp.asarray(labels[start:start + batch_size])
    adv = pgd_attack(apply_fn, x, y, norm=norm, eps=eps, step_size=step_size,
                     num_steps=num_steps, random_start=random_start,
                     key=jax.random.fold_in(jax.random.PRNGKey(seed), i))
    correct_clean += float(batch_acc(apply_fn, x, y)) * len(y)
    correct_adv += float(batch_acc(apply_fn, adv, y)) * len(y)
  return {"clean": correct_clean / len(labels), "adversarial": correct_adv / len(labels),
          "eps": eps, "norm": norm}
