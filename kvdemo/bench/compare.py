"""``python -m kvdemo.bench.compare``: what comparing and explaining cost and show, on the trained tiny model.

1. Real time: the bundled sample of each kind streamed into the compared policies and the full cache at once (one
   vision encoding): model work per second of stream (vision encoding once, every engine's prefills and
   compressions), and the wall time of the whole stream; one question to every engine with and without
   attribution (what tallying in the attention seam adds).
2. Attribution against ground truth: on held-out generated streams (seed tag 3), every question asked of every
   engine with attribution; per engine, the evidence ratio (attention per frame showing the asked object over
   attention per frame, :func:`kvdemo.analysis.explain.evidence_ratio`): geometric mean, share of questions above 1, and
   accuracy.
3. Fidelity: per engine, the mean first-token KL and the mean per-layer attention-output error against the full
   cache, over the same questions.

Prints tables and writes JSON (``--json``); it asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from ..analysis.explain import evidence_grids, evidence_ratio, evidence_share, fidelity, object_token_share
from ..experiments.compare import FULL, compare_engines, model_seconds, parse_overrides
from ..models.loading import load_model
from ..policies import COMPARE_POLICIES
from ..stream.streaming import stream_video
from ..world.synthetic import STREAM_KINDS, StreamSpec, generate_episode, grade_answer, sample_episode
from . import write_json


def realtime(model, policies: list[str], budget: int, keep: int) -> dict[str, Any]:
    """Per sample kind: model work and wall time per stream second, and one question's time with and without
    attribution (summed over the engines)."""
    out = {}
    for kind in STREAM_KINDS:
        episode = sample_episode(kind)
        video = episode.video.sampled(2.0).resized(model.geometry)
        engines = compare_engines(model, parse_overrides(policies), budget, keep, video.fps)
        start = time.perf_counter()
        for _ in stream_video(model, video, engines):
            pass
        wall = time.perf_counter() - start
        stream_s = video.num_frames / video.fps
        question = episode.questions[0].text
        timings = {}
        for attribute in (False, True):
            start = time.perf_counter()
            for engine in engines.values():
                engine.answer(question, 12, attribute)
                engine.reset_dialogue()
            timings[attribute] = time.perf_counter() - start
        out[kind] = {
            "engines": len(engines),
            "stream_s": stream_s,
            "model_s": model_seconds(engines),
            "wall_s": wall,
            "model_s_per_stream_s": model_seconds(engines) / stream_s,
            "wall_s_per_stream_s": wall / stream_s,
            "question_s": timings[False],
            "question_with_attribution_s": timings[True],
        }
    return out


def grounded(model, policies: list[str], budget: int, keep: int, episodes: int) -> dict[str, Any]:
    """Per stream kind and engine: evidence ratios, accuracy and fidelity over ``episodes`` held-out streams."""
    out = {}
    for kind in STREAM_KINDS:
        ratios: dict[str, list[float]] = {}
        right: dict[str, list[bool]] = {}
        kl: dict[str, list[float]] = {}
        error: dict[str, list[float]] = {}
        shares: dict[str, list[tuple[float, float]]] = {}
        tokens: dict[str, list[list[tuple[float, float]]]] = {}
        for index in range(episodes):
            episode = generate_episode((0, 3, index), StreamSpec(pairs=(24, 24), kind=kind))
            engines = compare_engines(model, parse_overrides(policies), budget, keep, episode.video.fps)
            for _ in stream_video(model, episode.video, engines):
                pass
            for question in episode.questions:
                shows = evidence_grids(episode, question.subject, engines[FULL].memory.num_grids)
                for name, engine in engines.items():
                    answer = engine.answer(question.text, 12, attribute=True)
                    engine.reset_dialogue()
                    right.setdefault(name, []).append(grade_answer(question.answer, answer.answer))
                    if shows.any() and not shows.all():
                        ratios.setdefault(name, []).append(
                            evidence_ratio(answer.attribution, episode, question.subject)
                        )
                        shares.setdefault(name, []).append(
                            (evidence_share(answer.attribution, episode, question.subject), float(shows.mean()))
                        )
                        layers = range(len(answer.attribution.visual))
                        tokens.setdefault(name, []).append(
                            [
                                object_token_share(answer.attribution, episode, question.subject, layer)
                                for layer in (None, *layers)
                            ]
                        )
                for name, result in fidelity(
                    engines[FULL], {n: e for n, e in engines.items() if n != FULL}, question.text
                ).items():
                    kl.setdefault(name, []).append(result["first_token_kl"])
                    error.setdefault(name, []).append(float(np.mean(result["layer_error"])))
        out[kind] = {}
        for name in right:
            r = np.array(ratios.get(name, []))
            finite = r[np.isfinite(r) & (r > 0)]
            out[kind][name] = {
                "questions": len(right[name]),
                "accuracy": float(np.mean(right[name])),
                "evidence_ratio_geomean": float(np.exp(np.log(finite).mean())) if finite.size else None,
                "evidence_ratio_median": float(np.median(r)) if r.size else None,
                "share_above_1": float((r > 1).mean()) if r.size else None,
                **evidence_summary(shares.get(name, []), tokens.get(name, [])),
                "first_token_kl": float(np.mean(kl[name])) if name in kl else 0.0,
                "mean_layer_error": float(np.mean(error[name])) if name in error else 0.0,
            }
    return out


def evidence_summary(shares: list[tuple[float, float]], tokens: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """Means over questions (nan where an engine attended nothing visual left out): the share of the visual
    attention on the frames that show the asked object and the share of frames that show it (chance); the share on
    the object's own tokens and the share of attended tokens that are the object's, over every layer and per layer."""
    if not shares:
        return {
            "evidence_share": None,
            "evidence_frames": None,
            "object_tokens": None,
            "object_tokens_chance": None,
            "object_tokens_by_layer": None,
        }
    frames = np.array(shares)
    on = np.array(tokens)  # [questions, 1 + layers, 2]
    return {
        "evidence_share": float(np.nanmean(frames[:, 0])),
        "evidence_frames": float(frames[:, 1].mean()),
        "object_tokens": float(np.nanmean(on[:, 0, 0])),
        "object_tokens_chance": float(np.nanmean(on[:, 0, 1])),
        "object_tokens_by_layer": np.round(np.nanmean(on[:, 1:, 0], axis=0), 4).tolist(),
    }


def tables(results: dict[str, Any]) -> str:
    lines = [
        "real time (bundled sample, 40 s, every engine at once)",
        f"{'kind':<8} {'engines':>7} {'model s/stream s':>17} {'wall s/stream s':>16} {'question s':>11} {'with attribution':>17}",
    ]
    for kind, r in results["realtime"].items():
        lines.append(
            f"{kind:<8} {r['engines']:>7} {r['model_s_per_stream_s']:>17.4f} {r['wall_s_per_stream_s']:>16.4f} "
            f"{r['question_s']:>11.3f} {r['question_with_attribution_s']:>17.3f}"
        )
    for kind, engines in results["grounded"].items():
        lines.append(
            f"\n{kind} held-out streams ({results['episodes']} x 24 s): attribution against ground truth, fidelity"
        )
        lines.append(
            f"{'engine':<14} {'questions':>9} {'accuracy':>8} {'ratio geomean':>13} {'median':>7} {'>1':>5} "
            f"{'first-token KL':>14} {'layer error':>11}"
        )
        for name, r in engines.items():
            geo = "-" if r["evidence_ratio_geomean"] is None else f"{r['evidence_ratio_geomean']:.2f}"
            med = "-" if r["evidence_ratio_median"] is None else f"{r['evidence_ratio_median']:.2f}"
            above = "-" if r["share_above_1"] is None else f"{r['share_above_1']:.2f}"
            lines.append(
                f"{name:<14} {r['questions']:>9} {r['accuracy']:>8.2f} {geo:>13} {med:>7} {above:>5} "
                f"{r['first_token_kl']:>14.3f} {r['mean_layer_error']:>11.3f}"
            )
        lines.append(
            f"\n{kind}: share of the visual attention on the asked object (frames that show it; its own tokens)"
        )
        lines.append(
            f"{'engine':<14} {'on its frames':>13} {'frames':>7} {'on its tokens':>13} {'tokens':>7}  per layer"
        )
        for name, r in engines.items():
            if r["evidence_share"] is None:
                continue
            by_layer = " ".join(f"{v:.2f}" for v in r["object_tokens_by_layer"])
            lines.append(
                f"{name:<14} {r['evidence_share']:>13.3f} {r['evidence_frames']:>7.3f} {r['object_tokens']:>13.3f} "
                f"{r['object_tokens_chance']:>7.3f}  {by_layer}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvdemo.bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", default=",".join(COMPARE_POLICIES))
    parser.add_argument("--budget", "-M", type=int, default=64)
    parser.add_argument("--keep", "-C", type=int, default=48)
    parser.add_argument("--episodes", type=int, default=50, help="held-out streams per kind (default 50)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model("tiny")
    policies = [p for p in args.policies.split(",") if p]
    results = {
        "model": model.name,
        "policies": policies,
        "budget": args.budget,
        "keep": args.keep,
        "episodes": args.episodes,
        "threads": args.threads,
        "realtime": realtime(model, policies, args.budget, args.keep),
        "grounded": grounded(model, policies, args.budget, args.keep, args.episodes),
    }
    print(tables(results))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
