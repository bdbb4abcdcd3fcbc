"""Policies by name: registration (each with its :class:`PolicyCard`), parameters as form fields read from the
dataclass fields (default, kind, and the help text and choices in each field's ``metadata``), coercion of form
and command-line values, and :func:`make_policy`.

A policy's parameter declares its help text (and, for a text parameter, its choices; for a number, the interval it
must lie in) where it is defined, in the field's ``metadata`` (:func:`param` writes the ``field`` for it)::

    alpha: float = param(0.5, "share of C chosen by TaR", within="[0, 1]")  # field(default=0.5, metadata={...})
    tar: str = param("patch", "TaR scoring", choices=("patch", "frame", "reverse"))

Those declarations are the one check of a value a user gives (:func:`coerce_param`, which :func:`make_policy` and the
app's form run); a policy's ``__post_init__`` checks only what relates two parameters.

What is said and shown about a policy (its one-line summary, the names of its reason codes, the titles of its
views) and what ``bench`` measures about it are declared beside the class in a :class:`PolicyCard`, registered
with it: the class itself holds none of it. The CLI, the app, :mod:`kvdemo.viz` and :mod:`kvdemo.bench` read
cards through :func:`policy_card`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PolicyParameterError, UnknownPolicyError
from .contract import Policy


@dataclass(frozen=True)
class BenchDeclaration:
    """What ``python -m kvdemo bench`` measures about a policy beyond its compression pass, as data the bench
    reads (the runners are the bench's own, :func:`kvdemo.bench.plans.bench_plan`).

    benchmarks: names of the bench's policy benchmarks (``update``: its per-chunk update over a long stream;
    ``decode``: decode-step attention against the full cache). variants: parameter changes its pass is also timed
    with (label -> changes). refresh_all: ``refresh_all(policy, rotary, heads)`` recomputes every entry of its
    summary region at once (what synthesising at read time would cost), for a policy that owns one. host_reads: the
    most values one pass may read back to the host (``bench --count``); launches: the most operations one pass may
    launch in all at any depth (None: only the bound on their growth with depth applies).
    """

    benchmarks: tuple[str, ...] = ()
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    refresh_all: Callable[[Any, Any, int], None] | None = None
    host_reads: int = 8
    launches: int | None = None


@dataclass(frozen=True)
class PolicyCard:
    """What is said and shown about a policy, declared beside its class and registered with it.

    summary: one line saying what it keeps (for help texts). reasons: the names of the reason codes it reports per
    kept token in ``Selection.info["reason"]`` (code -> name; the legends). view_titles: the titles of the views
    its ``views()`` may return (the app makes room for as many as any policy declares). bench: what the benchmark
    measures about it (:class:`BenchDeclaration`).
    """

    summary: str
    reasons: Mapping[int, str] = field(default_factory=dict)
    view_titles: tuple[str, ...] = ()
    bench: BenchDeclaration = BenchDeclaration()


@dataclass(frozen=True)
class ParamSpec:
    """One policy parameter as a form field: name, default, kind (bool/float/int/choice/numbers), help, a text
    parameter's choices and a number's interval (``within``, e.g. ``"(0, 1]"``; "" for any number)."""

    name: str
    default: Any
    kind: str
    help: str = ""
    choices: tuple[str, ...] = ()
    within: str = ""


def param(default: Any, help: str, choices: tuple[str, ...] = (), within: str = "") -> Any:
    """A policy parameter's dataclass field: ``field(default=default, metadata={"help": ..., "choices": ...,
    "within": ...})``: the CLI's and the app's help text, a text parameter's allowed values, and the interval a number
    must lie in, written as in mathematics (``"[0, 1]"``, ``"(0, 1]"``, ``"[1, inf)"``)."""
    if within:
        interval(within)  # a malformed interval fails where it is declared
    return field(default=default, metadata={"help": help, "choices": tuple(choices), "within": within})


def interval(text: str) -> tuple[float, float, bool, bool]:
    """``"(0, 1]"`` as ``(low, high, low_included, high_included)``."""
    low, _, high = text[1:-1].partition(",")
    if text[:1] not in "[(" or text[-1:] not in ")]" or not _:
        raise ValueError(f"an interval is written like [0, 1] or (0, inf), got {text!r}")
    return float(low), float(high), text[0] == "[", text[-1] == "]"


def in_interval(value: float, text: str) -> bool:
    """Whether ``value`` lies in the interval ``text`` (:func:`interval`)."""
    low, high, low_included, high_included = interval(text)
    above = value >= low if low_included else value > low
    below = value <= high if high_included else value < high
    return above and below


#: The registered policies and their cards, by name, in registration order.
REGISTRY: dict[str, type[Policy]] = {}
CARDS: dict[str, PolicyCard] = {}


def register(card: PolicyCard) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make the policy available by ``cls.name``, with ``card``."""

    def add(cls: type[Policy]) -> type[Policy]:
        if not cls.name:
            raise ValueError(f"{cls.__name__} has no name")
        REGISTRY[cls.name] = cls
        CARDS[cls.name] = card
        return cls

    return add


def policy_names() -> list[str]:
    return list(REGISTRY)


def policy_class(name: str) -> type[Policy]:
    """The registered policy class called ``name`` (:class:`~kvdemo.errors.UnknownPolicyError` naming the
    choices if none is)."""
    if name not in REGISTRY:
        raise UnknownPolicyError(f"unknown policy {name!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def policy_card(name: str) -> PolicyCard:
    """The card registered with the policy called ``name`` (:class:`~kvdemo.errors.UnknownPolicyError` if none)."""
    policy_class(name)
    return CARDS[name]


def policy_params(name: str) -> list[ParamSpec]:
    """The parameters of a registered policy, with their paper defaults, help texts and choices (from each
    field's ``metadata``)."""
    specs = []
    for f in dataclasses.fields(policy_class(name)):
        if not f.init or f.name.startswith("_"):
            continue
        default, choices = f.default, tuple(f.metadata.get("choices", ()))
        if choices:
            kind = "choice"
        elif isinstance(default, bool):
            kind = "bool"
        elif isinstance(default, int):
            kind = "int"
        elif isinstance(default, float):
            kind = "float"
        else:
            kind = "numbers"  # an optional list of numbers (e.g. CV thresholds)
        help_text, within = str(f.metadata.get("help", "")), str(f.metadata.get("within", ""))
        specs.append(ParamSpec(f.name, default, kind, help_text, choices, within))
    return specs


def coerce_param(policy: str, spec: ParamSpec, value: Any) -> Any:
    """``value`` as parameter ``spec`` of ``policy`` takes it (a number from text, a list of numbers from
    "0.1, 0.2"; blank numbers mean "none"), within its declared choices or interval;
    :class:`~kvdemo.errors.PolicyParameterError` naming the policy, the parameter and the value if it cannot be."""
    number = _coerced(policy, spec, value)
    if spec.within and number is not None and not in_interval(number, spec.within):
        raise PolicyParameterError(f"{policy}'s {spec.name} must be in {spec.within}, got {number:g}")
    return number


def _coerced(policy: str, spec: ParamSpec, value: Any) -> Any:
    """``value`` converted to ``spec``'s kind (a text parameter checked against its choices)."""
    try:
        if spec.kind == "numbers":
            if value is None or isinstance(value, (list, tuple)):
                return None if value is None else [float(x) for x in value]
            text = str(value).strip().strip("[]()")
            return [float(x) for x in text.replace(";", ",").split(",") if x.strip()] if text else None
        if spec.kind == "bool":
            if isinstance(value, str):
                if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.strip().lower() in ("true", "1", "yes")
            return bool(value)
        if spec.kind == "int":
            number = float(value)
            if number != int(number):
                raise ValueError(value)
            return int(number)
        if spec.kind == "float":
            return float(value)
        value = str(value)
        if spec.choices and value not in spec.choices:
            raise PolicyParameterError(
                f"{policy}'s {spec.name} must be one of {', '.join(spec.choices)}, got {value!r}"
            )
        return value
    except PolicyParameterError:
        raise
    except (TypeError, ValueError, OverflowError):
        kind = {"numbers": "numbers separated by commas", "bool": "true or false"}.get(
            spec.kind, f"a number ({spec.kind})"
        )
        raise PolicyParameterError(f"{policy}'s {spec.name} takes {kind}, got {value!r}") from None


def make_policy(name: str, **params: Any) -> Policy:
    """Instantiate a registered policy with its defaults overridden by ``params`` (each coerced to the
    parameter's kind, so ``alpha="abc"`` is a one-line :class:`~kvdemo.errors.PolicyParameterError`, not a crash
    later)."""
    specs = {spec.name: spec for spec in policy_params(name)}
    unknown = set(params) - set(specs)
    if unknown:
        raise PolicyParameterError(
            f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}"
            + (f"; it takes: {', '.join(sorted(specs))}" if specs else "; it takes none")
        )
    return REGISTRY[name](**{key: coerce_param(name, specs[key], value) for key, value in params.items()})
