"""A second device on a machine that has none: CPU tensors that behave, for device placement, like a GPU's.

kvdemo's CUDA paths cannot run without a GPU, and the ``meta`` device stops at the first data-dependent step
(a top-k count, ``int(...)``), so neither checks that a whole compression keeps its tensors together. Inside
:class:`EmulatedDevice` some CPU tensors are *on the device*: they report :data:`DEVICE` as their ``.device``,
an op's outputs are on it when an input is, and what PyTorch refuses between a CUDA and a CPU tensor is refused
here too (:class:`DeviceMixError`):

- an op combining tensors on the device with host tensors of one dimension or more (0-d host tensors are
  scalars, which CUDA takes; host index tensors in ``[]`` indexing too, as CUDA does);
- ``.numpy()`` of a tensor on the device (CUDA needs ``.cpu()`` first).

A tensor reaches the device the ways it reaches a GPU: ``.to(DEVICE)`` (or ``.to(t)`` of such a tensor), a
factory given ``device=DEVICE`` (``device=t.device`` of a tensor on it), ``*_like``/``new_*`` of one. A factory
given no device makes a host tensor, as on a GPU host. Values are computed on the CPU, so results can be
compared with a plain CPU run bit for bit. Used by ``tests/test_devices.py`` and ``python -m kvdemo doctor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

#: What a tensor on the emulated device reports as its device (``meta`` is never a real tensor's device here).
DEVICE = torch.device("meta")
#: The attribute that marks a tensor on the emulated device.
MARK = "_kvdemo_emulated_device"
#: Factories that place their result by ``device=`` (host when it is missing).
FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "full",
        "empty",
        "arange",
        "tensor",
        "as_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "eye",
        "linspace",
        "logspace",
        "empty_strided",
        "scalar_tensor",
        "tril_indices",
        "triu_indices",
    }
)
#: Ops that follow their input's device unless given one.
FOLLOWERS = frozenset(
    {
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty",
        "new_tensor",
    }
)
#: Ops that copy between devices by design.
COPIES = frozenset({"copy_"})


class DeviceMixError(RuntimeError):
    """Tensors on the emulated device met host tensors where a GPU would refuse them."""


def _is_target(device: Any) -> bool | None:
    """True for the emulated device, False for another named device, None when ``device`` names none."""
    if device is None:
        return None
    if isinstance(device, (str, torch.device)):
        return torch.device(device) == DEVICE
    return None


class EmulatedDevice(TorchFunctionMode):
    """Run code with :data:`DEVICE` emulated on the CPU (see the module docstring). ``ops`` counts the ops that
    touched the device (a check that the device was used at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    @staticmethod
    def on_device(tensor: torch.Tensor) -> bool:
        return getattr(tensor, MARK, False)

    def _mark(self, out: Any) -> Any:
        def mark(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                setattr(t, MARK, True)  # on the Python object: it dies with it (an id can be reused)
            return t

        return tree_map(mark, out)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: .device reports the emulated device
            out = func(*args, **kwargs)
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "device" and self.on_device(args[0]):
                return DEVICE
            if prop in ("grad", "data", "real", "imag", "T", "mT", "H", "mH") and self.on_device(args[0]):
                return self._mark(out)
            return out
        target = _is_target(kwargs.get("device"))
        if target:
            kwargs["device"] = "cpu"
        if name in ("to", "cuda", "cpu", "type"):
            return self._move(func, name, args, kwargs, target)
        if name in FACTORIES:
            out = func(*args, **kwargs)
            return self._mark(out) if target else out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if self.on_device(t)]
        if name == "numpy" and on:
            raise DeviceMixError("can't convert a tensor on the device to numpy: use .cpu() first")
        if name in FOLLOWERS:
            out = func(*args, **kwargs)
            follows = target if target is not None else bool(on)
            return self._mark(out) if follows else out
        if on and name not in COPIES:
            checked = tensors
            if name in ("__getitem__", "__setitem__"):  # host index tensors are fine in [] indexing, as on CUDA
                index = args[1] if len(args) > 1 else None
                indices = {id(t) for t in tree_flatten(index)[0] if isinstance(t, torch.Tensor)}
                checked = [t for t in tensors if id(t) not in indices]
                if name == "__setitem__" and not indices:  # basic slicing assigns by copy_, across devices
                    checked = [args[0]]
            host = [t for t in checked if not self.on_device(t) and t.dim() > 0]
            if host:
                shapes = ", ".join(str(tuple(t.shape)) for t in host[:3])
                raise DeviceMixError(f"{name}: tensors on the device met host tensors of shape {shapes}")
        out = func(*args, **kwargs)
        if on:
            self.ops += 1
            if name in ("__int__", "__float__", "__bool__", "__index__", "item", "tolist"):
                return out
            if (
                name in COPIES
            ):  # copy_ returns its destination, which stays where it is (a host tensor stays on the host)
                return out
            return self._mark(out)
        return out

    def _move(self, func, name: str, args: tuple, kwargs: dict, target: bool | None) -> Any:
        """``.to``/``.cuda``/``.cpu``/``.type``: where the result lands."""
        source = args[0]
        rest = list(args[1:])
        for i, arg in enumerate(rest):
            if isinstance(arg, torch.Tensor):  # .to(other): other's device and dtype
                target = self.on_device(arg)
                rest[i] = arg.dtype
            elif _is_target(arg) is not None:
                target = _is_target(arg)
                rest[i] = "cpu"
        if name == "cuda":
            target, rest = True, []
        elif name == "cpu":
            target = False
        out = func(source, *rest, **kwargs) if name != "cuda" else source.clone()
        if target is None:
            target = self.on_device(source)
        if out is source and target != self.on_device(source):  # crossing between host and device copies
            out = source.clone()
        return self._mark(out) if target else out


def place_module(module: torch.nn.Module) -> torch.nn.Module:
    """Put ``module``'s parameters and buffers on the emulated device (as ``module.to(cuda)`` would; their
    Python objects are marked in place, so the module keeps working outside the mode). Returns ``module``."""
    for tensor in [*module.parameters(), *module.buffers()]:
        setattr(tensor, MARK, True)
    return module
