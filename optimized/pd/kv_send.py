"""One rank's part of a request's KV transfer and of its digest, over the engine's paged cache.

The prefill rank writes the KV heads the rank mapping gives it into each decode TP rank of the request's decode DP
group (`send`); each side's rank digests the heads it holds (`rank_digest`) and the parts merge into the side's
digest (`merge`), which the decode side checks against the prefill's (`digest.KvDigest.check_against`). Targets and
digests travel between instances as plain data (`target_of` / `target_data`, `digest_data` / `digest_of`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from optimized.executor.kv_cache import PagedKVCache
from optimized.pd.block_transfer import CacheDescriptor, check_scales_transferable, write_ranges
from optimized.pd.digest import KvDigest, digest_cache
from optimized.pd.rank_mapping import AttentionLayout, decode_rank_sources, heads_of_rank


@dataclass(frozen=True)
class RankTarget:
    """One decode TP rank of the request's DP group: its transfer engine's session, its cache, the request's
    blocks in it."""

    session: str
    cache: CacheDescriptor
    blocks: tuple[int, ...]


def target_data(t: RankTarget) -> dict:
    return {"session": t.session, "cache": asdict(t.cache), "blocks": list(t.blocks)}


def target_of(data: dict) -> RankTarget:
    cache = dict(data["cache"])
    cache["addresses"] = tuple(tuple(int(a) for a in layer) for layer in cache["addresses"])
    return RankTarget(str(data["session"]), CacheDescriptor(**cache), tuple(int(b) for b in data["blocks"]))


def send(
    transfer,
    cache: PagedKVCache,
    blocks: list[int],
    num_tokens: int,
    prefill: AttentionLayout,
    prefill_tp_rank: int,
    targets: list[RankTarget],
    decode: AttentionLayout,
    num_kv_heads: int,
) -> int:
    """This prefill rank's writes into the decode TP ranks `targets` (in TP rank order); the number of writes."""
    if len(targets) != decode.tp:
        raise ValueError(f"the decode side names {len(targets)} ranks for a request; its attention TP is {decode.tp}")
    plan = decode_rank_sources(prefill, decode, num_kv_heads)
    source = CacheDescriptor.of(cache)
    check_scales_transferable(plan, source.quantized)
    writes = 0
    for decode_tp_rank, target in enumerate(targets):
        runs = tuple(r for r in plan[decode_tp_rank] if r.prefill_tp_rank == prefill_tp_rank)
        if not runs:
            continue
        ranges = write_ranges(source, target.cache, blocks, list(target.blocks), num_tokens, runs)
        transfer.batch_transfer_sync_write(target.session, *ranges)
        writes += len(ranges[0])
    return writes


def rank_digest(
    cache: PagedKVCache, blocks: list[int], num_tokens: int, layout: AttentionLayout, tp_rank: int, num_kv_heads: int
) -> KvDigest:
    return digest_cache(cache, blocks, num_tokens, heads_of_rank(num_kv_heads, layout.tp, tp_rank))


def merge(parts: list[KvDigest]) -> KvDigest:
    total = parts[0]
    for part in parts[1:]:
        total = total.merge(part)
    return total


def digest_data(d: KvDigest) -> dict:
    """JSON-safe (digest sums are 64-bit: sent as hex strings)."""
    return {
        "num_tokens": d.num_tokens,
        "values": {str(h): f"{v:016x}" for h, v in d.values.items()},
        "scales": {str(h): f"{v:016x}" for h, v in d.scales.items()},
    }


def digest_of(data: dict) -> KvDigest:
    return KvDigest(
        int(data["num_tokens"]),
        {int(h): int(v, 16) for h, v in data["values"].items()},
        {int(h): int(v, 16) for h, v in data["scales"].items()},
    )
