"""canonical_convs: the same convolutions in XLA:CPU's canonical order, in loops too."""

import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from jax import lax

import safe_optax
from safe_optax import _conv_layout
from safe_optax import flatness

CANONICAL_LABELS = {1: "b0f_0io->b0f", 2: "b01f_01io->b01f", 3: "b012f_012io->b012f"}


def _conv_case(draw, spatial):
  """A random convolution: shapes, window settings and dimension orders."""
  ndim = spatial + 2
  groups = draw(st.sampled_from([(1, 1), (2, 1), (1, 2)]))  # feature / batch groups
  fgc, bgc = groups
  batch = 2 * bgc
  cin = 2 * fgc
  cout = 2 * fgc * bgc
  sizes = [draw(st.integers(3, 6)) for _ in range(spatial)]
  window = [draw(st.integers(1, 3)) for _ in range(spatial)]
  strides = [draw(st.integers(1, 2)) for _ in range(spatial)]
  lhs_dil = [draw(st.integers(1, 2)) for _ in range(spatial)]
  rhs_dil = [draw(st.integers(1, 2)) for _ in range(spatial)]
  padding = [(draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(spatial)]
  lhs_spec = tuple(draw(st.permutations(range(ndim))))
  rhs_spec = tuple(draw(st.permutations(range(ndim))))
  out_spec = tuple(draw(st.permutations(range(ndim))))
  # Logical shapes (batch/out, feature/in, spatial...) placed by the specs.
  lhs_shape = [0] * ndim
  for axis, size in zip(lhs_spec, [batch, cin, *sizes]):
    lhs_shape[axis] = size
  rhs_shape = [0] * ndim
  for axis, size in zip(rhs_spec, [cout, cin // fgc, *window]):
    rhs_shape[axis] = size
  dn = lax.ConvDimensionNumbers(lhs_spec, rhs_spec, out_spec)
  kwargs = dict(window_strides=strides, padding=padding, lhs_dilation=lhs_dil,
                rhs_dilation=rhs_dil, dimension_numbers=dn, feature_group_count=fgc,
                batch_group_count=bgc)
  return lhs_shape, rhs_shape, kwargs


@st.composite
def conv_cases(draw):
  return _conv_case(draw, draw(st.integers(1, 3)))


# Every example compiles a new convolution: the profile (tests/conftest.py) sets how many.
@pytest.mark.slow
@given(conv_cases(), st.integers(0, 2**31 - 1))
def test_any_convolution_is_unchanged(case, seed):
  lhs_shape, rhs_shape, kwargs = case
  rng = np.random.default_rng(seed)  # numpy draws: jax.random would compile per shape too
  x = rng.standard_normal(lhs_shape).astype(np.float32)
  w = rng.standard_normal(rhs_shape).astype(np.float32)

  def conv(x, w):
    return lax.conv_general_dilated(x, w, precision=lax.Precision.HIGHEST, **kwargs)

  # Both in one program (one compile an example); each keeps its own convolution.
  both = jax.jit(lambda x, w: (conv(x, w), safe_optax.experimental.canonical_convs(conv)(x, w)))
  expected, got = (np.asarray(a) for a in both(x, w))
  assert got.shape == expected.shape
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_canonical_order_is_xla_cpus():
  assert _conv_layout.canonical_dimension_numbers(4) == lax.conv_dimension_numbers(
      (1, 5, 5, 3), (3, 3, 3, 4), ("NHWC", "HWIO", "NHWC"))


def _conv_net():
  def loss(k, x):
    h = lax.conv_general_dilated(x, k["a"], (2, 2), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h)
    h = lax.conv_general_dilated(h, k["b"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(jnp.tanh(h) ** 2)

  key = jax.random.PRNGKey(0)
  ka, kb, kx = jax.random.split(key, 3)
  params = {"a": 0.3 * jax.random.normal(ka, (3, 3, 2, 4)),
            "b": 0.3 * jax.random.normal(kb, (3, 3, 4, 3))}
  x = jax.random.normal(kx, (2, 8, 8, 2))
  return loss, params, x


def _conv_labels(jitted, *args):
  text = jitted.lower(*args).compile().as_text()
  return re.findall(r"convolution\(.*?dim_labels=([^,\s]+)", text)


def test_loop_bodies_get_canonical_convolutions():
  loss, params, x = _conv_net()
  grad = jax.grad(loss)

  def loop(p):
    return lax.fori_loop(0, 2, lambda i, q: jax.tree.map(lambda a, b: a - 0.1 * b, q,
                                                         grad(q, x)), p)

  before = _conv_labels(jax.jit(loop), params)
  after = _conv_labels(jax.jit(safe_optax.experimental.canonical_convs(loop)), params)
  # The backward convolutions inside the loop body are permuted without the rewrite ...
  assert any(label != CANONICAL_LABELS[2] for label in before)
  # ... and every convolution is canonical with it.
  assert after and all(label == CANONICAL_LABELS[2] for label in after)
  got, expected = jax.jit(safe_optax.experimental.canonical_convs(loop))(params), jax.jit(loop)(params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("control", ["fori", "while", "scan", "cond"])
def test_control_flow_results_are_unchanged(control):
  loss, params, x = _conv_net()
  grad = jax.grad(loss)

  def step(q):
    return jax.tree.map(lambda a, b: a - 0.1 * b, q, grad(q, x))

  def fn(p):
    if control == "fori":
      return lax.fori_loop(0, 3, lambda i, q: step(q), p)
    if control == "while":
      return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, step(c[1])), (0, p))[1]
    if control == "scan":
      return lax.scan(lambda q, _: (step(q), loss(q, x)), p, None, length=3)
    return lax.cond(loss(p, x) > 0, step, lambda q: q, p)

  expected = jax.jit(fn)(params)
  got = jax.jit(safe_optax.experimental.canonical_convs(fn))(params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_custom_derivative_rules_are_kept():
  # relu's custom JVP gives derivative 0 at 0; differentiating max(x, 0) gives 0.5.
  def f(k):
    h = lax.conv_general_dilated(jnp.zeros((1, 4, 4, 1)), k, (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jax.nn.relu(h + 0.0 * k.sum()))

  k = jnp.ones((3, 3, 1, 2))
  expected = jax.grad(f)(k)
  got = jax.grad(safe_optax.experimental.canonical_convs(f))(k)
  np.testing.assert_array_equal(got, expected)


def test_pytrees_keywords_and_no_convolution():
  def fn(tree, scale=2.0):
    return {"s": tree["a"] * scale, "t": (tree["b"].sum(),)}

  tree = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}
  got = safe_optax.experimental.canonical_convs(fn)(tree, scale=3.0)
  assert jax.tree.structure(got) == jax.tree.structure(fn(tree))
  np.testing.assert_array_equal(got["s"], jnp.arange(3.0) * 3.0)
  assert float(got["t"][0]) == 4.0


def test_not_callable_is_refused():
  with pytest.raises(TypeError, match="`fn` must be callable"):
    safe_optax.experimental.canonical_convs(3)


@pytest.mark.slow
def test_power_iteration_inside_jit_matches_outside_and_is_canonical():
  loss, params, x = _conv_net()
  batches = [x[:1], x[1:]]
  key = jax.random.PRNGKey(3)

  def measure(p, bs):
    return flatness.max_hessian_eigenvalue(loss, p, bs, key=key, tol=0.0, max_iterations=4)

  jitted = jax.jit(measure)
  inside = jitted(params, batches)
  outside = measure(params, batches)
  np.testing.assert_allclose(inside.eigenvalue, outside.eigenvalue, rtol=1e-5)
  labels = _conv_labels(jitted, params, batches)
  assert labels and all(label == CANONICAL_LABELS[2] for label in labels)


@pytest.mark.slow
def test_obd_dual_branch_is_canonical_and_matches_the_split_program():
  # SAFE+ with OBD scores differentiates the model inside the dual update's
  # lax.cond; that branch must run canonical convolutions and give what the
  # program compiled for a due dual update (no cond) gives.
  loss, params, x = _conv_net()
  grad_fn = lambda p, _: jax.grad(loss)(p, x)
  tx = safe_optax.admm(0.1, 0.5, penalty=1.0, scores=safe_optax.obd_saliency())
  state = tx.init(params)

  def step(p, s, dual_due=None):
    updates, s = tx.update(grad_fn(p, 0), s, p, grad_fn=grad_fn, dual_due=dual_due)
    return updates, s

  with_cond = jax.jit(step)
  split = jax.jit(step, static_argnames="dual_due")
  labels = _conv_labels(with_cond, params, state)
  assert labels and all(label == CANONICAL_LABELS[2] for label in labels)
  (u1, s1), (u2, s2) = with_cond(params, state), split(params, state, dual_due=True)
  for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
