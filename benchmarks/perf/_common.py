"""Shared pieces of the training-step benchmarks (``step_overhead.py``, ``train_throughput.py``).

The optimizers compared and one jitted training step built with
:mod:`safe_optax.flax_utils` (the perturbed pass of SAM / SAFE keeps the first
pass's BatchNorm statistics). Timing and the run record: :mod:`benchmarks.harness`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax

import safe_optax
from safe_optax import flax_utils
from safe_optax import methods
from safe_optax.experiment import cross_entropy

DUAL_EVERY = 32
METHODS = ("sgd", "sam", "safe", "admm", "safe_nodual")


HYPERPARAMS = methods.Hyperparams(sparsity=0.9, epochs=1, learning_rate=0.1, warmup_epochs=0,
                                  penalty=1e-3, dual_every=DUAL_EVERY, weight_decay=1e-4)
"""The benchmarks' settings of the registry's methods (:mod:`safe_optax.methods`)."""
SCHEDULE_STEPS = 10000
"""The length of the schedules (learning rate, penalty ramp): one 'epoch' of this many steps."""
_REGISTERED = {"sgd": ("dense", {}), "safe": ("safe", {}), "admm": ("admm", {}),
               "safe_nodual": ("safe", {"dual_every": 2**30})}


def make_tx(method: str) -> tuple[optax.GradientTransformation, bool]:
  """The optimizer and whether its ``update`` needs ``grad_fn``, from the method registry.

  * sgd: the registry's ``dense`` (weight decay 1e-4, SGD lr 0.1 with momentum 0.9,
    cosine-decayed over :data:`SCHEDULE_STEPS`);
  * sam: ``safe_optax.sam`` (rho 0.1) around sgd;
  * safe: the registry's ``safe`` (SAM + ADMM penalty 1e-3, a top-k dual update every
    32 steps, sparsity 0.9);
  * admm: SAFE without SAM; safe_nodual: SAFE whose dual update never comes.
  """
  if method == "sam":
    tx, _ = make_tx("sgd")
    return safe_optax.sam(tx, HYPERPARAMS.rho), True
  if method not in _REGISTERED:
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
  name, changes = _REGISTERED[method]
  hp = dataclasses.replace(HYPERPARAMS, method=name, **changes)
  return methods.make_optimizer(hp, SCHEDULE_STEPS), methods.get(name).uses_grad_fn


def make_step(apply_fn: Callable[..., Any], tx: optax.GradientTransformation,
              needs_grad_fn: bool, dual_due: bool | None = None,
              donate: bool = True) -> Callable[..., Any]:
  """``step(params, model_state, opt_state, batch) -> (params, model_state, opt_state, loss)``,
  jitted with the three states donated (unless ``donate=False``); ``dual_due`` (if not
  ``None``) goes to ``tx.update``."""
  hint = {} if dual_due is None else {"dual_due": dual_due}

  def step(params, model_state, opt_state, batch):
    (loss, (_, new_model_state)), grads = flax_utils.loss_and_grad_with_state(
        apply_fn, params, model_state, batch, cross_entropy)
    if needs_grad_fn:
      grad_fn = flax_utils.sam_grad_fn(apply_fn, model_state, batch, cross_entropy)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn, **hint)
    else:
      updates, opt_state = tx.update(grads, opt_state, params, **hint)
    return optax.apply_updates(params, updates), new_model_state, opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2) if donate else ())


def parse_steps(text: str | None, models: list[str], defaults: dict[str, int]) -> dict[str, int]:
  """``--steps``: ``None`` (the defaults), ``N`` for every model, or ``model=N,model=N``."""
  if text is None:
    return {m: defaults[m] for m in models}
  if "=" not in text:
    return {m: int(text) for m in models}
  steps = {m: defaults[m] for m in models}
  for item in text.split(","):
    key, value = item.split("=")
    steps[key] = int(value)
  return steps
