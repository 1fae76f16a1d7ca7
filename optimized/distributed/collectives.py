"""The collectives the model layers call, with byte counting.

`all_reduce`, `all_gather` (`sizes=` for uneven shards), `reduce_scatter`, `all_to_all_single`, `broadcast` take a
ProcessGroup, a `GroupInfo` or None and are the identity when the group is None or of size 1, so a single process
needs no `torch.distributed` at all. Every call adds the bytes this rank sends to the active `count_bytes()` counter.

Invariants, on every backend: 16-bit floats travel as they are (gloo rounds a sum at every reduction step, every rank
still getting the same value; `upcast=True` sums in fp32 and rounds once); 1-byte types (fp8, E8M0 scales, packed
FP4) move as uint8 views, bit-exact, and reducing them is refused; gloo's missing uneven all_gather is a pad, one
gather and a trim. While torch.compile traces, the same collectives go through torch's functional collectives, so a
decode step with TP / EP collectives captures as one graph. Findings pinned by tests/test_dist_harness.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from optimized.distributed.parallel_state import GroupInfo
from optimized.ops.process_groups import add_traffic_observer

# ------------------------------------------------------------------------------------------ collectives

# torch 2.13 renamed the single-tensor collectives and deprecated the old names; torch_npu users may be
# on an older torch (>= 2.8) that has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_ONE_BYTE_FLOATS = tuple(
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, n)
)


class CommCounter:
    """Bytes that leave this rank, per collective, while `count_bytes()` is active.

    Counted as if every collective were direct point-to-point (what the data needs, whatever algorithm the
    backend picks): all_gather (n-1) * this rank's shard; reduce_scatter (n-1) * one output chunk;
    all_to_all_single the rows sent to the other ranks; all_reduce 2 * (n-1) * size // n (reduce-scatter +
    all-gather); broadcast (n-1) * size on the source; the MC2 operators (optimized/ops/mc2.py) what their
    all_to_alls send to other ranks. Collectives without communication count nothing.
    """

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def add(self, op: str, nbytes: int) -> None:
        self.bytes[op] = self.bytes.get(op, 0) + int(nbytes)
        self.calls[op] = self.calls.get(op, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __repr__(self) -> str:
        return f"CommCounter(total={self.total}, bytes={self.bytes}, calls={self.calls})"


_COUNTERS: list[CommCounter] = []


@contextlib.contextmanager
def count_bytes():
    """`with comm.count_bytes() as counter:` counts the bytes this rank's collectives send (see CommCounter)."""
    counter = CommCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _count(op: str, nbytes: int) -> None:
    for counter in _COUNTERS:
        counter.add(op, nbytes)


# Collective operators (the portable MC2 dispatch / combine) report what they send through the ops-floor hook.
add_traffic_observer(_count)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _pg(group) -> "dist.ProcessGroup | None":
    """ProcessGroup from a ProcessGroup / GroupInfo / None; None when no communication is needed."""
    if isinstance(group, GroupInfo):
        group = group.group
    if group is None:
        return None
    return None if group.size() == 1 else group


def _wire(x: torch.Tensor) -> torch.Tensor:
    """A dtype every backend moves: 1-byte float types travel as uint8 (bit-exact)."""
    return x.view(torch.uint8) if x.dtype in _ONE_BYTE_FLOATS else x


def _check_reducible(x: torch.Tensor, what: str) -> None:
    if x.dtype in _ONE_BYTE_FLOATS:
        raise TypeError(
            f"{what}: cannot sum {x.dtype} tensors on the wire (no backend reduces fp8/fp4 "
            f"exactly); dequantize to bfloat16/float32 first"
        )


def all_reduce(x: torch.Tensor, group, *, upcast: bool = False) -> torch.Tensor:
    """Sum over the group. Returns the result (x itself is reduced in place when contiguous).

    upcast=True reduces 16-bit floats in float32 and rounds once (instead of once per reduction step).
    """
    pg = _pg(group)
    if pg is None:
        return x
    _check_reducible(x, "all_reduce")
    if torch.compiler.is_compiling():  # graph mode: the traceable functional form, the same sum
        wide = upcast and x.dtype in (torch.bfloat16, torch.float16)
        out = funcol.all_reduce(x.float() if wide else x, "sum", pg)
        return out.to(x.dtype) if wide else out
    if upcast and x.dtype in (torch.bfloat16, torch.float16):
        buf = x.float()
        _count("all_reduce", 2 * (pg.size() - 1) * _nbytes(buf) // pg.size())
        dist.all_reduce(buf, group=pg)
        return buf.to(x.dtype)
    buf = x if x.is_contiguous() else x.contiguous()
    _count("all_reduce", 2 * (pg.size() - 1) * _nbytes(buf) // pg.size())
    dist.all_reduce(buf, group=pg)
    return buf


def all_gather(x: torch.Tensor, group, dim: int = 0, *, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in group-rank order.

    Without `sizes` all ranks' shapes must be equal. With `sizes` (the per-rank extent along `dim`, the
    same list on every rank) shards may differ: each is padded to the largest, gathered once, trimmed.
    """
    pg = _pg(group)
    if pg is None:
        return x
    n = dist.get_world_size(pg)
    dim = dim % x.dim()
    src = x.movedim(dim, 0)
    if sizes is not None:
        if len(sizes) != n:
            raise ValueError(f"all_gather: sizes has {len(sizes)} entries for a group of {n} ranks")
        me = sizes[dist.get_rank(pg)]
        if src.shape[0] != me:
            raise ValueError(f"all_gather: this rank's extent along dim {dim} is {src.shape[0]}, sizes says {me}")
        pad = max(sizes) - me
        if pad:
            src = torch.cat([src, src.new_zeros((pad, *src.shape[1:]))])
    src = _wire(src.contiguous())
    _count("all_gather", (n - 1) * _nbytes(src))
    if torch.compiler.is_compiling():  # graph mode: the traceable functional form
        out = funcol.all_gather_tensor(src, 0, pg)
    else:
        out = src.new_empty((n * src.shape[0], *src.shape[1:]))
        _all_gather_single(out, src, group=pg)
    if x.dtype in _ONE_BYTE_FLOATS:
        out = out.view(x.dtype)
    if sizes is not None and max(sizes) != min(sizes):
        out = torch.cat([c[:s] for c, s in zip(out.chunk(n), sizes)])
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0, *, upcast: bool = False) -> torch.Tensor:
    """Sum over the group, then keep this rank's `1/n` chunk along `dim` (chunk i goes to group rank i)."""
    pg = _pg(group)
    if pg is None:
        return x
    _check_reducible(x, "reduce_scatter")
    n = dist.get_world_size(pg)
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} along dim {dim} is not divisible by the group size {n}")
    src = x.movedim(dim, 0)
    cast = upcast and x.dtype in (torch.bfloat16, torch.float16)
    src = (src.float() if cast else src).contiguous()
    if torch.compiler.is_compiling():  # graph mode: the traceable functional form, the same sum
        out = funcol.reduce_scatter_tensor(src, "sum", 0, pg)
    else:
        out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
        _count("reduce_scatter", (n - 1) * _nbytes(out))
        _reduce_scatter_single(out, src, group=pg)
    if cast:
        out = out.to(x.dtype)
    return out.movedim(0, dim)


def exchange_split_sizes(input_split_sizes: list[int], group, device: torch.device) -> list[int]:
    """What every peer sends this rank, given what this rank sends each peer (one small all_to_all).

    device: the rows' device (hccl / nccl move device tensors only); the counts come back to the host, the
    host list `all_to_all_single` takes."""
    pg = _pg(group)
    if pg is None:
        return list(input_split_sizes)
    send = torch.tensor(input_split_sizes, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    _count("all_to_all", (pg.size() - 1) * send.element_size())
    dist.all_to_all_single(recv, send, group=pg)
    return recv.tolist()


def all_to_all_single(
    x: torch.Tensor, group, output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None
) -> torch.Tensor:
    """Rows of `x` (dim 0) split by `input_split_sizes` go to group ranks 0..n-1; returns what arrives.

    Equal splits when both are None. When only `input_split_sizes` is given, the output splits are
    exchanged first (`exchange_split_sizes`).
    """
    pg = _pg(group)
    if pg is None:
        if (
            input_split_sizes is not None
            and output_split_sizes is not None
            and list(input_split_sizes) != list(output_split_sizes)
        ):
            raise ValueError("all_to_all_single without a group: input and output splits must match")
        return x
    n = dist.get_world_size(pg)
    for name, splits in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
        if splits is not None and len(splits) != n:
            raise ValueError(f"all_to_all_single: {name} has {len(splits)} entries for a group of {n} ranks")
    if input_split_sizes is not None and sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"all_to_all_single: input_split_sizes sum to {sum(input_split_sizes)} but x has {x.shape[0]} rows"
        )
    if input_split_sizes is None and x.shape[0] % n:
        raise ValueError(f"all_to_all_single: {x.shape[0]} rows cannot be split equally over {n} ranks")
    compiling = torch.compiler.is_compiling()
    if input_split_sizes is not None and output_split_sizes is None:
        if compiling:
            raise ValueError(
                "all_to_all_single: under torch.compile give output_split_sizes too (exchanging the "
                "split sizes reads them back to the host, which a graph cannot do)"
            )
        output_split_sizes = exchange_split_sizes(input_split_sizes, pg, x.device)
    src = _wire(x.contiguous())
    if compiling:  # graph mode: the traceable functional form, the same rows
        out = funcol.all_to_all_single(src, output_split_sizes, input_split_sizes, pg)
        return out.view(x.dtype) if x.dtype in _ONE_BYTE_FLOATS else out
    rows = sum(output_split_sizes) if output_split_sizes is not None else src.shape[0]
    out = src.new_empty((rows, *src.shape[1:]))
    row = src[0].numel() * src.element_size() if src.shape[0] else 0
    sent = list(input_split_sizes) if input_split_sizes is not None else [src.shape[0] // n] * n
    _count("all_to_all", (sum(sent) - sent[dist.get_rank(pg)]) * row)
    dist.all_to_all_single(out, src, output_split_sizes, input_split_sizes, group=pg)
    return out.view(x.dtype) if x.dtype in _ONE_BYTE_FLOATS else out


def broadcast(x: torch.Tensor, group, src_group_rank: int = 0) -> torch.Tensor:
    """Every rank gets group rank `src_group_rank`'s `x` (in place when contiguous)."""
    pg = _pg(group)
    if pg is None:
        return x
    buf = x if x.is_contiguous() else x.contiguous()
    if dist.get_rank(pg) == src_group_rank:
        _count("broadcast", (pg.size() - 1) * _nbytes(buf))
    dist.broadcast(_wire(buf), group=pg, group_src=src_group_rank)
    return buf
