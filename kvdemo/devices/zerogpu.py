"""ZeroGPU: GPU work as ``spaces.GPU`` calls on a Hugging Face ZeroGPU Space, and an emulation of them.

On a ZeroGPU Space a ``@spaces.GPU`` function runs in a forked worker that holds a GPU for the call; its
arguments and results are pickled through queues (generator functions stream pickled items back), and
whatever the worker changes in memory is lost when the call ends. kvdemo therefore keeps every session's
engine state on the CPU in the main process between calls and passes it in and out explicitly
(:meth:`kvdemo.stream.engine.StreamEngine.__getstate__` drops the model; the worker re-binds it by name).

:func:`gpu` is the decorator kvdemo uses:

- on a ZeroGPU Space (the ``spaces`` package importable and ``SPACES_ZERO_GPU`` set): ``spaces.GPU``;
- with ``KVDEMO_ZEROGPU_EMULATE=1`` (read at each call): every call runs in a forked child process, with
  arguments and results pickled exactly as ZeroGPU does (whatever device the machine has; the CPU here), so
  the boundary is exercised on any machine; the pickled bytes of each call are recorded (:data:`TRANSFERS`);
- elsewhere: the function itself, in place.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

EMULATE_ENV = "KVDEMO_ZEROGPU_EMULATE"


@dataclass
class Transfer:
    """Pickled bytes of one GPU call: arguments in, results out (summed over a generator's items)."""

    name: str
    args_bytes: int
    result_bytes: int
    items: int


#: The most recent calls' transfers (bounded), newest last: what crossed the boundary, measured.
TRANSFERS: list[Transfer] = []
MAX_TRANSFERS = 256


def emulating() -> bool:
    return os.environ.get(EMULATE_ENV, "").strip() not in ("", "0", "false", "False")


def on_zerogpu() -> bool:
    """True on a ZeroGPU Space (the ``spaces`` package is there and the Space runs on ZeroGPU hardware)."""
    if not os.environ.get("SPACES_ZERO_GPU"):
        return False
    try:
        import spaces  # noqa: F401  (deferred on purpose: the package exists only on Hugging Face Spaces)
    except ImportError:
        return False
    return True


def gpu(duration: int | Callable[..., int] = 60) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as GPU work (see the module docstring). ``duration`` is the seconds the call may hold the
    GPU, or a function of the call's arguments that computes them (ZeroGPU's contract)."""

    def decorate(fn: Callable) -> Callable:
        if on_zerogpu():
            import spaces  # deferred on purpose: only on a ZeroGPU Space

            return spaces.GPU(duration=duration)(fn)
        return _emulated(fn)  # decides at each call: in a forked child when emulating, else in place

    return decorate


def active() -> bool:
    """True when GPU calls cross a process boundary (on a ZeroGPU Space, or emulating one)."""
    return on_zerogpu() or emulating()


def _record(transfer: Transfer) -> None:
    TRANSFERS.append(transfer)
    del TRANSFERS[:-MAX_TRANSFERS]


def _child(fn: Callable, payload: bytes, queue, generator: bool) -> None:
    """In the forked child: unpickle the arguments, run, send every result pickled (then a sentinel).

    The child runs torch on one intra-op thread: GNU OpenMP's thread pool (PyTorch's CPU backend) does not
    survive a fork once the parent has used it, and a parallel op in the child would wait forever.
    """
    torch.set_num_threads(1)
    try:
        args, kwargs = pickle.loads(payload)
        if generator:
            for item in fn(*args, **kwargs):
                queue.put(("item", pickle.dumps(item)))
        else:
            queue.put(("item", pickle.dumps(fn(*args, **kwargs))))
        queue.put(("done", b""))
    except BaseException as exc:  # sent to the parent, raised there
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        queue.put(("error", (blob, traceback.format_exc())))


def _run(fn: Callable, args: tuple, kwargs: dict, generator: bool) -> Iterator[Any]:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    payload = pickle.dumps((args, kwargs))  # raises here, like ZeroGPU, if the arguments do not pickle
    process = context.Process(target=_child, args=(fn, payload, queue, generator), daemon=True)
    process.start()
    transfer = Transfer(fn.__qualname__, len(payload), 0, 0)
    finished = False
    try:
        while True:
            kind, blob = queue.get()
            if kind == "done":
                finished = True
                break
            if kind == "error":
                error, trace = blob
                exc = pickle.loads(error)
                exc.__notes__ = [*getattr(exc, "__notes__", []), "in the emulated ZeroGPU worker:\n" + trace]
                raise exc
            transfer.result_bytes += len(blob)
            transfer.items += 1
            yield pickle.loads(blob)
    finally:
        _record(transfer)
        if finished:
            process.join(timeout=10)
        if process.is_alive():  # the caller stopped early (a cancelled stream) or the child hangs
            process.kill()
            process.join()


def _emulated(fn: Callable) -> Callable:
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator(*args, **kwargs):
            if not emulating():
                yield from fn(*args, **kwargs)
                return
            yield from _run(fn, args, kwargs, generator=True)

        return generator

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not emulating():
            return fn(*args, **kwargs)
        return next(_run(fn, args, kwargs, generator=False))

    return call
