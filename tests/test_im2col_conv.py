"""safe_optax.vision.models.im2col_conv: lax.conv_general_dilated as shifted slices and one matmul.

Under ``jax.vmap`` over runs (a packed step), XLA turns a convolution with one kernel per run into
a grouped convolution; the im2col form becomes a batched matmul instead. Checked against
``lax.conv_general_dilated`` itself (values and gradients), in Flax models, and in a packed step's
lowered program.
"""

import functools

from hypothesis import example, given, settings, strategies as st
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from safe_optax.vision import configs
from safe_optax.vision import models

DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def _reference(x, w, strides, padding):
  return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=DIMENSIONS,
                                  precision=lax.Precision.HIGHEST)


def _im2col(x, w, strides, padding):
  dims = lax.conv_dimension_numbers(x.shape, w.shape, DIMENSIONS)
  return models.im2col_conv(x, w, strides, padding, dimension_numbers=dims,
                            precision=lax.Precision.HIGHEST)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
# Explicit padding that leaves the image shorter than the window: no output row (found by
# hypothesis; the slices had wrapped around to a nonempty window).
@example(batch=1, height=2, width=1, channels=1, out=1, kh=5, kw=1, strides=(1, 1),
         padding=((1, 0), (2, 1)), seed=0)
@example(batch=1, height=2, width=1, channels=1, out=1, kh=5, kw=1, strides=(2, 2),
         padding=((1, 0), (2, 1)), seed=0)
@given(batch=st.integers(1, 3), height=st.integers(1, 7), width=st.integers(1, 6),
       channels=st.integers(1, 4), out=st.integers(1, 4), kh=st.sampled_from([1, 2, 3, 5]),
       kw=st.sampled_from([1, 3]), strides=st.sampled_from([(1, 1), (2, 2), (1, 2), (3, 1)]),
       padding=st.sampled_from(["SAME", "VALID", "SAME_LOWER", ((1, 0), (2, 1))]),
       seed=st.integers(0, 2**16))
def test_values_and_gradients_match_lax_conv(batch, height, width, channels, out, kh, kw, strides,
                                             padding, seed):
  # A window larger than the (padded) image has no output position: both give an empty output.
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((batch, height, width, channels)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((kh, kw, channels, out)), jnp.float32)
  shape = jax.eval_shape(lambda x, w: _reference(x, w, strides, padding), x, w).shape
  cotangent = jnp.asarray(rng.standard_normal(shape), jnp.float32)

  # One compiled program an example (run op by op, each example compiled a few dozen).
  @jax.jit
  def values_and_gradients(x, w, cotangent):
    out = {}
    for name, conv in (("im2col", _im2col), ("lax", _reference)):
      loss = lambda x, w, conv=conv: jnp.sum(conv(x, w, strides, padding) * cotangent)
      out[name] = (conv(x, w, strides, padding), jax.grad(loss, (0, 1))(x, w))
    return out

  out = values_and_gradients(x, w, cotangent)
  (got, got_grads), (expected, expected_grads) = out["im2col"], out["lax"]
  assert got.shape == expected.shape and got.dtype == expected.dtype
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  for g, e in zip(got_grads, expected_grads):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def test_zeros_nan_and_bfloat16_pass_through_as_in_lax_conv():
  x = jnp.zeros((1, 4, 4, 2), jnp.float32).at[0, 1, 1, 0].set(jnp.nan)
  w = jnp.ones((3, 3, 2, 1), jnp.float32)
  np.testing.assert_array_equal(np.isnan(_im2col(x, w, (1, 1), "SAME")),
                                np.isnan(_reference(x, w, (1, 1), "SAME")))
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  assert _im2col(xb, wb, (1, 1), "SAME").dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs,message", [
    ({"feature_group_count": 2}, "feature_group_count=2"),
    ({"rhs_dilation": (2, 2)}, "rhs_dilation=(2, 2)"),
    ({"lhs_dilation": (2, 1)}, "lhs_dilation=(2, 1)"),
    ({"dimension_numbers": None}, "dimension_numbers"),
])
def test_what_it_does_not_cover_is_refused_by_name(kwargs, message):
  x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 2))
  call = {"dimension_numbers": lax.conv_dimension_numbers(x.shape, w.shape, DIMENSIONS), **kwargs}
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    models.im2col_conv(x, w, (1, 1), "SAME", **call)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet8", "vgg19", "lenet5"])
def test_a_model_with_im2col_convolutions_has_the_same_parameters_and_outputs(model):
  dataset = "mnist" if model == "lenet5" else "cifar10"
  shape = (2, 28, 28, 1) if model == "lenet5" else (2, 32, 32, 3)
  base = configs.Config(model=model, dataset=dataset, matmul_precision="highest")
  xla, im2col = (models.create_model(base.replace(conv_impl=impl), 10) for impl in
                 configs.CONV_IMPLS)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
  # Compiled, not op by op: two programs instead of one per operation and shape. The im2col
  # model's parameters only need their tree: its init traced, not run.
  init = lambda model: functools.partial(model.init, train=False)
  variables = jax.jit(init(xla))(jax.random.PRNGKey(0), x)
  assert (jax.tree.structure(variables)
          == jax.tree.structure(jax.eval_shape(init(im2col), jax.random.PRNGKey(0), x)))
  both = jax.jit(lambda variables, x: (im2col.apply(variables, x, train=False),
                                       xla.apply(variables, x, train=False)))
  got, want = both(variables, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_packed_im2col_step_has_no_grouped_convolution_left():
  """vmap over runs' kernels: lax's convolution becomes a grouped one, im2col a batched dot."""
  x = jnp.ones((3, 8, 16, 16, 32))
  w = jnp.ones((3, 3, 3, 32, 32))
  dims = lax.conv_dimension_numbers(x.shape[1:], w.shape[1:], DIMENSIONS)

  def lowered(conv):
    loss = lambda x, w: jnp.sum(conv(x, w, (1, 1), "SAME", dimension_numbers=dims) ** 2)
    return jax.jit(jax.vmap(jax.grad(loss, (0, 1)))).lower(x, w).as_text()

  grouped = lowered(lax.conv_general_dilated)
  assert "feature_group_count = 3" in grouped
  packed = lowered(models.im2col_conv)
  assert "convolution" not in packed and "dot_general" in packed


def test_conv_impl_is_checked_at_construction():
  with pytest.raises(ValueError, match="conv_impl"):
    configs.Config().replace(conv_impl="winograd")
  with pytest.raises(ValueError, match="conv_impl"):
    models.ResNet(blocks_per_stage=1, conv_impl="winograd").init(
        jax.random.PRNGKey(0), jnp.ones((1, 8, 8, 3)), train=False)
  assert isinstance(models.create_model(configs.Config(conv_impl="im2col"), 10), nn.Module)
