"""Which prefill rank sends which KV heads to which decode rank, when the two instances shard attention differently.

Each side shards KV heads over its attention TP group as the model does (`kv_heads_per_rank`, `first_kv_head`):
an even split, or one replicated head per rank when there are fewer KV heads than ranks. A request lives in one
attention DP group on each side, so the rule is stated over TP ranks and is the same for every decode DP group.

The source ranks follow the recipe's rule: with the decode TP wider, decode TP rank d reads from prefill TP rank
d // (decode_tp / prefill_tp); with the prefill TP wider, from the span of prefill_tp / decode_tp ranks starting at
d * span. Inside those sources each KV head the decode rank holds is sent once, by the first source that holds it:
ranks replicating a head do not send it twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.errors import UsageError
from optimized.layers.linear import first_kv_head, kv_heads_per_rank


@dataclass(frozen=True)
class AttentionLayout:
    """One instance's attention parallelism: `tp` ranks share a request's heads, `dp` groups hold separate requests."""

    tp: int
    dp: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1:
            raise UsageError(f"attention layout tp={self.tp} dp={self.dp}: both must be at least 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class HeadRun:
    """`count` consecutive KV heads from global head `head`, sent by prefill TP rank `prefill_tp_rank`: they sit at
    local head `src_head` of that rank's cache and land at local head `dst_head` of the decode rank's cache."""

    prefill_tp_rank: int
    head: int
    count: int
    src_head: int
    dst_head: int


def heads_of_rank(num_kv_heads: int, tp: int, tp_rank: int) -> range:
    """The global KV heads TP rank `tp_rank` of a `tp`-wide group holds, in its cache's order."""
    first = first_kv_head(num_kv_heads, tp, tp_rank)
    return range(first, first + kv_heads_per_rank(num_kv_heads, tp))


def source_tp_ranks(prefill_tp: int, decode_tp: int, decode_tp_rank: int) -> range:
    """The prefill TP ranks decode TP rank `decode_tp_rank` pulls from (the recipe's rule)."""
    if decode_tp >= prefill_tp:
        first = decode_tp_rank // (decode_tp // prefill_tp)
        return range(first, first + 1)
    span = prefill_tp // decode_tp
    return range(decode_tp_rank * span, (decode_tp_rank + 1) * span)


def _check(prefill: AttentionLayout, decode: AttentionLayout, num_kv_heads: int) -> None:
    wide, narrow = max(prefill.tp, decode.tp), min(prefill.tp, decode.tp)
    if wide % narrow:
        raise UsageError(
            f"prefill attention TP {prefill.tp} and decode attention TP {decode.tp}: one must divide the other "
            "for the KV transfer's rank mapping"
        )
    for side, layout in (("prefill", prefill), ("decode", decode)):
        try:
            kv_heads_per_rank(num_kv_heads, layout.tp)
        except ValueError as e:
            raise UsageError(f"{side} attention TP {layout.tp} with num_key_value_heads={num_kv_heads}: {e}") from e


def decode_rank_sources(
    prefill: AttentionLayout, decode: AttentionLayout, num_kv_heads: int
) -> dict[int, tuple[HeadRun, ...]]:
    """For every decode rank (global: dp_rank * tp + tp_rank), the runs of KV heads it receives and from which
    prefill TP rank of the request's prefill DP group."""
    _check(prefill, decode, num_kv_heads)
    plan = {}
    for decode_tp_rank in range(decode.tp):
        wanted = heads_of_rank(num_kv_heads, decode.tp, decode_tp_rank)
        sources = source_tp_ranks(prefill.tp, decode.tp, decode_tp_rank)
        runs: list[HeadRun] = []
        for dst_head, head in enumerate(wanted):
            sender = next(r for r in sources if head in heads_of_rank(num_kv_heads, prefill.tp, r))
            src_head = heads_of_rank(num_kv_heads, prefill.tp, sender).index(head)
            last = runs[-1] if runs else None
            if last and last.prefill_tp_rank == sender and last.src_head + last.count == src_head:
                runs[-1] = HeadRun(sender, last.head, last.count + 1, last.src_head, last.dst_head)
            else:
                runs.append(HeadRun(sender, head, 1, src_head, dst_head))
        for dp_rank in range(decode.dp):
            plan[dp_rank * decode.tp + decode_tp_rank] = tuple(runs)
    return plan
