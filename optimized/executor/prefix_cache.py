"""Automatic prefix caching: the key of a full KV block is a hash chain over the tokens before and in it.

`block_hashes(ids, block_size, identity, known)` extends `known` (a request's hashes so far) with one hash per full
block of `ids`: sha256 of the parent block's hash, the block's token ids and the cache's identity. Two requests get
the same hash for block i exactly when their first (i + 1) * block_size tokens are the same and their caches hold
the same kind of KV, so a block found by its hash holds the keys and values the request would compute itself.

`cache_identity(runner)` is that identity: the KV dtype, the KV quantization and whether the attention linears
rotate their input (W4A4's Hadamard rotation changes q/k/v, so K/V too). sha256 rather than Python's `hash`: the
same on every rank and process (every rank's scheduler must take the same decisions), and collision-free in
practice, so a hit never needs the tokens compared.
"""

from __future__ import annotations

import hashlib
import struct

from optimized.executor.kv_cache import QUANTIZED_DTYPES


def cache_identity(runner) -> tuple[str, ...]:
    """What, besides the tokens, decides the KV a block holds: (KV dtype, KV quantization, rotation)."""
    dtype = runner.kv_cache_dtype
    quantization = "per-token-fp8" if dtype in QUANTIZED_DTYPES else "none"
    rotated = any(getattr(m, "input_rotation", None) is not None for m in runner.model.modules())
    return (str(dtype).replace("torch.", ""), quantization, "hadamard" if rotated else "none")


def block_hash(parent: bytes | None, tokens, identity: tuple[str, ...]) -> bytes:
    """The key of one full block: its parent's key (None for the first block), its token ids, the identity."""
    h = hashlib.sha256()
    h.update(b"\x00" * 32 if parent is None else parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update("\x1f".join(identity).encode())
    return h.digest()


def block_hashes(ids: list[int], block_size: int, identity: tuple[str, ...], known: list[bytes]) -> list[bytes]:
    """The hash chain of every full block of `ids`: `known` (the chain of a shorter run of the same ids), extended."""
    chain = list(known)
    for i in range(len(chain), len(ids) // block_size):
        chain.append(block_hash(chain[-1] if chain else None, ids[i * block_size : (i + 1) * block_size], identity))
    return chain
