"""Device memory as the KV pool is sized from it: the device's total, and the most a call allocates at once.

`device_memory(device)` picks the source. An accelerator (CUDA, NPU) reports both from its allocator's statistics,
and the memory in use outside that allocator (communication buffers such as the MC2 window, the runtime's own). The
CPU has no allocator statistics: its "device memory" is the host's physical memory (as the start-up memory check
has always read it), and a call's peak is counted op by op from the tensor storage it creates and frees
(`LiveStorage`), which is what an allocator's peak counts too (workspace a kernel allocates inside itself aside).
A test states a device instead (`StatedMemory`: its size given, its peak measured or given).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DeviceMemory:
    """Where a run's memory figures come from."""

    name = "device"

    def total_bytes(self) -> int:
        raise NotImplementedError

    def peak_bytes(self, fn) -> int:
        """Run `fn()`; the most bytes it held allocated at once beyond what was allocated before it."""
        raise NotImplementedError

    def other_bytes(self) -> int:
        """Device memory in use outside the tensor allocator (communication buffers such as the MC2 window, the
        runtime's own): none where there is no such figure."""
        return 0


class LiveStorage(TorchDispatchMode):
    """Counts the bytes of tensor storage created inside the mode while it lives, and their peak: each operator's
    outputs are counted once per storage (views share theirs) and uncounted when the storage is freed."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}  # storage address -> bytes
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # an opaque tensor (e.g. a oneDNN weight packed once): no storage
            return
        address, size = storage.data_ptr(), storage.nbytes()
        if not size or address in self._live:
            return
        self._live[address] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, address)

    def _free(self, address: int) -> None:
        self.now -= self._live.pop(address, 0)


def live_storage_peak(fn) -> int:
    """The peak bytes of tensor storage `fn()` holds at once (`LiveStorage`)."""
    with LiveStorage() as counter:
        fn()
    return counter.peak


class HostMemory(DeviceMemory):
    """The CPU: the host's physical memory, peaks counted from live tensor storage."""

    name = "host"

    def total_bytes(self) -> int:
        from optimized.platform import memory_bytes

        return memory_bytes(torch.device("cpu"))

    def peak_bytes(self, fn) -> int:
        return live_storage_peak(fn)


class AllocatorMemory(DeviceMemory):
    """An accelerator: its total memory and its allocator's peak statistics (torch.cuda, torch.npu)."""

    def __init__(self, device: torch.device):
        self.device, self.name = device, device.type
        self.module = getattr(torch, device.type)

    def total_bytes(self) -> int:
        return self.module.mem_get_info(self.device)[1]

    def peak_bytes(self, fn) -> int:
        self.module.synchronize(self.device)
        before = self.module.memory_allocated(self.device)
        self.module.reset_peak_memory_stats(self.device)
        fn()
        self.module.synchronize(self.device)
        return max(self.module.max_memory_allocated(self.device) - before, 0)

    def other_bytes(self) -> int:
        free, total = self.module.mem_get_info(self.device)
        return max(total - free - self.module.memory_reserved(self.device), 0)


class StatedMemory(DeviceMemory):
    """A device of `total` bytes, as a test states it; its peaks measured as on the host, or `peak` given; `other`
    bytes in use outside the tensors."""

    name = "stated"

    def __init__(self, total: int, peak: int | None = None, other: int = 0):
        self.total, self.peak, self.other = int(total), peak, int(other)

    def other_bytes(self) -> int:
        return self.other

    def total_bytes(self) -> int:
        return self.total

    def peak_bytes(self, fn) -> int:
        measured = live_storage_peak(fn)
        return measured if self.peak is None else self.peak


def device_memory(device: torch.device) -> DeviceMemory:
    """The memory figures of `device`: its allocator's (CUDA, NPU with torch_npu), else the host's."""
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(module, "max_memory_allocated") and hasattr(module, "mem_get_info"):
        return AllocatorMemory(device)
    return HostMemory()
