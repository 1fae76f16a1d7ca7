"""Paged KV cache: a pool of fixed-size blocks per layer, block tables and slot mappings per request.

Cache tensors are [num_blocks, block_size, kv_heads, head_dim] ("BnBsND"); attention reads them as
BnBsH. A float8_e4m3fn cache (the recipe's per-token FP8 KV cache) adds one float32 scale cache per K and V,
[num_blocks, block_size]: one de-quantization scale per token, written through the same slot mapping, so
a layer's cache is (k, v) or (k, v, k_scale, v_scale). Block 0 is the null block: padding entries of block tables point
at it and it is never handed
out, so a stray write to it cannot corrupt a request.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

NULL_BLOCK = 0
QUANTIZED_DTYPES = (torch.float8_e4m3fn,)
SCALE_BYTES = 4  # one float32 de-quantization scale per token, for K and for V


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one token occupies on one rank: K and V of every layer, plus their scales when quantized."""
    per_layer = 2 * kv_heads * head_dim * dtype.itemsize
    if dtype in QUANTIZED_DTYPES:
        per_layer += 2 * SCALE_BYTES
    return num_layers * per_layer


class BlockPool:
    """The host bookkeeping of a pool of `num_blocks` blocks (block 0, the null block, never handed out). Under
    attention DP every rank keeps one for every DP group (the scheduler's decisions must agree on every rank), and
    tensors only for its own group's (`PagedKVCache`).

    Prefix caching (optimized/executor/prefix_cache.py): a full block whose KV is computed may be registered under
    its hash (`cache`); requests holding it are counted (`share`, `release`), and when none holds it any more it
    stays findable (`cached_prefix`) until a block is needed and none is free: then the least recently released
    cached block is evicted (`take`). Free blocks (`free_blocks`) are the uncached ones and the evictable cached
    ones. Without registered blocks the pool hands out and takes back blocks as a plain free list."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out 1, 2, 3, ...
        self._refs: dict[int, int] = {}  # handed-out block -> requests holding it
        self._block_of: dict[bytes, int] = {}  # block hash -> the block holding that prefix's KV
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Blocks registered under a hash (held or evictable)."""
        return len(self._hash_of)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks for a request of up to `num_tokens` tokens."""
        needed = math.ceil(num_tokens / self.block_size)
        if needed > self.free_blocks:
            raise RuntimeError(
                f"KV cache out of blocks: a request of {num_tokens} tokens needs {needed} blocks of "
                f"{self.block_size}, {self.free_blocks} free of {self.num_blocks - 1}"
            )
        return self.take(needed)

    def take(self, count: int) -> list[int]:
        """`count` more blocks (a running request whose next token starts a new block): uncached ones first, then
        the least recently released cached ones, evicted (their hashes forgotten)."""
        if count > self.free_blocks:
            raise RuntimeError(
                f"KV cache out of blocks: {count} asked, {self.free_blocks} free of {self.num_blocks - 1}"
            )
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """A request gives its blocks back; one nobody holds any more is free, a cached one evictable (the request's
        last block first: a chain's tail goes before the head other prompts are likelier to share)."""
        for block in reversed(blocks):
            held = self._refs[block] - 1
            if held:
                self._refs[block] = held
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest run of `hashes` (a request's chain, from its first block) that are cached."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def evictable(self, blocks: list[int]) -> int:
        """How many of these cached blocks nobody holds (sharing them takes them out of the free count)."""
        return sum(block in self._evictable for block in blocks)

    def share(self, blocks: list[int]) -> None:
        """A request holds these cached blocks too."""
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a held block whose KV is (or is being) computed under its hash; a hash already cached keeps its
        block (this one stays a private copy, freed as uncached)."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash


class PagedKVCache(BlockPool):
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(num_blocks, block_size)
        self.dtype = dtype
        shape = (num_blocks, block_size, kv_heads, head_dim)

        def layer():
            kv = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            if dtype not in QUANTIZED_DTYPES:
                return kv
            scales = [torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device) for _ in range(2)]
            return kv + tuple(scales)

        self.layers = [layer() for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


def block_table(requests_blocks: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """[B, max_blocks] int32, each row padded with the null block."""
    width = max((len(blocks) for blocks in requests_blocks), default=0) or 1
    rows = [blocks + [NULL_BLOCK] * (width - len(blocks)) for blocks in requests_blocks]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(rows), width)  # [B, W], also for B 0


def slot_mapping(
    table: torch.Tensor, request_of_token: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of each token: block_table[b, pos // block_size] * block_size + pos % block_size."""
    blocks = table[request_of_token, positions // block_size].long()
    return blocks * block_size + positions % block_size
