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
  """A PRNG key that is different at every step."""
  flags: tuple[bool, ...]
  """Prunable flags of ``params``' leaves, in flatten order."""


Saliency = Callable[[SaliencyInputs], Any]


def magnitude_scores(values: Any) -> Any:
  """``|v|``: the Euclidean projection's score (``P = I``)."""
  return jax.tree.map(jnp.abs, values)


def snip_scores(values: Any, grads: Any) -> Any:
  """``|g * v|``: SNIP's connection sensitivity (``P = g^2``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import snip_scores
    >>> snip_scores(jnp.array([1., -2.]), jnp.array([3., 0.5]))
    Array([3., 1.], dtype=float32)
  """
  return jax.tree.map(lambda v, g: jnp.abs(v * g.astype(v.dtype)), values, grads)


def obd_scores(values: Any, hessian_diag: Any) -> Any:
  """``sqrt(|h|) * |v|``: Optimal Brain Damage with a Hessian-diagonal estimate."""
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

  Examples:
    >>> import jax.numpy as jnp
    >>> from safe_optax import wanda_scores
    >>> wanda_scores(jnp.array([[1., -1.], [2., 1.]]), jnp.array([3., 1.]))
    Array([[3., 3.],
           [2., 1.]], dtype=float32)
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
  """
  leaves, treedef = jax.tree.flatten(params)
  probe_keys = jax.random.split(key, num_probes)

  def add_probe(i, total):
    keys = jax.random.split(probe_keys[i], len(leaves))
    probe = jax.tree.unflatten(treedef, [
        jax.random.rademacher(k, jnp.shape(p), dtype=jnp.result_type(p))
        for k, p in zip(keys, leaves)
    ])
    _, hvp = jax.jvp(lambda p: grad_fn(p, 0), (params,), (probe,))
    return jax.tree.map(lambda t, z, h: t + z * h, total, probe, hvp)

  # A loop, not a batch, so memory stays at one probe whatever num_probes is.
  total = jax.lax.fori_loop(0, num_probes, add_probe, jax.tree.map(jnp.zeros_like, params))
  return jax.tree.map(lambda t: t / num_probes, total)


def _prunable_leaves(tree: Any, flags: tuple[bool, ...]) -> list[Any]:
  return [leaf for leaf, flag in zip(jax.tree.leaves(tree), flags) if flag]


def _snip(inputs: SaliencyInputs) -> Any:
  return snip_scores(inputs.values, _prunable_leaves(inputs.updates, inputs.flags))


def obd_saliency(num_probes: int = 1) -> Saliency:
  """OBD saliency for the transforms: Hutchinson diagonal at the current params.

  Needs ``grad_fn`` in ``update`` (as ``sam_perturb`` does). Costs
  ``num_probes`` Hessian-vector products per dual update, not per step.
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
    return obd_scores(inputs.values, _prunable_leaves(diag, inputs.flags))

  return saliency


def wanda_saliency(input_norms: Any, *, axis: int = -2) -> Saliency:
  """Wanda saliency for the transforms from fixed per-input-feature norms.

  Args:
    input_norms: pytree shaped like the params with a 1-D ``||A_j||`` array
      for each prunable leaf (``None`` elsewhere).
    axis: the input-feature axis of each weight.
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
