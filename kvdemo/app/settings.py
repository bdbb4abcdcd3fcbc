"""The settings a user types, checked with the same rules as a run: the policy's parameters from the form, the
budget resolved once (:class:`~kvdemo.cache.budget.Budget`), and the chunk it must hold; the defaults per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..cache.budget import Budget
from ..devices import zerogpu
from ..errors import StreamSettingError, UserError
from ..media.geometry import FrameGeometry
from ..media.video import VideoError, open_video, sampling_fps
from ..models.catalog import chosen_model_name, geometry_for
from ..policies import BudgetError, Policy, coerce_param, policy_class, policy_params
from ..pruning import METHODS, NONE
from ..stream.lineup import cap_bytes
from ..views import counted
from ..world.synthetic import sample_episode
from .sessions import CACHE_TTL_S, CompareSettings, RunSettings

FRAMES_PER_CHUNK = 2
#: The pruning choices the app lists (any ``METHOD:VALUE`` may be typed): none, then each method at two rates.
PRUNE_CHOICES = [NONE, "evs:0.75", "evs:0.5", "vidcom2:0.25", "vidcom2:0.5"]
PRUNE_HELP = (
    "before the LLM, in front of the policy: "
    + "; ".join(f"{name}:{method.parameter}" for name, method in METHODS.items())
    + " (evs:0.75 prunes 3/4 of the visual tokens, vidcom2:0.25 keeps 1/4)"
)

#: What each kind of bundled sample shows, under its choice (it follows the choice).
SAMPLE_KIND_HELP = {
    "static": "still: a fixed camera; shapes come into view, move a little and leave (the case redundancy heuristics "
    "are made for)",
    "moving": "moving: the camera pans and zooms, the background drifts, objects reappear among look-alike decoys "
    "(where the policies differ)",
}
#: The errors a user can cause (every kind of :class:`~kvdemo.errors.UserError`): one-line messages, never tracebacks.
USER_ERRORS = (UserError,)


def parse_params(policy: str, values: dict[str, Any]) -> dict[str, Any]:
    """Form values of ``policy``'s parameters -> keyword arguments (blank number lists mean "none")."""
    return {
        spec.name: coerce_param(policy, spec, values[spec.name])
        for spec in policy_params(policy)
        if spec.name in values
    }


def within_max_pixels(geometry: FrameGeometry, max_pixels: Any) -> FrameGeometry:
    """``geometry`` (how the model sizes frames) within the chosen max pixels (its own minimum, or less if the
    maximum is below it); :class:`~kvdemo.errors.StreamSettingError` if the maximum is below one token."""
    if max_pixels is None or int(max_pixels) < geometry.smallest_frame:
        raise StreamSettingError(
            f"max pixels must be at least {geometry.smallest_frame} (one token of "
            f"{geometry.factor}x{geometry.factor} pixels), got {max_pixels}"
        )
    return geometry.with_pixels(min(geometry.min_pixels, int(max_pixels)), int(max_pixels))


def open_stream(geometry: FrameGeometry, video_path: str | None, fps: float, sample: str):
    """The stream a run plays: the uploaded file at ``video_path`` (decoded lazily), or the bundled sample of kind
    ``sample`` when there is none, sampled at ``fps`` and sized by ``geometry``; with the sample's ground truth
    (None for a file). :class:`VideoError` for an upload the server no longer has."""
    episode = None if video_path else sample_episode(sample)
    if episode is not None:
        return episode.video.sampled(fps).resized(geometry), episode
    if not Path(video_path).exists():
        raise VideoError(
            f"{Path(video_path).name}: the upload is no longer on the server (uploads are kept "
            f"{CACHE_TTL_S:g} s); upload it again"
        )
    return open_video(Path(video_path), fps=fps, geometry=geometry), None


def settings_geometry(settings: RunSettings | CompareSettings) -> FrameGeometry:
    """How the chosen model sizes frames (known before it loads), within the chosen max pixels."""
    return within_max_pixels(geometry_for(settings.model), settings.max_pixels)


def settings_lineup(settings: RunSettings | CompareSettings) -> dict[str, tuple[Policy, Budget]]:
    """Either page's settings as the engines will take them: each contender's policy and budget by engine name,
    resolved once (:func:`kvdemo.stream.lineup.lineup_budgets`: the takes-C rule is
    :meth:`~kvdemo.cache.budget.Budget.resolve`'s); :class:`BudgetError` with a one-line reason if they cannot work
    (the sampling, pixel and cap numbers too). With several contenders the reason names the one it is about."""
    contenders = settings.contenders()
    lineup = {}
    for contender in contenders:
        try:
            lineup[contender.label] = contender.policy_and_budget(settings.budget, settings.keep)
        except BudgetError as exc:
            if len(contenders) == 1:
                raise
            raise BudgetError(f"{contender.name}: {exc}") from None
    sampling_fps(settings.fps)
    settings_geometry(settings)
    cap_bytes(settings.cap_mb)
    return lineup


def validate_settings(
    policy: str,
    budget: Any,
    keep: Any,
    fps: Any = 2.0,
    max_pixels: Any = 200704,
    video: str | None = None,
    model: str | None = None,
) -> str:
    """A one-line verdict on the settings, shown as the user types: the same checks as the run they lead to,
    with one chunk of the uploaded ``video`` (resized as ``model`` sizes frames) when there is one, else of the
    bundled sample (what runs without an upload)."""
    try:
        settings = RunSettings(model or chosen_model_name(None), policy, {}, budget, keep, fps, max_pixels, False, 0)
        [(policy, resolved)] = settings_lineup(settings).values()
        geometry = settings_geometry(settings)
        if video:
            size = open_video(video, fps=float(fps), geometry=geometry).size
            name = f" of {Path(video).name} ({size[1]}x{size[0]})"
        else:
            size, name = geometry.frame_size(*sample_episode().video.size), " of the bundled sample"
        tokens, shape = geometry.chunk_tokens(size, FRAMES_PER_CHUNK)
        resolved = resolved.sized(policy, tokens, shape, FRAMES_PER_CHUNK / float(fps))  # as a run will size it
    except USER_ERRORS as exc:
        return f"⚠️ {exc}"
    except (TypeError, ValueError) as exc:
        return f"⚠️ not a number: {exc}"
    upload = "" if video else f" (an upload's: up to {geometry.chunk_tokens(None, FRAMES_PER_CHUNK)[0]} at max pixels)"
    if resolved.C is None:
        return (
            f"✓ M={resolved.M} = {resolved.split_text} (C does not apply); one chunk{name} is "
            f"{counted(tokens, 'visual token')}{upload} and must fit the {resolved.window_name}"
        )
    return (
        f"✓ M={resolved.M}, C={resolved.C}: one chunk{name} is {counted(tokens, 'visual token')}{upload}; "
        f"M and M − C must each hold one chunk"
    )


def policy_label(policy: str, budget: Budget) -> str:
    """ "**infinipot-v**, M=1024 C=768" (Markdown; "**protokv**, M=1024" for a policy sized by M alone)."""
    if not budget.bounded:
        return f"**{policy}**"
    return f"**{policy}**, M={budget.M}" + (f" C={budget.C}" if budget.C is not None else "")


def takes_keep(policy: str) -> bool:
    """Whether ``policy``'s budget has a ``C`` (the C field is greyed out otherwise)."""
    return policy_class(policy).takes_keep()


def baseline_cap_default() -> int:
    """The full-cache baseline's memory cap (MB): 2048, or 512 when every GPU call pickles the session's state
    in and out (ZeroGPU: the baseline's cache is most of what crosses, ~37 KB per visual token on
    Qwen2.5-VL-3B)."""
    return 512 if zerogpu.active() else 2048
