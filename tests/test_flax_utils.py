"""Tests for `safe_optax.flax_utils` (SAM / SAFE steps on Linen models with BatchNorm).

A tiny Dense-BN-ReLU-Dropout-Dense model with numpy-drawn weights (random
initialisers inside jit cost seconds of XLA compile on CPU). Checked:

* after a full SAM or SAFE step the BatchNorm running statistics are
  bit-for-bit those of the first, unperturbed forward pass alone, and differ
  from what the perturbed pass would have stored;
* the gradient handed on by `sam_perturb` is the gradient at ``x + e``,
  ``e = rho * g / ||g||``, computed here by hand with `jax.grad` on the same
  batch and dropout key, and differs from the clean gradient when ``rho > 0``;
* the first pass agrees with a direct `jax.value_and_grad`; `grad_fn` ignores
  its step, honours the dropout key, and works for models without BatchNorm.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax
from safe_optax import flax_utils

RHO = 0.5


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x)
    x = nn.relu(x)
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(3)(x)


MODEL = Net()


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def numpy_init(model, x, seed=0):
  abstract = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, train=False), x)
  rng = np.random.default_rng(seed)
  variables = jax.tree.map(lambda s: (0.7 * rng.normal(size=s.shape)).astype(np.float32),
                           abstract)
  params = variables.pop("params")
  if "batch_stats" in variables:  # running var must be positive
    variables["batch_stats"] = jax.tree.map(np.abs, variables["batch_stats"])
  return params, variables


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 5)) + 1.0, jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, size=16), jnp.int32)
  params, model_state = numpy_init(MODEL, x)
  return params, model_state, (x, y), jax.random.PRNGKey(7)


def first_pass_stats(params, model_state, batch, key):
  """The reference: BN statistics of one unperturbed training forward pass, nothing else."""
  _, new_state = MODEL.apply({"params": params, **model_state}, batch[0], train=True,
                             mutable=["batch_stats"], rngs={"dropout": key})
  return new_state


def direct_grad(params, model_state, batch, key):
  def loss(p):
    logits, _ = MODEL.apply({"params": p, **model_state}, batch[0], train=True,
                            mutable=["batch_stats"], rngs={"dropout": key})
    return loss_fn(logits, batch[1])
  return jax.grad(loss)(params)


TXS = {
    "sam": lambda: optax.chain(safe_optax.sam_perturb(RHO), optax.add_decayed_weights(1e-4),
                               optax.sgd(0.1, 0.9)),
    "safe": lambda: safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=100, dual_every=2,
                                    rho=RHO, weight_decay=1e-4),
}


def make_train_step(tx):
  def train_step(params, model_state, opt_state, batch, key):
    (loss, (_, new_state)), grads = flax_utils.loss_and_grad_with_state(
        MODEL.apply, params, model_state, batch, loss_fn, rng=key)
    grad_fn = flax_utils.sam_grad_fn(MODEL.apply, model_state, batch, loss_fn, rng=key)
    updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    return optax.apply_updates(params, updates), new_state, opt_state, loss
  return train_step


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TXS))
def test_bn_stats_after_full_step_are_the_first_pass_stats(setup, name):
  """Bit-for-bit, so the step runs eagerly: under jit the step and the reference
  are different XLA programs whose fusions may round differently (1 ulp seen)."""
  params, model_state, batch, key = setup
  tx = TXS[name]()
  train_step = make_train_step(tx)
  reference = first_pass_stats
  opt_state = tx.init(params)
  for step in range(3):  # SAFE: step 0 runs the initial projection, step 2 a dual update
    step_key = jax.random.fold_in(key, step)
    expected = reference(params, model_state, batch, step_key)["batch_stats"]["BatchNorm_0"]
    # What the perturbed pass would have stored, for contrast.
    g = direct_grad(params, model_state, batch, step_key)
    norm = optax.tree.norm(g)
    perturbed = jax.tree.map(lambda p, gi: p + RHO * gi / norm, params, g)
    wrong = reference(perturbed, model_state, batch, step_key)["batch_stats"]["BatchNorm_0"]

    params, model_state, opt_state, _ = train_step(params, model_state, opt_state, batch,
                                                   step_key)
    got = model_state["batch_stats"]["BatchNorm_0"]
    for stat in ("mean", "var"):
      np.testing.assert_array_equal(np.asarray(got[stat]), np.asarray(expected[stat]))
      assert np.max(np.abs(np.asarray(got[stat]) - np.asarray(wrong[stat]))) > 1e-3
  assert set(model_state) == {"batch_stats"}


def test_perturbed_gradient_is_the_gradient_at_params_plus_e(setup):
  params, model_state, batch, key = setup
  (_, _), clean = flax_utils.loss_and_grad_with_state(
      MODEL.apply, params, model_state, batch, loss_fn, rng=key)
  grad_fn = flax_utils.sam_grad_fn(MODEL.apply, model_state, batch, loss_fn, rng=key)
  tx = safe_optax.sam_perturb(RHO)
  sam, _ = tx.update(clean, tx.init(params), params, grad_fn=grad_fn)

  # By hand: e = rho * g / ||g|| (norm over all leaves, in float64).
  flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(clean)])
  e = jax.tree.map(lambda g: RHO * np.asarray(g, np.float64) / np.linalg.norm(flat), clean)
  at_e = jax.tree.map(lambda p, ei: jnp.asarray(np.asarray(p, np.float64) + ei, jnp.float32),
                      params, e)
  expected = direct_grad(at_e, model_state, batch, key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), sam,
               expected)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(sam),
                                                            jax.tree.leaves(clean)))
  assert diff > 1e-2
  # rho = 0: the "perturbed" gradient is the clean one.
  zero_tx = safe_optax.sam_perturb(0.0)
  same, _ = zero_tx.update(clean, zero_tx.init(params), params, grad_fn=grad_fn)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), same, clean)


def test_first_pass_matches_direct_value_and_grad(setup):
  params, model_state, batch, key = setup
  (loss, (logits, new_state)), grads = flax_utils.loss_and_grad_with_state(
      MODEL.apply, params, model_state, batch, loss_fn, rng={"dropout": key})
  expected_grads = direct_grad(params, model_state, batch, key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), grads,
               expected_grads)
  expected_logits, expected_state = MODEL.apply(
      {"params": params, **model_state}, batch[0], train=True, mutable=["batch_stats"],
      rngs={"dropout": key})
  np.testing.assert_allclose(logits, expected_logits, rtol=1e-6)
  np.testing.assert_allclose(loss, loss_fn(expected_logits, batch[1]), rtol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, new_state, expected_state)
  # The running statistics moved (the pass really was in training mode).
  assert not np.allclose(new_state["batch_stats"]["BatchNorm_0"]["mean"],
                         model_state["batch_stats"]["BatchNorm_0"]["mean"])


def test_grad_fn_ignores_step_and_uses_the_given_key(setup):
  params, model_state, batch, key = setup
  grad_fn = flax_utils.sam_grad_fn(MODEL.apply, model_state, batch, loss_fn, rng=key)
  g0, g1 = grad_fn(params, 0), grad_fn(params, 1)
  jax.tree.map(np.testing.assert_array_equal, g0, g1)
  same_key = flax_utils.sam_grad_fn(MODEL.apply, model_state, batch, loss_fn,
                                    rng={"dropout": key})(params, 0)
  jax.tree.map(np.testing.assert_array_equal, g0, same_key)
  other = flax_utils.sam_grad_fn(MODEL.apply, model_state, batch, loss_fn,
                                 rng=jax.random.PRNGKey(8))(params, 0)
  assert not np.allclose(other["Dense_1"]["kernel"], g0["Dense_1"]["kernel"])
  # No BatchNorm state is returned: the gradient has exactly the params' structure.
  assert jax.tree.structure(g0) == jax.tree.structure(params)


def test_model_without_batch_stats():
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  apply_fn = lambda v, x, train, **kw: model.apply(v, x, **kw)  # noqa: E731
  x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  y = jnp.array([0, 1, 1, 0])
  abstract = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x), x)
  rng = np.random.default_rng(3)
  model_state = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), abstract)
  params = model_state.pop("params")
  assert model_state == {}

  @jax.jit
  def run(params):
    (_, (_, new_state)), grads = flax_utils.loss_and_grad_with_state(
        apply_fn, params, {}, (x, y), loss_fn)
    expected = jax.grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
    sam_grads = flax_utils.sam_grad_fn(apply_fn, {}, (x, y), loss_fn)(params, 0)
    return new_state, grads, expected, sam_grads

  new_state, grads, expected, sam_grads = run(params)
  assert new_state == {}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, expected)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), sam_grads, grads)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-3


def test_batch_must_be_a_pair(setup):
  params, model_state, batch, _ = setup
  with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
    flax_utils.loss_and_grad_with_state(MODEL.apply, params, model_state,
                                        {"image": batch[0], "label": batch[1]}, loss_fn)


@pytest.mark.slow
def test_linen_programs_do_not_load_flax_nnx_and_the_nnx_helpers_load_it_on_use():
  """flax.nnx costs about a second of every CLI process's start (it imports IPython):
  the Linen engines never load it; flax_utils' NNX helpers still resolve, from the module
  and by name."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = ("import sys\n"
          "from safe_optax.vision import cli, train\n"
          "from safe_optax.llm import cli as llm_cli, prune\n"
          "from safe_optax import flax_utils\n"
          "print('flax.nnx' in sys.modules)\n"
          "from safe_optax.flax_utils import nnx_sam_grad_fn\n"
          "print('flax.nnx' in sys.modules, nnx_sam_grad_fn.__name__,\n"
          "      sorted(set(flax_utils.__all__) - set(dir(flax_utils))))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.split("\n")
  assert out[0] == "False", out
  assert out[1] == "True nnx_sam_grad_fn []", out
  with pytest.raises(AttributeError, match="no attribute 'nnx_missing'"):
    flax_utils.nnx_missing  # pylint: disable=pointless-statement
