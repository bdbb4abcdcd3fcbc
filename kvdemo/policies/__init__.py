"""KV-cache compression policies, registered by name (``make_policy("uniform")``)."""

from . import cords, full, hybridkv, infinipot_v, protokv, uniform, window  # noqa: F401  (registration)
from .base import (
    REGISTRY,
    BudgetError,
    LayerView,
    ParamSpec,
    Policy,
    Selection,
    make_policy,
    policy_names,
    policy_params,
    register,
)

__all__ = [
    "REGISTRY",
    "BudgetError",
    "LayerView",
    "ParamSpec",
    "Policy",
    "Selection",
    "make_policy",
    "policy_names",
    "policy_params",
    "register",
]
