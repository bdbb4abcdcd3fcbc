"""Whose turn it is to use a device (:class:`DeviceTurn`): one model call at a time on one device, shared by the
threads that feed a stream and those that answer on it (:mod:`kvdemo.stream.live`, the app's sessions)."""

from __future__ import annotations

import threading
from collections import deque


class DeviceTurn:
    """Whose turn it is to use the device: one holder at a time (reentrant for it), the others served in the order
    they asked; :meth:`take` with ``blocking=False`` takes it only if it is free and nobody waits."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._line: deque[object] = deque()

    def take(self, blocking: bool = True) -> bool:
        me = threading.get_ident()
        with self._condition:
            if self._owner == me:
                self._depth += 1
                return True
            if not blocking and (self._owner is not None or self._line):
                return False
            ticket = object()
            self._line.append(ticket)
            try:
                self._condition.wait_for(lambda: self._owner is None and self._line[0] is ticket)
            finally:
                self._line.remove(ticket)
            self._owner, self._depth = me, 1
            return True

    def give_back(self) -> None:
        with self._condition:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._condition.notify_all()

    def __enter__(self) -> "DeviceTurn":
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.give_back()
