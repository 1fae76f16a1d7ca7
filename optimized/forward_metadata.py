"""What one forward step needs besides the token ids: positions, lengths, cache slots (TND layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rank_rows(tokens: int, rank: int, rows: int) -> int:
    """Of `tokens` packed `rows` to a rank (rank i: tokens [i*rows, (i+1)*rows), the tail padded), how many rank
    `rank` holds."""
    return min(max(tokens - rank * rows, 0), rows)


@dataclass(frozen=True)
class DataParallelBatch:
    """Host data of one attention-DP step, the same on every rank (the engine knows every DP group's request counts).

    DP group d runs `tokens[d]` packed tokens this step; each of its `tp_size` attention TP ranks holds `rows` of them
    (rank i: tokens [i*rows, (i+1)*rows), past tokens[d] padding), `rows` the same on every rank of the job so every
    collective and MC2 exchange sees equal shapes. `picks[d]`: how many of group d's tokens the step returns logits
    for (its `logits_indices`; None: every token, i.e. decode). Only sizes: a graph-mode decode step pads every group
    to its bucket, so this is constant per captured graph.
    """

    tokens: tuple[int, ...]
    tp_size: int
    picks: tuple[int, ...] | None = None
    idle: tuple[bool, ...] = ()  # groups whose one token is a dummy (nothing to run this step); () none

    @property
    def rows(self) -> int:
        return max(1, max(-(-t // self.tp_size) for t in self.tokens))

    def active(self, group: int, tp_rank: int) -> int:
        """Real tokens among the rows of TP rank `tp_rank` of DP group `group`."""
        return rank_rows(self.tokens[group], tp_rank, self.rows)

    def real(self, group: int, tp_rank: int) -> int:
        """`active` less an idle group's dummy token: the rows of this rank that are a request's tokens."""
        return 0 if self.idle and self.idle[group] else self.active(group, tp_rank)

    def picked(self, group: int) -> int:
        """Logits rows DP group `group` returns."""
        return self.tokens[group] if self.picks is None else self.picks[group]


@dataclass
class ForwardMetadata:
    """One step's metadata. Three kinds of step:

    - prefill (`is_prefill`, `cached_lens` None): each row's tokens attend only to themselves; the KV lengths are
      the cumulative query lengths;
    - prefill over cached KV, "extend" (`is_prefill`, `cached_lens` given): row b's new tokens sit at positions
      cached_lens[b] .. cached_lens[b] + new_b - 1 and attend to the row's cached_lens[b] tokens already in the
      paged cache (through `block_table`) plus themselves, causally; `actual_seq_lengths_kv` is then per row
      (cached + new, not cumulative), as the paged attention kernel takes it;
    - decode: one token per row over the paged cache.
    """

    is_prefill: bool
    positions: torch.Tensor  # [T] int64, position of each packed token in its request
    actual_seq_lengths_cu_q: list[int]  # [B] cumulative query lengths (TND)
    # [B] prefill: cumulative (== cu_q); extend and decode: per-request KV length (cached + new)
    actual_seq_lengths_kv: list[int]
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token: block * block_size + offset
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with the null block 0
    block_size: int
    dp: DataParallelBatch | None = None  # attention DP: every DP group's sizes (the rest describes this group)
    # A static graph's decode (ge_graph): the lengths as device tensors [B] (query prefix sums, KV lengths), which the
    # attention hands torchair's operator instead of the host lists (those are then not filled).
    seq_lens_cu_q: torch.Tensor | None = None
    seq_lens_kv: torch.Tensor | None = None
    cached_lens: list[int] | None = None  # extend: [B] tokens of each row already in the cache (host list)
    # extend: [sum of the KV lengths] int64, the cache slot of every key of every row (positions 0 .. Lkv_b - 1),
    # row by row: what an attention that gathers its context from the cache reads (the FP8 cache's)
    context_slots: torch.Tensor | None = None

    @property
    def is_extend(self) -> bool:
        """A prefill whose rows read KV already in the paged cache."""
        return self.is_prefill and self.cached_lens is not None

    @property
    def max_position(self) -> int:
        """The largest position of the step, from the host lists (no device read): a prefill's longest prompt,
        a decode's longest KV length, minus one. -1 for an empty step."""
        if not self.actual_seq_lengths_kv:
            return -1
        if self.is_prefill and not self.is_extend:
            cu = self.actual_seq_lengths_cu_q
            return max(b - a for a, b in zip([0, *cu[:-1]], cu)) - 1
        return max(self.actual_seq_lengths_kv) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


# Graph mode's default captured decode batches: these small sizes, then every BUCKET_STEP rows (a batch of 600 pads
# to 608, not 1024: fewer padding rows on every rank and an MC2 window sized for them).
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def batch_bucket(batch: int, buckets: tuple[int, ...] | None = None) -> int:
    """The captured batch size a batch of `batch` requests is padded to: the smallest of `buckets` that holds it,
    or (buckets None) the default rule's: the next of 1, 2, 4, 8, then the next multiple of 16."""
    if batch < 1:
        raise ValueError(f"batch size {batch} must be at least 1")
    if buckets is None:
        if batch <= SMALL_BUCKETS[-1]:
            return min(b for b in SMALL_BUCKETS if b >= batch)
        return -(-batch // BUCKET_STEP) * BUCKET_STEP
    fits = [b for b in buckets if b >= batch]
    if not fits:
        raise ValueError(
            f"batch size {batch} exceeds the largest captured batch bucket {max(buckets)} (buckets {sorted(buckets)})"
        )
    return min(fits)


def default_buckets(batch: int) -> tuple[int, ...]:
    """The default rule's captured sizes for decode batches up to `batch`: 1, 2, 4, 8, then every 16, up to the
    bucket that holds `batch`."""
    top = batch_bucket(batch)
    return tuple(b for b in SMALL_BUCKETS if b <= top) + tuple(range(BUCKET_STEP, top + 1, BUCKET_STEP))
