"""KV-cache compression policies, registered by name (``make_policy("uniform")``)."""

# Registration, in the order the CLI's help and the app list them: the papers' policies, then the baselines.
from . import infinipot_v, cords, protokv, hybridkv, uniform, window, full  # noqa: F401, I001
from .base import (
    REGISTRY,
    BudgetError,
    LayerView,
    ParamSpec,
    Policy,
    Probed,
    Ranking,
    ScoredPolicy,
    Selection,
    SummaryRegion,
    coerce_param,
    make_policy,
    policy_class,
    policy_names,
    policy_params,
    register,
)

#: The policy the CLI and the app start with; the ones ``python -m kvdemo eval`` compares by default; the
#: baselines every pass benchmark is timed next to; the policy ``bench`` measures by default.
DEFAULT_POLICY = "infinipot-v"
EVAL_POLICIES = ("full", "sliding-window", "uniform", "infinipot-v", "cords")
#: What ``compare`` (CLI and app) compares unless told otherwise: the four seed papers' policies.
COMPARE_POLICIES = ("infinipot-v", "cords", "protokv", "hybridkv")
BASELINES = ("uniform", "sliding-window")
BENCH_POLICY = "sliding-window"

__all__ = [
    "BASELINES",
    "BENCH_POLICY",
    "DEFAULT_POLICY",
    "COMPARE_POLICIES",
    "EVAL_POLICIES",
    "REGISTRY",
    "BudgetError",
    "LayerView",
    "ParamSpec",
    "Policy",
    "Probed",
    "Ranking",
    "ScoredPolicy",
    "Selection",
    "SummaryRegion",
    "coerce_param",
    "make_policy",
    "policy_class",
    "policy_names",
    "policy_params",
    "register",
]
