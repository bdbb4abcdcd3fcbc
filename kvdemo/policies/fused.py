"""Compiled kernels of the selection passes: per-token reductions over keys and values done in one read of the
cache, where eager PyTorch makes one pass per operation (an upcast, a gather, a product, a sum, a norm) and writes
a cache-sized intermediate between them.

``torch.compile`` (Inductor: fused C++ loops on a CPU, Triton on CUDA) turns each kernel here into one loop over
``[H, L, D]`` that loads a key, its reference and a value once and keeps the sums in registers. Compiling takes
seconds to a minute, once per process and dtype: the kernels are compiled with dynamic shapes, so a stream whose
cache length (and buffer capacity) changes from pass to pass reuses them (:func:`compile_stats` counts the
compilations). Every kernel has an eager twin that is the definition (the policy's own plain code): the compiled
one restates the same arithmetic in the same precision (a half-precision product is rounded to the cache's dtype
before it is summed in float32, a norm is rounded to the cache's dtype), so the two select the same tokens on a
CPU. Only the order of float32 additions differs, which on CUDA in bfloat16 is enough to round some sums the other
way and flip near-ties (measured in docs/devices.md); ``bench`` counts the kept tokens that differ.

Which runs (kvdemo's choice): eager unless compiling is asked for, with the environment variable
``KVDEMO_COMPILE=1`` or :func:`use_compiled` (``python -m kvdemo bench`` times both side by side). A first pass
that compiles would stall a demo stream for longer than the whole stream's compression on the tiny model; at a
real model's cache shape the compiled pass is faster on a CPU (not on a GPU, where the pass is launch-bound).
Where compiling is unavailable (no C++ compiler, a torch without Inductor) or fails, the eager kernel runs and
:func:`compile_stats` says why.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

ENVIRONMENT = "KVDEMO_COMPILE"
_state: dict[str, Any] = {"enabled": None, "error": None, "compiles": 0, "compile_ms": 0.0, "calls": 0}
_compiled: dict[str, Callable[..., Any]] = {}


def use_compiled(enabled: bool | None) -> None:
    """Run the compiled kernels (True), the eager ones (False), or what ``KVDEMO_COMPILE`` says (None)."""
    _state["enabled"] = enabled


def compiled_enabled() -> bool:
    """Whether the next pass runs the compiled kernels (asked for, and not known to fail here)."""
    enabled = _state["enabled"]
    if enabled is None:
        enabled = os.environ.get(ENVIRONMENT, "0").strip().lower() in ("1", "true", "yes", "on")
    return bool(enabled) and _state["error"] is None


@functools.cache
def compile_unavailable() -> str | None:
    """Why compiling cannot work here (None when it can be tried): torch without ``torch.compile``, or no C++
    compiler for Inductor's CPU code."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        return f"no C++ compiler found ({compiler}, c++, clang++) for Inductor's CPU kernels"
    return None


def compile_stats() -> dict[str, Any]:
    """Compilations so far (one per kernel and dtype when shapes are dynamic, as intended), their wall time
    (the first call of each, which includes one run), calls, and the reason compiling was given up (if it was)."""
    return {key: _state[key] for key in ("compiles", "compile_ms", "calls", "error")}


def _frames_compiled() -> int:
    try:
        from torch._dynamo.utils import counters  # deferred: dynamo loads only when compiling is asked for
    except ImportError:  # pragma: no cover - a torch without dynamo
        return 0
    return int(sum(counters["stats"].values())) if "stats" in counters else 0


def run_compiled(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)`` compiled (once per process, dynamic shapes), or None when :func:`compiled_enabled` is
    off or compiling is unavailable or fails (then the caller runs its eager code, from then on:
    :func:`compile_stats` keeps the reason)."""
    if not compiled_enabled():
        return None
    reason = compile_unavailable()
    if reason is not None:
        _state["error"] = reason
        return None
    name = kernel.__qualname__
    if name not in _compiled:
        _compiled[name] = torch.compile(kernel, dynamic=True, options={"emulate_precision_casts": True})
    before = _frames_compiled()
    start = time.perf_counter()
    try:
        out = _compiled[name](*args)
    except Exception as error:  # noqa: BLE001 (any compiler failure means: run eager from now on)
        _state["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        return None
    _state["calls"] += 1
    if _frames_compiled() != before:
        _state["compiles"] += 1
        _state["compile_ms"] += (time.perf_counter() - start) * 1000
    return out


# --- the kernels (compiled by run_compiled(); the caller's eager code is the definition they restate) ---------


def tar_and_van_terms(
    keys: torch.Tensor,
    values: torch.Tensor,
    reference: torch.Tensor,
    row: torch.Tensor,
    count: torch.Tensor,
    rounded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """InfiniPot-V's two per-token terms in one read of keys and values (paper 000, Eq. 4 and Sec. 3.2).

    ``keys, values [H, L, D]`` (strided views of the cache), ``reference [R, D]`` each (head, patch) row's sum of
    unit recent keys (cache dtype), ``row [H, L]`` (contiguous) the row of each token, ``count [R]`` float32 how
    many recent frames hold each row. Returns the mean cosine similarity to the recent frames' keys at the same
    patch ``[H, L]`` and the value norms ``||V||_2 [H, L]``, float32. ``rounded`` (a half-precision cache):
    products and norms are rounded to the cache's dtype as eager PyTorch computes them in that dtype
    (:func:`kvdemo.policies.infinipot_v.patch_similarity`, :func:`~kvdemo.policies.infinipot_v.value_norms`).
    """
    k = keys.float()
    product = k * reference[row].float()
    key_norm = (k * k).sum(-1).sqrt()
    value_norm = values.float().square().sum(-1).sqrt()
    if rounded:
        product = product.to(keys.dtype).float()
        key_norm = key_norm.to(keys.dtype).float()
        value_norm = value_norm.to(values.dtype).float()
    similarity = product.sum(-1) / key_norm.clamp_min(1e-12)
    return similarity / count[row].clamp_min(1.0), value_norm
