"""Where the policy contract used to live, kept so that ``from kvdemo.policies.base import ...`` goes on working.
The contract is :mod:`.contract`, the scored core and top-k kernels :mod:`.topk`, registration and parameters
:mod:`.registry`, the error kinds :mod:`kvdemo.errors`; new code imports from those (or from :mod:`kvdemo.policies`).
"""

from ..devices.timing import PhaseTimer
from ..errors import BudgetError
from .contract import LayerView, OffloadUpdate, Policy, Probed, Selection, SummaryRegion, SummaryUpdate
from .registry import REGISTRY, ParamSpec, coerce_param, make_policy, policy_class, policy_names, policy_params
from .topk import (
    Ranking,
    ScoredPolicy,
    kept_indices,
    mask_to_indices,
    minmax,
    select_ranked,
    select_with_text,
    top_k_mask,
    top_k_sorted,
)

__all__ = [
    "REGISTRY",
    "BudgetError",
    "LayerView",
    "OffloadUpdate",
    "ParamSpec",
    "PhaseTimer",
    "Policy",
    "Probed",
    "Ranking",
    "ScoredPolicy",
    "Selection",
    "SummaryRegion",
    "SummaryUpdate",
    "coerce_param",
    "kept_indices",
    "make_policy",
    "mask_to_indices",
    "minmax",
    "policy_class",
    "policy_names",
    "policy_params",
    "select_ranked",
    "select_with_text",
    "top_k_mask",
    "top_k_sorted",
]
