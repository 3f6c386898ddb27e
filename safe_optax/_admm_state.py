"""The state of SAFE's ADMM transforms, and what reads it.

:class:`ADMMState` (``z``, ``u``, the counts) is what
:func:`safe_optax.admm_penalty` keeps; :func:`find_admm_state` finds it in a
nested optax state and :func:`constraint_distance` measures ``||x - z||``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from safe_optax import _prunable


class ADMMState(NamedTuple):
  """State of :func:`safe_optax.admm_penalty`."""

  count: jax.Array
  """Number of updates taken (int32)."""
  z: Any
  """Sparse target ``Proj(x + u)``; ``optax.MaskedNode()`` on non-prunable leaves."""
  u: Any
  """Scaled dual variable; ``optax.MaskedNode()`` on non-prunable leaves."""
  invalid_hyperparams: jax.Array
  """Number of updates with a hyperparameter out of range (int32).

  Python values are checked at construction; traced ones (from
  ``optax.inject_hyperparams`` or a schedule) can only be checked here, so an
  out-of-range value is ignored for that update and counted: a ``sparsity``
  outside ``[0, 1)`` (or NaN) or a ``dual_every < 1`` skips the dual update,
  keeping ``z`` and ``u``; a ``penalty`` (times the decoupled
  ``learning_rate``) that is negative or not finite counts as 0. An update
  called with ``dual_due=False`` when its dual update was due (and not
  already run by :func:`safe_optax.experimental.run_dual_update`) skips that
  update and is counted too. Check it is 0 after training.
  """
  dual_count: jax.Array
  """The update count at which the dual update last ran (int32; -1 before the first).

  It makes the dual update at a count run at most once, so
  :func:`safe_optax.experimental.run_dual_update` followed by a
  ``dual_due=False`` step equals one step that runs it.
  """


DUAL_ONLY = "only"
"""The ``dual_due`` value that :func:`safe_optax.experimental.run_dual_update`
passes: run only the dual update."""


class DecoupledADMMState(NamedTuple):
  """State of :func:`safe_optax.decoupled_admm_penalty`."""

  inner: Any
  """State of the wrapped base optimizer."""
  admm: ADMMState
  """State of the penalty and dual update."""


def find_admm_state(opt_state: Any) -> ADMMState:
  """Returns the (single) :class:`ADMMState` inside a nested optax state.

  Args:
    opt_state: the state of an optimizer that contains one
      :func:`admm_penalty` (e.g. of :func:`safe_optax.safe`).

  Returns:
    That transform's :class:`ADMMState` (``count``, ``z``, ``u``).

  Raises:
    ValueError: the state holds no ``ADMMState``, or more than one.

  Examples:
    >>> import jax.numpy as jnp, safe_optax
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1e-3)
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]]), 'b': jnp.ones(2)}
    >>> zero = {'w': jnp.zeros((2, 2)), 'b': jnp.zeros(2)}
    >>> _, state = tx.update(zero, tx.init(params), params)  # step 0 sets z = Proj(x0)
    >>> admm_state = safe_optax.find_admm_state(state)
    >>> int(admm_state.count), admm_state.z  # biases carry no z
    (1, {'b': MaskedNode(), 'w': Array([[ 4., -3.],
           [ 0.,  0.]], dtype=float32)})
  """
  found = optax.tree.get_all_with_path(
      opt_state, ADMMState.__name__, filtering=lambda _, value: isinstance(value, ADMMState))
  if len(found) != 1:
    raise ValueError(f"expected exactly one ADMMState in the optimizer state, found {len(found)}.")
  return found[0][1]


def constraint_distance(params: Any, opt_state: Any) -> jax.Array:
  r"""``||x - z||_2`` over prunable leaves: how far the iterate is from its sparse target.

  .. math::

    \Big(\textstyle\sum_{\ell\ \mathrm{prunable}} \|x_\ell - z_\ell\|_2^2\Big)^{1/2}

  computed in float32. Worth logging during training: it shrinks as the
  penalty grows, and after :func:`safe_optax.finalize` the loss change is
  small when it is small.

  Args:
    params: the current parameters ``x``.
    opt_state: the optimizer state holding the :class:`ADMMState` of ``params``.

  Returns:
    A float32 scalar.

  Examples:
    >>> import jax.numpy as jnp, safe_optax
    >>> params = {'w': jnp.array([[4., -3.], [0.2, 0.1]])}
    >>> tx = safe_optax.admm(0.1, 0.5, penalty=1e-3)
    >>> _, state = tx.update({'w': jnp.zeros((2, 2))}, tx.init(params), params)
    >>> safe_optax.constraint_distance(params, state)  # z = Proj(x): sqrt(0.2**2 + 0.1**2)
    Array(0.2236068, dtype=float32)
  """
  state = find_admm_state(opt_state)
  pairs = [(x, z) for x, z in zip(jax.tree.leaves(params),
                                  jax.tree.leaves(state.z, is_leaf=_prunable.is_masked))
           if not _prunable.is_masked(z)]
  x, z = (optax.tree.cast([p[i] for p in pairs], jnp.float32) for i in (0, 1))
  return optax.tree.norm(optax.tree.sub(x, z))
