"""The W4A8 optimized model, sharded over real gloo ranks, computes what the fake-quantized reference computes.

Checkpoint: the tiny fixtures converted by `python -m optimized convert --quant w4a8` (cached). Oracle:
`reference.fake_quant.load_fake_quant_model`: the plain reference with MX quantize-dequantize at the W4A8
points, written independently of the portable MX operators. Layouts at world 1, 2, 4: attention TP up to 4
(KV heads replicated at 4), expert parallel up to 4, vocab-parallel embedding / lm_head (MoE TP stays 1:
tiny's moe_intermediate_size 32 is one MX block, which MoE TP cannot split).

- MXFP8 linears: every rank's merged QKV output equals the reference's q/k/v projections of the same input
  bitwise; the row-parallel o_proj partial products sum (in fp32) to the reference o_proj within op.bfloat16.
- MoE block (W4A8 grouped matmul, fused SwiGLU + MXFP8): vs the fake-quant reference replaying its expert ids,
  within `layer.w4a8.bfloat16`; and at least 10x closer to it than to the BF16 reference (so it quantizes
  at the oracle's points, with the oracle's rules).
- Whole model, bf16 (tiny at world 1, tiny-dense with MXFP8 dense MLPs at 2, tiny-nonorm at 4; and the
  sequence-parallel prefill at world 2 and 4 with both MoE EP schemes, which for W4A8 moves MXFP8 on the wire,
  `MxSequenceParallelStep`, optimized/phases.py): prefill and
  decode logits vs the fake-quant reference replaying the optimized routing, within `model.w4a8.bfloat16`
  (a token may flip only where its router input difference can overturn its margin, `input_tie_margins`), and
  at least `min_separation` times closer to it than to the BF16 reference replaying the same routing; the
  cost of quantization itself against the BF16 reference (its own routing): logits cosine, rel_l2 and top-1
  agreement, bounded by `quant_cost.w4a8`; greedy tokens over 3 prompts agree with the fake-quant reference's
  greedy run (`model.w4a8.bfloat16` min_greedy), more than with the BF16 reference's.
"""

from __future__ import annotations

import pytest
import torch

from equivalence.support.compare import (
    assert_close,
    cosine,
    describe,
    rel_l2,
    token_agreement,
    tolerance,
    top1_agreement,
)
from equivalence.support.dist import get_pool
from equivalence.support.logits_runs import (
    _draw_forced,
    _generate_task,
    _logits_task,
    _moe_bf16_task,
    _reference_logits,
    assert_bf16_logits_match_replayed_reference,
)
from equivalence.support.parallel_support import routing_check, same_on_all_ranks
from equivalence.support.strategies import describe_layout, hidden_states, layout, sp_layout
from equivalence.support.w4a8_reference import (
    bf16_reference,
    fake_quant_reference,
)
from fixtures.checkpoints import w4a8_checkpoint
from fixtures.tiny import tiny_config
from optimized.distributed import ParallelState
from reference.fake_quant import quantize_activation
from reference.generate import greedy_generate

pytestmark = pytest.mark.distributed

CONFIG = tiny_config("tiny")
H = CONFIG.hidden_size
LAYOUTS = {
    1: layout(1),
    2: layout(2, attn_tp_size=2, embed_tp_size=2, lmhead_tp_size=2),
    4: layout(4, attn_tp_size=4, embed_tp_size=4, lmhead_tp_size=4),
}
# The W4A8 model under the sequence-parallel prefill (MXFP8 replicated o_proj, experts by EP token exchange).
SP_LAYOUTS = {
    "sp2-alltoall": (2, sp_layout(2, "alltoall", embed_tp_size=2, lmhead_tp_size=2), "tiny-nonorm"),
    "sp2-allgather": (2, sp_layout(2, "allgather"), "tiny-dense"),
    "sp4-alltoall": (4, sp_layout(4, "alltoall", embed_tp_size=4, lmhead_tp_size=4), "tiny"),
    "sp4-allgather": (4, sp_layout(4, "allgather"), "tiny"),
}


# ------------------------------------------------------------------------------------------- MXFP8 linears


@pytest.mark.parametrize("attn_tp", [1, 2, 4])
def test_mxfp8_attention_linears_equal_fake_quant_reference(attn_tp):
    from optimized.model_loader.build import load_model

    ref = fake_quant_reference("tiny").model.layers[1].self_attn
    g = torch.Generator().manual_seed(attn_tp)
    x = torch.randn(9, H, generator=g).bfloat16()
    o_in = torch.randn(9, CONFIG.num_attention_heads * CONFIG.head_dim, generator=g).bfloat16()
    partial_sum = torch.zeros(9, H, dtype=torch.float64)
    lay = layout(attn_tp, attn_tp_size=attn_tp)
    with torch.no_grad():
        q, k, v = ref.q_proj(x), ref.k_proj(x), ref.v_proj(x)
        want_o = torch.nn.functional.linear(
            quantize_activation(o_in).dequantize(torch.float64), ref.o_proj.weight.double()
        )
        for rank in range(attn_tp):
            state = ParallelState.build(rank=rank, create_groups=False, **lay)
            attn = load_model(w4a8_checkpoint("tiny"), parallel=state, dtype=torch.bfloat16).layers[1].self_attn
            proj = attn.merged_qkv_proj
            d, qh, kvh = CONFIG.head_dim, proj.q_heads, proj.kv_heads
            kv0 = (
                (rank * CONFIG.num_key_value_heads // attn_tp) * d
                if CONFIG.num_key_value_heads >= attn_tp
                else (rank * qh // (CONFIG.num_attention_heads // CONFIG.num_key_value_heads)) * d
            )
            kv = slice(kv0, kv0 + kvh * d)
            want = torch.cat([q[:, rank * qh * d : (rank + 1) * qh * d], k[:, kv], v[:, kv]], -1)
            got = proj(x)
            assert torch.equal(got, want), f"attn_tp {attn_tp} rank {rank}: merged QKV {describe(got, want)}"
            cols = slice(rank * qh * d, (rank + 1) * qh * d)
            partial_sum += attn.o_proj.quant_method.apply(attn.o_proj, o_in[:, cols]).double()
    assert_close(partial_sum, want_o, "op.bfloat16", f"attn_tp {attn_tp}: o_proj partial sums vs the reference")


# ----------------------------------------------------------------------------------------------- MoE block


@pytest.mark.parametrize("world", [1, 2, 4])
def test_w4a8_moe_block_equals_fake_quant_reference(world):
    lay = layout(world)  # expert parallel over all ranks
    path = str(w4a8_checkpoint("tiny"))
    near_tie = tolerance("router_tie.bfloat16").rtol
    for kind, seed, layer_idx in {
        1: [("random", 1, 0), ("identical", 2, 1), ("large", 3, 1)],
        2: [("random", 4, 1), ("two_distinct", 5, 0)],
        4: [("large", 6, 0)],
    }[world]:
        x = hidden_states(kind, seed, 37, H, torch.bfloat16)
        got = same_on_all_ranks(get_pool(world).run(_moe_bf16_task, path, lay, layer_idx, x, timeout=120), "w4a8 moe")
        block = fake_quant_reference("tiny").model.layers[layer_idx].mlp
        plain = bf16_reference("tiny").model.layers[layer_idx].mlp
        with torch.no_grad():
            stats = routing_check(block.route(x)[2], block.top_k, got["ids"], near_tie)
            want = block(x, expert_ids=got["ids"].long())
            unquantized = plain(x, expert_ids=got["ids"].long())
        what = (
            f"{describe_layout(lay)} {kind} layer {layer_idx}: {stats}; "
            f"vs fake-quant {describe(got['out'], want)}; "
            f"vs bf16 reference rel_l2 {rel_l2(got['out'], unquantized):.3e}"
        )
        print(what)
        assert stats.clear_flips == 0, what
        assert_close(got["out"], want, "layer.w4a8.bfloat16", what)
        separation = tolerance("layer.w4a8.bfloat16").min_separation
        assert rel_l2(got["out"], want) * separation < rel_l2(got["out"], unquantized), what


# ----------------------------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("case", [1, 2, 4, *SP_LAYOUTS])
def test_w4a8_logits_match_fake_quant_reference_and_quantization_cost_is_bounded(case):
    if case in SP_LAYOUTS:
        world, lay, name = SP_LAYOUTS[case]
    else:
        world, lay, name = case, LAYOUTS[case], {1: "tiny", 2: "tiny-dense", 4: "tiny-nonorm"}[case]
    path = str(w4a8_checkpoint(name))
    g = torch.Generator().manual_seed(world)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (17, 31, 5)[: world % 3 + 1]]
    forced = _draw_forced(world, len(prompts), 2)
    got = same_on_all_ranks(
        get_pool(world).run(_logits_task, path, lay, "bfloat16", prompts, forced, timeout=180), "w4a8 logits"
    )
    # vs the fake-quant reference replaying the routing (a flip excused only where the router input difference
    # can overturn the token's margin); vs the BF16 reference on its own: the cost of W4A8
    a, r, b, report = assert_bf16_logits_match_replayed_reference(
        got,
        name,
        prompts,
        forced,
        f"{describe_layout(lay)} {name} W4A8",
        replayed_ref=fake_quant_reference(name),
        own_ref=bf16_reference(name),
        tol="model.w4a8.bfloat16",
        near_tie="router_tie.float32",
        ties_from_router_inputs=True,
    )
    # separation: the BF16 reference replaying the same routing differs from the fake-quant one by W4A8 alone
    unquantized = torch.cat(
        [torch.cat(x) for x in _reference_logits(bf16_reference(name), prompts, forced, got["routes"], 1.0, [])]
    )
    separation = rel_l2(a, unquantized) / max(rel_l2(a, r), 1e-30)
    cost = tolerance("quant_cost.w4a8")
    report += (
        f"; vs BF16 reference: cosine {cosine(a, b):.5f}; vs BF16 replaying the routing rel_l2 "
        f"{rel_l2(a, unquantized):.3e}: {separation:.2f}x farther than the fake-quant reference"
    )
    print(report)
    assert separation >= tolerance("model.w4a8.bfloat16").min_separation, report
    assert cosine(a, b) >= cost.min_cosine and top1_agreement(a, b) >= cost.min_top1, report
    assert rel_l2(a, b) <= cost.max_rel_l2, report


def test_w4a8_greedy_generation_agreement_with_bf16_and_fake_quant_references():
    """16 greedy tokens for 3 prompts at world 2: agreement with the fake-quant reference's own greedy run
    (position by position) is at least `model.w4a8.bfloat16` min_greedy and above the agreement with the BF16
    reference's (which is reported)."""
    lay, n = LAYOUTS[2], 16
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, CONFIG.vocab_size, (k,), generator=g).tolist() for k in (6, 16, 23)]
    tokens = torch.tensor(
        same_on_all_ranks(
            get_pool(2).run(_generate_task, str(w4a8_checkpoint("tiny")), lay, "bfloat16", prompts, n, timeout=180),
            "w4a8 generation",
        )
    )
    fq = torch.stack([greedy_generate(fake_quant_reference("tiny"), torch.tensor([p]), n)[0] for p in prompts])
    bf = torch.stack([greedy_generate(bf16_reference("tiny"), torch.tensor([p]), n)[0] for p in prompts])

    def lead(x, y):  # tokens generated before the first disagreement, per prompt
        return [int((x[i] != y[i]).cumsum(0).eq(0).sum()) for i in range(len(prompts))]

    report = (
        f"W4A8 greedy agreement: with the fake-quant reference {token_agreement(tokens, fq):.4f} (leading "
        f"{lead(tokens, fq)}), with the BF16 reference {token_agreement(tokens, bf):.4f} (leading "
        f"{lead(tokens, bf)}) (fake-quant vs BF16 {token_agreement(fq, bf):.4f}, leading {lead(fq, bf)}); "
        f"tokens {tokens.tolist()} fq {fq.tolist()} bf {bf.tolist()}"
    )
    print(report)
    # the oracle: as close to the fake-quant reference's greedy run as measured, and closer than to BF16's
    assert token_agreement(tokens, fq) >= tolerance("model.w4a8.bfloat16").min_greedy, report
    assert token_agreement(tokens, fq) > token_agreement(tokens, bf), report
