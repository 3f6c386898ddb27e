"""The training methods of every experiment: one registry, name -> optimizer.

Each :class:`Method` says how to build its optax optimizer from a
:class:`Hyperparams` (SGD + momentum + weight decay base, a linear warm-up
then a cosine decay to 0, :func:`learning_rate_schedule`), whether
``tx.update`` needs ``grad_fn`` (SAM-style second gradients), whether its
state carries an :class:`~safe_optax.ADMMState` (whose ``||x - z||`` is
logged), which field holds its penalty ``lambda`` and whether the run's seed
enters the optimizer. The vision trainer (its ``Config`` is a
:class:`Hyperparams`), the digits demo and the benchmarks all build their
optimizers here (:func:`make_optimizer`).

The sparsity set of a run (the target sparsity and the structure of
``Hyperparams.structure``: :class:`~safe_optax.Global`, one top-k over all
:func:`~safe_optax.default_prunable` leaves, by default,
:class:`~safe_optax.PerLeaf` or :class:`~safe_optax.ERK`) is
:func:`projection`; every projection of a run (the optimizers,
``||x - Proj(x)||``, the final projection) takes its keywords from there.

Adding a method: write its ``build`` and add one :data:`REGISTRY` entry.

Examples:
  >>> from safe_optax import methods
  >>> hp = methods.Hyperparams(method="admm", sparsity=0.9, admm_penalty=0.01)
  >>> m = methods.get("admm")
  >>> m.uses_grad_fn, m.has_admm_state, m.penalty_field, methods.penalty(hp)
  (False, True, 'admm_penalty', 0.01)
  >>> methods.projection(hp)
  {'sparsity': 0.9, 'structure': Global()}
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import jax.numpy as jnp
import optax

import safe_optax


@dataclasses.dataclass(frozen=True)
class Hyperparams:
  """How a run trains: the method, its sparsity set and every setting a method reads.

  ``penalty=None`` takes ``lambda`` from ``penalty_table``: the first
  ``(max_sparsity, lambda)`` entry whose ``max_sparsity >= sparsity``. An
  experiment's config subclasses it (the vision ``Config``, the demo's), so
  the fields are declared once.
  """

  method: str = "safe"
  sparsity: float = 0.9
  structure: str = "global"
  """``global``: one top-k over all prunable leaves (the paper's vision setting; layers end
  with different sparsities); ``per_leaf``: ``sparsity`` in every prunable leaf (a uniform
  per-layer mask, which no layer can lose entirely); ``erk``: RigL's Erdős–Rényi-Kernel
  allocation, small layers denser, the same total as ``global``; ``"N:M"`` (e.g. ``"2:4"``):
  ``N`` kept in every ``M`` consecutive weights along each kernel's input axis
  (:class:`~safe_optax.NM`), with ``sparsity`` ``1 - N/M`` (:func:`parse_structure`)."""
  epochs: int = 200
  learning_rate: float = 0.1
  warmup_epochs: int = 5
  momentum: float = 0.9
  weight_decay: float = 1e-4
  rho: float = 0.1
  dual_every: int = 32
  penalty: Optional[float] = None
  penalty_table: tuple[tuple[float, float], ...] = ((1.0, 1e-3),)
  penalty_schedule: str = "cosine"
  """SAFE family ramp; ADMM always uses a constant penalty (Zhang et al.)."""
  rescale_dual: bool = False
  """SAFE family: keep the unscaled dual ``lambda * u`` while the penalty ramps
  (``safe_optax.safe(rescale_dual=True)``, Boyd et al. 2011 §3.4.1). ``False`` is the paper's
  update, which can diverge at extreme sparsity under the ramp (docs/dual_rescaling.md)."""
  admm_penalty: Optional[float] = None
  """ADMM's ``lambda`` when tuned apart from SAFE's (``None``: the same as SAFE)."""
  saliency: str = "snip"
  """SAFE+ score: ``snip`` or ``obd``."""
  multi_sparsities: tuple[float, ...] = (0.7, 0.8, 0.9, 0.95, 0.98)
  """SAFE-Multi: choices drawn at each dual update; the run finalizes at ``sparsity``."""
  gmp_begin_fraction: float = 0.0
  gmp_end_fraction: float = 0.75
  """GMP's cubic ramp runs over this fraction of training (persistent mask after)."""
  gmp_update_every: int = 100
  imp_every_epochs: int = 10
  imp_power: int = 3
  """IMP+SAM: 1 (linear) or 3 (cubic) sparsity increase, pruning every ``imp_every_epochs``."""
  seed: int = 0

  def resolved_penalty(self) -> float:
    """``lambda`` for this sparsity (``penalty``, else the ``penalty_table`` entry)."""
    if self.penalty is not None:
      return self.penalty
    for max_sparsity, lam in self.penalty_table:
      if self.sparsity <= max_sparsity + 1e-12:
        return lam
    return self.penalty_table[-1][1]


SALIENCIES = ("snip", "obd")
PENALTY_SCHEDULES = ("constant", "linear", "cosine")


def check_one_of(value: Any, name: str, allowed: tuple[Any, ...]) -> None:
  """Raises ``ValueError`` naming ``name`` and ``allowed`` unless ``value`` is one of them."""
  if value not in allowed:
    raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}.")


def check_positive_int(value: Any, name: str) -> None:
  """Raises ``ValueError`` naming ``name`` unless ``value`` is an int >= 1 (not a bool)."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def validate(hp: Hyperparams) -> Hyperparams:
  """Checks every :class:`Hyperparams` field; raises ``ValueError`` naming it and what is allowed.

  Examples:
    >>> validate(Hyperparams(warmup_epochs=3, epochs=3))
    Traceback (most recent call last):
    ...
    ValueError: `warmup_epochs` must be in [0, epochs=3), got 3 (for short runs set ...).
  """
  check_one_of(hp.method, "method", tuple(REGISTRY))
  check_one_of(hp.saliency, "saliency", SALIENCIES)
  structure = parse_structure(hp.structure)
  check_one_of(hp.penalty_schedule, "penalty_schedule", PENALTY_SCHEDULES)
  check_one_of(hp.imp_power, "imp_power", (1, 3))
  if not isinstance(hp.rescale_dual, bool):
    raise ValueError(f"`rescale_dual` must be True or False, got {hp.rescale_dual!r}.")
  for name in ("epochs", "dual_every", "imp_every_epochs", "gmp_update_every"):
    check_positive_int(getattr(hp, name), name)
  if not 0.0 <= hp.sparsity < 1.0:
    raise ValueError(f"`sparsity` must be in [0, 1), got {hp.sparsity}.")
  if hp.method != "dense" and hp.sparsity == 0.0:
    raise ValueError(f"method {hp.method!r} needs `sparsity` > 0.")
  if isinstance(structure, safe_optax.NM) and hp.method != "dense":
    _check_nm(hp, structure)
  for s in hp.multi_sparsities:
    if not 0.0 < s < 1.0:
      raise ValueError(f"`multi_sparsities` must lie in (0, 1), got {hp.multi_sparsities}.")
  if not 0 <= hp.warmup_epochs < hp.epochs:
    raise ValueError(f"`warmup_epochs` must be in [0, epochs={hp.epochs}), "
                     f"got {hp.warmup_epochs} (for short runs set warmup_epochs, "
                     "CLI --warmup-epochs).")
  if not 0.0 <= hp.gmp_begin_fraction < hp.gmp_end_fraction <= 1.0:
    raise ValueError("GMP needs 0 <= `gmp_begin_fraction` < `gmp_end_fraction` <= 1, got "
                     f"{hp.gmp_begin_fraction}, {hp.gmp_end_fraction}.")
  for name in ("learning_rate", "momentum", "weight_decay", "rho"):
    if getattr(hp, name) < 0:
      raise ValueError(f"`{name}` must be >= 0, got {getattr(hp, name)}.")
  for name in ("penalty", "admm_penalty"):
    if getattr(hp, name) is not None and getattr(hp, name) < 0:
      raise ValueError(f"`{name}` must be >= 0, got {getattr(hp, name)}.")
  return hp


def fit_warmup(warmup_epochs: int, epochs: int, *, name: str) -> int:
  """The warm-up rule of every experiment: a run no longer than its warm-up warms up for a tenth.

  A run of ``epochs <= warmup_epochs`` warms up for ``epochs // 10`` epochs
  instead, with a warning naming ``name`` (where the warm-up came from); a
  longer run keeps ``warmup_epochs``.

  Examples:
    >>> fit_warmup(5, 200, name="the preset")
    5
  """
  if 0 < epochs <= warmup_epochs:
    capped = epochs // 10
    warnings.warn(f"{name} warms up for {warmup_epochs} epochs, more than the run's "
                  f"{epochs}; warming up for {capped} (set warmup_epochs, CLI "
                  "--warmup-epochs, to choose).", stacklevel=3)
    return capped
  return warmup_epochs


def projection(config: Hyperparams) -> dict[str, Any]:
  """The sparsity set of ``config`` as keywords of the projection functions.

  The one place the vision trainer describes its sparsity set: pass the
  result to :func:`safe_optax.project_topk`, :func:`safe_optax.finalize`,
  an alias or a pruner (``**projection(config)``). The structure is
  ``config.structure``: :class:`~safe_optax.Global` (one top-k over all
  prunable leaves, the paper's vision setting), :class:`~safe_optax.PerLeaf`
  (the same sparsity in every prunable leaf) or :class:`~safe_optax.ERK`
  (per-leaf sparsities from the shapes, RigL's allocation); the prunable
  leaves are the library's default.

  Args:
    config: the run's configuration.

  Returns:
    ``{"sparsity": config.sparsity, "structure": Global(), PerLeaf() or ERK()}``.

  Examples:
    >>> projection(Hyperparams(sparsity=0.95))
    {'sparsity': 0.95, 'structure': Global()}
    >>> projection(Hyperparams(sparsity=0.95, structure="per_leaf"))
    {'sparsity': 0.95, 'structure': PerLeaf()}
    >>> projection(Hyperparams(sparsity=0.5, structure="2:4"))
    {'sparsity': 0.5, 'structure': NM(n=2, m=4, axis=-2)}
  """
  return {"sparsity": config.sparsity, "structure": parse_structure(config.structure)}


def parse_structure(
    name: str) -> Union[safe_optax.Global, safe_optax.PerLeaf, safe_optax.ERK, safe_optax.NM]:
  """The library's structure for a ``Hyperparams.structure`` name: :data:`STRUCTURES` or N:M.

  ``"N:M"`` with integers ``0 < N < M`` is :class:`safe_optax.NM` ``(N, M)``: ``N`` kept in
  every ``M`` consecutive weights along each kernel's input axis (``-2``: ``in`` of a Dense
  kernel ``(in, out)`` and of a conv kernel ``(h, w, in, out)``).

  Raises:
    ValueError: any other name (the message lists the allowed ones).

  Examples:
    >>> parse_structure("erk"), parse_structure("2:4")
    (ERK(power_scale=1.0), NM(n=2, m=4, axis=-2))
    >>> parse_structure("4:2")
    Traceback (most recent call last):
    ...
    ValueError: `structure` must be one of ['global', 'per_leaf', 'erk'], got '4:2'; N:M with integers 0 < N < M (e.g. '2:4') is allowed too.
  """
  if isinstance(name, str) and name in STRUCTURES:
    return STRUCTURES[name]()
  match = re.fullmatch(r"([0-9]+):([0-9]+)", name) if isinstance(name, str) else None
  if match is None or not 0 < int(match[1]) < int(match[2]):
    raise ValueError(f"`structure` must be one of {list(STRUCTURES)}, got {name!r}; N:M with "
                     "integers 0 < N < M (e.g. '2:4') is allowed too.")
  return safe_optax.NM(int(match[1]), int(match[2]))


def _check_nm(hp: Hyperparams, structure: safe_optax.NM) -> None:
  """An N:M run prunes exactly ``1 - N/M`` with a method whose sparsity stays fixed."""
  if get(hp.method).varies_sparsity:
    fixed = [name for name, m in REGISTRY.items() if name != "dense" and not m.varies_sparsity]
    raise ValueError(f"method {hp.method!r} changes its sparsity during training, which "
                     f"`structure` {hp.structure!r} cannot follow (N:M keeps N of every M "
                     f"from the first projection); use one of {fixed}.")
  nm_sparsity = 1 - structure.n / structure.m
  if abs(hp.sparsity - nm_sparsity) > 1e-9:
    raise ValueError(f"`sparsity` {hp.sparsity:g} contradicts `structure` {hp.structure!r}, "
                     f"which prunes exactly {nm_sparsity:g} (N of every M weights); set "
                     f"`sparsity` to {nm_sparsity:g}.")


STRUCTURES = {"global": safe_optax.Global, "per_leaf": safe_optax.PerLeaf, "erk": safe_optax.ERK}
"""``Hyperparams.structure`` names -> the library's structure types; the names, in this order, are
:data:`~safe_optax.vision.configs.STRUCTURES` (``"N:M"`` is :func:`parse_structure`'s too)."""

STRUCTURE_HELP = {
    "global": "one top-k over all prunable leaves (the paper's)",
    "per_leaf": "the same sparsity in every prunable leaf",
    "erk": "a per-leaf sparsity from each leaf's shape (Erdős–Rényi-Kernel, RigL's), "
           "the same total as global",
}
"""One line per :data:`STRUCTURES` name, for help texts and result tables."""


def _set_keywords(config: Hyperparams) -> dict[str, Any]:
  """:func:`projection` without the sparsity, for transforms with a sparsity schedule."""
  return {k: v for k, v in projection(config).items() if k != "sparsity"}


def learning_rate_schedule(config: Hyperparams, num_steps_per_epoch: int) -> optax.Schedule:
  """Linear warm-up for ``warmup_epochs``, then cosine decay to 0 at step ``epochs * spe``.

  optax's ``decay_steps`` is the length of the whole schedule, warm-up
  included, so the rate reaches 0 exactly when training ends (the official
  code passes the post-warm-up length and so trains its last 5 epochs at 0).

  Examples:
    >>> lr = learning_rate_schedule(Hyperparams(epochs=10, warmup_epochs=1), 100)
    >>> float(lr(0)), float(lr(100)), float(lr(1000))
    (0.0, 0.1, 0.0)
  """
  total = config.epochs * num_steps_per_epoch
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=config.warmup_epochs * num_steps_per_epoch, decay_steps=total, end_value=0.0)


class Recipe:
  """What every method's optimizer shares: the schedule, the SGD base, the ADMM keywords."""

  def __init__(self, config: Hyperparams, num_steps_per_epoch: int):
    self.steps_per_epoch = num_steps_per_epoch
    self.total_steps = config.epochs * num_steps_per_epoch
    self.learning_rate = learning_rate_schedule(config, num_steps_per_epoch)
    self.base = (optax.add_decayed_weights(config.weight_decay),
                 optax.sgd(self.learning_rate, momentum=config.momentum))
    # The keywords of the ADMM-based aliases (which build the same SGD base themselves).
    self.admm = dict(total_steps=self.total_steps, dual_every=config.dual_every,
                     momentum=config.momentum, weight_decay=config.weight_decay,
                     seed=config.seed, rescale_dual=config.rescale_dual)


def _dense(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  del config
  return optax.chain(*recipe.base)


def _magnitude(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  """Dense training, then one-shot magnitude pruning at the last step (no fine-tuning)."""
  last = max(recipe.total_steps - 1, 1)
  s = projection(config)["sparsity"]
  at_end = lambda step: jnp.where(step >= last, jnp.float32(s), jnp.float32(0.0))
  return optax.chain(*recipe.base, safe_optax.magnitude_pruning(
      at_end, update_every=last, **_set_keywords(config)))


def _safe_alias(alias: Callable[..., Any]) -> Callable[[Hyperparams, Recipe], Any]:
  """SAFE / SAFE-SG: the alias with the (cosine-ramped) penalty and SAM radius ``rho``."""
  def build(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
    return alias(recipe.learning_rate, **projection(config), penalty=penalty(config),
                 penalty_schedule=config.penalty_schedule, rho=config.rho, **recipe.admm)
  return build


# The config's saliency names and the saliencies they build.
_SALIENCIES = {"snip": safe_optax.snip_saliency, "obd": safe_optax.obd_saliency}


def _safe_plus(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  return safe_optax.safe_plus(recipe.learning_rate, **projection(config), penalty=penalty(config),
                              scores=_SALIENCIES[config.saliency](),
                              penalty_schedule=config.penalty_schedule,
                              rho=config.rho, **recipe.admm)


def _safe_multi(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  """Draws its sparsity from ``multi_sparsities`` at each dual update (finalizes at the target)."""
  return safe_optax.safe(recipe.learning_rate, tuple(config.multi_sparsities),
                         **_set_keywords(config), penalty=penalty(config),
                         penalty_schedule=config.penalty_schedule, rho=config.rho,
                         **recipe.admm)


def _admm(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  """ADMM (Zhang et al.): a constant penalty, no SAM."""
  return safe_optax.admm(recipe.learning_rate, **projection(config), penalty=penalty(config),
                         penalty_schedule="constant", **recipe.admm)


def _gradual(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  """GMP (cubic ramp, masks every ``gmp_update_every`` steps) and IMP+SAM (SAM, then pruning
  every ``imp_every_epochs`` with ``imp_power``), both over ``[gmp_begin_fraction,
  gmp_end_fraction]`` of training with a persistent mask after."""
  total, gmp = recipe.total_steps, config.method == "gmp"
  every = (config.gmp_update_every if gmp
           else config.imp_every_epochs * recipe.steps_per_epoch)
  ramp_end = max(1, int(config.gmp_end_fraction * total))
  every = min(every, ramp_end)
  # Both ends on the mask-update grid, so masks change exactly when the sparsity does.
  begin = (int(config.gmp_begin_fraction * total) // every) * every
  end = max(begin + every, (ramp_end // every) * every)
  schedule = safe_optax.polynomial_sparsity(
      projection(config)["sparsity"], begin_step=begin, end_step=end,
      power=3 if gmp else config.imp_power, update_every=every)
  pruner = safe_optax.magnitude_pruning(schedule, update_every=every, update_until=end,
                                        **_set_keywords(config))
  head = () if gmp else (safe_optax.sam_perturb(config.rho),)
  return optax.chain(*head, *recipe.base, pruner)


def _cram(config: Hyperparams, recipe: Recipe) -> optax.GradientTransformation:
  """CrAM / CrAM+ (:func:`safe_optax.cram`) before the SGD base."""
  return optax.chain(safe_optax.cram(config.rho, **projection(config),
                                     plus=config.method == "cram-plus"), *recipe.base)


def _never(config: Hyperparams) -> bool:
  del config
  return False


@dataclasses.dataclass(frozen=True)
class Method:
  """How an experiment runs one training method."""

  build: Callable[[Hyperparams, Recipe], optax.GradientTransformation]
  """``build(config, recipe)``: the optax optimizer."""
  uses_grad_fn: bool = False
  """``tx.update`` takes ``grad_fn=`` (SAM-style second gradients of the same batch)."""
  has_admm_state: bool = False
  """Its state holds an :class:`~safe_optax.ADMMState` (``||x - z||`` is logged)."""
  penalty_field: Optional[str] = None
  """The config field holding its ``lambda`` (``None``: no lambda to choose)."""
  tuned_field: Optional[str] = None
  """A config field other than a penalty that a sweep may choose on a validation split
  (CrAM's radius ``rho``, its one hyperparameter); see :attr:`selected_field`."""
  seeded: Callable[[Hyperparams], bool] = _never
  """Whether ``config.seed`` enters the optimizer (else its programs are shared across seeds)."""
  varies_sparsity: bool = False
  """Its sparsity changes during training (a ramp, a prune at the last step, a draw at each
  dual update), so it cannot train an N:M structure, which fixes ``N`` of every ``M``."""
  dual_alone: bool = False
  """Its dual update reads no gradient (magnitude scores), so the trainer runs it as a
  program of its own on dual steps (:func:`safe_optax.experimental.run_dual_update`); SAFE+'s
  saliency reads the step's gradient and runs inside the step."""

  @property
  def selected_field(self) -> Optional[str]:
    """The field a sweep chooses on a validation split: the penalty's, else :attr:`tuned_field`."""
    return self.penalty_field or self.tuned_field


_SAFE = dict(uses_grad_fn=True, has_admm_state=True, penalty_field="penalty", dual_alone=True)

REGISTRY: Mapping[str, Method] = {
    "dense": Method(_dense),
    "safe": Method(_safe_alias(safe_optax.safe), **_SAFE),
    "safe-plus": Method(_safe_plus, **{**_SAFE, "dual_alone": False},
                        # OBD scores draw Hutchinson probes from the seed.
                        seeded=lambda config: config.saliency == "obd"),
    "admm": Method(_admm, has_admm_state=True, penalty_field="admm_penalty", dual_alone=True),
    "gmp": Method(_gradual, varies_sparsity=True),
    "magnitude": Method(_magnitude, varies_sparsity=True),
    "imp-sam": Method(_gradual, uses_grad_fn=True, varies_sparsity=True),
    "cram": Method(_cram, uses_grad_fn=True, tuned_field="rho"),
    "cram-plus": Method(_cram, uses_grad_fn=True, tuned_field="rho"),
    "safe-sg": Method(_safe_alias(safe_optax.safe_sg), **_SAFE),
    "safe-multi": Method(_safe_multi, **_SAFE, seeded=lambda config: True,
                         varies_sparsity=True),
}
"""Every training method; :data:`safe_optax.vision.configs.METHODS` are its names."""


def get(name: str) -> Method:
  """The registry entry of ``name``.

  Raises:
    ValueError: an unknown name (the message lists the known ones).

  Examples:
    >>> get("safe").uses_grad_fn
    True
  """
  if name not in REGISTRY:
    raise ValueError(f"`method` must be one of {list(REGISTRY)}, got {name!r}.")
  return REGISTRY[name]


def penalty(config: Hyperparams) -> Optional[float]:
  """The ``lambda`` that ``config.method`` trains with (``None`` for a method without one).

  ``Hyperparams.admm_penalty`` for ADMM when set, else :meth:`Hyperparams.resolved_penalty`.

  Examples:
    >>> import dataclasses
    >>> config = Hyperparams(method="safe", sparsity=0.9, penalty_table=((1.0, 0.1),))
    >>> penalty(config), penalty(dataclasses.replace(config, method="gmp"))
    (0.1, None)
  """
  field = get(config.method).penalty_field
  if field is None:
    return None
  value = getattr(config, field)
  return config.resolved_penalty() if value is None else value


def make_optimizer(config: Hyperparams, num_steps_per_epoch: int) -> optax.GradientTransformation:
  """The optax optimizer of ``config.method`` (see :data:`REGISTRY`).

  * ``dense``: SGD only;
  * ``magnitude``: dense training, then one-shot magnitude pruning at the
    last step (:func:`safe_optax.magnitude_pruning` whose sparsity jumps from
    0 to the target there; no fine-tuning, as the paper's baselines);
  * ``safe`` / ``safe-plus`` / ``safe-sg`` / ``safe-multi``: the aliases with
    the cosine-ramped penalty; ``admm``: constant penalty, no SAM;
  * ``gmp``: magnitude pruning with a persistent mask on a cubic
    :func:`safe_optax.polynomial_sparsity` ramp over
    ``[gmp_begin_fraction, gmp_end_fraction]`` of training, masks every
    ``gmp_update_every`` steps;
  * ``imp-sam``: SAM, then magnitude pruning every ``imp_every_epochs``
    (capped at the ramp length) with a linear or cubic increase;
  * ``cram`` / ``cram-plus``: :func:`safe_optax.cram` before the base optimizer.

  Examples:
    >>> import jax.numpy as jnp
    >>> tx = make_optimizer(Hyperparams(method="admm", sparsity=0.5), 10)
    >>> safe_optax.find_admm_state(tx.init({"w": jnp.ones((4, 4))})).z["w"].shape
    (4, 4)
  """
  return get(config.method).build(config, Recipe(config, num_steps_per_epoch))
