"""Automatic prefix caching, host bookkeeping only (optimized/executor/prefix_cache.py, kv_cache.BlockPool,
scheduler.py): the block-hash chain, reference counts and least-recently-used eviction, admission over a cached
prefix, preemption giving blocks back as cached, and the config key."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.executor.kv_cache import BlockPool
from optimized.executor.prefix_cache import block_hashes
from optimized.executor.scheduler import Request, Scheduler

BLOCK = 4
IDENTITY = ("bfloat16", "none", "none")
IDENTITIES = [IDENTITY, ("float8_e4m3fn", "per-token-fp8", "none"), ("bfloat16", "none", "hadamard")]


def _chain(ids, identity=IDENTITY):
    return block_hashes(ids, BLOCK, identity, [])


# ---------------------------------------------------------------------------------------------- the hash chain


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**20), min_size=BLOCK, max_size=6 * BLOCK),
    tail=st.lists(st.integers(0, 2**20), max_size=3 * BLOCK),
    data=st.data(),
)
def test_same_prefix_same_chain_and_any_token_or_identity_change_a_different_one(ids, tail, data):
    chain = _chain(ids)
    assert len(chain) == len(ids) // BLOCK
    # the same tokens followed by anything: the same keys for the blocks they fill
    assert _chain(ids + tail)[: len(chain)] == chain
    # known hashes extended give the chain computed at once
    assert block_hashes(ids + tail, BLOCK, IDENTITY, chain) == _chain(ids + tail)
    # one token changed: every block from its block on has a new key (the chain carries it), none before
    at = data.draw(st.integers(0, len(chain) * BLOCK - 1), "changed position")
    changed = list(ids)
    changed[at] = data.draw(st.integers(0, 2**20).filter(lambda t: t != ids[at]), "new token")
    other = _chain(changed)
    first = at // BLOCK
    assert other[:first] == chain[:first]
    assert all(a != b for a, b in zip(other[first:], chain[first:])), f"token {at} changed, a later key did not"
    # the cache's identity (KV dtype, KV quantization, rotation): every key differs
    identity = data.draw(st.sampled_from(IDENTITIES[1:]), "identity")
    assert all(a != b for a, b in zip(_chain(ids, identity), chain))


def test_a_key_depends_on_the_parent_not_only_on_its_own_tokens():
    """Two prompts whose second blocks hold the same tokens after different first blocks."""
    a, b = _chain([1, 2, 3, 4, 9, 9, 9, 9]), _chain([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]


# ---------------------------------------------------------------------------------------------- the pool


def test_reference_counts_and_least_recently_used_eviction():
    pool = BlockPool(5, BLOCK)  # blocks 1..4
    a = pool.take(2)
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    assert pool.cached_prefix([b"h0", b"h1", b"h2"]) == a and pool.cached_prefix([b"h1"]) == [a[1]]
    pool.share(a)  # a second request holds them
    pool.release(a)
    assert pool.free_blocks == 2 and pool.evictable(a) == 0, "a block still held became free"
    pool.release(a)
    assert pool.free_blocks == 4 and pool.evictable(a) == 2 and pool.cached_blocks == 2
    # uncached free blocks are handed out first; then the least recently released cached block (the chain's tail)
    assert sorted(pool.take(2)) == [3, 4]
    assert pool.take(1) == [a[1]] and pool.cached_prefix([b"h0", b"h1"]) == [a[0]]
    # sharing an evictable block takes it out of the free count
    pool.share([a[0]])
    assert pool.free_blocks == 0
    with pytest.raises(RuntimeError, match="out of blocks"):
        pool.take(1)


def test_a_hash_already_cached_keeps_its_block():
    pool = BlockPool(4, BLOCK)
    x, y = pool.take(2)
    pool.cache(x, b"h")
    pool.cache(y, b"h")  # the same prefix computed twice in one step: y stays a private copy
    pool.release([x, y])
    assert pool.cached_prefix([b"h"]) == [x] and pool.evictable([x, y]) == 1


# ---------------------------------------------------------------------------------------------- the scheduler


def _finish(s, pools, r):
    s.remove(r)
    s.cache_written(r, pools[r.dp_group])
    pools[r.dp_group].release(r.blocks)
    r.blocks = []


def test_admission_reuses_the_cached_full_blocks_and_computes_at_least_the_last_token():
    s, pool = Scheduler(3, 0, BLOCK, 9, prefix_identity=IDENTITY), BlockPool(10, BLOCK)
    a = Request("a", list(range(12)), 3)
    s.add(a)
    assert s.schedule([pool]).requests == (a,) and a.cached_tokens == 0
    a.tokens.append(100)
    # a prompt of exactly the three blocks a computed: two are reused, its last token is computed
    b = Request("b", list(range(12)), 3)
    c = Request("c", list(range(8)) + [7, 7, 7, 7, 7], 3)
    s.add(b)
    s.add(c)
    step = s.schedule([pool])
    assert step.kind == "prefill" and step.requests == (b, c)
    assert b.cached_tokens == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert c.cached_tokens == 8 and c.blocks[:2] == a.blocks[:2]
    assert (s.prefix_queries, s.prefix_hits) == (12 + 12 + 13, 16)
    for r in (a, b, c):
        r.tokens.append(1)
        _finish(s, [pool], r)
    assert pool.free_blocks == 9 and not pool._refs


def test_a_request_asking_for_prompt_logprobs_is_computed_whole_and_not_counted():
    s, pool = Scheduler(2, 0, BLOCK, 9, prefix_identity=IDENTITY), BlockPool(10, BLOCK)
    a = Request("a", list(range(12)), 3)
    s.add(a)
    s.schedule([pool])
    echo = Request("e", list(range(12)), 3, prompt_logprobs=True)
    s.add(echo)
    s.schedule([pool])
    assert echo.cached_tokens == 0 and set(echo.blocks).isdisjoint(a.blocks)
    assert (s.prefix_queries, s.prefix_hits) == (12, 0)


def test_a_preempted_request_gives_its_blocks_back_cached_and_is_recomputed_over_them():
    """Pool of 5 blocks; a, then b sharing a's first block; a grows until b is preempted: b's own full blocks go
    back cached (the shared one still held by a), and b's recompute reuses them."""
    s, pool = Scheduler(2, 0, BLOCK, 5, prefix_identity=IDENTITY), BlockPool(6, BLOCK)
    a = Request("a", [1, 2, 3, 4, 5], 10)
    s.add(a)
    s.schedule([pool])
    a.tokens.append(0)
    b = Request("b", [1, 2, 3, 4, 6, 6, 6, 6, 6], 6)  # budget 15: 4 blocks
    s.add(b)
    step = s.schedule([pool])
    assert step.requests == (b,) and b.cached_tokens == 4 and b.blocks[0] == a.blocks[0]
    b.tokens.append(0)
    preempted = []
    while not preempted:
        step = s.schedule([pool])
        assert step.kind == "decode"
        preempted = [r for r, _ in step.preempted]
        for r in step.requests:
            r.tokens.append(0)
    assert preempted == [b] and b.blocks == []
    assert pool._refs[a.blocks[0]] == 1, "the shared block's count is not a's alone"
    assert pool.cached_prefix(b.block_hashes) != [], "b's own full blocks were not kept cached"
    _finish(s, [pool], a)
    assert s.schedule([pool]).requests == (b,)
    assert b.cached_tokens >= 8 and pool.free_blocks == 5 - len(b.blocks)
    _finish(s, [pool], b)
    assert pool.free_blocks == 5 and not pool._refs


def test_the_config_key_is_a_boolean_off_by_default():
    from optimized.config import ConfigError, InferenceConfig

    assert InferenceConfig.from_dict({}).scheduler_config.enable_prefix_caching is False
    on = InferenceConfig.from_dict({"scheduler_config": {"enable_prefix_caching": True}})
    assert on.scheduler_config.enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        InferenceConfig.from_dict({"scheduler_config": {"enable_prefix_caching": "yes"}})
