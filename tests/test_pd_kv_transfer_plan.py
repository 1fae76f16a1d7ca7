"""The KV transfer between differently sharded prefill and decode instances, without a network: the rank mapping
gives every decode rank exactly the KV heads it holds, each once (replicated heads sent by one rank); the byte ranges
carry a request's tokens (and FP8 scales) into the decode caches' blocks; the coordinate-keyed digest agrees between
the two sides however they shard, and catches a flipped byte and a token count off by one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from equivalence.support.kv_shards import MemmoveEngine, assert_holds, prefilled_pair, side_digest, transfer
from optimized.errors import UsageError
from optimized.pd.block_transfer import check_scales_transferable
from optimized.pd.digest import KvIntegrityError
from optimized.pd.rank_mapping import (
    AttentionLayout,
    HeadRun,
    decode_rank_sources,
    heads_of_rank,
    source_tp_ranks,
)

TP = st.sampled_from([1, 2, 4, 8])
KV_HEADS = st.sampled_from([1, 2, 4, 8])

# (prefill TP, decode TP, decode DP, KV heads): the shapes a deployment uses, and KV heads fewer than a TP
NAMED = [(1, 2, 1, 4), (2, 1, 1, 4), (2, 1, 2, 4), (4, 2, 1, 4), (4, 2, 1, 2), (4, 1, 1, 2), (2, 4, 1, 1), (8, 2, 2, 4)]


def check_plan(prefill_tp: int, decode_tp: int, decode_dp: int, heads: int) -> None:
    plan = decode_rank_sources(AttentionLayout(prefill_tp), AttentionLayout(decode_tp, decode_dp), heads)
    assert sorted(plan) == list(range(decode_tp * decode_dp))
    for rank, runs in plan.items():
        tp_rank = rank % decode_tp
        held = heads_of_rank(heads, decode_tp, tp_rank)
        received = [h for run in runs for h in range(run.head, run.head + run.count)]
        assert sorted(received) == list(held), f"decode rank {rank} holds {list(held)}, receives {received}"
        for run in runs:
            assert run.prefill_tp_rank in source_tp_ranks(prefill_tp, decode_tp, tp_rank)  # the recipe's sources
            sender = heads_of_rank(heads, prefill_tp, run.prefill_tp_rank)
            assert list(sender[run.src_head : run.src_head + run.count]) == list(range(run.head, run.head + run.count))
            assert list(held[run.dst_head : run.dst_head + run.count]) == list(range(run.head, run.head + run.count))


@pytest.mark.parametrize("prefill_tp,decode_tp,decode_dp,heads", NAMED)
def test_named_layouts_receive_exactly_their_heads(prefill_tp, decode_tp, decode_dp, heads):
    check_plan(prefill_tp, decode_tp, decode_dp, heads)


@given(prefill_tp=TP, decode_tp=TP, decode_dp=st.integers(1, 3), heads=KV_HEADS)
def test_every_decode_rank_receives_exactly_its_heads_once(prefill_tp, decode_tp, decode_dp, heads):
    check_plan(prefill_tp, decode_tp, decode_dp, heads)


def test_replicated_heads_are_sent_by_one_rank():
    # 2 KV heads over prefill TP 4: ranks 0, 1 hold head 0, ranks 2, 3 head 1; decode TP 1 takes each from one rank
    plan = decode_rank_sources(AttentionLayout(4), AttentionLayout(1), 2)
    assert plan == {0: (HeadRun(0, 0, 1, 0, 0), HeadRun(2, 1, 1, 0, 1))}


def test_wide_prefill_to_dp_decode():
    # the recipe's shape: prefill TP 2, decode TP 1 x DP 2: each decode rank takes half its heads from each prefill rank
    plan = decode_rank_sources(AttentionLayout(2), AttentionLayout(1, 2), 4)
    assert plan[0] == plan[1] == (HeadRun(0, 0, 2, 0, 0), HeadRun(1, 2, 2, 0, 2))


def test_layouts_that_do_not_divide_are_refused():
    with pytest.raises(UsageError, match="one must divide the other"):
        decode_rank_sources(AttentionLayout(2), AttentionLayout(3), 6)
    with pytest.raises(UsageError, match="num_key_value_heads=4"):
        decode_rank_sources(AttentionLayout(1), AttentionLayout(3), 4)  # 3 ranks cannot share 4 heads


DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@given(
    prefill_tp=st.sampled_from([1, 2, 4]),
    decode_tp=st.sampled_from([1, 2, 4]),
    heads=st.sampled_from([1, 2, 4]),
    tokens=st.integers(1, 40),
    block_size=st.sampled_from([1, 4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_transfer_lands_every_byte_and_the_digests_agree(prefill_tp, decode_tp, heads, tokens, block_size, dtype, seed):
    plan = decode_rank_sources(AttentionLayout(prefill_tp), AttentionLayout(decode_tp), heads)
    if dtype == torch.float8_e4m3fn and len({r.prefill_tp_rank for r in plan[0]}) > 1:
        with pytest.raises(UsageError, match="per-token scales differ"):
            check_scales_transferable(plan, quantized=True)
        return
    kv, prefill, prefill_blocks, decode, decode_blocks = prefilled_pair(
        prefill_tp, decode_tp, heads, tokens, block_size, dtype, seed, num_blocks=-(-40 // block_size) + 1
    )
    transfer(prefill, prefill_blocks, decode, decode_blocks, tokens, heads, MemmoveEngine())
    assert_holds(decode, decode_blocks, kv, prefill_tp, heads)
    sent = side_digest(prefill, prefill_blocks, tokens, heads)
    side_digest(decode, decode_blocks, tokens, heads).check_against(sent)


BF16, FP8 = DTYPES
# FP8 from a wider prefill only where each decode rank's heads come from one prefill rank (replicated heads)
FLIP_CASES = [(1, 2, 4, BF16), (2, 1, 4, BF16), (4, 2, 2, BF16), (1, 2, 4, FP8), (4, 2, 2, FP8), (2, 2, 1, FP8)]


@pytest.mark.parametrize("prefill_tp,decode_tp,heads,dtype", FLIP_CASES)
def test_digest_catches_one_flipped_byte(prefill_tp, decode_tp, heads, dtype):
    tokens, block_size = 13, 4
    kv, prefill, prefill_blocks, decode, decode_blocks = prefilled_pair(
        prefill_tp, decode_tp, heads, tokens, block_size, dtype, seed=7
    )
    transfer(prefill, prefill_blocks, decode, decode_blocks, tokens, heads, MemmoveEngine())
    sent = side_digest(prefill, prefill_blocks, tokens, heads)
    side_digest(decode, decode_blocks, tokens, heads).check_against(sent)
    # one byte of one block, in the last layer's V of the last decode rank, the block's last token used
    v = decode[-1].layers[-1][1]
    v.view(torch.uint8)[decode_blocks[-1][-1], (tokens - 1) % block_size, 0, 0] ^= 0x10
    # a replicated head's corrupted copy is caught by its replica, the others by the prefill side's digest
    with pytest.raises(KvIntegrityError, match=r"values digest mismatch|replicas of KV head \d+ disagree \(values\)"):
        side_digest(decode, decode_blocks, tokens, heads).check_against(sent)


def test_digest_catches_one_flipped_scale_byte():
    tokens, block_size, heads = 9, 4, 4
    kv, prefill, prefill_blocks, decode, decode_blocks = prefilled_pair(1, 2, heads, tokens, block_size, FP8, 3)
    transfer(prefill, prefill_blocks, decode, decode_blocks, tokens, heads, MemmoveEngine())
    sent = side_digest(prefill, prefill_blocks, tokens, heads)
    decode[0].layers[0][2].view(torch.uint8)[decode_blocks[0][0], 0] ^= 0x01  # K scale, first token
    with pytest.raises(KvIntegrityError, match="scales digest mismatch"):
        side_digest(decode, decode_blocks, tokens, heads).check_against(sent)


@pytest.mark.parametrize("dtype", DTYPES)
def test_digest_catches_a_token_count_off_by_one(dtype):
    tokens, block_size, heads = 13, 4, 4
    kv, prefill, prefill_blocks, decode, decode_blocks = prefilled_pair(1, 2, heads, tokens, block_size, dtype, 11)
    sent = side_digest(prefill, prefill_blocks, tokens, heads)
    # the bytes of one token too few moved (a wrong byte length), both sides believing 13 tokens
    transfer(prefill, prefill_blocks, decode, decode_blocks, tokens - 1, heads, MemmoveEngine())
    with pytest.raises(KvIntegrityError, match="values digest mismatch for KV head 0 over 13 tokens"):
        side_digest(decode, decode_blocks, tokens, heads).check_against(sent)
    # every byte moved, but the decode side takes over one token fewer (or one more) than prefill sent
    transfer(prefill, prefill_blocks, decode, decode_blocks, tokens, heads, MemmoveEngine())
    side_digest(decode, decode_blocks, tokens, heads).check_against(sent)
    for taken in (tokens - 1, tokens + 1):
        with pytest.raises(KvIntegrityError, match=f"decode took over {taken} tokens of KV, prefill sent 13"):
            side_digest(decode, decode_blocks, taken, heads).check_against(sent)
    # the values differ too, not only the count the digest carries
    for taken in (tokens - 1, tokens + 1):
        assert side_digest(decode, decode_blocks, taken, heads).values != sent.values  # every head's
