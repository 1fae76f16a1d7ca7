"""The engine's KV pool size (per attention-DP group, the null block included): given, or sized by memory.

Sized by memory, as vLLM sizes its cache: `scheduler_config.mem_fraction_static` of the device's memory, less the
weights, the activation peak a profiling forward measured and the memory in use outside the tensors (communication
buffers; optimized/executor/memory.py), in blocks of what one
block of the KV cache takes on this rank; every rank takes the smallest count any rank can hold (the scheduler keeps
every group's pool alike on every rank). It is capped at what the batch can use at once: a DP group's share of
batch_size, each request at its budget, input_max_len + max_new_tokens capped at max_position_embeddings (no request
holds more), so a host with memory to spare does not allocate it. A pool below that is fine: requests take blocks as
they grow and the scheduler preempts when none are free. One that cannot hold a single request's budget is refused
(`KVPoolTooSmall`, naming what to lower). Given: `--kv-pool-blocks`, or a `generate` call's prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.errors import UsageError

GIB, MIB = 1 << 30, 1 << 20
MEMORY = "memory"  # KVPool.source of a pool sized by memory


class KVPoolTooSmall(UsageError):
    """The memory mem_fraction_static leaves for the KV pool cannot hold one request."""


def size_text(n: int) -> str:
    """Bytes as printed: GiB, MiB for small pools (the test models')."""
    return f"{n / GIB:.2f} GiB" if n >= GIB // 100 else f"{n / MIB:.2f} MiB"


def request_budget(input_max_len: int, max_new_tokens: int, max_positions: int) -> int:
    """The most tokens one request can hold: its longest prompt and its new tokens, within the model's positions."""
    return min(input_max_len + max_new_tokens, max_positions)


@dataclass(frozen=True)
class KVPool:
    blocks: int  # per DP group, the null block included
    block_size: int
    block_bytes: int  # one block on this rank: K and V of every layer (and their scales when quantized)
    dp_groups: int = 1
    source: str = MEMORY  # MEMORY, or what gave the size ("--kv-pool-blocks", "the prompts")
    # sized by memory: the figures it came from
    device_bytes: int | None = None
    fraction: float | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    other_bytes: int = 0  # in use outside the tensors (communication buffers)
    memory_blocks: int | None = None  # what the memory holds (the smallest of every rank's)
    need_blocks: int | None = None  # what the batch can use at once
    group_batch: int | None = None
    request_tokens: int | None = None

    @property
    def tokens(self) -> int:
        """Tokens the requests can hold (the null block aside)."""
        return (self.blocks - 1) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    def line(self) -> str:
        """The start-up line: the pool, and how it was sized."""
        where = " per DP group" if self.dp_groups > 1 else ""
        head = (
            f"KV pool: {self.blocks} blocks of {self.block_size} tokens{where} (null block included; "
            f"{self.tokens} tokens, {size_text(self.nbytes)} per rank)"
        )
        if self.source != MEMORY:
            return f"{head}, given by {self.source}"
        capped = self.need_blocks <= self.memory_blocks
        batch = f"{self.group_batch} requests of {self.request_tokens} tokens ({self.need_blocks} blocks)"
        return (
            f"{head}, sized by memory: mem_fraction_static {self.fraction} of {size_text(self.device_bytes)}, less "
            f"the weights {size_text(self.weights_bytes)}"
            + (f", other device memory {size_text(self.other_bytes)}" if self.other_bytes else "")
            + f" and the activation peak {size_text(self.activation_bytes)}, holds {self.memory_blocks} blocks; "
            + (
                f"capped at what the batch can use: {batch}"
                if capped
                else f"the batch could use {batch}: beyond the pool, requests wait or are preempted"
            )
        )


def memory_blocks(
    device_bytes: int, fraction: float, weights_bytes: int, activation_bytes: int, block_bytes: int, other_bytes=0
) -> int:
    """Blocks of `block_bytes` that mem_fraction_static of the device holds beside the weights, the activations and
    the memory in use outside the tensors."""
    room = int(fraction * device_bytes) - weights_bytes - activation_bytes - other_bytes
    return max(room, 0) // block_bytes


def sized_by_memory(
    *,
    device_bytes: int,
    fraction: float,
    weights_bytes: int,
    activation_bytes: int,
    block_bytes: int,
    block_size: int,
    group_batch: int,
    request_tokens: int,
    dp_groups: int = 1,
    other_bytes: int = 0,
    agree=None,
) -> KVPool:
    """The pool by memory (the module docstring). agree: the smallest of every rank's block count (None: this rank's
    alone). KVPoolTooSmall when it cannot hold one request of `request_tokens`."""
    held = memory_blocks(device_bytes, fraction, weights_bytes, activation_bytes, block_bytes, other_bytes)
    if agree is not None:
        held = agree(held)
    per_request = -(-request_tokens // block_size)
    need = 1 + group_batch * per_request
    if held < 1 + per_request:
        raise KVPoolTooSmall(
            f"the KV pool cannot hold one request: scheduler_config.mem_fraction_static={fraction} of the device's "
            f"{size_text(device_bytes)}, less the weights ({size_text(weights_bytes)}), other device memory "
            f"({size_text(other_bytes)}) and the activation peak ({size_text(activation_bytes)}), leaves {held} "
            f"blocks of {block_size} tokens ({size_text(block_bytes)} each) where one request of {request_tokens} "
            f"tokens (data_config.input_max_len + scheduler_config.max_new_tokens, at most max_position_embeddings) "
            f"needs {1 + per_request} with the null block; lower input_max_len or max_new_tokens, raise "
            f"mem_fraction_static, or shard the model over more ranks (parallel_config)"
        )
    return KVPool(
        blocks=min(held, need),
        block_size=block_size,
        block_bytes=block_bytes,
        dp_groups=dp_groups,
        device_bytes=device_bytes,
        fraction=fraction,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        other_bytes=other_bytes,
        memory_blocks=held,
        need_blocks=need,
        group_batch=group_batch,
        request_tokens=request_tokens,
    )
