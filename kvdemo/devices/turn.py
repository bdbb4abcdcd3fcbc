"""Whose turn it is to use a device (:class:`DeviceTurn`): one model call at a time on one device, shared by the
threads that feed a stream and those that answer on it (:mod:`kvdemo.stream.live`, the app's sessions)."""

from __future__ import annotations

import threading
from collections import deque


class DeviceTurn:
    """Whose turn it is to use the device: one holder at a time, the others served in the order they asked;
    :meth:`take` with ``blocking=False`` takes it only if it is free and nobody waits.

    Not reentrant, and not tied to a thread: a holder may be a generator that yields while it holds the turn (a GPU
    call streaming its updates) and is resumed on another thread of a pool, while the thread it took the turn on
    serves someone else, who must wait. Code that holds the turn calls what would take it again with ``held=True``
    (:meth:`kvdemo.stream.live.LiveSession.step`)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._held = False
        self._line: deque[object] = deque()

    def take(self, blocking: bool = True) -> bool:
        with self._condition:
            if not blocking and (self._held or self._line):
                return False
            ticket = object()
            self._line.append(ticket)
            try:
                self._condition.wait_for(lambda: not self._held and self._line[0] is ticket)
            finally:
                self._line.remove(ticket)
            self._held = True
            return True

    def give_back(self) -> None:
        with self._condition:
            self._held = False
            self._condition.notify_all()

    def __enter__(self) -> "DeviceTurn":
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.give_back()
