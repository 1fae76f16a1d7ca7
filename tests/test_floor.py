"""optimized.benchmarks.floor: the physical floors of the two seed budgets, computed by hand here and by the module.

Qwen3-235B-A22B: H=4096, 64 query / 4 KV heads of D=128, 128 experts, top-8, moe_intermediate I=1536,
vocab V=151936, 94 layers, all MoE.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.presets import preset_config
from fixtures.tiny import tiny_config
from optimized.benchmarks import floor as F
from optimized.benchmarks.budgets import budget_floor, load_budgets

Q235 = preset_config("Qwen3-235B-A22B")
MX8, MX4 = 1 + 1 / 32, 0.5 + 1 / 32  # bytes per element incl. one E8M0 scale byte per 32


def test_a3_bf16_decode_floor_tp16_by_hand():
    # One die = one rank of TP 16 (attention, MoE, embedding, lm_head); the 4 KV heads replicate: 1 per rank.
    attn_proj = 4096 * 4 * 128 + 2 * 4096 * 1 * 128 + 4 * 128 * 4096  # q 4 heads, k+v 1 head, o = 5,242,880
    attention = 94 * (attn_proj * 2 + (2 * 128 + 2 * 4096) * 2)  # + q/k norms, 2 layer norms
    assert attention == 94 * 10_502_656 == 987_249_664
    router = 94 * 128 * 4096 * 2  # 98,566,144
    experts = 94 * 8 * 3 * 4096 * (1536 // 16) * 2  # top-8, 1/16 of each: 1,774,190,592
    lm_head = (151936 // 16 * 4096 + 4096 + 1 * 4096) * 2  # shard + final norm + 1 row: 77,807,616
    kv = 94 * 2 * 1 * 128 * 4096 * 2  # K and V at context 4096: 197,132,288
    total = attention + router + experts + lm_head + kv
    assert total == 3_134_946_304
    memory_s = total / 1.6e12  # 1.95934144 ms per die
    collectives = 94 * 2 + 2  # per layer o_proj + MoE-TP all-reduce; embedding all-reduce; lm_head gather
    floor_s = memory_s + collectives * 5e-6  # 2.90934144 ms

    got = F.decode_floor(
        Q235,
        F.HARDWARE["atlas_a3"],
        "bf16",
        batch=1,
        context=4096,
        layout=F.Layout(attn_tp=16, moe_tp=16, moe_ep=1, embed_tp=16, lmhead_tp=16),
    )
    b = got["bytes"]
    assert (b["attention"], b["router"], b["experts"], b["lm_head_norm_embedding"], b["kv_cache"]) == (
        attention,
        router,
        experts,
        lm_head,
        kv,
    )
    assert b["total"] == total and got["collectives"] == 190
    assert got["floor_s"] == pytest.approx(floor_s, rel=1e-12) and floor_s == pytest.approx(2.90934144e-3)


def test_950pr_w4a8_decode_floor_tp4_ep4_by_hand():
    # Attention TP 4 (16 query heads, 1 KV head per rank) in MXFP8; MoE EP 4: the 8 routed experts of one
    # token spread over 4 ranks at best, 2 per rank, MXFP4; router, norms, lm_head in BF16; the per-token FP8 KV
    # cache: 1 byte per element and one fp32 scale per token for K and for V (this rank's 1 KV head).
    attn_proj = 4096 * 16 * 128 + 2 * 4096 * 128 + 16 * 128 * 4096  # 17,825,792
    attention = 94 * (attn_proj * MX8 + 8448 * 2)  # 94 * 18,399,744
    assert attention == 1_729_575_936
    router = 94 * 128 * 4096 * 2  # 98,566,144
    experts = 94 * (8 / 4) * 3 * 4096 * 1536 * MX4  # 94 * 20,054,016 = 1,885,077,504
    lm_head = (151936 // 4 * 4096 + 4096 + 4096) * 2  # 311,181,312
    kv = 94 * (2 * 1 * 128 * 1 + 2 * 4) * 4096  # 101,646,336 (BF16: 197,132,288)
    total = attention + router + experts + lm_head + kv
    assert total == 4_126_047_232
    floor_s = total / 1.6e12 + (94 * 2 + 2) * 5e-6  # 2.57877952 + 0.95 = 3.52877952 ms

    got = F.decode_floor(
        Q235,
        F.HARDWARE["atlas_950pr"],
        "w4a8",
        batch=1,
        context=4096,
        layout=F.Layout(attn_tp=4, moe_tp=1, moe_ep=4, embed_tp=4, lmhead_tp=4),
    )
    assert got["bytes"]["total"] == pytest.approx(total, rel=1e-12) and got["collectives"] == 190
    assert got["bytes"]["experts"] == pytest.approx(experts, rel=1e-12)
    assert got["bytes"]["kv_cache"] == kv
    assert got["floor_s"] == pytest.approx(floor_s, rel=1e-12) and floor_s == pytest.approx(3.52877952e-3)


def test_950pr_w4a8_prefill_floor_sp_ep4_4k_by_hand():
    S = 4096  # one 4K prompt; SP: each rank owns S/4 = 1024 tokens
    # FLOPs per rank. QKV on all S tokens for the rank's 16 + 2*1 heads; o_proj replicated on own tokens
    # (= 2 * S * 16 * 128 * H); router on own tokens; experts: S*8/4 = 8192 rows, 3 GEMMs of H x I.
    qkv = 2 * S * 4096 * (16 + 2) * 128  # 77,309,411,328
    o_proj = 2 * (S // 4) * 64 * 128 * 4096  # 68,719,476,736
    router = 2 * (S // 4) * 4096 * 128  # 1,073,741,824
    experts = 2 * 3 * (S * 8 // 4) * 4096 * 1536  # 309,237,645,312
    lm_head = 2 * 4096 * 151936 // 4  # last token only: 311,164,928
    linear = 94 * (qkv + o_proj + router + experts) + lm_head
    assert linear == 42_896_297_033_728
    attention = 94 * 2 * 2 * 128 * 16 * (S * (S + 1) // 2)  # causal pairs 8,390,656 per head
    assert attention == 6_461_207_871_488
    compute_s = linear / 1e15 + attention / 1e15  # MXFP8 rate 1 PFLOPS (bf16 taken <= it): 49.3575 ms
    # Bytes per rank: attention weights (o_proj whole under SP), all 32 local experts (a 4K prompt hits
    # every expert: 32 * (1 - (15/16)^4096) = 32 up to 1e-100), router, lm_head shard + norm + S embedding
    # rows, KV cache written.
    hbm = (
        94 * ((4096 * 16 * 128 + 2 * 4096 * 128 + 64 * 128 * 4096) * MX8 + 8448 * 2)
        + 94 * 128 * 4096 * 2
        + 94 * 32 * 3 * 4096 * 1536 * MX4
        + (151936 // 4 * 4096 + 4096 + S * 4096) * 2
        + 94 * (2 * 128 + 2 * 4) * S
    )  # FP8 K/V + fp32 scale per token
    assert hbm == 34_875_268_096  # 21.797 ms at 1.6 TB/s
    # Bytes each rank sends: hidden all-gather before QKV (MXFP8) and all-to-all after attention (MXFP8),
    # MoE all-gather of hidden (MXFP8) + top-8 ids and weights (4 + 4 B), reduce-scatter of the expert output
    # (BF16), embedding all-reduce of own tokens (ring: 2 * 3/4), lm_head gather of the last logits.
    comm = (
        94 * 3 / 4 * S * 4096 * MX8
        + 94 * 3 / 4 * S * 16 * 128 * MX8
        + 94 * 3 / 4 * S * (4096 * MX8 + 8 * 8)
        + 94 * 3 / 4 * S * 4096 * 2
        + 2 * 3 / 4 * (S // 4) * 4096 * 2
        + 3 / 4 * 151936 * 2
    )
    assert comm == 5_446_269_504  # 2.723 ms at 2 TB/s
    floor_s = max(compute_s, hbm / 1.6e12) + comm / 2e12  # 52.0806 ms

    got = F.prefill_floor(
        Q235,
        F.HARDWARE["atlas_950pr"],
        "w4a8",
        [S],
        F.Layout(attn_tp=4, moe_tp=1, moe_ep=4, embed_tp=4, lmhead_tp=4),
        sp=True,
    )
    assert got["flops"]["linear_total"] == pytest.approx(linear, rel=1e-12)
    assert got["flops"]["attention"] == pytest.approx(attention, rel=1e-12)
    assert got["bytes"]["total"] == pytest.approx(hbm, rel=1e-12)
    assert got["comm_bytes"]["total"] == pytest.approx(comm, rel=1e-12)
    assert got["floor_s"] == pytest.approx(floor_s, rel=1e-12) and floor_s == pytest.approx(52.0806397e-3)


def test_seed_budgets_floor_at_their_layout_and_mean_context():
    budgets = load_budgets()
    a3 = budgets["a3_235b_bf16_decode"]
    # decode steps 1..32 after a 4096 prompt: mean context 4096 + 33/2
    assert budget_floor(a3, "decode") == F.decode_floor(
        Q235, F.HARDWARE["atlas_a3"], "bf16", 1, 4096 + 16.5, F.Layout(16, 16, 1, 16, 16)
    )
    pr = budgets["atlas950pr_235b_w4a8"]
    assert budget_floor(pr, "prefill")["floor_s"] == pytest.approx(52.0806397e-3)
    assert budget_floor(pr, "decode", collective_latency=20e-6)["collective_s"] == pytest.approx(190 * 20e-6)


def test_one_rank_decode_bytes_are_the_bench_formula():
    # What `python -m optimized bench` printed before the floor moved here (tiny: H 64, 8/2 heads of 16,
    # 16 experts top-4 of I 32, vocab 512, 2 layers), fp32, batch 1, context 10.
    c = tiny_config("tiny")
    by_hand = 4 * (
        2 * (64 * 8 * 16 + 2 * 64 * 2 * 16 + 8 * 16 * 64 + 2 * 16 + 2 * 64)
        + 2 * 16 * 64
        + 2 * 4 * 3 * 64 * 32
        + 512 * 64
        + 64
        + 64
        + 2 * 2 * 2 * 16 * 10
    )
    b = F.decode_bytes(c, torch.float32, 1, 10)
    assert b["total"] == by_hand and b["active_experts_per_layer"] == 4
    # batch 3 hits 16 * (1 - (12/16)^3) = 9.25 experts per layer in expectation
    assert F.decode_bytes(c, torch.bfloat16, 3, 10)["active_experts_per_layer"] == pytest.approx(9.25)


def test_decode_collectives_follow_the_layout():
    c = tiny_config("tiny-dense")  # 4 layers: dense (step), dense (mlp_only_layers), dense (step), sparse
    assert F.decode_collectives(c, F.Layout()) == 0
    # per sparse layer attn + moe_tp + moe_ep, per dense layer attn + moe_tp, + embedding + lm_head
    assert F.decode_collectives(c, F.Layout(2, 2, 2, 2, 4)) == 1 * 3 + 3 * 2 + 1 + 1


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown precision 'int3'; known: bf16, fp32, w4a8"):
        F.precision_of("int3")
