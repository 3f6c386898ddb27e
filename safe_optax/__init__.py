"""safe_optax: SAFE / SAFE+ sparse and flat training as composable optax transforms."""

from safe_optax._projection import NM
from safe_optax._projection import PerOutput
from safe_optax._projection import project_topk
from safe_optax._prunable import default_prunable
from safe_optax._prunable import prunable_mask
from safe_optax._select import num_keep

__version__ = "0.1.0.dev0"

__all__ = (
    "NM",
    "PerOutput",
    "default_prunable",
    "num_keep",
    "project_topk",
    "prunable_mask",
)
