"""The one timer of kvdemo's measurements (the engine's per-chunk stats, ``doctor`` and ``bench``, a policy's
phase split): wall time in ms that is true on a GPU too. On a CPU it is ``time.perf_counter``; on CUDA the
device is synchronised before the clock is read at both ends, so queued kernels are counted where they run
(timing an asynchronous launch alone would report microseconds). A leaf module: it imports nothing of kvdemo.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch


def synchronize(devices: torch.device | str | Iterable[torch.device | str] | None) -> None:
    """Wait for the queued work of every CUDA device in ``devices`` (a device, several, or None: nothing)."""
    if devices is None:
        return
    if isinstance(devices, (torch.device, str)):
        devices = (devices,)
    for device in {torch.device(d) for d in devices}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class Stopwatch:
    """Milliseconds since :meth:`restart` (or construction) on ``devices``, synchronised at both ends."""

    def __init__(self, devices: torch.device | str | Iterable[torch.device | str] | None = None) -> None:
        self.devices = list(devices) if isinstance(devices, (list, tuple, set)) else devices
        self.restart()

    def restart(self) -> "Stopwatch":
        synchronize(self.devices)
        self.start = time.perf_counter()
        return self

    def ms(self) -> float:
        """Milliseconds elapsed (the device's queued work included)."""
        synchronize(self.devices)
        return (time.perf_counter() - self.start) * 1000


class PhaseTimer:
    """Milliseconds per named phase of a pass, summed over repeats of a phase (:class:`Stopwatch` per phase, so
    the split is true on a GPU too); ``ms`` is what the benchmark reads."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device | str | None = None) -> Iterator[None]:
        watch = Stopwatch(device)
        yield
        self.ms[name] = self.ms.get(name, 0.0) + watch.ms()
