"""kvdemo as an lmms-eval model: ``python -m lmms_eval --model kvdemo --model_args policy=...,M=...``.

Installed kvdemo registers ``kvdemo`` under lmms-eval's ``lmms_eval.models`` entry point (:func:`manifest`); the
class is a "simple" lmms-eval model (``is_simple = True``: requests carry the task's flat prompt and
``doc_to_visual``). Model arguments (``--model_args key=value,...``):

- ``pretrained`` (or ``checkpoint``): anything :func:`kvdemo.models.loading.load_model` takes (``tiny``, a Hugging
  Face id, a local folder); default ``tiny``.
- ``policy`` (default ``full``), ``M`` and ``C`` (the budget, visual tokens; without ``M`` a bounded policy runs at
  the model's default budget, the app's, and the run's config says so in ``budget_from``; ``C`` left out is 0.75 M),
  ``param_<name>=value`` for each policy parameter (``param_alpha=0.5``).
- ``prune``: pruning before the LLM in front of the policy (``prune=evs:0.75``, ``prune=vidcom2:0.25``;
  :mod:`kvdemo.pruning`); default none.
- ``fps`` (sampling, default 2), ``min_pixels`` / ``max_pixels`` (the frame size range; default the model's),
  ``max_new_tokens`` (default: the task's ``generation_kwargs``).
- ``time_field``: a document field holding the stream time (seconds) to ask at; without it (or where a document
  lacks it) a question is asked at the end of its video, which is where VideoMME, MLVU and OVO-Bench ask
  (OVO-Bench cuts each clip at its question's time).
- ``runs``: where the run folder goes (default ``runs``; one folder per run, :mod:`kvdemo.experiments.results`).

Protocol (kvdemo's own): requests are grouped by video; each video is decoded and streamed once through one
engine, and its questions are asked in time order, each from the memory alone (the dialogue is reset after each
answer). A question due at time ``t`` is asked once every grid whose first frame is at or before ``t`` has been
fed. OVO-Bench's multi-round forward task continues one engine per document: each round's clip is a longer prefix
of the same video, and only its frames past those already fed are fed (a final odd frame waits for the next
round). Data parallel under ``accelerate launch -m lmms_eval``: lmms-eval hands each process its share of the
documents; a video whose questions land on several processes is streamed by each of them (same answers).
One model load per process: CPU for the offline models, the process's GPU in bfloat16 for real checkpoints.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_ID = "kvdemo"


def manifest() -> Any:
    """The ``lmms_eval.models`` entry point's payload (lmms-eval's ``ModelManifest``): ``--model kvdemo`` is
    :class:`KVDemoLMM`. Defined before this module imports lmms-eval: importing lmms-eval's model base loads its
    registry, which calls this function (on this module, still being imported) when kvdemo is imported first."""
    from lmms_eval.models.registry_v2 import ModelManifest  # deferred: see above (an import circle otherwise)

    return ModelManifest(model_id=MODEL_ID, simple_class_path=f"{__name__}.KVDemoLMM")


from lmms_eval.api.instance import Instance  # noqa: E402 (after manifest(): see its docstring)
from lmms_eval.api.model import lmms  # noqa: E402

from ..cache.budget import DEFAULT_KEEP_RATIO, Budget  # noqa: E402
from ..experiments.results import RunWriter, grade_prediction  # noqa: E402
from ..media.video import VideoError, open_video  # noqa: E402
from ..models.catalog import default_budget  # noqa: E402
from ..models.loading import load_model  # noqa: E402
from ..policies import make_policy  # noqa: E402
from ..pruning import parse_prune  # noqa: E402
from ..stream.engine import EngineError, StreamEngine  # noqa: E402
from ..stream.lineup import Contender, make_engines  # noqa: E402


@dataclass
class Ask:
    """One question of one video: the request's index, its prompt, when to ask (None: at the end)."""

    index: int
    context: str
    time_s: float | None
    max_new_tokens: int
    until: tuple[str, ...]
    doc: dict[str, Any]
    task: str


class KVDemoLMM(lmms):
    """A streamed kvdemo engine answering lmms-eval's requests (see the module docstring for the arguments)."""

    is_simple = True

    def __init__(
        self,
        pretrained: str = "tiny",
        checkpoint: str | None = None,
        policy: str = "full",
        M: int | None = None,
        C: int | None = None,
        fps: float = 2.0,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_new_tokens: int | None = None,
        time_field: str | None = None,
        prune: str | None = None,
        runs: str = "runs",
        device: str | None = None,
        batch_size: int | str | None = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        params = {key[len("param_") :]: value for key, value in kwargs.items() if key.startswith("param_")}
        unknown = sorted(key for key in kwargs if not key.startswith("param_") and key != "max_batch_size")
        if unknown:
            raise ValueError(
                f"kvdemo: unknown model argument(s) {', '.join(unknown)} (policy parameters go as param_<name>=value)"
            )
        self.checkpoint = str(checkpoint or pretrained)
        self.policy_name, self.budget, self.keep, self.policy_params = str(policy), M, C, params
        self.fps, self.max_new_tokens, self.time_field = float(fps), max_new_tokens, time_field
        # Bad arguments fail before the model loads. Without M a bounded policy runs at the model's default budget,
        # the one the app starts it with; C defaults to 0.75 M, as on the command line.
        policy = make_policy(self.policy_name, **params)
        self.budget_from = "model_args"
        if policy.bounded and (M is None or not str(M).strip()):
            M, default_keep, _ = default_budget(self.checkpoint)
            C = default_keep if C is None else C
            self.budget_from = "the model's default (as the app starts it)"
        self.bounds = Budget.resolve(policy, M, C, default_ratio=DEFAULT_KEEP_RATIO)
        policy.check_stream(2 / self.fps)  # a window in seconds holds a chunk (two frames) before the model loads
        self.prune = parse_prune(prune, "kvdemo's model argument prune")
        self.engine_name = Contender(self.policy_name, prune=self.prune).label
        self._rank, self._world_size, local_device = _process_placement()
        self.accelerator = _accelerator() if self._world_size > 1 else None
        self.model = load_model(self.checkpoint, device=device or local_device)
        self.geometry = self.model.geometry.with_pixels(min_pixels, max_pixels)
        self.writer = RunWriter.open(
            Path(runs), f"lmms-eval-{self.engine_name}", self._config(), self._rank, self._world_size
        )

    # --- lmms-eval's API --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> Any:
        return self.model.device

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("kvdemo generates answers; tasks scored by log-likelihood are not supported")

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Every request's answer, each video streamed once and its questions asked in time order."""
        by_video: dict[str, list[Ask]] = defaultdict(list)
        for index, request in enumerate(requests):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
            doc = self.task_dict[task][split][doc_id]
            by_video[self._video_of(doc_to_visual(doc))].append(self._ask(index, context, gen_kwargs, doc, task))
        answers: list[str] = [""] * len(requests)
        for path, asks in by_video.items():
            for ask, answer in zip(asks, self._stream_and_ask(path, asks)):
                answers[ask.index] = answer
        self.writer.flush()
        return answers

    def generate_until_multi_round(self, requests: list[Instance]) -> list[list[str]]:
        """OVO-Bench's forward task: one engine per document; each round feeds only the frames its clip adds."""
        results = []
        for request in requests:
            context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = request.args
            doc = self.task_dict[task][split][doc_id]
            engine, fed, round_answers = self._engine(), 0, []
            path, prompt, round_index = self._video_of(doc_to_visual(doc)), context, 0
            while True:
                fed = self._feed(engine, path, skip=fed, flush=False)
                ask = self._ask(len(round_answers), prompt, gen_kwargs, doc, task)
                round_answers.append(self._answer(engine, ask, path))
                round_index += 1
                visuals, prompt, terminal, _, _ = doc_to_text(
                    doc, previous_output=list(round_answers), round_idx=round_index, previous_round_info=None
                )
                if terminal:
                    break
                path = self._video_of(visuals)
            results.append(round_answers)
        self.writer.flush()
        return results

    # --- streaming --------------------------------------------------------------------------------
    def _stream_and_ask(self, path: str, asks: list[Ask]) -> list[str]:
        """Stream ``path`` once; ask each of ``asks`` when its time comes (those without a time at the end)."""
        order = sorted(range(len(asks)), key=lambda i: (asks[i].time_s is None, asks[i].time_s or 0.0, i))
        answers: dict[int, str] = {}
        engine, pending = self._engine(), list(order)
        try:
            video = open_video(path, fps=self.fps, geometry=self.geometry)
            for _, frames, times in video.chunks(self.geometry.frames_per_grid):
                while pending and asks[pending[0]].time_s is not None and asks[pending[0]].time_s < float(times[0]):
                    due = pending.pop(0)
                    answers[due] = self._answer(engine, asks[due], path)
                engine.feed(frames, times)
            engine.flush()
        except (VideoError, EngineError) as exc:
            print(f"kvdemo: {Path(path).name}: {exc}")
        for i in pending:
            answers[i] = self._answer(engine, asks[i], path)
        return [answers[i] for i in range(len(asks))]

    def _feed(self, engine: StreamEngine, path: str, skip: int, flush: bool) -> int:
        """Feed ``path``'s sampled frames from the ``skip``-th on; returns how many frames it holds in all."""
        video = open_video(path, fps=self.fps, geometry=self.geometry)
        seen = 0
        for _, frames, times in video.chunks(self.geometry.frames_per_grid):
            new = max(0, seen + len(frames) - max(skip, seen))
            if new:
                engine.feed(frames[-new:], times[-new:])
            seen += len(frames)
        if flush:
            engine.flush()
        return max(seen, skip)

    def _answer(self, engine: StreamEngine, ask: Ask, path: str) -> str:
        """Answer ``ask`` from the memory alone and record it (the dialogue is reset afterwards)."""
        start = time.perf_counter()
        try:
            answer = engine.answer(ask.context, ask.max_new_tokens)
            text, error = answer.answer, None
        except EngineError as exc:
            answer, text, error = None, "", str(exc)
        for stop in ask.until:
            text = text.split(stop)[0] if stop else text
        engine.reset_dialogue()
        stats = engine.stats
        timeline = engine.memory.timeline
        self.writer.add(
            {
                "task": ask.task,
                "video": Path(path).name,
                "question": ask.context,
                "answer": text,
                **grade_prediction(ask.doc, text),
                "ask_s": ask.time_s,
                "delay_s": ask.doc.get("delay_s"),
                "policy": engine.policy.name,
                "prune": engine.pruning.spec.text if engine.pruning is not None else None,
                "tokens_entered": engine.pruning.entered if engine.pruning is not None else None,
                "M": engine.budget.M,
                "C": engine.budget.C,
                "tokens_held": engine.memory.visual_tokens,
                "peak_tokens": max((e.visual_tokens for e in timeline), default=engine.memory.visual_tokens),
                "compressions": stats.compressions,
                "frames_fed": engine.frames_fed,
                "answer_ms": answer.ms if answer else (time.perf_counter() - start) * 1000,
                "stream_ms": stats.encode_ms + stats.prefill_ms + stats.compress_ms,
                **({"error": error} if error else {}),
            }
        )
        return text

    def _engine(self) -> StreamEngine:
        """A fresh engine (a fresh policy, its state its own) under the budget resolved once, for one video."""
        contender = Contender(self.policy_name, self.policy_params, budget=self.bounds, prune=self.prune)
        return make_engines(self.model, [contender], fps=self.fps)[contender.label]

    def _ask(self, index: int, context: str, gen_kwargs: dict[str, Any], doc: dict[str, Any], task: str) -> Ask:
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(u for u in until if u != "\n\n")
        time_s = doc.get(self.time_field) if self.time_field else None
        tokens = self.max_new_tokens or int(gen_kwargs.get("max_new_tokens") or 16)
        return Ask(index, context, None if time_s is None else float(time_s), tokens, until, doc, task)

    @staticmethod
    def _video_of(visuals: Any) -> str:
        if not visuals or not isinstance(visuals[0], (str, Path)):
            raise ValueError("kvdemo answers about one video per question: the task's doc_to_visual must return [path]")
        return str(visuals[0])

    def _config(self) -> dict[str, Any]:
        return {
            "harness": "lmms-eval",
            "model": self.model.name,
            "checkpoint": self.checkpoint,
            "policy": self.policy_name,
            "params": self.policy_params,
            "prune": self.prune.text if self.prune is not None else None,
            "M": self.bounds.M,
            "C": self.bounds.C,
            "budget_from": self.budget_from,
            "fps": self.fps,
            "min_pixels": self.geometry.min_pixels,
            "max_pixels": self.geometry.max_pixels,
            "time_field": self.time_field,
            "world_size": self._world_size,
        }


def _process_placement() -> tuple[int, int, str | None]:
    """This process's rank, the number of processes, and its device (``cuda:<local rank>`` when data parallel on
    GPUs; None: the model's own choice) from the launcher's environment (``accelerate launch`` sets it)."""
    import os  # deferred with torch, below

    import torch  # deferred: read only once a model is made

    rank, world, local = (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )
    if world > 1 and torch.cuda.is_available():
        torch.cuda.set_device(local)
        return rank, world, f"cuda:{local}"
    return rank, world, None


def _accelerator() -> Any:
    """The launcher's accelerator. On CPUs the gloo process group is started first (accelerate starts none for a
    CPU-only launch, and lmms-eval gathers the processes' answers through it); on GPUs accelerate starts NCCL."""
    import torch  # deferred: only data-parallel launches need these three
    import torch.distributed as dist  # deferred (as above)
    from accelerate import Accelerator  # deferred (as above)

    if not torch.cuda.is_available() and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo")
    return Accelerator()
