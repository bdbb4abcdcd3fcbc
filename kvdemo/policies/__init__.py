"""KV-cache compression policies, registered by name (``make_policy("uniform")``): the contract
(:mod:`.contract`), the scored core and its top-k (:mod:`.topk`), registration, parameters and cards
(:mod:`.registry`), and one module per policy."""

# Registration, in the order the CLI's help and the app list them: the papers' policies, then the baselines.
from . import infinipot_v, cords, protokv, hybridkv, rekv, streamingvlm, uniform, window, full  # noqa: F401, I001
from ..errors import BudgetError, PolicyParameterError, UnknownPolicyError
from .contract import (
    LayerSlice,
    OffloadUpdate,
    Policy,
    Probed,
    Selection,
    SliceStack,
    SummaryRegion,
    SummaryUpdate,
    VisualSlices,
    RetrievalRule,
    layer_rows,
    padded_stacks,
    slice_stacks,
)
from .registry import (
    CARDS,
    REGISTRY,
    BenchDeclaration,
    ParamSpec,
    PolicyCard,
    coerce_param,
    make_policy,
    param,
    policy_card,
    policy_class,
    policy_names,
    policy_params,
    register,
)
from .topk import Ranking, ScoredPolicy

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
    "CARDS",
    "DEFAULT_POLICY",
    "COMPARE_POLICIES",
    "EVAL_POLICIES",
    "REGISTRY",
    "BenchDeclaration",
    "BudgetError",
    "LayerSlice",
    "SliceStack",
    "VisualSlices",
    "RetrievalRule",
    "layer_rows",
    "padded_stacks",
    "slice_stacks",
    "OffloadUpdate",
    "ParamSpec",
    "PolicyCard",
    "PolicyParameterError",
    "Policy",
    "Probed",
    "Ranking",
    "ScoredPolicy",
    "Selection",
    "SummaryRegion",
    "SummaryUpdate",
    "UnknownPolicyError",
    "coerce_param",
    "make_policy",
    "param",
    "policy_card",
    "policy_class",
    "policy_names",
    "policy_params",
    "register",
]
