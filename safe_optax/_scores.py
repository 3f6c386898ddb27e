r"""Saliency scores for SAFE+'s generalized projection.

SAFE+ projects with a diagonal metric ``P``: it keeps the entries with the
largest :math:`\sqrt{P_{ii}}\,|v_i|`. The builders here give that score for

* magnitude, ``P = I``: :math:`|v|` (plain SAFE);
* SNIP, ``P = g^2``: :math:`|g \odot v|`;
* OBD, ``P = diag(H)``: :math:`\sqrt{|h|}\,|v|`, with ``h`` a Hutchinson
  estimate of the Hessian diagonal, :math:`E_z[z \odot Hz]` over Rademacher
  probes ``z`` (absolute value, since a non-convex Hessian diagonal can be
  negative and ``P`` must be positive semi-definite);
* Wanda, ``P = diag(A^T A)``: :math:`|W_{ij}|\,\|A_j\|_2` from per-input-feature
  activation norms.

The pure functions take and return pytrees. Inside the optax transforms a
saliency is a callable ``SaliencyInputs -> scores`` (see :func:`get_saliency`),
evaluated at each dual update on ``v = x + u``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from safe_optax import _prunable

GradFn = Callable[[Any, int], Any]


class SaliencyInputs(NamedTuple):
  """What a saliency may look at when the transform projects ``values``."""

  values: Any
  """The point being projected, ``x + u`` (prunable leaves only, a list)."""
  params: Any
  """The current parameters ``x`` (the full tree)."""
  updates: Any
  """The gradient entering the transform at this step (full tree)."""
  grad_fn: Optional[GradFn]
  """``grad_fn(params, step)`` if the caller passed one to ``update``."""
  key: jax.Array
  """A PRNG key for the saliency (Hutchinson probes), new at every step and independent
  of SAFE-Multi's draw of the sparsity."""
  flags: tuple[bool, ...]
  """Prunable flags of ``params``' leaves, in flatten order."""


Saliency = Callable[[SaliencyInputs], Any]


def magnitude_scores(values: Any) -> Any:
  """``|v|``: the Euclidean projection's score (``P = I``), plain SAFE.

  Args:
    values: pytree of arrays ``v``.

  Returns:
    A pytree like ``values`` with ``|v|``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import magnitude_scores
    >>> magnitude_scores({'w': jnp.array([1., -2.])})
    {'w': Array([1., 2.], dtype=float32)}
  """
  return jax.tree.map(jnp.abs, values)


def snip_scores(values: Any, grads: Any) -> Any:
  """``|g * v|``: SNIP's connection sensitivity (``P = g^2``).

  Args:
    values: pytree of arrays ``v`` (the weights being projected).
    grads: pytree of gradients ``g`` with the structure of ``values``.

  Returns:
    A pytree like ``values`` with ``|g * v|`` (in ``values``' dtypes).

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import snip_scores
    >>> snip_scores(jnp.array([1., -2.]), jnp.array([3., 0.5]))
    Array([3., 1.], dtype=float32)

  References:
    Lee, Ajanthan, Torr, `SNIP: Single-shot Network Pruning based on
    Connection Sensitivity <https://arxiv.org/abs/1810.02340>`_, ICLR 2019.
  """
  return jax.tree.map(lambda v, g: jnp.abs(v * g.astype(v.dtype)), values, grads)


def obd_scores(values: Any, hessian_diag: Any) -> Any:
  r"""``sqrt(|h|) * |v|``: Optimal Brain Damage with a Hessian-diagonal estimate.

  The score of :math:`P = \mathrm{diag}(H)`: :math:`\sqrt{|h_i|}\,|v_i|`,
  which ranks entries as OBD's saliency :math:`\tfrac12 h_i v_i^2` does.
  The absolute value keeps ``P`` positive semi-definite where a
  non-convex loss has a negative curvature estimate.

  Args:
    values: pytree of arrays ``v``.
    hessian_diag: pytree of Hessian-diagonal estimates ``h`` (e.g. from
      :func:`hutchinson_diagonal`) with the structure of ``values``.

  Returns:
    A pytree like ``values`` with ``sqrt(|h|) * |v|``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import obd_scores
    >>> obd_scores(jnp.array([1., -2.]), jnp.array([4., 1.]))
    Array([2., 2.], dtype=float32)

  References:
    LeCun, Denker, Solla, `Optimal Brain Damage
    <https://proceedings.neurips.cc/paper/1989/hash/6c9882bbac1c7093bd25041881277658-Abstract.html>`_,
    NeurIPS 1989.
  """
  return jax.tree.map(
      lambda v, h: jnp.sqrt(jnp.abs(h.astype(v.dtype))) * jnp.abs(v), values, hessian_diag
  )


def wanda_scores(values: Any, input_norms: Any, *, axis: int = -2) -> Any:
  """``|W_ij| * ||A_j||``: Wanda's score from per-input-feature activation norms.

  Args:
    values: pytree of weight matrices (Flax layout, input features on ``axis``).
    input_norms: pytree of 1-D arrays, ``||A_j||_2`` for each input feature
      ``j`` of the matching leaf (length ``leaf.shape[axis]``); ``None``
      leaves keep plain magnitude.
    axis: the input-feature axis of each weight.

  Returns:
    A pytree like ``values`` with ``|W_ij| * ||A_j||`` (``|W|`` where the
    norm is ``None``).

  Raises:
    ValueError: a norm vector does not match its weight's ``axis``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import wanda_scores
    >>> wanda_scores(jnp.array([[1., -1.], [2., 1.]]), jnp.array([3., 1.]))
    Array([[3., 3.],
           [2., 1.]], dtype=float32)

  References:
    Sun, Liu, Bair, Kolter, `A Simple and Effective Pruning Approach for Large
    Language Models <https://arxiv.org/abs/2306.11695>`_, ICLR 2024.
  """
  def score(v, norms):
    if norms is None:
      return jnp.abs(v)
    norms = jnp.asarray(norms, v.dtype)
    if norms.ndim != 1 or norms.shape[0] != v.shape[axis]:
      raise ValueError(
          f"`input_norms` for a weight of shape {v.shape} must be 1-D of length "
          f"{v.shape[axis]} (axis {axis}), got shape {norms.shape}."
      )
    shape = [1] * v.ndim
    shape[axis] = -1
    return jnp.abs(v) * norms.reshape(shape)

  return jax.tree.map(score, values, input_norms, is_leaf=lambda x: x is None)


def hutchinson_diagonal(
    grad_fn: GradFn, params: Any, key: jax.Array, num_probes: int = 1
) -> Any:
  """Hutchinson estimate of the Hessian diagonal, ``mean_z z * (H z)``.

  ``H z`` is a forward-over-reverse Hessian-vector product of ``grad_fn``
  (``jax.jvp`` of the gradient), with Rademacher probes ``z``.

  Args:
    grad_fn: ``grad_fn(params, step) -> grads`` (optax's SAM convention).
    params: where the Hessian is taken.
    key: PRNG key for the probes.
    num_probes: number of probes averaged.

  Returns:
    A pytree like ``params``: the estimate of ``diag(H)``, unbiased; exact
    when the Hessian is diagonal.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from safe_optax import hutchinson_diagonal
    >>> loss = lambda p: jnp.sum(jnp.array([1., 2., 3.]) * p ** 2)  # H = diag(2, 4, 6)
    >>> hutchinson_diagonal(lambda p, _: jax.grad(loss)(p), jnp.zeros(3), jax.random.PRNGKey(0))
    Array([2., 4., 6.], dtype=float32)

  References:
    Hutchinson, `A Stochastic Estimator of the Trace of the Influence Matrix
    for Laplacian Smoothing Splines
    <https://doi.org/10.1080/03610918908812806>`_, 1989; Bekas, Kokiopoulou,
    Saad, `An estimator for the diagonal of a matrix
    <https://doi.org/10.1016/j.apnum.2007.01.003>`_, 2007.
  """
  probe_keys = jax.random.split(key, num_probes)

  def add_probe(i, total):
    probe = optax.tree.random_like(probe_keys[i], params, jax.random.rademacher)
    _, hvp = jax.jvp(lambda p: grad_fn(p, 0), (params,), (probe,))
    return optax.tree.add(total, optax.tree.mul(probe, hvp))

  # A loop, not a batch, so memory stays at one probe whatever num_probes is.
  total = jax.lax.fori_loop(0, num_probes, add_probe, optax.tree.zeros_like(params))
  return optax.tree.scale(1.0 / num_probes, total)


def _snip(inputs: SaliencyInputs) -> Any:
  return snip_scores(inputs.values, _prunable.prunable_leaves(inputs.updates, inputs.flags))


def obd_saliency(num_probes: int = 1) -> Saliency:
  """OBD saliency for the transforms: Hutchinson diagonal at the current params.

  Needs ``grad_fn`` in ``update`` (as ``sam_perturb`` does). Costs
  ``num_probes`` Hessian-vector products per dual update, not per step.

  Args:
    num_probes: Rademacher probes per estimate of the Hessian diagonal.

  Returns:
    A saliency callable ``SaliencyInputs -> scores`` for the ``scores``
    argument of :func:`safe_optax.safe_plus` / :func:`safe_optax.admm_penalty`.

  Raises:
    ValueError: ``num_probes`` is not a positive int.

  Examples:
    >>> import jax, jax.numpy as jnp, safe_optax
    >>> loss = lambda p: jnp.sum(jnp.array([[100., 1.], [1., 1.]]) * p['w'] ** 2)
    >>> grad_fn = lambda p, _: jax.grad(loss)(p)
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1.0, scores=safe_optax.obd_saliency())
    >>> params = {'w': jnp.array([[1., -1.], [2., 1.]])}
    >>> _, state = tx.update(grad_fn(params, 0), tx.init(params), params, grad_fn=grad_fn)
    >>> safe_optax.find_admm_state(state).z  # sqrt(h) |w| = [[14.1, 1.4], [2.8, 1.4]]
    {'w': Array([[1., 0.],
           [2., 0.]], dtype=float32)}
  """
  if not isinstance(num_probes, int) or num_probes < 1:
    raise ValueError(f"`num_probes` must be a positive int, got {num_probes!r}.")

  def saliency(inputs: SaliencyInputs) -> Any:
    if inputs.grad_fn is None:
      raise ValueError(
          "OBD scores need `grad_fn` passed to update(): tx.update(grads, state, params, "
          "grad_fn=grad_fn) with grad_fn(params, step) -> grads."
      )
    diag = hutchinson_diagonal(inputs.grad_fn, inputs.params, inputs.key, num_probes)
    return obd_scores(inputs.values, _prunable.prunable_leaves(diag, inputs.flags))

  return saliency


def wanda_saliency(input_norms: Any, *, axis: int = -2) -> Saliency:
  """Wanda saliency for the transforms from fixed per-input-feature norms.

  Args:
    input_norms: pytree shaped like the params with a 1-D ``||A_j||`` array
      for each prunable leaf (``None`` elsewhere).
    axis: the input-feature axis of each weight.

  Returns:
    A saliency callable ``SaliencyInputs -> scores`` for the ``scores``
    argument of :func:`safe_optax.safe_plus` / :func:`safe_optax.admm_penalty`
    (one threshold per group of the structure: combine with
    ``structure=PerOutput()`` for Wanda's per-row comparison).

  Examples:
    >>> import jax, jax.numpy as jnp, safe_optax
    >>> norms = {'b': None, 'w': jnp.array([3., 1.])}  # ||A_j|| of the 2 input features
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1.0, scores=safe_optax.wanda_saliency(norms))
    >>> params = {'b': jnp.zeros(2), 'w': jnp.array([[1., -1.], [2., 1.]])}
    >>> zero = jax.tree.map(jnp.zeros_like, params)
    >>> _, state = tx.update(zero, tx.init(params), params)
    >>> safe_optax.find_admm_state(state).z['w']  # scores [[3, 3], [2, 1]]
    Array([[ 1., -1.],
           [ 0.,  0.]], dtype=float32)

  References:
    Sun, Liu, Bair, Kolter, `A Simple and Effective Pruning Approach for Large
    Language Models <https://arxiv.org/abs/2306.11695>`_, ICLR 2024.
  """
  def saliency(inputs: SaliencyInputs) -> Any:
    norms = jax.tree.structure(inputs.params).flatten_up_to(input_norms)
    return wanda_scores(
        inputs.values, [n for n, f in zip(norms, inputs.flags) if f], axis=axis
    )

  return saliency


SALIENCIES = ("magnitude", "snip", "obd")


def get_saliency(scores: Union[None, str, Saliency]) -> Optional[Saliency]:
  """Resolves the ``scores`` argument of the transforms; ``None`` means magnitude.

  Args:
    scores: ``None``, ``"magnitude"``, ``"snip"``, ``"obd"`` (one Hutchinson
      probe), or a callable ``SaliencyInputs -> scores`` such as
      :func:`wanda_saliency` or :func:`obd_saliency`.

  Returns:
    The saliency callable, or ``None`` for magnitude.

  Raises:
    ValueError: any other ``scores``, naming the allowed values.
  """
  if scores is None or scores == "magnitude":
    return None
  if scores == "snip":
    return _snip
  if scores == "obd":
    return obd_saliency()
  if callable(scores):
    return scores
  raise ValueError(
      f"`scores` must be one of {SALIENCIES}, a callable SaliencyInputs -> scores, "
      f"or None; got {scores!r}."
  )
