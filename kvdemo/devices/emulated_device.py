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
#: Ops that make the host wait for the device when a tensor on it takes part: a value converted to a Python number or
#: list, or an output whose size depends on the values (CUDA learns it on the device and copies it back).
HOST_READS = frozenset(
    {
        "__int__",
        "__float__",
        "__bool__",
        "__index__",
        "item",
        "tolist",
        "nonzero",
        "argwhere",
        "unique",
        "unique_consecutive",
        "masked_select",
        "bincount",
        "equal",
        "allclose",
    }
)
#: Ops that read or describe a tensor without running anything on the device.
METADATA = frozenset(
    {
        "size",
        "dim",
        "stride",
        "numel",
        "nelement",
        "element_size",
        "is_contiguous",
        "data_ptr",
        "untyped_storage",
        "storage_offset",
        "__len__",
        "is_floating_point",
        "is_complex",
        "__repr__",
        "__format__",
        "__hash__",
    }
)


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
    touched the device (a check that the device was used at all); ``launches`` the ones a GPU would launch a kernel
    for (not a view of its input nor metadata; a copy onto the device counts); ``host_reads`` the ones that make
    the host wait for the device (:data:`HOST_READS`, a boolean index, ``repeat_interleave`` not told its output size,
    a copy back to the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launches = 0
        self.host_reads = 0

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
            self.launches += bool(target)  # made on the device: a fill or a copy runs there
            return self._mark(out) if target else out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if self.on_device(t)]
        if name == "numpy" and on:
            raise DeviceMixError("can't convert a tensor on the device to numpy: use .cpu() first")
        if name in FOLLOWERS:
            out = func(*args, **kwargs)
            follows = target if target is not None else bool(on)
            self.launches += bool(follows)
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
            self._count(name, args, kwargs, tensors, out)
            if name in ("__int__", "__float__", "__bool__", "__index__", "item", "tolist"):
                return out
            if (
                name in COPIES
            ):  # copy_ returns its destination, which stays where it is (a host tensor stays on the host)
                return out
            return self._mark(out)
        return out

    def _count(self, name: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor], out: Any) -> None:
        """Count one op on the device as a launch and/or a host read (see the class docstring)."""
        if name in METADATA:
            return
        if name in HOST_READS or _waits(name, args, kwargs):
            self.host_reads += 1
            if name in ("__int__", "__float__", "__bool__", "__index__", "item", "tolist"):
                return  # a copy of a value back, no kernel
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        writes = (name.endswith("_") and not name.endswith("__")) or name in (
            "__setitem__",
            "__iadd__",
            "__isub__",
            "__imul__",
            "__itruediv__",
            "__ior__",
            "__iand__",
        )
        if outputs and not writes and all(_aliases(t, inputs) for t in outputs):
            return  # a view of an input (slicing, reshape of a contiguous tensor...): nothing runs
        self.launches += 1

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
        if self.on_device(source) and not target:
            self.host_reads += 1  # copied back: the host waits for it
        elif out is not source and (target or self.on_device(source)):
            self.launches += 1  # a copy onto the device, or a conversion on it
        return self._mark(out) if target else out


def _waits(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether an op not in :data:`HOST_READS` still makes the host wait: indexing with a boolean tensor (its count
    sizes the result), ``repeat_interleave`` of tensor repeats without ``output_size``, ``where`` of a condition
    alone (a ``nonzero``)."""
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(index)[0])
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    if name == "where":
        return len(args) + len(kwargs) == 1
    return False


def _aliases(tensor: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``tensor`` shares its storage with one of ``inputs`` (a view of it)."""
    if tensor.numel() == 0:
        return True
    pointer = tensor.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == pointer for t in inputs if t.numel())


def place_module(module: torch.nn.Module) -> torch.nn.Module:
    """Put ``module``'s parameters and buffers on the emulated device (as ``module.to(cuda)`` would; their
    Python objects are marked in place, so the module keeps working outside the mode). Returns ``module``."""
    for tensor in [*module.parameters(), *module.buffers()]:
        setattr(tensor, MARK, True)
    return module
