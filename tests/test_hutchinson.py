"""Tests for :func:`safe_optax.hutchinson_diagonal`'s three paths against a dense reference.

Outside ``jit`` the probes run in a Python loop over one jitted product, inside
``jit`` up to ``_MAX_UNROLLED_PROBES`` are unrolled and more run in a
``fori_loop``. All three must give ``mean_i z_i * (H z_i)`` for the same
probes, with ``H`` the dense Hessian of a small conv net (``jax.hessian`` of
the flattened loss, compared in float64 on the host).
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import safe_optax
from safe_optax import _scores

KEY = jax.random.PRNGKey(3)


def conv_net():
  """A 3x3 conv (4 channels), tanh, a dense head: the backward pass has convolutions."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"conv": 0.5 * jax.random.normal(keys[0], (3, 3, 2, 4)),
            "dense": 0.3 * jax.random.normal(keys[1], (6 * 6 * 4, 3))}
  images = jax.random.normal(keys[2], (5, 6, 6, 2))
  labels = jax.random.randint(keys[3], (5,), 0, 3)

  def loss(p):
    h = jax.lax.conv_general_dilated(images, p["conv"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    logits = jnp.tanh(h).reshape(5, -1) @ p["dense"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss, params


@functools.cache
def dense_hessian() -> np.ndarray:
  loss, params = conv_net()
  flat, unravel = ravel_pytree(params)
  return np.asarray(jax.jit(jax.hessian(lambda f: loss(unravel(f))))(flat), np.float64)


def reference_diagonal(params, key, num_probes):
  """``mean_i z_i * (H z_i)`` from the dense Hessian, probes drawn as the estimator does."""
  flat, _ = ravel_pytree(params)
  hessian = dense_hessian()
  total = np.zeros(flat.size)
  for probe_key in jax.random.split(key, num_probes):
    z = np.asarray(ravel_pytree(optax.tree.random_like(probe_key, params,
                                                       jax.random.rademacher))[0], np.float64)
    assert set(np.unique(z)) <= {-1.0, 1.0}
    total += z * (hessian @ z)
  return total / num_probes


@pytest.mark.parametrize("num_probes", [1, 3, _scores._MAX_UNROLLED_PROBES + 2],
                         ids=["one", "unrolled", "looped"])
def test_every_path_matches_the_dense_reference(num_probes):
  loss, params = conv_net()
  grad_fn = lambda p, _: jax.grad(loss)(p)
  want = reference_diagonal(params, KEY, num_probes)
  eager = safe_optax.hutchinson_diagonal(grad_fn, params, KEY, num_probes)
  jitted = jax.jit(lambda p, k: safe_optax.hutchinson_diagonal(grad_fn, p, k, num_probes))(
      params, KEY)
  for got in (eager, jitted):
    np.testing.assert_allclose(np.asarray(ravel_pytree(got)[0], np.float64), want, rtol=2e-4,
                               atol=1e-6)
  # The same probes and sums: the two paths differ by the products' rounding only.
  np.testing.assert_allclose(ravel_pytree(eager)[0], ravel_pytree(jitted)[0], rtol=1e-5,
                             atol=1e-7)


def _convolutions_in_loops(jaxpr, in_loop: bool = False) -> int:
  """Convolutions of ``jaxpr`` (recursively) inside a ``while`` or ``scan`` body."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "conv_general_dilated":
      count += in_loop
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _convolutions_in_loops(sub, in_loop or eqn.primitive.name in ("while", "scan"))
  return count


def _has_loop(num_probes: int) -> bool:
  loss, params = conv_net()
  grad_fn = lambda p, _: jax.grad(loss)(p)
  closed = jax.make_jaxpr(lambda p, k: safe_optax.hutchinson_diagonal(grad_fn, p, k, num_probes))(
      params, KEY)
  return _convolutions_in_loops(closed.jaxpr) > 0


def test_few_probes_inside_jit_are_unrolled_and_many_are_looped():
  """XLA:CPU runs a loop body's backward convolutions ~20x slower (jax-ml/jax#12868)."""
  assert not _has_loop(1)
  assert not _has_loop(_scores._MAX_UNROLLED_PROBES)
  assert _has_loop(_scores._MAX_UNROLLED_PROBES + 1)


def test_outside_jit_one_program_serves_every_call_of_a_grad_fn():
  loss, params = conv_net()
  grad_fn = lambda p, _: jax.grad(loss)(p)
  first = safe_optax.hutchinson_diagonal(grad_fn, params, KEY, 2)
  before = _scores._add_probe_program.cache_info()
  again = safe_optax.hutchinson_diagonal(grad_fn, params, KEY, 2)
  after = _scores._add_probe_program.cache_info()
  assert after.hits == before.hits + 1 and after.misses == before.misses
  np.testing.assert_array_equal(ravel_pytree(first)[0], ravel_pytree(again)[0])
  # The caller's params are not donated with the running sum.
  assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("num_probes", [0, -1, 2.0, True])
def test_num_probes_must_be_a_positive_int(num_probes):
  with pytest.raises(ValueError, match="num_probes"):
    safe_optax.hutchinson_diagonal(lambda p, _: p, jnp.ones(2), KEY, num_probes)
