"""Experimental: XLA:CPU workarounds, outside the stable API.

They exist for speed on XLA:CPU only and may change or go without notice:

* :func:`canonical_convs`: a function's convolutions in XLA:CPU's canonical
  order, for ``lax.scan`` / ``while_loop`` / ``cond`` bodies that
  differentiate conv nets on CPU;
* :func:`is_dual_step` and :func:`run_dual_update`: a training loop that
  counts steps on the host compiles the step without the projection on the
  ``K - 1`` steps of ``K`` that have no dual update (``update(...,
  dual_due=is_dual_step(t, K))``), or runs the dual update as a program of
  its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from safe_optax import _admm_state
from safe_optax import _schedules
from safe_optax._conv_layout import canonical_convs

__all__ = (
    "canonical_convs",
    "is_dual_step",
    "run_dual_update",
)


def is_dual_step(count: int, dual_every: int) -> bool:
  r"""Whether update number ``count`` of :func:`safe_optax.admm_penalty` runs the dual update.

  The transform decides this inside the program with a ``lax.cond``, so every
  step's compiled program carries the projection: XLA:CPU allocates the
  temporaries of both branches at every call (on a 266k-weight MLP, 4.7 MiB
  against 1.3 MiB, hundreds of page faults and about 20 % of a step on CPU),
  and the cond itself costs a few percent of an LLM block's step. A training
  loop that counts steps on the host can pass
  ``update(..., dual_due=is_dual_step(step, K))`` through a
  ``jax.jit(..., static_argnames="dual_due")`` step: two programs are
  compiled, and the one for the ``K - 1`` steps without a dual update has no
  projection. The results are the same bit for bit; a wrong
  ``dual_due=False`` skips that dual update and counts it in
  :attr:`safe_optax.ADMMState.invalid_hyperparams`. With a traced ``dual_every``
  (``optax.inject_hyperparams``) leave ``dual_due`` unset. On XLA:CPU, running
  the dual update as a program of its own (:func:`safe_optax.experimental.run_dual_update`) and the
  dual step with ``dual_due=False`` is faster still.

  Args:
    count: the transform's update count before this update (the number of
      ``update`` calls so far, a host int; 0 at the first step).
    dual_every: ``K``, as given to :func:`safe_optax.admm_penalty`.

  Returns:
    ``count % dual_every == 0``, as a Python bool.

  Raises:
    ValueError: ``count`` negative or ``dual_every`` < 1.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax
    >>> from safe_optax import admm_penalty
    >>> from safe_optax.experimental import is_dual_step
    >>> tx = optax.chain(admm_penalty(0.5, penalty=1.0, dual_every=2), optax.sgd(0.1))
    >>> @functools.partial(jax.jit, static_argnames="dual_due")
    ... def step(params, state, *, dual_due):
    ...   zero = jax.tree.map(jnp.zeros_like, params)
    ...   updates, state = tx.update(zero, state, params, dual_due=dual_due)
    ...   return optax.apply_updates(params, updates), state
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> state = tx.init(params)
    >>> for t in range(50):
    ...   params, state = step(params, state, dual_due=is_dual_step(t, 2))
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)
    >>> int(state[0].invalid_hyperparams)
    0
  """
  _schedules.check_positive_int(dual_every, "dual_every")
  if count < 0:
    raise ValueError(f"`count` must be a non-negative step count, got {count!r}.")
  return count % dual_every == 0


def run_dual_update(tx: optax.GradientTransformation, opt_state: Any, params: Any,
                    **extra_args: Any) -> Any:
  r"""Runs the dual update due at this step of every ADMM transform in ``tx``, alone.

  Returns ``opt_state`` with ``z = Proj(x + u)`` and ``u = u + x - z`` done
  for this update count (where it is a dual step) and nothing else changed: no
  count advances, no other transform's state moves. The training step that
  follows, called with ``dual_due=False``, then skips the projection and
  finds this count's dual update done, so the pair equals one step that runs
  it, bit for bit. Jit it as a program of its own: on dual steps a loop runs

  .. code-block:: python

    if is_dual_step(t, K):
      opt_state = dual(opt_state, params)   # jax.jit(partial(run_dual_update, tx))
    params, opt_state = step(params, opt_state, batch, dual_due=False)

  On XLA:CPU a small MLP's fused dual step fell into a slow mode (4-6 ms
  instead of about 2 ms) in some processes; this program, undonated, then a
  plain step did not, in 12 of 12 (README, "Step overhead"). Do not donate
  its ``opt_state``: donated, the same program was slow in most calls. A
  count that is not a dual step, or whose dual update has already run, leaves
  ``opt_state`` as it is, so a second call is harmless.

  Only the magnitude-scored dual update (SAFE, ADMM, SAFE-SG, SAFE-Multi) can
  run alone; SAFE+'s saliency reads the step's gradient and is refused. Under
  ``optax.MultiSteps`` the transform counts accumulated steps: call it on the
  micro-step that ends an accumulation whose inner count is due (on other
  micro-steps it changes nothing).

  Args:
    tx: the optimizer holding the :func:`safe_optax.admm_penalty` (or
      :func:`safe_optax.decoupled_admm_penalty`), e.g. :func:`safe_optax.safe`.
    opt_state: its state before this step.
    params: the current parameters ``x``.
    **extra_args: passed to ``tx.update`` (a ``grad_fn`` is supplied when
      missing: SAM's transforms need one to trace, and their output is unused).

  Returns:
    The new optimizer state, with the structure of ``opt_state``. Undonated,
    a jitted call copies the state's unchanged leaves too (momentum, SAM's);
    a program that returns only the :class:`safe_optax.ADMMState` nodes avoids that
    (``safe_optax.vision.steps.dual_step`` does).

  Raises:
    ValueError: ``opt_state`` holds no :class:`safe_optax.ADMMState`, or an ADMM
      transform scores with a saliency.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax
    >>> from safe_optax import admm_penalty
    >>> from safe_optax.experimental import is_dual_step, run_dual_update
    >>> tx = optax.chain(admm_penalty(0.5, penalty=1.0, dual_every=2), optax.sgd(0.1))
    >>> dual = jax.jit(functools.partial(run_dual_update, tx))
    >>> @jax.jit
    ... def step(params, state):  # never holds the projection
    ...   updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params,
    ...                              dual_due=False)
    ...   return optax.apply_updates(params, updates), state
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> state = tx.init(params)
    >>> for t in range(50):
    ...   if is_dual_step(t, 2):
    ...     state = dual(state, params)
    ...   params, state = step(params, state)
    >>> jnp.round(params['w'], 2)
    Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)
    >>> int(state[0].invalid_hyperparams)  # no dual update was missed
    0
  """
  is_admm = lambda node: isinstance(node, _admm_state.ADMMState)
  if not any(is_admm(node) for node in jax.tree.leaves(opt_state, is_leaf=is_admm)):
    raise ValueError("run_dual_update needs an optimizer state holding an ADMMState "
                     "(from admm_penalty, e.g. safe_optax.safe); found none in `opt_state`.")
  extra_args.setdefault("grad_fn", lambda p, _: jax.tree.map(jnp.zeros_like, p))
  zeros = jax.tree.map(jnp.zeros_like, params)
  _, ran = tx.update(zeros, opt_state, params, dual_due=_admm_state.DUAL_ONLY, **extra_args)
  # Keep only the ADMM states' dual update; whatever else moved (momentum, SAM's
  # state) is dropped, and XLA removes the computation that fed it.
  return jax.tree.map(lambda old, new: new if is_admm(old) else old, opt_state, ran,
                      is_leaf=is_admm)
