"""Convolutions that XLA:CPU runs on its fast kernel inside loops and branches.

XLA:CPU runs a convolution on its Eigen kernel only when its dimension
numbers are in the canonical order (input and output batch-spatial-feature,
kernel spatial-in-out). Its ``ConvCanonicalization`` pass transposes other
convolutions into that order, but only in a program's top-level computation:
inside a ``lax.while_loop``, ``lax.fori_loop``, ``lax.scan`` or ``lax.cond``
the backward pass's kernel-gradient and input-gradient convolutions (whose
orders are permuted) run on a naive loop nest instead (jax-ml/jax#12868;
``lambda_max`` inside ``jax.jit`` cost 13.5x a plain gradient per FLOP on
ResNet-20 before this rewrite, 0.89x with it: ``benchmarks/perf/eval_speed.py``). :func:`canonical_convs` does the rewrite in JAX
before XLA sees the program: it traces a function to a jaxpr and evaluates it
again with every ``conv_general_dilated`` in canonical order between
transposes, in nested jaxprs too. The result is the same computation (the
same convolution in another memory order; bit-equal on the cases tested).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jex_core

# Call-like primitives whose body is inlined (no derivative rule is lost:
# these differentiate as their body does). Everything else with a nested
# jaxpr (scan, while, cond, custom_jvp_call, custom_vjp_call, ...) is
# rebound with its nested jaxprs rewritten, so custom derivative rules stay.
_INLINED = frozenset({"pjit", "jit", "closed_call", "core_call"})


def canonical_convs(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` with its convolutions in XLA:CPU's canonical dimension order.

  Use it around code that runs convolutions (or their gradients) inside a
  loop or branch of a jitted program on CPU: the body of a
  ``lax.while_loop``, ``lax.scan`` or ``lax.cond``, or a function whose body
  has such loops. On GPU and TPU it changes nothing that matters (their
  compilers canonicalise everywhere). Differentiating the wrapped function
  works: ``custom_jvp`` / ``custom_vjp`` functions inside keep their rules.

  Args:
    fn: a JAX-traceable function of arrays (pytrees allowed; keyword
      arguments are treated as static).

  Returns:
    A function with ``fn``'s signature and results.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> from safe_optax.experimental import canonical_convs
    >>> def conv(x, k):  # input NCHW, kernel OIHW: not XLA:CPU's canonical order
    ...   return lax.conv_general_dilated(x, k, (1, 1), "SAME",
    ...                                   dimension_numbers=("NCHW", "OIHW", "NCHW"))
    >>> x, k = jnp.ones((2, 3, 5, 5)), jnp.ones((4, 3, 3, 3))
    >>> bool(jnp.array_equal(canonical_convs(conv)(x, k), conv(x, k)))
    True
  """
  if not callable(fn):
    raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    closed, out_shape = jax.make_jaxpr(bound, return_shape=True)(*args)
    outs = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped


def canonical_dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
  """The dimension order XLA:CPU's Eigen convolution takes, for ``ndim``-d operands."""
  spatial = tuple(range(1, ndim - 1))
  feature_last = (0, ndim - 1, *spatial)
  return lax.ConvDimensionNumbers(feature_last, (ndim - 1, ndim - 2, *range(ndim - 2)),
                                  feature_last)


def _canonical_conv(lhs: jax.Array, rhs: jax.Array, *, dimension_numbers: Any,
                    **params: Any) -> jax.Array:
  """One ``conv_general_dilated`` in canonical order, transposed in and out."""
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  ndim = lhs.ndim
  canonical = canonical_dimension_numbers(ndim)
  if tuple(map(tuple, dimension_numbers)) == tuple(map(tuple, canonical)):
    return lax.conv_general_dilated_p.bind(lhs, rhs, dimension_numbers=dimension_numbers,
                                           **params)
  # Window settings (strides, padding, dilations) are listed in the order of
  # the spatial dimensions in the specs, which the transposes keep.
  lhs = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
  rhs = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
  out = lax.conv_general_dilated_p.bind(lhs, rhs, dimension_numbers=canonical, **params)
  # Axis a of the requested output is axis source[a] of the canonical one.
  source = [0] * ndim
  source[out_spec[0]] = 0
  source[out_spec[1]] = ndim - 1
  for i, axis in enumerate(out_spec[2:]):
    source[axis] = 1 + i
  return lax.transpose(out, tuple(source))


def _nested(value: Any) -> list[Any]:
  """The jaxprs (open or closed) held by one equation parameter."""
  if isinstance(value, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
    return [value]
  if isinstance(value, (tuple, list)):
    return [v for v in value if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr))]
  return []


def _open(jaxpr: Any) -> Any:
  return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


@functools.lru_cache(maxsize=256)
def _has_conv_cached(jaxpr: Any) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is lax.conv_general_dilated_p:
      return True
    if any(_has_conv(sub) for value in eqn.params.values() for sub in _nested(value)):
      return True
  return False


def _has_conv(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it) has a ``conv_general_dilated``."""
  return _has_conv_cached(_open(jaxpr))


def _rewrite_closed(closed: Any) -> Any:
  """A closed jaxpr with the same signature and canonical convolutions."""
  if not _has_conv(closed):
    return closed
  avals = [v.aval for v in closed.jaxpr.invars]
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
  rewritten = jax.make_jaxpr(lambda *xs: _evaluate(closed.jaxpr, closed.consts, xs))(*specs)
  return rewritten


def _rewrite_param(value: Any) -> Any:
  if isinstance(value, jex_core.ClosedJaxpr):
    return _rewrite_closed(value)
  if isinstance(value, tuple) and value and all(
      isinstance(v, jex_core.ClosedJaxpr) for v in value):
    return tuple(_rewrite_closed(v) for v in value)
  return value


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """``jax.core.eval_jaxpr`` with canonical convolutions (recursively)."""
  env: dict[Any, Any] = {}

  def read(var: Any) -> Any:
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    inputs = [read(v) for v in eqn.invars]
    nested = [sub for value in eqn.params.values() for sub in _nested(value)]
    with eqn.ctx.manager:
      if eqn.primitive is lax.conv_general_dilated_p:
        outputs = [_canonical_conv(*inputs, **eqn.params)]
      elif not any(_has_conv(sub) for sub in nested):
        outputs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
        outputs = outputs if eqn.primitive.multiple_results else [outputs]
      elif eqn.primitive.name in _INLINED and len(nested) == 1:
        body = nested[0]
        body_consts = body.consts if isinstance(body, jex_core.ClosedJaxpr) else ()
        outputs = _evaluate(_open(body), body_consts, inputs)
      else:
        params = {k: _rewrite_param(v) for k, v in eqn.params.items()}
        outputs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(params))
        outputs = outputs if eqn.primitive.multiple_results else [outputs]
    env.update(zip(eqn.outvars, outputs))
  return [read(v) for v in jaxpr.outvars]
