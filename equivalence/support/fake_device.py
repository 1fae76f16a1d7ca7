"""A device that is not the CPU, on a host without an accelerator: the proof of device discipline.

`torch.utils.backend_registration` turns the PrivateUse1 dispatch key into a Python backend renamed `npu`, so
`torch.device("npu")` is a real, non-CPU device type here. Tensors on it are `DeviceTensor`s: wrapper
tensors whose device is `npu:0` while their values live in a CPU tensor underneath (`.host`). While
`on_fake_device()` is active, every aten and `torch.ops.npu` call goes through `DeviceDiscipline`, which
- refuses (DeviceMismatch, naming the operator and the devices) any call that mixes tensors of two
  devices, looking into tensor lists too: a host tensor reaching an operator of the model fails here as it
  would on an NPU (where the CPU cannot tell);
- runs the call on the CPU values, so the model computes real numbers (bitwise those of a CPU run);
- places factory calls (`torch.zeros(..., device=...)`, also under `with torch.device("npu")`) and copies
  (`.to("npu")`) on the fake device, and counts device -> host reads (`.item()`, `int(t)`, `.tolist()`,
  `.cpu()` / `.to("cpu")`): `host_reads` lists them, each naming the model's line that made it; `transfers`
  the host -> device copies, named the same way (`copy_` between devices, the one operator allowed two
  devices: weight loading copies host values into device parameters;
  `.to("npu")` of a host tensor; `torch.tensor(data, device="npu")`, which runs below any dispatch mode and is
  counted by the backend's own `_copy_from`); `ops` counts every operator call by name;
- runs the collectives (the `c10d` operators `torch.distributed` issues, e.g. all_gather_into_tensor /
  all_to_all_single / reduce_scatter, and the `_c10d_functional` ones) on the host values, so a gloo job of
  fake-device ranks computes what the CPU job does and the results land in the device tensors; a collective
  of host tensors only is refused (DeviceMismatch): HCCL moves device tensors only. A functional
  collective's result is waited for at once and stays a DeviceTensor (no AsyncCollectiveTensor around it);
  another tensor subclass reaching the mode is left to its own dispatch first.

Why not FakeTensorMode with a fake `cuda`: it has no values, so data-dependent reads (routing splits, the
runner's `.tolist()`) need seams, and indexing with None fails without a CUDA build; this device runs the
unchanged model.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_TYPE = "npu"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _origin() -> str:
    """Where the model's code made the current call: the innermost frame outside torch and this module, as
    `path:line` from the repository root (host reads and transfers name it)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class DeviceMismatch(RuntimeError):
    """An operator received tensors on more than one device."""


class _Backend:
    """torch.npu while the fake device is registered: not an available NPU (platform keeps the portable
    kernels and the CPU choices), but a device module with the calls the model's code makes."""

    def is_available(self) -> bool:
        return False

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass


@functools.cache
def register() -> torch.device:
    """Register the `npu` Python backend once per process (it cannot be undone); returns npu:0."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        raise RuntimeError(f"PrivateUse1 is already the {torch._C._get_privateuse1_backend_name()!r} backend")
    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=_Backend())
    _register_backend_kernels()
    return torch.device(DEVICE_TYPE, 0)


_LIB = None
_ACTIVE: list["DeviceDiscipline"] = []


def _register_backend_kernels() -> None:
    """What `torch.tensor(data, device="npu")` calls below any dispatch mode: an allocation on the device and
    the host -> device copy into it (both land on DeviceTensors)."""
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL")

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return DeviceTensor(torch.empty_strided(size, stride, dtype=dtype))

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return DeviceTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))

    def copy_from(src, dst, non_blocking=False):
        host_src = src.host if isinstance(src, DeviceTensor) else src
        host_dst = dst.host if isinstance(dst, DeviceTensor) else dst
        to_device, from_device = isinstance(dst, DeviceTensor), isinstance(src, DeviceTensor)
        if to_device != from_device:  # e.g. torch.tensor(data, device="npu"): no dispatch mode sees it
            for mode in _ACTIVE:
                (mode.transfers if to_device else mode.host_reads).append(
                    f"aten._copy_from ({'host -> device' if to_device else 'device -> host'}, "
                    f"{tuple(src.shape)} {src.dtype}) at {_origin()}"
                )
        host_dst.copy_(host_src)
        return dst

    _LIB.impl("empty_strided", empty_strided, "PrivateUse1")
    _LIB.impl("empty.memory_format", empty, "PrivateUse1")
    _LIB.impl("_copy_from", copy_from, "PrivateUse1")


class DeviceTensor(torch.Tensor):
    """A tensor on npu:0 whose values are the CPU tensor `host` (same shape, strides and dtype)."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            strides=host.stride(),
            dtype=host.dtype,
            storage_offset=host.storage_offset(),
            device=register(),
            requires_grad=host.requires_grad,
        )
        out.host = host
        return out

    def tolist(self):
        """A device -> host read (torch refuses .tolist() on wrapper subclasses: read the values here)."""
        for mode in _ACTIVE:
            mode.host_reads.append(f"tolist at {_origin()}")
        return self.host.tolist()

    def __repr__(self) -> str:
        return f"DeviceTensor({self.host!r}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a DeviceTensor was used outside on_fake_device()")


# The operators that may take tensors of two devices: they are the copies between them.
_TRANSFERS = (torch.ops.aten.copy_.default,)
# Collectives without data (their tensor is the backend's own token).
_DATALESS_COLLECTIVES = ("barrier", "monitored_barrier")
# What wraps a functional collective's output in an AsyncCollectiveTensor (eager): on the fake device the result is
# waited for at once and stays the DeviceTensor (as under tracing).
_WRAP_ASYNC = "_c10d_functional._wrap_tensor_autograd.default"


def _is_collective(func) -> bool:
    return func.namespace in ("c10d", "_c10d_functional")


def _foreign_subclass(args, kwargs) -> bool:
    """A tensor subclass other than DeviceTensor (a functional collective's AsyncCollectiveTensor): its own
    __torch_dispatch__ runs first and calls again with what it wraps."""
    return any(
        isinstance(t, torch.Tensor)
        and type(t) not in (torch.Tensor, torch.nn.Parameter)
        and not isinstance(t, DeviceTensor)
        for t in tree_flatten((args, kwargs))[0]
    )


def _devices(args, kwargs) -> set[torch.device]:
    return {t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}


def _is_fake(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE_TYPE


class DeviceDiscipline(TorchDispatchMode):
    """See the module docstring."""

    def __init__(self):
        super().__init__()
        self.host_reads: list[str] = []
        self.transfers: list[str] = []
        self.ops: collections.Counter[str] = collections.Counter()  # operator name -> calls
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _foreign_subclass(args, kwargs):
            return NotImplemented
        self.calls += 1
        self.ops[str(func)] += 1
        devices = _devices(args, kwargs)
        if func in _TRANSFERS and len(devices) > 1:  # an explicit copy between devices
            onto = isinstance(args[0], DeviceTensor)
            (self.transfers if onto else self.host_reads).append(
                f"{func} ({'host -> device' if onto else 'device -> host'}, {_describe(args[1:2], {})}) at {_origin()}"
            )
            return _rewrap(func(*_unwrap(args), **_unwrap(kwargs)), args, _unwrap(args))
        if len(devices) > 1:
            raise DeviceMismatch(f"{func} received tensors on {sorted(map(str, devices))}: {_describe(args, kwargs)}")
        on_fake = bool(devices) and _is_fake(next(iter(devices)))
        if _is_collective(func) and devices and not on_fake and func._opname not in _DATALESS_COLLECTIVES:
            raise DeviceMismatch(
                f"{func} received host tensors only ({_describe(args, kwargs)}) while the model "
                f"runs on {register()}: HCCL moves device tensors only"
            )
        if str(func) == _WRAP_ASYNC and on_fake:  # a functional collective's result: waited, stays itself
            torch.ops._c10d_functional.wait_tensor(args[0].host)
            return args[0]
        target = kwargs.get("device")
        if func is torch.ops.aten._local_scalar_dense.default and on_fake:
            self.host_reads.append(f"{func} at {_origin()}")
        if _is_fake(target):  # a factory or a copy onto the device
            if devices:  # .to("npu") of a host tensor
                self.transfers.append(f"{func} (host -> device, {_describe(args, kwargs)}) at {_origin()}")
            kwargs = {**kwargs, "device": torch.device("cpu")}
            return tree_map(_wrap, func(*_unwrap(args), **_unwrap(kwargs)))
        if not on_fake:  # host work (e.g. building metadata)
            return func(*args, **kwargs)
        host_args, host_kwargs = _unwrap(args), _unwrap(kwargs)
        out = func(*host_args, **host_kwargs)
        if target is not None:  # .to("cpu"): leaves the device
            if func is torch.ops.aten._to_copy.default:
                self.host_reads.append(f"{func} (device -> host, {_describe(args, kwargs)}) at {_origin()}")
            return out
        if func is torch.ops.aten._local_scalar_dense.default:
            return out
        return _rewrap(out, args, host_args)


def _unwrap(tree):
    return tree_map(lambda t: t.host if isinstance(t, DeviceTensor) else t, tree)


def _wrap(t):
    return DeviceTensor(t) if isinstance(t, torch.Tensor) else t


def _rewrap(out, args, host_args):
    """Wrap the outputs; an in-place / out= result is the caller's own tensor, returned as itself."""
    own = {id(h): a for a, h in zip(tree_flatten(args)[0], tree_flatten(host_args)[0]) if isinstance(a, torch.Tensor)}

    def rewrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        return own[id(t)] if id(t) in own else _wrap(t)

    return tree_map(rewrap, out)


def _describe(args, kwargs) -> str:
    leaves = tree_flatten((args, kwargs))[0]
    return ", ".join(f"{tuple(t.shape)} {t.dtype} on {t.device}" for t in leaves if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def on_fake_device():
    """`with on_fake_device() as mode:` the fake npu:0 device with DeviceDiscipline checking every call."""
    device = register()
    mode = DeviceDiscipline()
    _ACTIVE.append(mode)
    try:
        with mode:
            mode.device = device
            yield mode
    finally:
        _ACTIVE.remove(mode)


def to_host(tree):
    """A result tree with every DeviceTensor replaced by its CPU values (outside the mode)."""
    return tree_map(lambda t: t.host if isinstance(t, DeviceTensor) else t, tree)
