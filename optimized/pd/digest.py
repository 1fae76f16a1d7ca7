"""A digest of a request's KV keyed by logical coordinate, so that two differently sharded caches can be compared.

Every element (layer, K or V, token, global KV head, dim) hashes its coordinate together with its bits; the
digest is the sum of those hashes modulo 2**64. A sum does not care which rank held which element, so each rank
digests the heads it owns (`rank_mapping.digest_owner`: a replicated head counted once) and the parts add up to the
same value on the prefill and the decode side exactly when the same bytes sit at the same coordinates. A flipped
byte changes one element's hash; a token too many or too few adds or drops a whole token's hashes; the token count
is compared as well. The FP8 cache's per-token scales are digested per (layer, K or V, token, head) in a sum of
their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.executor.kv_cache import PagedKVCache

_MASK32 = 0xFFFFFFFF
_MOD = 1 << 64
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63 in int64 (no overflow on any backend)
_M1, _M2 = 0x2C1B3C6D, 0x297A2D39
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_VALUE_SEED, _SCALE_SEED = 0x1234567, 0x7654321


class KvIntegrityError(RuntimeError):
    """The KV the decode side holds is not the KV the prefill side sent: the request must fail, never produce text."""


def _mix(x):
    """A 32-bit avalanche mix (murmur3's finalizer shape) on int64 tensors or Python ints."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of each element as a non-negative int64."""
    return t.contiguous().view(_BITS[t.element_size()]).to(torch.int64) & ((1 << (8 * t.element_size())) - 1)


@dataclass(frozen=True)
class KvDigest:
    """One side's digest of a request: the token count, and per global KV head the hash sum of its values and of its
    scales (FP8; 0 otherwise)."""

    num_tokens: int
    values: dict[int, int]
    scales: dict[int, int]

    def merge(self, other: KvDigest) -> KvDigest:
        """Two ranks' parts of one side's digest. A head two ranks replicate must digest the same on both: a
        corrupted replica is caught too, not only the copy one rank would count."""
        if self.num_tokens != other.num_tokens:
            raise KvIntegrityError(f"digest parts over {self.num_tokens} and {other.num_tokens} tokens")
        merged = []
        for part in ("values", "scales"):
            mine, theirs = getattr(self, part), getattr(other, part)
            for head in mine.keys() & theirs.keys():
                if mine[head] != theirs[head]:
                    raise KvIntegrityError(
                        f"replicas of KV head {head} disagree ({part}) over {self.num_tokens} tokens"
                    )
            merged.append(mine | theirs)
        return KvDigest(self.num_tokens, *merged)

    def check_against(self, sent: KvDigest) -> None:
        """Raise KvIntegrityError unless this (the received side's digest) equals the sent side's."""
        if self.num_tokens != sent.num_tokens:
            raise KvIntegrityError(f"decode took over {self.num_tokens} tokens of KV, prefill sent {sent.num_tokens}")
        if self.values.keys() != sent.values.keys():
            raise KvIntegrityError(f"decode holds KV heads {sorted(self.values)}, prefill sent {sorted(sent.values)}")
        for part in ("values", "scales"):
            mine, theirs = getattr(self, part), getattr(sent, part)
            for head in sorted(theirs):
                if mine.get(head) != theirs[head]:
                    raise KvIntegrityError(
                        f"KV {part} digest mismatch for KV head {head} over {self.num_tokens} tokens: received "
                        f"{mine.get(head, 0):016x}, sent {theirs[head]:016x}"
                    )


def _digest_elements(x: torch.Tensor, seed: int, first_head: int, layer: int, which: int) -> list[int]:
    """Per head, the sum of hashes of x [tokens, heads, dim...] keyed by (layer, K/V, token, first_head + head,
    dim)."""
    device = x.device
    tokens, heads = x.shape[0], x.shape[1]
    dim = x.shape[2] if x.dim() == 3 else 1
    x = x.reshape(tokens, heads, dim)
    head = torch.arange(first_head, first_head + heads, device=device).view(1, heads, 1)
    d = torch.arange(dim, device=device).view(1, 1, dim)
    token = torch.arange(tokens, device=device).view(tokens, 1, 1)
    static = _mix(_mix(_mix(seed + 2 * layer + which) + head) + d)  # [1, H, D]
    h = _mix(_mix(static ^ _mix(token + _M2)) + _bits(x))
    return h.sum(dim=(0, 2)).tolist()


def digest_cache(cache: PagedKVCache, blocks: list[int], num_tokens: int, heads: range) -> KvDigest:
    """This rank's part of a request's digest: its `num_tokens` tokens in `blocks`, its cache holding global KV
    `heads` (`rank_mapping.heads_of_rank`)."""
    if num_tokens > len(blocks) * cache.block_size:
        raise ValueError(f"{num_tokens} tokens do not fit {len(blocks)} blocks of {cache.block_size}")
    values, scales = [0] * len(heads), [0] * len(heads)
    for layer, tensors in enumerate(cache.layers):
        index = torch.tensor(blocks, dtype=torch.long, device=tensors[0].device)
        for which, t in enumerate(tensors[:2]):
            x = t.index_select(0, index).flatten(0, 1)[:num_tokens]
            values = [a + b for a, b in zip(values, _digest_elements(x, _VALUE_SEED, heads.start, layer, which))]
        for which, s in enumerate(tensors[2:]):  # one scale per token, the same for each of the rank's heads
            x = s.index_select(0, index).flatten(0, 1)[:num_tokens, None].expand(-1, len(heads))
            scales = [a + b for a, b in zip(scales, _digest_elements(x, _SCALE_SEED, heads.start, layer, which))]
    return KvDigest(
        num_tokens,
        {h: v % _MOD for h, v in zip(heads, values)},
        {h: v % _MOD for h, v in zip(heads, scales)},
    )
