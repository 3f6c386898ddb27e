"""safe_optax: SAFE / SAFE+ sparse and flat training as composable optax transforms.

Layers, bottom up: the sparsity set (``Global``, ``PerLeaf``, ``PerOutput``,
``NM``, ``ERK``, ``Projection``), exact top-k projection kernels (``project_topk``),
saliencies (``snip_saliency``, ``obd_saliency``, ``wanda_saliency``), optax
transforms (``sam``, ``sam_perturb``, ``admm_penalty``, ``decoupled_admm_penalty``,
``add_projected_gradient``), aliases (``safe``, ``safe_plus``, ``admm``,
``safe_sg``), the baseline pruners (``magnitude_pruning``,
``polynomial_sparsity``, ``cram``) and the final projection (``finalize``,
``sparsity_report``). XLA:CPU workarounds live in :mod:`safe_optax.experimental`.
"""

from safe_optax._admm import admm_penalty
from safe_optax._admm import decoupled_admm_penalty
from safe_optax._admm_state import ADMMState
from safe_optax._admm_state import DecoupledADMMState
from safe_optax._admm_state import constraint_distance
from safe_optax._admm_state import find_admm_state
from safe_optax._alias import admm
from safe_optax._alias import safe
from safe_optax._alias import safe_plus
from safe_optax._alias import safe_sg
from safe_optax._cram import CramState
from safe_optax._cram import cram
from safe_optax._dual import dual_update
from safe_optax._finalize import LeafSparsity
from safe_optax._finalize import SparsityReport
from safe_optax._finalize import finalize
from safe_optax._finalize import sparsity_report
from safe_optax._projection import project_topk
from safe_optax._pruners import MagnitudePruningState
from safe_optax._pruners import magnitude_pruning
from safe_optax._pruners import polynomial_sparsity
from safe_optax._prunable import default_prunable
from safe_optax._prunable import prunable_mask
from safe_optax._sam import AddProjectedGradientState
from safe_optax._sam import SAMState
from safe_optax._sam import add_projected_gradient
from safe_optax._sam import sam
from safe_optax._sam import sam_perturb
from safe_optax._schedules import penalty_schedule
from safe_optax._scores import Saliency
from safe_optax._scores import SaliencyInputs
from safe_optax._scores import hutchinson_diagonal
from safe_optax._scores import magnitude_scores
from safe_optax._scores import obd_saliency
from safe_optax._scores import obd_scores
from safe_optax._scores import snip_saliency
from safe_optax._scores import snip_scores
from safe_optax._scores import wanda_saliency
from safe_optax._scores import wanda_scores
from safe_optax._counts import erk_keep_counts
from safe_optax._counts import num_keep
from safe_optax._structures import ERK
from safe_optax._structures import NM
from safe_optax._structures import Global
from safe_optax._structures import PerLeaf
from safe_optax._structures import PerOutput
from safe_optax._structures import Projection
from safe_optax import experimental

__version__ = "0.2.0.dev0"

__all__ = (
    "ADMMState",
    "AddProjectedGradientState",
    "CramState",
    "DecoupledADMMState",
    "ERK",
    "Global",
    "LeafSparsity",
    "MagnitudePruningState",
    "NM",
    "PerLeaf",
    "PerOutput",
    "Projection",
    "SAMState",
    "Saliency",
    "SaliencyInputs",
    "SparsityReport",
    "add_projected_gradient",
    "admm",
    "admm_penalty",
    "constraint_distance",
    "cram",
    "decoupled_admm_penalty",
    "default_prunable",
    "dual_update",
    "erk_keep_counts",
    "finalize",
    "find_admm_state",
    "hutchinson_diagonal",
    "magnitude_pruning",
    "magnitude_scores",
    "num_keep",
    "obd_saliency",
    "obd_scores",
    "penalty_schedule",
    "polynomial_sparsity",
    "project_topk",
    "prunable_mask",
    "safe",
    "safe_plus",
    "safe_sg",
    "sam",
    "sam_perturb",
    "snip_saliency",
    "snip_scores",
    "sparsity_report",
    "wanda_saliency",
    "wanda_scores",
)
