"""What a user chooses of pruning before the LLM, read from text with no torch: ``evs:0.75`` (EVS, pruning rate
0.75) or ``vidcom2:0.25`` (VidCom2, retention ratio 0.25), each method's number named as vLLM names it, and an
engine entry ``METHOD:VALUE+POLICY`` (``evs:0.75+full``: pruning in front of a policy, one engine).

vLLM's functions take ``q``, the fraction of a video's tokens pruned (``--video-pruning-rate``). kvdemo's ``evs:Q``
is that rate; ``vidcom2:R`` is the retention ratio ``R = 1 - q`` (``--video-retention-ratio``), so ``evs:0.75`` and
``vidcom2:0.25`` both let a quarter of the tokens in. Either method also takes its number by name
(``evs:video_pruning_rate=0.75``, ``vidcom2:video_retention_ratio=0.25``, ``vidcom2:video_pruning_rate=0.75``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PruningSettingError

RATE = "video_pruning_rate"
RETENTION = "video_retention_ratio"


@dataclass(frozen=True)
class Method:
    """A pruning method: its name, the number ``method:VALUE`` gives (``RATE`` or ``RETENTION``), and a line about it."""

    name: str
    parameter: str
    summary: str


#: The methods, in the order the CLI's help and the app list them.
METHODS = {
    "evs": Method(
        "evs",
        RATE,
        "EVS: each token scored by 1 - cosine to the same patch of the previous frame, the most changed kept",
    ),
    "vidcom2": Method(
        "vidcom2",
        RETENTION,
        "VidCom2: tokens least like their video's and frame's centres kept, distinctive frames given more",
    ),
}
#: What the app's and the CLI's "no pruning" is.
NONE = "none"


@dataclass(frozen=True)
class PruneSpec:
    """One pruning choice: the method and ``rate``, the fraction of the offered visual tokens it prunes (vLLM's
    ``q``: ``video_pruning_rate``), strictly between 0 and 1."""

    method: str
    rate: float

    @property
    def value(self) -> float:
        """The number ``method:VALUE`` gives: the pruning rate (EVS) or the retention ratio (VidCom2)."""
        return self.rate if METHODS[self.method].parameter == RATE else round(1.0 - self.rate, 12)

    @property
    def text(self) -> str:
        """``evs:0.75`` / ``vidcom2:0.25``: what :func:`parse_prune` reads back to this choice."""
        return f"{self.method}:{self.value:g}"

    @property
    def parameter(self) -> dict[str, float]:
        """The method's number by its vLLM name, e.g. ``{"video_retention_ratio": 0.25}``."""
        return {METHODS[self.method].parameter: self.value}

    def __str__(self) -> str:
        return self.text


def parse_prune(choice: str | PruneSpec | None, field: str = "prune") -> PruneSpec | None:
    """``choice`` (``"evs:0.75"``, ``"vidcom2:video_retention_ratio=0.25"``, a :class:`PruneSpec`, or None / ``""`` /
    ``"none"`` for no pruning) as a :class:`PruneSpec`; :class:`~kvdemo.errors.PruningSettingError` naming ``field``
    (the flag or form field it came from) otherwise."""
    if choice is None or isinstance(choice, PruneSpec):
        return choice
    text = str(choice).strip()
    if not text or text.lower() == NONE:
        return None
    name, colon, number = text.partition(":")
    method = METHODS.get(name.strip().lower())
    if method is None:
        raise PruningSettingError(
            f"{field}: unknown pruning method {name.strip()!r} in {text!r}: one of {', '.join(METHODS)} "
            f"(e.g. evs:0.75), or {NONE}"
        )
    parameter, equals, value = number.partition("=")
    parameter = parameter.strip().replace("-", "_") if equals else method.parameter
    value = value if equals else number
    if parameter not in (method.parameter, RATE):
        raise PruningSettingError(
            f"{field}: {method.name} takes {' or '.join(dict.fromkeys((method.parameter, RATE)))}, got {parameter!r}"
        )
    if not colon or not value.strip():
        raise PruningSettingError(f"{field}: give {method.name}'s {parameter} after a colon, e.g. {method.name}:0.75")
    try:
        number_value = float(value)
    except ValueError:
        raise PruningSettingError(
            f"{field}: {method.name}'s {parameter} must be a number, got {value.strip()!r}"
        ) from None
    if not 0.0 < number_value < 1.0:  # nan too
        raise PruningSettingError(
            f"{field}: {method.name}'s {parameter} must lie strictly between 0 and 1, got {value.strip()}"
        )
    rate = number_value if parameter == RATE else 1.0 - number_value
    return PruneSpec(method.name, rate)


#: What joins a pruning choice to the policy behind it in one engine entry (``evs:0.75+full``).
JOIN = "+"


def split_entry(entry: str, field: str = "policies") -> tuple[PruneSpec | None, str]:
    """An engine entry ``[METHOD:VALUE+]POLICY`` as (its pruning or None, the policy's name)."""
    text = str(entry).strip()
    if JOIN not in text:
        return None, text
    prune, _, policy = text.rpartition(JOIN)
    return parse_prune(prune, f"{field} ({text})"), policy.strip()


def entry_label(prune: PruneSpec | None, policy: str) -> str:
    """The engine name of ``policy`` behind ``prune``: ``evs:0.75+full``, or the policy's own name without pruning."""
    return policy if prune is None else f"{prune.text}{JOIN}{policy}"
