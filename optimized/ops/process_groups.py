"""Process groups by name, and the traffic hook: what collective operators need from the layer above them.

torch_npu's collective operators (the MC2 dispatch / combine) take a communicator *name* (`group_ep`), not a
process group. On an NPU host HCCL resolves it; here the portable kernels resolve it in this registry, which
`optimized.distributed.parallel_state.comm_name` fills (the HCCL name on NPU, the ProcessGroup's own name
elsewhere). The registry lives on the operators' floor so they never import `optimized.distributed` (a higher
floor); a name not registered here falls back to torch.distributed's own group-name registry, so a group
created outside this package can be passed by `group.group_name`.

The traffic hook lets the byte counting of `optimized.distributed.collectives` see what operators send
(`report_traffic`), again without the operators importing it.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

_GROUP_NAMES: dict[str, "dist.ProcessGroup | None"] = {}
_TRAFFIC_OBSERVERS: list[Callable[[str, int], None]] = []


def register_group_name(name: str, group: "dist.ProcessGroup | None") -> str:
    """Make `group` findable by `name`; returns the name."""
    _GROUP_NAMES[name] = group
    return name


def group_by_name(name: str) -> "dist.ProcessGroup | None":
    """The group registered under `name` (None: a one-rank group), else torch.distributed's group of that name."""
    if name in _GROUP_NAMES:
        return _GROUP_NAMES[name]
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._resolve_process_group(name)
        except (KeyError, ValueError, RuntimeError):
            pass
    raise KeyError(f"no process group registered under {name!r}; registered: {sorted(_GROUP_NAMES)}")


def add_traffic_observer(observer: Callable[[str, int], None]) -> None:
    """`observer(op, nbytes)` is called for the bytes every collective operator sends to other ranks."""
    if observer not in _TRAFFIC_OBSERVERS:
        _TRAFFIC_OBSERVERS.append(observer)


def report_traffic(op: str, nbytes: int) -> None:
    for observer in _TRAFFIC_OBSERVERS:
        observer(op, nbytes)
