"""The streaming engine: frames in, a KV memory under a hard budget, answers from a fork of it.

``FrameStream`` turns incoming frames into vision-encoded chunks (one encoding per chunk, shared by
every engine watching the stream: :mod:`kvdemo.stream.streaming`). ``StreamEngine.feed_chunk`` prefills a chunk on the current
memory and compresses with the policy whenever the next chunk would push visual tokens past ``M``,
so visual tokens never exceed ``M``. ``StreamEngine.ask`` answers on a fork and leaves the memory
exactly as it was.
"""

# Long on purpose: StreamEngine is one life cycle (feed, compress, ask on a fork, report) whose steps share the
# memory, the budget and the timeline; the chunk's encoding is FrameStream's, building engines is lineup.py's, and
# the memory's own moves are kvdemo/cache.

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..analysis.explain import Attribution, AttributionTally
from ..analysis.survival import survival_fraction
from ..cache.attention import MemoryCache
from ..cache.budget import Budget
from ..cache.chunk import VisualChunk
from ..cache.memory import KVMemory, OccupancyEvent
from ..devices.timing import Stopwatch
from ..dialogue import DEFAULT_MAX_NEW_TOKENS, QuestionError, check_question, replayed_dialogue
from ..errors import UserError
from ..media.video import sampling_fps
from ..models.base import VideoLM
from ..policies import BudgetError, Policy, Probed, make_policy
from ..pruning import PruneSpec, parse_prune
from ..pruning.stage import Pruning
from ..views import View, ViewContext


class EngineError(UserError):
    """A request the engine cannot serve (asking before any frame, an empty question...)."""


class EngineStop(EngineError):
    """An engine cannot take the stream's next chunk (its group stops it and goes on with the others)."""


class MemoryCapError(EngineStop):
    """The next chunk would take the cache past its configured byte cap."""


class PositionLimitError(EngineStop):
    """The next chunk would take positions past the range the model was trained with (eviction does not give
    positions back: a position, once used, stays used)."""


#: Positions kept free after the stream for a question, the dialogue and an answer (a stream stops before).
QUESTION_ROOM = 1024


@dataclass
class Answer:
    question: str
    answer: str
    ms: float
    ttft_ms: float
    tokens: int
    cache_bytes: int
    visual_tokens: int
    dropped_turns: int = 0  # earlier turns left out of the replayed dialogue (kvdemo.dialogue)
    attribution: Attribution | None = None  # what the answer looked at, when asked for (kvdemo.analysis.explain)


class FrameStream:
    """Pairs incoming frames into temporal grids, numbers the grids, and vision-encodes each chunk once.

    An odd frame waits for the next push; :meth:`flush` pairs a final odd frame with a copy of itself.
    """

    def __init__(self, model: VideoLM, fps: float) -> None:
        self.model = model
        self.fps = sampling_fps(fps)
        self.next_grid = 0
        self.frames_seen = 0
        self._pending: list[tuple[np.ndarray, float]] = []
        self._size: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickles without its model (a ZeroGPU worker sets ``model`` again)."""
        return {**self.__dict__, "model": None}

    def check(self, frames: np.ndarray) -> None:
        """:class:`EngineError` unless ``frames`` are ``[T, H, W, 3]`` on the model's grid, of the stream's size
        (the first frames checked set it)."""
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise EngineError(f"frames must be [T, H, W, 3] RGB, got shape {tuple(frames.shape)}")
        size = (int(frames.shape[1]), int(frames.shape[2]))
        try:
            self.model.geometry.check_size(size)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if self._size is None:
            self._size = size
        elif size != self._size:
            raise EngineError(f"frame size changed mid-stream: {self._size} -> {size}")

    def push(self, frames: np.ndarray, times_s: np.ndarray | None = None) -> VisualChunk | None:
        """Add frames ``[T, H, W, 3]`` (uint8, already resized); encode every complete temporal grid."""
        self.check(frames)
        if times_s is None:
            times_s = (self.frames_seen + len(self._pending) + np.arange(len(frames))) / self.fps
        self._pending.extend(zip(frames, (float(t) for t in times_s)))
        usable = len(self._pending) - len(self._pending) % self.model.geometry.frames_per_grid
        return self._encode(usable)

    def flush(self) -> VisualChunk | None:
        """Encode a last odd frame (paired with a copy of itself)."""
        return self._encode(len(self._pending))

    def _encode(self, count: int) -> VisualChunk | None:
        if count == 0:
            return None
        taken, self._pending = self._pending[:count], self._pending[count:]
        frames = np.stack([f for f, _ in taken])
        times = np.array([t for _, t in taken])
        chunk = self.model.encode(frames, self.next_grid, times, self.fps)
        self.next_grid += chunk.num_grids
        self.frames_seen += count
        return chunk


@dataclass
class EngineStats:
    """What the stream cost so far, every time measured with the device synchronised (:class:`Stopwatch`)."""

    chunks: int = 0
    prefill_ms: float = 0.0
    compress_ms: float = 0.0
    compressions: int = 0
    encode_ms: float = 0.0
    per_chunk: list[dict[str, float]] = field(default_factory=list)

    @property
    def chunk_prefill_ms(self) -> float | None:
        """Mean prefill of a chunk, the first chunk left out when there are others (it pays for the warm-up: lazy
        set-up, first kernels); None before any chunk."""
        times = [chunk["prefill_ms"] for chunk in self.per_chunk]
        steady = times[1:] or times
        return sum(steady) / len(steady) if steady else None

    @property
    def pass_ms(self) -> float | None:
        """Mean time of one compression pass so far (None before the first)."""
        return self.compress_ms / self.compressions if self.compressions else None

    @property
    def pass_share(self) -> float | None:
        """One compression pass as a share of one chunk's prefill (:attr:`pass_ms` / :attr:`chunk_prefill_ms`):
        what compressing adds to the chunk that triggers it (the InfiniPot-V paper reports 0.5% on an A100)."""
        if self.pass_ms is None or not self.chunk_prefill_ms:
            return None
        return self.pass_ms / self.chunk_prefill_ms


def held_under_budget(memory: KVMemory, uncompressed_layers: tuple[int, ...] = ()) -> int:
    """Visual tokens of the layers the policy compresses (a pass may leave some layers uncompressed,
    ``Selection.uncompressed``, e.g. CoRDS with ``above=keep``: they do not trigger)."""
    free = set(uncompressed_layers)
    return memory.visual_tokens_in([layer for layer in range(memory.num_layers) if layer not in free])


def must_compress(budget: Budget, memory: KVMemory, uncompressed_layers: tuple[int, ...], incoming: int) -> bool:
    """The engine's compression trigger: a bounded budget, and ``incoming`` visual tokens would take what the
    compressed layers hold past ``M`` (the benchmark's simulated stream drives the same rule)."""
    return budget.bounded and held_under_budget(memory, uncompressed_layers) + incoming > budget.M


class StreamEngine:
    """A model's KV memory kept under budget ``M`` (visual tokens) by ``policy``, compressed to ``C``.

    ``policy`` is a registered name or a :class:`Policy`; ``budget`` a :class:`~kvdemo.cache.budget.Budget` resolved
    where the user's numbers entered (sized for the stream's chunks, or not yet), or ``M`` with ``keep`` = ``C`` as
    numbers, resolved here (:meth:`Budget.resolve`, exact; ``full`` ignores both). An unsized budget is sized at the
    first chunk, once (:meth:`Budget.sized`); later chunks are only checked against it. ``max_cache_bytes``
    (optional) stops the stream with :class:`MemoryCapError` before the cache would exceed it.
    ``prune`` (``"evs:0.75"``, ``"vidcom2:0.25"`` or a :class:`~kvdemo.pruning.PruneSpec`) puts pruning before the LLM
    in front of the policy (:mod:`kvdemo.pruning`): the tokens it prunes never enter the memory, and the budget counts
    what entered.
    """

    def __init__(
        self,
        model: VideoLM,
        policy: str | Policy = "full",
        budget: Budget | int | None = None,
        keep: int | None = None,
        fps: float = 2.0,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        max_cache_bytes: int | None = None,
        policy_params: dict[str, Any] | None = None,
        prune: str | PruneSpec | None = None,
    ) -> None:
        self.model = model
        spec = parse_prune(prune)
        #: Pruning before the LLM (None: every encoded token enters).
        self.pruning: Pruning | None = Pruning(spec) if spec is not None else None
        self.policy = make_policy(policy, **(policy_params or {})) if isinstance(policy, str) else policy
        if isinstance(budget, Budget):
            if keep is not None:
                raise BudgetError("give C inside the Budget, not as keep=")
            self.budget = budget
        else:
            self.budget = Budget.resolve(self.policy, budget, keep, exact=True)  # full ignores both numbers
        self.fps = float(fps)
        self.max_new_tokens = int(max_new_tokens)
        self.max_cache_bytes = max_cache_bytes
        self.memory = KVMemory(model.num_layers, model.num_kv_heads, self.budget, layer_map=model.layer_map)
        self.history: list[tuple[str, str]] = []
        self.answers: list[Answer] = []
        self.frames_fed = 0
        self.last_time_s = 0.0
        self.stats = EngineStats()
        self.last_selection_info: dict[str, Any] = {}
        self.uncompressed_layers: tuple[int, ...] = ()  # layers the last pass left whole (they do not count toward M)
        self._stream: FrameStream | None = None

    # --- crossing a process boundary (ZeroGPU) -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the model (memory, policy state, dialogue, timeline, stats) pickles; the model is
        re-attached by :meth:`bind` on the other side (resolved there by name)."""
        state = self.__dict__.copy()
        state["model"] = None
        state["model_name"] = self.model.name if self.model is not None else state.get("model_name")
        return state

    def attach(self, model: VideoLM) -> "StreamEngine":
        """Attach ``model`` after unpickling, leaving the memory where it is (e.g. on the CPU between GPU calls)."""
        self.model = model
        if self._stream is not None:
            self._stream.model = model
        return self

    def bind(self, model: VideoLM) -> "StreamEngine":
        """Attach ``model`` (after unpickling) and move each memory layer beside its weights (a model split over
        devices keeps its layers where they are) and the policy's state to the model's device."""
        self.attach(model)
        self.memory.to(model.layer_devices())
        self.policy.to(model.device)
        if self.pruning is not None:
            self.pruning.to(model.device)
        return self

    def to(self, device: torch.device | str) -> "StreamEngine":
        """Move the memory and the policy's state to ``device`` (e.g. to the CPU before pickling)."""
        self.memory.to(device)
        self.policy.to(device)
        if self.pruning is not None:
            self.pruning.to(device)
        return self

    # --- streaming ------------------------------------------------------------------------
    def feed(self, frames: np.ndarray, times_s: np.ndarray | None = None) -> list[OccupancyEvent]:
        """Encode and ingest frames ``[T, H, W, 3]``; returns the timeline events this caused."""
        if self._stream is None:
            self._stream = FrameStream(self.model, self.fps)
        chunk = self._stream.push(frames, times_s)
        return self.feed_chunk(chunk) if chunk is not None else []

    def flush(self) -> list[OccupancyEvent]:
        """Ingest a last odd frame buffered by :meth:`feed`."""
        chunk = self._stream.flush() if self._stream else None
        return self.feed_chunk(chunk) if chunk is not None else []

    @torch.inference_mode()
    def feed_chunk(self, chunk: VisualChunk) -> list[OccupancyEvent]:
        """Prefill an encoded chunk on the memory (compressing first if it would overflow ``M``). With pruning, only
        the tokens it lets in are prefilled, each at the position the model gives it in the full video."""
        self._check_chunk(chunk)  # the whole chunk: pruning may let every token of one in (a scene cut)
        if self.memory.is_empty:
            self._prefill_prefix()
        positions, cursor = self.model.chunk_positions(chunk, self.memory.cursor)
        offered = chunk.visual_tokens
        if self.pruning is not None:
            watch = self._stopwatch()
            keep = self.pruning.prune(chunk)
            self.pruning.ms += watch.ms()
            chunk, positions = chunk.subset(keep), positions[:, keep.to(positions.device)]
        events = []
        if must_compress(self.budget, self.memory, self.uncompressed_layers, chunk.num_tokens):
            events.append(self.compress(incoming=chunk.num_tokens))
        positions = self._placed(positions)  # after the compression: it may close gaps
        self._check_cap(chunk)
        watch = self._stopwatch()
        self._check_positions(cursor)
        if chunk.num_tokens:  # a chunk pruned whole puts nothing in the sequence: its grids are only recorded
            cache = MemoryCache(self.memory)
            self.model.forward(chunk.embeds, positions, cache, chunk)
        self.memory.commit_append(chunk, positions)
        self.memory.cursor = cursor
        if chunk.num_tokens:
            cache.commit_linear_state()
        prefill_ms = watch.ms()
        self.frames_fed += chunk.frames
        self.last_time_s = chunk.end_time_s
        moved = chunk.num_tokens * self.memory.token_bytes()
        events.append(self.memory.record("append", self.frames_fed, self.last_time_s, prefill_ms, moved))
        self.stats.chunks += 1
        self.stats.prefill_ms += prefill_ms
        self.stats.encode_ms += chunk.encode_ms
        self.stats.per_chunk.append(
            dict(
                frame=self.frames_fed,
                prefill_ms=prefill_ms,
                compress_ms=sum(e.ms for e in events if e.event == "compress"),
                visual_tokens=self.memory.visual_tokens,
                cache_bytes=self.memory.nbytes,
                offered_tokens=offered,
                entered_tokens=chunk.visual_tokens,
            )
        )
        return events

    @torch.inference_mode()
    def compress(self, incoming: int = 0, probe_text: str | None = None) -> OccupancyEvent:
        """Run the policy on the current memory, keeping ``C`` visual tokens per layer and KV head (for a
        policy sized by ``M`` alone, what leaves room for ``incoming`` tokens: :meth:`Budget.keep_for`).
        A :class:`~kvdemo.policies.contract.Probed` policy reads the memory with ``probe_text`` (its own proxy by
        default)."""
        watch = self._stopwatch()
        keep = self.budget.keep_for(incoming)
        probe = self._probe(probe_text or self.policy.probe_text) if isinstance(self.policy, Probed) else None
        selection = self.policy.compress(self.memory.slices(self.model.rotary, probe), keep)
        moved = self.memory.apply(selection)
        ms = watch.ms()
        self.last_selection_info = selection.info
        self.uncompressed_layers = tuple(selection.uncompressed)
        self.stats.compress_ms += ms
        self.stats.compressions += 1
        return self.memory.record("compress", self.frames_fed, self.last_time_s, ms, moved)

    def _held_under_budget(self) -> int:
        return held_under_budget(self.memory, self.uncompressed_layers)

    def _check_chunk(self, chunk: VisualChunk) -> None:
        if chunk.first_grid != self.memory.num_grids:
            raise EngineError(
                f"chunk starts at grid {chunk.first_grid} but the engine expects grid {self.memory.num_grids}"
            )
        shape = f"{chunk.num_grids} temporal grid(s) of {chunk.rows}x{chunk.cols} tokens"
        self.policy.check_stream(chunk.frames / self.fps)
        if not self.budget.is_sized:  # given as numbers: sized at the first chunk, the memory still empty
            self.budget = self.memory.budget = self.budget.sized(self.policy, chunk.num_tokens, shape)
        else:
            self.budget.check_chunk(self.policy, chunk.num_tokens, shape)

    def _check_cap(self, chunk: VisualChunk) -> None:
        if self.max_cache_bytes is None or self.memory.is_empty:
            return
        projected = self.memory.nbytes + self.memory.token_bytes() * chunk.num_tokens
        if projected > self.max_cache_bytes:
            raise MemoryCapError(
                f"stopped at {self.frames_fed} frames: the next chunk would take the cache to "
                f"{projected / 2**20:.1f} MB, above the {self.max_cache_bytes / 2**20:.1f} MB cap"
            )

    def _check_positions(self, cursor: Any) -> None:
        limit, reached = self.model.position_limit, cursor.next - self.memory.position_shift
        if limit is not None and reached + QUESTION_ROOM > limit:
            raise PositionLimitError(
                f"stopped at {self.frames_fed} frames: {self.model.name} was trained with positions up to {limit:,}, and "
                f"the next chunk would take the stream to {reached:,} (plus {QUESTION_ROOM} kept for a question); "
                "evicted tokens give their positions back only under a policy with contiguous positions"
            )

    def _prefill_prefix(self) -> None:
        embeds = self.model.prefix_embeds()
        positions, cursor = self.model.text_positions(self.model.new_cursor(), int(embeds.shape[0]))
        cache = MemoryCache(self.memory)
        self.model.forward(embeds, positions, cache)
        self.memory.commit_prefix(int(embeds.shape[0]))
        self.memory.cursor = cursor
        cache.commit_linear_state()

    def _probe(self, text: str) -> list[torch.Tensor]:
        """Every layer's queries ``[H_q, T, D]`` for ``text`` asked as a question after the memory (written
        into the slack, never committed): what a :class:`~kvdemo.policies.contract.Probed` policy reads the memory
        with."""
        embeds = self.model.question_embeds([], text)
        positions, _ = self.model.text_positions(self.memory.cursor, int(embeds.shape[0]))
        cache = MemoryCache(self.memory)
        cache.capture = {}
        self.model.forward(embeds, self._placed(positions), cache)
        return [cache.capture[layer] for layer in range(self.memory.num_layers)]

    def _placed(self, positions: torch.Tensor, memory: KVMemory | None = None) -> torch.Tensor:
        """Positions ``[3, n]`` counted by the cursor, placed where the memory (the engine's, or the fork an answer
        reads) holds the stream: lower by the gaps a policy closed (``KVMemory.position_shift``: 0 unless a policy
        keeps its positions contiguous)."""
        shift = (memory if memory is not None else self.memory).position_shift
        return positions - shift if shift else positions

    def _stopwatch(self) -> Stopwatch:
        """kvdemo's one timer (:mod:`kvdemo.devices.timing`), synchronised on the model's and the memory's devices."""
        return Stopwatch({self.model.device, *self.memory.devices})

    # --- answering ------------------------------------------------------------------------
    def ask(
        self,
        question: str,
        max_new_tokens: int | None = None,
        attribute: bool = False,
        ignore_stop: bool = False,
        fork: bool = False,
    ) -> Iterator[str]:
        """Answer ``question`` from the memory; yields text pieces as tokens are generated. With ``attribute`` the
        answer records what it looked at (``Answer.attribution``, :mod:`kvdemo.analysis.explain`), tallied in the
        attention seam while it is generated; with ``ignore_stop``, exactly ``max_new_tokens`` are generated (a stop
        token does not end the answer: what a decode benchmark needs).

        The question and answer tokens are written into the memory's slack and never committed, so the
        memory afterwards is bit-identical (no copy, no rollback). The one exception is a policy that
        ``compresses_on_question`` (HybridKV's ``classify_with=question``): the question first runs one pass
        with itself as the probe, when the memory holds more than ``C``; that pass is on the timeline.
        The question and the answer join the dialogue, re-encoded as text before the next question.

        With ``fork`` the answer runs on a copy of the memory taken now (:meth:`KVMemory.fork`), so chunks may enter
        the memory and compressions run between its tokens (:class:`kvdemo.stream.live.LiveSession`): the answer
        sees the memory as it was when the question was asked, and what it retrieved is recorded on the memory when
        it ends (the views show it). Without ``fork`` nothing else may use the memory until the answer ends.
        """
        question = self.check_question(question)
        if (
            isinstance(self.policy, Probed)
            and self.policy.compresses_on_question
            and self._held_under_budget() > self.budget.keep_for(0)
        ):
            self.compress(probe_text=question)
        memory = self.memory.fork() if fork else self.memory
        return self._generate(question, max_new_tokens or self.max_new_tokens, attribute, ignore_stop, memory)

    def check_question(self, question: str) -> str:
        """``question`` stripped, or :class:`EngineError` saying why it cannot be asked (:mod:`kvdemo.dialogue`)."""
        if self.memory.num_grids == 0:
            raise EngineError("no video yet: feed at least one frame before asking")
        try:
            return check_question(self.model, question)
        except QuestionError as exc:
            raise EngineError(str(exc)) from None

    def answer(
        self, question: str, max_new_tokens: int | None = None, attribute: bool = False, ignore_stop: bool = False
    ) -> Answer:
        """:meth:`ask`, collected."""
        for _ in self.ask(question, max_new_tokens, attribute, ignore_stop):
            pass
        return self.answers[-1]

    @torch.inference_mode()
    def question_logits(self, question: str) -> torch.Tensor:
        """The logits ``[vocab]`` of the first answer token to ``question`` after the dialogue so far, on a fork
        (the memory is unchanged, as when answering)."""
        return self._question_prefill(question)[0]

    def _question_prefill(
        self, question: str, observers: tuple = (), memory: KVMemory | None = None
    ) -> tuple[torch.Tensor, MemoryCache, Any, int]:
        """The question's prefill in the slack of ``memory`` (the engine's by default, or a fork of it): its last
        logits, the cache to decode on (with ``observers`` in its attention seam), the cursor after it, and the
        earlier turns left out of the replayed dialogue."""
        memory = memory if memory is not None else self.memory
        embeds, dropped = replayed_dialogue(self.model, self.history, question)
        positions, cursor = self.model.text_positions(memory.cursor, int(embeds.shape[0]))
        cache = MemoryCache(memory)  # writes go to the slack and are never committed
        cache.answering = True  # heads with an offload store retrieve (question prefill and every decode step)
        placed = self._placed(positions, memory)
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None:  # a store that scores queries before RoPE unrotates the question's own
            cache.unrotate = rotary.unrotating(placed)
        cache.observers.extend(observers)
        memory.reset_retrieved()
        return self.model.forward(embeds, placed, cache), cache, cursor, dropped

    @torch.inference_mode()
    def _generate(
        self,
        question: str,
        max_new_tokens: int,
        attribute: bool = False,
        ignore_stop: bool = False,
        memory: KVMemory | None = None,
    ) -> Iterator[str]:
        memory = memory if memory is not None else self.memory
        watch = self._stopwatch()
        tally = AttributionTally(memory) if attribute else None
        logits, cache, cursor, dropped = self._question_prefill(question, (tally,) if tally else (), memory)
        generated: list[int] = []
        text, ttft_ms = "", 0.0
        try:
            bias = self.model.logit_bias
            for step in range(max_new_tokens):
                token = int(torch.argmax(logits if bias is None else logits + bias.to(logits.device)))
                if token in self.model.stop_ids and not ignore_stop:
                    break
                generated.append(token)
                if not ttft_ms:
                    ttft_ms = watch.ms()
                decoded = self.model.detokenize(generated)
                if not decoded.endswith("\ufffd") and len(decoded) > len(text):
                    piece, text = decoded[len(text) :], decoded
                    yield piece
                if step + 1 == max_new_tokens:  # the last token allowed: no forward for a token never generated
                    break
                positions, cursor = self.model.text_positions(cursor, 1)
                logits = self.model.forward(self.model.embed_text([token]), self._placed(positions, memory), cache)
        finally:
            memory.release_retrieved()  # what the question brought back leaves the device
            text = self.model.detokenize(generated)
            self.history.append((question, text))
            self.answers.append(
                Answer(
                    question=question,
                    answer=text,
                    ms=watch.ms(),
                    ttft_ms=ttft_ms or watch.ms(),
                    tokens=len(generated),
                    cache_bytes=memory.nbytes,
                    visual_tokens=memory.visual_tokens,
                    dropped_turns=dropped,
                    attribution=tally.result() if tally is not None else None,
                )
            )
            if memory is not self.memory:  # a fork: its retrieval record goes to the memory, the fork is let go
                self._adopt_retrieved([None if s.offload is None else s.offload.retrieved for s in memory.layers])

    def reset_dialogue(self) -> None:
        self.history.clear()

    def answer_state(self) -> dict[str, Any]:
        """What answering changes (never the memory; a question-time pass of HybridKV's ``classify_with=question``
        is a compression, before answering): the dialogue, the answers, and which offloaded
        chunks each head retrieved. Small, so a question answered elsewhere (a ZeroGPU worker) sends back
        only this; :meth:`load_answer_state` applies it."""
        retrieved = [
            store.offload.retrieved.to("cpu", copy=True) if store.offload is not None else None
            for store in self.memory.layers
        ]
        return {"history": list(self.history), "answers": list(self.answers), "retrieved": retrieved}

    @torch.inference_mode()  # the retrieval marks are written in place into the store's (inference) tensors
    def load_answer_state(self, state: dict[str, Any]) -> None:
        self.history[:] = state["history"]
        self.answers[:] = state["answers"]
        self._adopt_retrieved(state["retrieved"])

    def _adopt_retrieved(self, retrieved: list[torch.Tensor | None]) -> None:
        """Each layer's record of the chunks the last answer retrieved ``[H, chunks]``, into the memory's stores: a
        store that grew since (a pass while a live answer ran adds chunks after the ones it had) keeps its width,
        the newer chunks marked not retrieved (:attr:`OffloadLayer.retrieved <kvdemo.cache.offload_layer.OffloadLayer>`
        writes a record narrower than the store so)."""
        for store, record in zip(self.memory.layers, retrieved):
            if record is not None and store.offload is not None:
                store.offload.retrieved = record

    # --- views and report -------------------------------------------------------------------
    def view_context(self) -> ViewContext:
        """What a declared view may read of this engine besides its own state."""
        memory = self.memory
        return ViewContext(
            memory.num_layers,
            memory.num_kv_heads,
            memory.grid_shape,
            list(memory.grid_times_s),
            memory.timeline,
            memory.summary_slots,
            memory.retrieved_frames(),
        )

    def policy_views(self, layer: int = 0, head: int = 0) -> list[View]:
        """The views the policy declares, for one layer and KV head."""
        if self.memory.num_grids == 0:
            return []
        return self.policy.views(self.view_context(), layer, head)

    @property
    def tokens_per_grid(self) -> int:
        shape = self.memory.grid_shape
        return shape[0] * shape[1] if shape else 0

    def report(self, video: str = "", lost_frames: int = 0) -> dict[str, Any]:
        """The run report (the JSON contract shared by the CLI, the app and the benchmarks).

        ``video`` describes the source (``Video.describe()``); ``lost_frames`` counts sampled frames
        that could not be decoded (a damaged file).
        """
        timeline = [e.to_dict() for e in self.memory.timeline]
        pruning = {"pruning": self.pruning.report()} if self.pruning is not None else {}  # what each grid let in
        return {
            "model": self.model.name,
            "video": video,
            "lost_frames": int(lost_frames),
            "random_weights": bool(self.model.random_weights),
            "policy": self.policy.name,
            "params": self.policy.params(),
            "budget": self.budget.M,
            "keep": self.budget.C,
            "fps": self.fps,
            "frames": self.frames_fed,
            "tokens_per_grid": self.tokens_per_grid,
            "timeline": timeline,
            "peak_visual_tokens": max((e["visual_tokens"] for e in timeline), default=0),
            "summary_slots": self.memory.summary_slots,  # counted in every visual_tokens above, in use or not
            "peak_cache_bytes": max((e["cache_bytes"] for e in timeline), default=0),
            "largest_head_tokens": self.memory.largest_head_tokens,
            "text_tokens": self.memory.text_tokens,
            "linear_state_bytes": self.memory.linear_state_bytes,
            "survivors": [
                {"grid": g, "time_s": self.memory.grid_times_s[g], "kept_fraction": fraction}
                for g, fraction in enumerate(survival_fraction(self.memory))
            ],
            "answers": [
                {
                    "question": a.question,
                    "answer": a.answer,
                    "ms": a.ms,
                    **({"attribution": a.attribution.to_dict()} if a.attribution is not None else {}),
                }
                for a in self.answers
            ],
            "policy_state": self.policy.report(),
            **pruning,
        }
