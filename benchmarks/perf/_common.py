"""Shared pieces of the training-step benchmarks (``step_overhead.py``, ``train_throughput.py``).

The optimizers compared, one jitted training step built with
:mod:`safe_optax.flax_utils` (the perturbed pass of SAM / SAFE keeps the first
pass's BatchNorm statistics), step-time summaries, and the machine / version
record every results JSON carries.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import jax
import optax

import safe_optax
from safe_optax import experiment
from safe_optax import flax_utils
from safe_optax import methods
from safe_optax.experiment import cross_entropy, versions

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


def summary(times: list[float]) -> dict[str, float]:
  """Median, mean, p10 / p90, min, max of step times (seconds in, milliseconds out)."""
  ms = sorted(1e3 * t for t in times)
  return {"n": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
          "p10_ms": ms[len(ms) // 10], "p90_ms": ms[(9 * len(ms)) // 10],
          "min_ms": ms[0], "max_ms": ms[-1]}


def cpu_info() -> dict[str, Any]:
  """CPU model, core count and load average (start of the run)."""
  return {"model": experiment.cpu_model(), "cpu_count": os.cpu_count(),
          "machine": platform.machine(), "loadavg_start": os.getloadavg()}


def run_record() -> dict[str, Any]:
  """Command, date, versions, machine and backend: the header of every results JSON."""
  return {
      "command": shlex.join([sys.executable] + sys.argv),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "versions": versions(),
      "cpu": cpu_info(), "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }


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


def write_report(report: dict[str, Any], out: str, start: float) -> None:
  """Adds the end load average and wall time, writes the JSON and says where."""
  report["cpu"]["loadavg_end"] = os.getloadavg()
  report["total_wall_s"] = time.perf_counter() - start
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"\nwrote {out} ({report['total_wall_s']:.0f} s; load average "
        f"{report['cpu']['loadavg_start'][0]:.1f} -> {report['cpu']['loadavg_end'][0]:.1f})")
