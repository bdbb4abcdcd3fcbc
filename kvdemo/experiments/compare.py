"""Several policies side by side on one stream: ``python -m kvdemo compare`` and the app's comparison page.

Up to :data:`MAX_POLICIES` bounded policies and the full-cache baseline watch one stream through one
:class:`~kvdemo.stream.streaming.EngineGroup` (one vision encoding per chunk feeds them all). Each policy takes the shared
``M``/``C`` unless its own line says otherwise (:func:`parse_overrides`: ``"hybridkv: M=96 C=72 share=0.5"``). Every
question goes to every engine (each keeps its own dialogue), optionally with answer attribution, and the
per-layer fidelity of each policy against the full cache (:mod:`kvdemo.analysis.explain`).

Memory grows with the number of engines: each bounded one holds at most its ``M`` visual tokens (plus the text
prefix and an answer's slack), the full cache grows with the stream until its byte cap stops it
(:func:`memory_bound` says how much, before the run).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..dialogue import clipped
from ..errors import PolicyChoiceError, PolicyParameterError
from ..policies import make_policy, policy_class
from ..pruning import PruneSpec, entry_label, parse_prune, split_entry
from ..stream.lineup import FULL, Contender, cap_bytes, lineup_budgets, make_engines, size_lineup
from ..views import counted

if TYPE_CHECKING:  # the engines import transformers: the CLI checks the choices here before they load
    from ..stream.engine import StreamEngine
    from ..stream.streaming import EngineGroup

#: Bounded policies compared at once (and the full cache beside them).
MAX_POLICIES = 4
#: A line of a policy's own settings: its engine's name (which may hold a colon: ``evs:0.5+cords``), then a colon
#: followed by a space or the line's end.
OVERRIDE_LINE = re.compile(r"^\s*(\S+?):(?=\s|$)")
#: The shared M and C a comparison starts with: two thirds of the model's single-policy defaults (kvdemo's choice:
#: several engines share the memory one would have; for the tiny model 64 and 48, the eval's defaults).
COMPARE_BUDGET_SHARE = 2 / 3


def compare_budget(budget: int, keep: int) -> tuple[int, int]:
    """The comparison's default ``M``, ``C`` from a model's single-policy defaults (:data:`COMPARE_BUDGET_SHARE`)."""
    return round(budget * COMPARE_BUDGET_SHARE), round(keep * COMPARE_BUDGET_SHARE)


def parse_overrides(names: list[str], text: str = "", prune: PruneSpec | str | None = None) -> list[Contender]:
    """The compared policies (each a name, or ``METHOD:VALUE+POLICY`` with pruning before the LLM in front of it),
    with the lines of ``text`` (``"policy: M=96 C=72 prune=evs:0.5 key=value ..."``, one per policy) giving a policy
    its own budget, pruning and parameters, and ``prune`` the pruning of those that name none; a one-line
    :class:`~kvdemo.errors.UnknownPolicyError` (a name), :class:`~kvdemo.errors.PolicyChoiceError` (which policies),
    :class:`~kvdemo.errors.PolicyParameterError` (a line, or a parameter the policy does not take) or
    :class:`~kvdemo.errors.PruningSettingError` otherwise."""
    names = [entry_label(*split_entry(n)) for n in names if n and n.strip()]
    if not names:
        raise PolicyChoiceError("choose at least one policy to compare")
    for name in names:  # the wrong name first, whatever else is wrong with the list
        policy_class(split_entry(name)[1])
    if FULL in names:
        raise PolicyChoiceError(f"{FULL!r} is always compared (the full cache is the baseline): leave it out")
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise PolicyChoiceError(f"{twice!r} is named twice: each policy once")
    if len(names) > MAX_POLICIES:
        raise PolicyChoiceError(
            f"compare at most {MAX_POLICIES} policies at once (memory grows with each), got {len(names)}"
        )
    shared = parse_prune(prune, "pruning")
    contenders = {}
    for name in names:
        own, policy = split_entry(name)
        contenders[name] = Contender(policy, prune=own or shared)
    for line in (text or "").splitlines():
        if not line.strip():
            continue
        found = OVERRIDE_LINE.match(line)
        name, rest = (found.group(1), line[found.end() :]) if found else (line.strip(), "")
        if name not in contenders:
            raise PolicyParameterError(f"the line {line.strip()!r} names no compared policy ({', '.join(names)})")
        contender = contenders[name]
        for item in rest.split():
            key, eq, value = item.partition("=")
            if not eq:
                raise PolicyParameterError(f"{item!r} in {name}'s line is not key=value")
            if key in ("M", "C"):
                setattr(contender, "budget" if key == "M" else "keep", value)
            elif key == "prune":
                contender.prune = parse_prune(value, f"{name}'s prune")
            else:
                contender.params[key.replace("-", "_")] = value
    for contender in contenders.values():
        make_policy(contender.name, **contender.params)  # a line's parameters, checked as the policy declares them
    return list(contenders.values())


def compare_engines(
    model,
    contenders: list[Contender],
    budget: Any,
    keep: Any,
    fps: float,
    full_cap_bytes: int | None = None,
    max_new_tokens: int = 64,
) -> dict[str, StreamEngine]:
    """The comparison's lineup (:func:`kvdemo.stream.lineup.make_engines`): one engine per contender (its own budget, else
    the shared ``budget``/``keep``), then the full cache stopped at ``full_cap_bytes``."""
    return make_engines(
        model,
        contenders,
        budget,
        keep,
        fps=fps,
        max_new_tokens=max_new_tokens,
        baseline=True,
        baseline_cap_bytes=full_cap_bytes,
    )


def compare_lineup(
    contenders: list[Contender], budget: Any, keep: Any, tokens: int, shape: str = "", seconds: float = 0.0
) -> list[Contender]:
    """The compared ``contenders`` with their budgets resolved (their own ``M``/``C``, else the shared ``budget``/
    ``keep``) and sized for chunks of ``tokens`` visual tokens (``seconds`` of video each, when known): every budget
    error, naming the policy it is about, before a model loads."""
    lineup = lineup_budgets(contenders, budget, keep, baseline=True)
    sized = size_lineup(lineup, tokens, shape, named=True, seconds=seconds)
    return [Contender(name, policy=policy, budget=bounds) for name, (policy, bounds) in sized.items()]


def token_bytes(model) -> int:
    """Bytes one token's keys and values take over every memory layer of ``model``."""
    element = torch.empty(0, dtype=model.dtype).element_size()
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * element


def memory_bound(
    model, engines: dict[str, StreamEngine], tokens_per_second: float, full_cap_bytes: int | None
) -> dict[str, Any]:
    """What the compared engines may hold: each bounded engine at most its ``M`` visual tokens' keys and values (plus
    the text prefix and an answer's slack, a few hundred tokens), the full cache ``tokens_per_second`` more each
    second of stream until its cap; with the sentence the app and the CLI show."""
    per_token = token_bytes(model)
    bounded = {name: e.budget.M * per_token for name, e in engines.items() if e.budget.M is not None}
    per_minute = tokens_per_second * 60 * per_token
    # The cap as a limit, not an event: whether the full cache reached it is its engine's own line (its stop reason).
    cap = f" (it stops if it reaches its {full_cap_bytes / 2**20:.0f} MB cap)" if full_cap_bytes else " (no cap)"
    sentence = (
        f"memory grows with the number of policies: {counted(len(bounded), 'bounded engine')} hold at most "
        f"{sum(bounded.values()) / 2**20:.1f} MB of keys and values together ("
        + ", ".join(f"{n} {b / 2**20:.1f}" for n, b in bounded.items())
        + f" MB), the full cache grows by {per_minute / 2**20:.1f} MB per minute of this stream{cap}"
    )
    return {
        "bytes_per_token": per_token,
        "bounded_bytes": bounded,
        "bounded_total_bytes": sum(bounded.values()),
        "full_bytes_per_minute": per_minute,
        "full_cap_bytes": full_cap_bytes,
        "text": sentence,
    }


def ask_all(
    engines: dict[str, StreamEngine],
    stopped: dict[str, str],
    question: str,
    attribute: bool = False,
    max_new_tokens: int | None = None,
) -> dict[str, Any]:
    """Ask every engine that has not stopped (each in its own dialogue); name -> its :class:`~kvdemo.stream.engine.Answer`."""
    return {
        name: engine.answer(question, max_new_tokens, attribute)
        for name, engine in engines.items()
        if name not in stopped
    }


def question_record(
    question: str, answers: dict[str, Any], episode=None, time_s: float = 0.0, earlier: list[str] | None = None
) -> dict[str, Any]:
    """One question's entry of the comparison report: each engine's answer, grade (on a generated stream, in the
    dialogue's ``earlier`` questions), attribution and, where the ground truth names the object, the evidence ratio of
    its attribution."""
    from ..analysis.explain import evidence_ratio  # deferred on purpose (see the imports)
    from ..world.grading import asked_question, grade  # deferred on purpose: only generated streams are graded

    known = episode.answer_for(asked_question(question, earlier or [])) if episode is not None else None
    record: dict[str, Any] = {"question": question, "expected": known.answer if known else None, "answers": {}}
    for name, answer in answers.items():
        entry: dict[str, Any] = {"answer": answer.answer, "ms": round(answer.ms, 1), "tokens": answer.tokens}
        if episode is not None:
            entry["correct"] = grade(episode, question, answer.answer, time_s, earlier or []).correct
        if answer.attribution is not None:
            entry["attribution"] = answer.attribution.to_dict()
            if known is not None:
                entry["evidence_ratio"] = round(evidence_ratio(answer.attribution, episode, known.subject), 4)
        record["answers"][name] = entry
    return record


def model_seconds(engines: dict[str, StreamEngine]) -> float:
    """The model work of a comparison's stream so far: every chunk's vision encoding once (shared) plus every
    engine's prefills and compressions (answers not included)."""
    encode_ms = max((e.stats.encode_ms for e in engines.values()), default=0.0)
    return (encode_ms + sum(e.stats.prefill_ms + e.stats.compress_ms for e in engines.values())) / 1000


def comparison_report(
    engines: dict[str, StreamEngine],
    group: EngineGroup,
    video: str,
    questions: list[dict[str, Any]],
    bound: dict[str, Any],
    lost_frames: int = 0,
) -> dict[str, Any]:
    """The JSON report: one run report per engine, the questions, the memory bound and how fast it ran (model work
    per second of stream: below 1 is faster than real time)."""
    any_engine = next(iter(engines.values()))
    stream_s = group.frames_seen / any_engine.fps if any_engine.fps else 0.0
    wall_s = model_seconds(engines)
    return {
        "model": any_engine.model.name,
        "video": video,
        "memory": bound,
        "policies": {name: e.report(video, lost_frames) for name, e in engines.items() if name != FULL},
        FULL: engines[FULL].report(video, lost_frames) if FULL in engines else None,
        "stopped": dict(group.stopped),
        "questions": questions,
        "timing": {
            "stream_s": round(stream_s, 3),
            "model_s": round(wall_s, 3),
            "model_s_per_stream_s": round(wall_s / stream_s, 4) if stream_s else None,
            "faster_than_real_time": bool(stream_s and wall_s < stream_s),
        },
    }


def compare_command(args, model, video, contenders: list[Contender], episode=None, progress=None) -> int:
    """``python -m kvdemo compare`` on ``video`` with ``contenders`` (the CLI parsed and checked the arguments, opened
    the stream and sized every budget, :func:`compare_lineup`; ``episode``: its generated ground truth, for the
    bundled sample). ``progress``: makes a bar (tqdm's interface), advanced by the frames streamed; with one, each
    question is announced on stderr as it is asked of every engine."""
    from ..analysis.explain import fidelity  # deferred on purpose (see the imports)
    from ..stream.streaming import EngineGroup  # deferred with it

    cap = cap_bytes(args.full_cap_mb)
    engines = compare_engines(model, contenders, None, None, video.fps, cap, args.max_new_tokens)
    tokens, _ = model.geometry.chunk_tokens(video.size, 2)
    tokens_per_second = tokens * video.fps / 2
    bound = memory_bound(model, engines, tokens_per_second, cap)
    print(
        f"model {model.name}; " + "; ".join(f"{n} {e.budget.describe()}" for n, e in engines.items()), file=sys.stderr
    )
    print(bound["text"], file=sys.stderr)
    group = EngineGroup(model, engines, video.fps)
    bar = progress() if progress is not None else None  # after the lines above, so that it does not cut into them
    parts = video.chunks(2)
    current = next(parts, None)
    while current is not None:
        following = next(parts, None)
        steps = group.push(current[1], current[2], flush=following is None, total=video.num_frames)
        if bar is not None:
            bar.update(sum(step.chunk.frames for step in steps))
        current = following
    if bar is not None:
        bar.close()
    for name, why in group.stopped.items():
        print(f"{name}: {why}", file=sys.stderr)
    if video.lost_frames:
        print(f"warning: {video.describe()}", file=sys.stderr)
    questions = []
    for number, question in enumerate(args.ask):
        if progress is not None:
            running = len(engines) - len(group.stopped)
            print(f"asking {running} engines question {number + 1} of {len(args.ask)}", file=sys.stderr, flush=True)
        answers = ask_all(engines, group.stopped, question, args.attribution)
        record = question_record(question, answers, episode, engines[FULL].last_time_s, args.ask[:number])
        if args.fidelity and FULL not in group.stopped:
            record["fidelity"] = fidelity(engines[FULL], {n: e for n, e in engines.items() if n != FULL}, question)
        questions.append(record)
    report = comparison_report(engines, group, video.describe(), questions, bound, video.lost_frames)
    print(comparison_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report written to {args.json}", file=sys.stderr)
    return 0


def comparison_table(report: dict[str, Any]) -> str:
    """The comparison as aligned rows: per engine its budget, peak tokens and MB, compressions, and per question
    its answer (graded on a generated stream), visual share of its attention, evidence ratio and fidelity."""
    engines = {**report["policies"], **({FULL: report[FULL]} if report.get(FULL) else {})}
    lines = [f"{'engine':<14} {'M / C':>9} {'peak tokens':>11} {'peak MB':>8} {'compressions':>12}"]
    reserved = []
    for name, r in engines.items():
        size = "-" if r["budget"] is None else f"{r['budget']}" + (f"/{r['keep']}" if r["keep"] is not None else "")
        passes = sum(e["event"] == "compress" for e in r["timeline"])
        held = r["peak_visual_tokens"] - r["summary_slots"]
        lines.append(f"{name:<14} {size:>9} {held:>11} {r['peak_cache_bytes'] / 2**20:>8.2f} {passes:>12}")
        if r["summary_slots"]:
            reserved.append(f"{name} also reserves {r['summary_slots']} summary slots in M")
    if reserved:
        lines.append(f"(peak tokens: visual tokens held; {'; '.join(reserved)})")
    for q in report["questions"]:
        lines.append(f"\nQ: {clipped(q['question'])}" + (f"  (ground truth: {q['expected']})" if q["expected"] else ""))
        for name, a in q["answers"].items():
            mark = {True: " ✓", False: " ✗"}.get(a.get("correct"), "")
            extra = ""
            if "attribution" in a:
                extra += f"  visual {100 * a['attribution']['share']['visual']:.0f}% of attention"
            if a.get("evidence_ratio") is not None:
                extra += f", evidence ratio {a['evidence_ratio']:.2f}"
            if name in q.get("fidelity", {}):
                f = q["fidelity"][name]
                extra += f", KL {f['first_token_kl']:.3f}, mean layer error {sum(f['layer_error']) / len(f['layer_error']):.3f}"
            lines.append(f"  {name:<14} {a['answer']!r}{mark}{extra}")
    t = report["timing"]
    if t["model_s_per_stream_s"] is not None:
        lines.append(
            f"\nmodel work: {t['model_s']:.1f} s for {t['stream_s']:.0f} s of stream "
            f"({t['model_s_per_stream_s']:.2f} s per stream second, {len(engines)} engines)"
        )
    return "\n".join(lines)
