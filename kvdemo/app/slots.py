"""The stream slots: at most so many streams (file runs, comparisons, delay sweeps, webcam segments) use the model at
once; the others wait in line, in order of arrival, and a waiting run says in its status where it stands.

Gradio's own queue also says where an event waits, but only to the browser's progress overlay and to an API client
that polls ``job.status()``: a client reading the outputs sees nothing while its run waits. So the app lets Gradio
start more stream events than it has slots (a waiting room, :data:`WAITING_ROOM`) and holds them here, each yielding
a status line whenever its place changes (kvdemo's choice; events past the waiting room wait in Gradio's queue).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: File runs, comparisons, sweeps and webcam segments served at once; more wait in line (:class:`StreamSlots`).
STREAM_SLOTS = 2
#: Stream events Gradio starts beyond the slots: they wait here, told their place.
WAITING_ROOM = 16
#: A waiting run checks its place at least this often (a slot freed wakes it at once).
CHECK_EVERY_S = 1.0
#: A ticket whose run has not checked its place for this long is dropped from the line (its client went away and
#: nobody closed the run), so it never holds up the runs behind it.
STALE_AFTER_S = 30.0


class Ticket:
    """One run's place in the line (:meth:`StreamSlots.line`)."""

    def __init__(self, slots: "StreamSlots") -> None:
        self.slots = slots
        self.running = False
        self.checked = time.monotonic()

    def places(self) -> Iterator[int]:
        """Waits for a slot; yields the run's place in line (1 = next) whenever it changes, and returns once the run
        holds a slot (at once when one is free)."""
        last = None
        while True:
            place = self.slots._take_or_place(self)
            if place == 0:
                return
            if place != last:
                last = place
                yield place
                continue  # the caller resumed: look again at once
            self.slots._wait(CHECK_EVERY_S)


class StreamSlots:
    """At most ``slots`` runs at once; the others wait in line in order of arrival (thread-safe)."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"at least one stream slot, got {slots}")
        self.slots = slots
        self._condition = threading.Condition()
        self._running = 0
        self._line: list[Ticket] = []

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._line)

    @contextmanager
    def line(self) -> Iterator[Ticket]:
        """Join the line; the ticket's :meth:`Ticket.places` waits for a slot. Leaving (the run ended, failed, or was
        closed while it waited) frees the slot or the place."""
        ticket = Ticket(self)
        with self._condition:
            self._line.append(ticket)
        try:
            yield ticket
        finally:
            with self._condition:
                if ticket.running:
                    self._running -= 1
                elif ticket in self._line:
                    self._line.remove(ticket)
                self._condition.notify_all()

    def _take_or_place(self, ticket: Ticket) -> int:
        """0 once ``ticket`` holds a slot (taken now if one is free and it is first in line), else its place (1 = next)."""
        with self._condition:
            if ticket.running:
                return 0
            now = time.monotonic()
            ticket.checked = now
            self._line = [t for t in self._line if t is ticket or now - t.checked < STALE_AFTER_S]
            if ticket not in self._line:  # cannot happen (a ticket never prunes itself), but never lose a run
                self._line.append(ticket)
            place = self._line.index(ticket)
            if place < self.slots - self._running:
                self._line.remove(ticket)
                ticket.running = True
                self._running += 1
                return 0
            return place - (self.slots - self._running) + 1

    def _wait(self, timeout_s: float) -> None:
        with self._condition:
            self._condition.wait(timeout_s)

    def held(self, run: Callable[[], Iterator[dict[str, Any]]], key: str = "status") -> Iterator[dict[str, Any]]:
        """``run()``'s updates once it holds a slot; while it waits, ``{key: where it stands}`` whenever its place
        changes. The slot is freed when the updates end (or the caller closes them)."""
        with self.line() as ticket:
            for place in ticket.places():
                yield {key: queued_text(place, self.slots)}
            yield from run()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold a slot for a short step that cannot report (a webcam segment), waiting in line for it silently."""
        with self.line() as ticket:
            for _ in ticket.places():
                pass
            yield


def queued_text(place: int, slots: int) -> str:
    """ "⏳ queued: 2nd in line for one of the 2 stream slots; …" (Markdown)."""
    suffix = "th" if 10 <= place % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(place % 10, "th")
    where = "next in line" if place == 1 else f"{place}{suffix} in line"
    return (
        f"⏳ **queued: {where}** for one of the app's {slots} stream slots (each run holds one until it ends); this "
        "run starts by itself"
    )
