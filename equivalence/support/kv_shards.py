"""A request's logical KV (every layer, K and V, token, KV head, dim) laid into paged caches sharded by attention TP,
and a KV transfer carried out with the project's byte ranges: the prefill and decode sides of the KV transfer's
tests. Values are random bit patterns (what is compared is bytes, not numbers)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from optimized.executor.kv_cache import PagedKVCache
from optimized.pd.block_transfer import CacheDescriptor, write_ranges
from optimized.pd.digest import KvDigest, digest_cache
from optimized.pd.rank_mapping import AttentionLayout, decode_rank_sources, heads_of_rank

_BITS = {1: torch.uint8, 2: torch.int16}
DEVICE = torch.device("cpu")  # the transfer engine's protocol tcp moves host memory
LAYERS, DIM = 2, 4


@dataclass
class LogicalKv:
    """kv[layer, 0 or 1 (K, V), token, head, dim] as raw bits; for FP8, scales[layer, K/V, token, head]: the scale of
    the rank holding `head` (a per-token scale over a rank's heads: every head of a rank shares it)."""

    kv: torch.Tensor
    scales: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]


def random_kv(layers: int, tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> LogicalKv:
    g = torch.Generator().manual_seed(seed)
    if dtype.itemsize == 1:
        kv = torch.randint(0, 256, (layers, 2, tokens, heads, dim), generator=g, dtype=torch.uint8).view(dtype)
        scales = torch.rand(layers, 2, tokens, heads, generator=g, dtype=torch.float32)
        return LogicalKv(kv, scales)
    bits = torch.randint(-(2**15), 2**15, (layers, 2, tokens, heads, dim), generator=g, dtype=torch.int16)
    return LogicalKv(bits.view(dtype), None)


def empty_cache(kv: LogicalKv, num_blocks: int, block_size: int, local_heads: int) -> PagedKVCache:
    layers, _, _, _, dim = kv.kv.shape
    return PagedKVCache(layers, num_blocks, block_size, local_heads, dim, kv.kv.dtype, DEVICE)


def fill(cache: PagedKVCache, blocks: list[int], kv: LogicalKv, heads: range) -> None:
    """Write the request's tokens of global `heads` into `cache` at `blocks` (the prefill side's forward)."""
    slots = torch.tensor([b * cache.block_size + s for b in blocks for s in range(cache.block_size)])
    slots = slots[: kv.num_tokens]
    for layer, tensors in enumerate(cache.layers):
        for which in range(2):
            bits = _BITS[kv.kv.element_size()]  # index_put on the raw bits (no float8 kernels needed)
            flat = tensors[which].view(bits).view(-1, *tensors[which].shape[2:])
            flat[slots] = kv.kv[layer, which, :, heads.start : heads.stop].view(bits)
            if kv.scales is not None:
                tensors[2 + which].view(-1)[slots] = kv.scales[layer, which, :, heads.start]


def shard_scales(kv: LogicalKv, tp: int) -> LogicalKv:
    """The logical KV as a `tp`-wide side holds it: each head's scale is that of the first head of its rank."""
    if kv.scales is None:
        return kv
    heads = kv.kv.shape[3]
    scales = kv.scales.clone()
    for rank in range(tp):
        held = heads_of_rank(heads, tp, rank)
        scales[..., held.start : held.stop] = kv.scales[..., held.start : held.start + 1]
    return LogicalKv(kv.kv, scales)


class MemmoveEngine:
    """An in-process stand-in for the transfer engine's one-sided write (both caches live in this process)."""

    def batch_transfer_sync_write(self, peer, src, dst, lengths) -> None:
        for s, d, n in zip(src, dst, lengths, strict=True):
            ctypes.memmove(d, s, n)


def side_digest(caches: list[PagedKVCache], blocks: list[list[int]], num_tokens: int, heads: int) -> KvDigest:
    """One side's digest of a request held by the TP ranks `caches` of its DP group: the parts of every rank."""
    tp = len(caches)
    parts = [
        digest_cache(cache, rank_blocks, num_tokens, heads_of_rank(heads, tp, rank))
        for rank, (cache, rank_blocks) in enumerate(zip(caches, blocks))
    ]
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return total


def transfer(
    prefill: list[PagedKVCache],
    prefill_blocks: list[list[int]],
    decode: list[PagedKVCache | CacheDescriptor],
    decode_blocks: list[list[int]],
    num_tokens: int,
    heads: int,
    engine,
    peer: str = "",
) -> None:
    """Every prefill TP rank writes what the rank mapping gives it into the decode TP ranks of one DP group (their
    caches, or for a decode side in another process their descriptors)."""
    plan = decode_rank_sources(AttentionLayout(len(prefill)), AttentionLayout(len(decode)), heads)
    decode = [CacheDescriptor.of(d) if isinstance(d, PagedKVCache) else d for d in decode]
    for d, (dst, dst_blocks) in enumerate(zip(decode, decode_blocks)):
        for p, (src, src_blocks) in enumerate(zip(prefill, prefill_blocks)):
            runs = tuple(r for r in plan[d] if r.prefill_tp_rank == p)
            if runs:
                ranges = write_ranges(CacheDescriptor.of(src), dst, src_blocks, dst_blocks, num_tokens, runs)
                engine.batch_transfer_sync_write(peer, *ranges)


def blocks_for(tokens: int, block_size: int, seed: int, num_blocks: int) -> list[int]:
    """A request's blocks, scattered through the pool (never the null block 0)."""
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    return order[: -(-tokens // block_size)].tolist()


def prefill_side(prefill_tp, heads, tokens, block_size, dtype, seed, num_blocks=16):
    """The request's logical KV, and the prefill TP ranks' caches holding it in scattered blocks."""
    kv = random_kv(LAYERS, tokens, heads, DIM, dtype, seed)
    caches, blocks = [], []
    for rank in range(prefill_tp):
        held = heads_of_rank(heads, prefill_tp, rank)
        caches.append(empty_cache(kv, num_blocks, block_size, len(held)))
        blocks.append(blocks_for(tokens, block_size, seed + rank, num_blocks))
        fill(caches[-1], blocks[-1], kv, held)
    return kv, caches, blocks


def decode_side(kv, decode_tp, heads, block_size, seed, num_blocks=16):
    """The decode TP ranks' empty caches, blocks reserved for the request."""
    held = [heads_of_rank(heads, decode_tp, rank) for rank in range(decode_tp)]
    caches = [empty_cache(kv, num_blocks, block_size, len(h)) for h in held]
    blocks = [blocks_for(kv.num_tokens, block_size, seed + 100 + r, num_blocks) for r in range(decode_tp)]
    return caches, blocks


def prefilled_pair(prefill_tp, decode_tp, heads, tokens, block_size, dtype, seed, num_blocks=16):
    """Both sides in one process."""
    kv, prefill, prefill_blocks = prefill_side(prefill_tp, heads, tokens, block_size, dtype, seed, num_blocks)
    decode, decode_blocks = decode_side(kv, decode_tp, heads, block_size, seed, num_blocks)
    return kv, prefill, prefill_blocks, decode, decode_blocks


def assert_holds(decode, decode_blocks, kv, prefill_tp, heads):
    """Each decode rank's cache holds the request's tokens of its heads (and its sender's scales), bit for bit."""
    expected = shard_scales(kv, prefill_tp)
    for rank, (cache, blocks) in enumerate(zip(decode, decode_blocks)):
        held = heads_of_rank(heads, len(decode), rank)
        index = torch.tensor(blocks)
        for layer, tensors in enumerate(cache.layers):
            for which in range(2):
                got = tensors[which].index_select(0, index).flatten(0, 1)[: kv.num_tokens]
                want = kv.kv[layer, which, :, held.start : held.stop]
                assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
                if expected.scales is not None:
                    got_scale = tensors[2 + which].index_select(0, index).flatten(0, 1)[: kv.num_tokens]
                    assert torch.equal(got_scale, expected.scales[layer, which, :, held.start])
