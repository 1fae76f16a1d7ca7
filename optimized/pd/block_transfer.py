"""Byte ranges of a request's KV blocks, from one prefill rank's paged cache into one decode rank's.

A cache tensor is [num_blocks, block_size, kv_heads, head_dim] (token-major, head-major within a token), so a run
of KV heads of one token is one contiguous range on both sides; when a run is the whole token record on both sides,
a block's tokens coalesce into one range. The FP8 cache's per-token scales ([num_blocks, block_size] float32, one
per K and V) travel with their tokens. Only the request's `num_tokens` tokens are written, never a block's unused
tail.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.errors import UsageError
from optimized.executor.kv_cache import PagedKVCache
from optimized.pd.rank_mapping import HeadRun


@dataclass(frozen=True)
class CacheDescriptor:
    """What a peer needs to address a rank's paged cache: per layer the base address of each of its tensors
    (k, v, and for FP8 k_scale, v_scale), and the shape facts. Plain data: it travels between instances."""

    addresses: tuple[tuple[int, ...], ...]
    block_size: int
    kv_heads: int
    head_dim: int
    itemsize: int
    dtype: str

    @property
    def quantized(self) -> bool:
        return len(self.addresses[0]) == 4

    @classmethod
    def of(cls, cache: PagedKVCache) -> CacheDescriptor:
        k = cache.layers[0][0]
        return cls(
            addresses=tuple(tuple(t.data_ptr() for t in layer) for layer in cache.layers),
            block_size=cache.block_size,
            kv_heads=k.shape[2],
            head_dim=k.shape[3],
            itemsize=k.element_size(),
            dtype=str(k.dtype),
        )


SCALE_BYTES = 4


def _check_pair(src: CacheDescriptor, dst: CacheDescriptor) -> None:
    for field in ("block_size", "head_dim", "itemsize", "dtype"):
        if getattr(src, field) != getattr(dst, field):
            raise UsageError(
                f"prefill and decode KV caches differ in {field}: {getattr(src, field)} vs {getattr(dst, field)}; "
                "both instances need the same kv cache dtype and block_size"
            )
    if len(src.addresses) != len(dst.addresses):
        raise UsageError(f"prefill cache has {len(src.addresses)} layers, decode cache {len(dst.addresses)}")


def token_spans(blocks: list[int], num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """(block, token count) of each block a request of `num_tokens` tokens fills, from the block's first slot."""
    if num_tokens > len(blocks) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit {len(blocks)} blocks of {block_size}")
    spans = []
    for i, block in enumerate(blocks):
        count = min(block_size, num_tokens - i * block_size)
        if count <= 0:
            break
        spans.append((block, count))
    return spans


def write_ranges(
    src: CacheDescriptor,
    dst: CacheDescriptor,
    src_blocks: list[int],
    dst_blocks: list[int],
    num_tokens: int,
    runs: tuple[HeadRun, ...],
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) for the runs one prefill rank sends one decode rank."""
    _check_pair(src, dst)
    if len(dst_blocks) * dst.block_size < num_tokens:
        raise ValueError(f"decode reserved {len(dst_blocks)} blocks for {num_tokens} tokens")
    token_bytes = src.head_dim * src.itemsize  # one head of one token
    src_rec, dst_rec = src.kv_heads * token_bytes, dst.kv_heads * token_bytes
    pairs = list(
        zip(
            token_spans(src_blocks, num_tokens, src.block_size),
            token_spans(dst_blocks, num_tokens, dst.block_size),
            strict=True,
        )
    )
    srcs, dsts, lengths = [], [], []
    for src_layer, dst_layer in zip(src.addresses, dst.addresses, strict=True):
        for src_base, dst_base in zip(src_layer[:2], dst_layer[:2], strict=True):  # K, then V
            for run in runs:
                whole = run.count * token_bytes == src_rec == dst_rec
                for (sb, count), (db, _) in pairs:
                    s0 = src_base + sb * src.block_size * src_rec + run.src_head * token_bytes
                    d0 = dst_base + db * dst.block_size * dst_rec + run.dst_head * token_bytes
                    if whole:  # the block's tokens are one range
                        srcs.append(s0), dsts.append(d0), lengths.append(count * src_rec)
                        continue
                    for t in range(count):
                        srcs.append(s0 + t * src_rec), dsts.append(d0 + t * dst_rec)
                        lengths.append(run.count * token_bytes)
        if src.quantized and runs:  # the one sender of this decode rank (check_scales_transferable)
            for src_base, dst_base in zip(src_layer[2:], dst_layer[2:], strict=True):  # k_scale, v_scale
                for (sb, count), (db, _) in pairs:
                    srcs.append(src_base + sb * src.block_size * SCALE_BYTES)
                    dsts.append(dst_base + db * dst.block_size * SCALE_BYTES)
                    lengths.append(count * SCALE_BYTES)
    return srcs, dsts, lengths


def check_scales_transferable(plan: dict[int, tuple[HeadRun, ...]], quantized: bool) -> None:
    """A per-token FP8 scale covers all of a rank's KV heads: a decode rank can take it over only when all its heads
    come from one prefill rank (else it would need two scales for one token)."""
    if not quantized:
        return
    for decode_rank, runs in plan.items():
        senders = {run.prefill_tp_rank for run in runs}
        if len(senders) > 1:
            raise UsageError(
                f"FP8 KV cache: decode rank {decode_rank} would take its KV heads from prefill TP ranks "
                f"{sorted(senders)}, whose per-token scales differ; use a decode attention TP at least the prefill's, "
                "or a 16-bit kv cache"
            )
