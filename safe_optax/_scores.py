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
saliency is a :class:`Saliency` wrapping ``SaliencyInputs -> scores``
(:func:`snip_saliency`, :func:`obd_saliency`, :func:`wanda_saliency`),
evaluated at each dual update on ``v = x + u``; ``None`` is magnitude.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from safe_optax import _conv_layout
from safe_optax import _prunable
from safe_optax import _schedules

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


@dataclasses.dataclass(frozen=True)
class Saliency:
  """A SAFE+ saliency for the transforms' ``scores=``: ``fn(SaliencyInputs) -> scores``.

  :func:`snip_saliency`, :func:`obd_saliency` and :func:`wanda_saliency`
  build one; wrap your own function as ``Saliency(fn)``. It is not itself
  callable, so ``optax.inject_hyperparams`` keeps it as a static argument
  (it would call a bare function as a schedule).
  """

  fn: Callable[[SaliencyInputs], Any]
  """Returns the list of scores of ``inputs.values`` (higher is kept)."""


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


def is_traced(*trees: Any) -> bool:
  """Whether any leaf is a tracer: the call is inside ``jit``, ``vmap``, ``grad``..."""
  return any(isinstance(leaf, jax.core.Tracer) for tree in trees for leaf in jax.tree.leaves(tree))


def cached_program(factory: Callable[[Callable[..., Any]], Any],
                   fn: Callable[..., Any]) -> Any:
  """``factory(fn)`` from its ``functools.lru_cache``; built afresh when ``fn`` is unhashable."""
  try:
    return factory(fn)
  except TypeError:
    return factory.__wrapped__(fn)


def probe_mean(add_probe: Callable[[Any, Any], Any], params: Any, key: jax.Array,
               num_probes: int, *, loop: bool) -> Any:
  """``mean_z z * (H z)`` over ``num_probes`` Rademacher probes drawn from ``key``.

  Every Hutchinson estimate of the project draws its probes here, so the
  jitted, eager and looped paths estimate from the same vectors.

  Args:
    add_probe: ``(total, z) -> total + z * (H z)``.
    params: pytree the probes are shaped like.
    key: PRNG key, split into one key per probe.
    num_probes: how many probes.
    loop: a ``lax.fori_loop`` over the probes (inside ``jit``: memory of one
      probe; its body goes through :func:`safe_optax.experimental.canonical_convs`, since
      XLA:CPU would run the backward convolutions of a loop body on a naive
      emitter, 20x slower, jax-ml/jax#12868), else a Python loop (outside
      ``jit``: one dispatch of a jitted ``add_probe`` per probe; inside: the
      probes unrolled into the program).

  Returns:
    A pytree like ``params``.
  """
  probe_keys = jax.random.split(key, num_probes)

  def add(i, total):
    return add_probe(total, _rademacher_like(probe_keys[i], params))

  total = optax.tree.zeros_like(params)
  if loop:
    total = jax.lax.fori_loop(0, num_probes, _conv_layout.canonical_convs(add), total)
  else:
    for i in range(num_probes):
      total = add(i, total)
  return optax.tree.scale(1.0 / num_probes, total)


@jax.jit
def _rademacher_like(key: jax.Array, params: Any) -> Any:
  """A Rademacher probe shaped like ``params`` (jitted: one dispatch outside ``jit``)."""
  return optax.tree.random_like(key, params, jax.random.rademacher)


def _add_probe(grad_fn: GradFn, total: Any, params: Any, probe: Any) -> Any:
  """``total + z * (H z)``, ``H z`` a forward-over-reverse product (``jax.jvp`` of ``grad_fn``)."""
  _, hvp = jax.jvp(lambda p: grad_fn(p, 0), (params,), (probe,))
  return optax.tree.add(total, optax.tree.mul(probe, hvp))


@functools.lru_cache(maxsize=8)
def _add_probe_program(grad_fn: GradFn) -> Callable[[Any, Any, Any], Any]:
  """:func:`_add_probe` of ``grad_fn`` jitted, once per ``grad_fn`` (cached; the total donated)."""
  return jax.jit(functools.partial(_add_probe, grad_fn), donate_argnums=0)


# Inside jit, up to this many probes are unrolled into the program (the
# default, and OBD's usual count, is 1); more run in a loop, whose memory does
# not grow with the count.
_MAX_UNROLLED_PROBES = 4


def hutchinson_diagonal(
    grad_fn: GradFn, params: Any, key: jax.Array, num_probes: int = 1
) -> Any:
  """Hutchinson estimate of the Hessian diagonal, ``mean_z z * (H z)``.

  ``H z`` is a forward-over-reverse Hessian-vector product of ``grad_fn``
  (``jax.jvp`` of the gradient), with Rademacher probes ``z``. Called with
  concrete ``params`` and ``key`` (outside ``jax.jit``), the probes run in a
  Python loop over one jitted product (compiled once per ``grad_fn``, which
  should then be a function kept between calls); inside ``jit`` up to
  four probes are unrolled into the program and more run in a
  ``lax.fori_loop`` whose body goes through :func:`safe_optax.experimental.canonical_convs`
  (XLA:CPU would run the backward convolutions of a loop body on a naive
  emitter, jax-ml/jax#12868).

  Args:
    grad_fn: ``grad_fn(params, step) -> grads`` (optax's SAM convention).
    params: where the Hessian is taken.
    key: PRNG key for the probes.
    num_probes: number of probes averaged (a positive int).

  Returns:
    A pytree like ``params``: the estimate of ``diag(H)``, unbiased; exact
    when the Hessian is diagonal.

  Raises:
    ValueError: ``num_probes`` is not a positive int.

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
  _schedules.check_positive_int(num_probes, "num_probes")
  if is_traced(params, key):
    return probe_mean(lambda total, z: _add_probe(grad_fn, total, params, z), params, key,
                      num_probes, loop=num_probes > _MAX_UNROLLED_PROBES)
  program = cached_program(_add_probe_program, grad_fn)
  params = jax.device_put(params)  # once, not per product
  return probe_mean(lambda total, z: program(total, params, z), params, key, num_probes,
                    loop=False)


def snip_saliency() -> Saliency:
  """SNIP saliency for the transforms: :func:`snip_scores` with the step's gradient.

  Scores ``|g * v|``, ``g`` the gradient entering the transform (the SAM
  gradient in :func:`safe_optax.safe_plus`, also with ``decoupled_penalty``).

  Args:
    (none): the gradient comes from the transform at each dual update.

  Returns:
    A :class:`Saliency` for the ``scores``
    argument of :func:`safe_optax.safe_plus` / :func:`safe_optax.admm_penalty`.

  Examples:
    >>> import jax, jax.numpy as jnp, safe_optax
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1.0, scores=safe_optax.snip_saliency())
    >>> params = {'w': jnp.array([[1., -1.], [2., 1.]])}
    >>> grads = {'w': jnp.array([[4., 1.], [0.5, 3.]])}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> safe_optax.find_admm_state(state).z['w']  # |g w| = [[4, 1], [1, 3]]
    Array([[1., 0.],
           [0., 1.]], dtype=float32)

  References:
    Lee, Ajanthan, Torr, `SNIP: Single-shot Network Pruning based on
    Connection Sensitivity <https://arxiv.org/abs/1810.02340>`_, ICLR 2019.
  """
  def saliency(inputs: SaliencyInputs) -> Any:
    return snip_scores(inputs.values, _prunable.prunable_leaves(inputs.updates, inputs.flags))

  return Saliency(saliency)


def obd_saliency(num_probes: int = 1) -> Saliency:
  """OBD saliency for the transforms: Hutchinson diagonal at the current params.

  Needs ``grad_fn`` in ``update`` (as ``sam_perturb`` does). Costs
  ``num_probes`` Hessian-vector products per dual update, not per step.

  Args:
    num_probes: Rademacher probes per estimate of the Hessian diagonal.

  Returns:
    A :class:`Saliency` for the ``scores``
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
  _schedules.check_positive_int(num_probes, "num_probes")

  def saliency(inputs: SaliencyInputs) -> Any:
    if inputs.grad_fn is None:
      raise ValueError(
          "OBD scores need `grad_fn` passed to update(): tx.update(grads, state, params, "
          "grad_fn=grad_fn) with grad_fn(params, step) -> grads."
      )
    diag = hutchinson_diagonal(inputs.grad_fn, inputs.params, inputs.key, num_probes)
    return obd_scores(inputs.values, _prunable.prunable_leaves(diag, inputs.flags))

  return Saliency(saliency)


def wanda_saliency(input_norms: Any, *, axis: int = -2) -> Saliency:
  """Wanda saliency for the transforms from fixed per-input-feature norms.

  Args:
    input_norms: pytree shaped like the params with a 1-D ``||A_j||`` array
      for each prunable leaf (``None`` elsewhere).
    axis: the input-feature axis of each weight.

  Returns:
    A :class:`Saliency` for the ``scores``
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

  return Saliency(saliency)


def check_saliency(scores: Optional[Saliency]) -> Optional[Callable[[SaliencyInputs], Any]]:
  """Checks the ``scores`` argument of the transforms; returns its function, or ``None``.

  Args:
    scores: ``None`` (magnitude, plain SAFE) or a :class:`Saliency`:
      :func:`snip_saliency`, :func:`obd_saliency`, :func:`wanda_saliency` or
      ``Saliency(fn)``.

  Returns:
    The saliency's function ``SaliencyInputs -> scores``, or ``None``.

  Raises:
    TypeError: anything else (strings and bare functions included), naming
      the allowed values.
  """
  if scores is None:
    return None
  if isinstance(scores, Saliency):
    return scores.fn
  hint = " (wrap a function as safe_optax.Saliency(fn))" if callable(scores) else ""
  raise TypeError(
      "`scores` must be None (magnitude) or a safe_optax.Saliency: "
      "safe_optax.snip_saliency(), safe_optax.obd_saliency(num_probes), "
      f"safe_optax.wanda_saliency(input_norms) or safe_optax.Saliency(fn){hint}; "
      f"got {scores!r}.")
