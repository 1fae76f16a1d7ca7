"""The W4A8 sequence-parallel prefill with MXFP8 on the wire (spec mx_quant.md §9.2, the recipe's `prefill_opt`
with `gmm_quant_mode` w4a8mxfloat4): one decoder layer's prefill step, chosen once at build time.

Where the bf16 SP step gathers bf16 hidden states and lets each MXFP8 linear / W4A8 grouped matmul quantize
its own input, this step quantizes each activation once, on the rank that owns the tokens, and moves the
E4M3 data (as uint8) plus the E8M0 scale bytes: (1 + 1/32) bytes per element instead of 2.

- input layernorm: `npu_add_rms_norm_dynamic_mx_quant` (first layer `npu_rms_norm_dynamic_mx_quant`) ->
  this rank's MXFP8 tokens; all-gathered over attention TP; merged_qkv_proj consumes them unchanged;
- attention output: quantized once, all_to_all of data and scales, reordered to [own tokens, all heads]
  for the replicated o_proj;
- post-attention norm: `npu_add_rms_norm_cast` -> fp32 router input, bf16 expert input;
- MoE: the expert input is quantized before the EP exchange (allgather: all_gather of data + scales,
  `moe_infer_ag_w4a8mx`; alltoall: the scale rows travel through init_routing / all_to_all / re_routing
  with their data rows) and the W4A8 grouped matmul consumes them.

Every MX quantization here is per row and per 32-block along the last axis, so quantizing before a row
gather / exchange gives the same bytes as quantizing after it; the attention output's blocks stay inside
one rank's heads because each rank's width is a multiple of 32 (checked at build time). The quantization
points are therefore exactly those of the bf16 SP step (and of the fake-quant reference). What differs is
arithmetic only: the fused norms round once from the fp32 residual sum (as the Ascend 950 `npu_add_rms_norm`
does), and the router reads the post-attention norm's fp32 output.

The step holds no module (the layer is passed in), so a model keeps no reference cycle through it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..config import head_dim_of
from .quantization import BLOCK, FLOAT8_E4M3FN, W4A8, mx_quant, pair_view, quant_scheme


def uses_mx_prefill(config, parallel) -> bool:
    """True for a W4A8 checkpoint under the SP prefill; raises if the layout splits an MX block across ranks."""
    if quant_scheme(config) != W4A8 or not parallel.sp_prefill:
        return False
    width = config.num_attention_heads // parallel.attn_tp_size * head_dim_of(config)
    if width % BLOCK:
        raise ValueError(f"the W4A8 sequence-parallel prefill quantizes each rank's attention output "
                         f"(num_attention_heads / attn_tp_size * head_dim = {config.num_attention_heads} / "
                         f"{parallel.attn_tp_size} * {head_dim_of(config)} = {width}) in {BLOCK}-element MX blocks: "
                         f"it must be a multiple of {BLOCK}; choose another attn_tp_size or turn prefill_opt off")
    return True


class MxSpPrefillStep:
    """One decoder layer's SP prefill with MXFP8 communication; `sparse`: the layer's MLP is the MoE block."""

    def __init__(self, sparse: bool, ep_scheme: str):
        self.sparse = sparse
        self.moe = {"allgather": moe_ag_mx, "alltoall": moe_double_routing_mx}[ep_scheme]

    def __call__(self, layer, hidden, residual, cos, sin, meta, kv_cache, atten_mask):
        xq, xs, residual = input_norm(layer.input_layernorm, hidden, residual)
        hidden = attention(layer.self_attn, xq, xs, cos, sin, meta, kv_cache, atten_mask)
        norm = layer.post_attention_layernorm
        router_in, expert_in, _, residual = torch.ops.npu.npu_add_rms_norm_cast(hidden, residual, norm.weight,
                                                                                norm.eps)
        out = self.moe(layer.mlp, router_in, expert_in) if self.sparse else layer.mlp(expert_in)
        return out, residual


def input_norm(norm, hidden: torch.Tensor, residual: torch.Tensor | None):
    """(fp8 [n, H], scales [n, H/64, 2], new residual [n, H]) of this rank's tokens."""
    if residual is None:            # first layer: nothing to add yet
        xq, xs, _ = torch.ops.npu.npu_rms_norm_dynamic_mx_quant(hidden, norm.weight, epsilon=norm.eps,
                                                                dst_type=FLOAT8_E4M3FN)
        return xq, xs, hidden
    xq, residual, xs, _ = torch.ops.npu.npu_add_rms_norm_dynamic_mx_quant(hidden, residual, norm.weight,
                                                                          epsilon=norm.eps, dst_type=FLOAT8_E4M3FN)
    return xq, xs, residual


def attention(attn, xq: torch.Tensor, xs: torch.Tensor, cos, sin, meta, kv_cache, atten_mask) -> torch.Tensor:
    """`Qwen3MoeAttention.forward_sp` on this rank's MXFP8 tokens (xq [n, H], xs [n, H/64, 2]) -> [n, H] bf16."""
    group, ranks, n, tokens = attn.tp.group, attn.tp.size, xq.shape[0], meta.num_tokens
    qkv_proj = attn.merged_qkv_proj
    full_q, full_s = comm.all_gather(xq, group)[:tokens], comm.all_gather(xs, group)[:tokens]   # padding dropped
    q, k, v = attn.heads(qkv_proj.quant_method.apply_quantized(qkv_proj, full_q, full_s), cos, sin)
    out = attn.attention_prefill(q, k, v, meta, atten_mask)                  # [T, Nq_r, D] this rank's heads
    attn.kv_cache_update(k, v, meta, kv_cache)
    out = F.pad(out.reshape(tokens, -1), (0, 0, 0, ranks * n - tokens))     # [P*n, W_r]
    blocks = out.shape[1] // BLOCK                                           # whole blocks (uses_mx_prefill)
    oq, os_ = mx_quant(out)
    # Only the real scale bytes travel (the pair layout pads an odd block count with a zero byte).
    oq = comm.all_to_all_single(oq, group)                                   # block r: own tokens, rank r's heads
    os_ = comm.all_to_all_single(os_.view(ranks * n, -1)[:, :blocks].contiguous(), group)
    oq = oq.view(ranks, n, -1).transpose(0, 1).reshape(n, -1)               # [n, Nq*D], heads in rank order
    os_ = os_.view(ranks, n, blocks).transpose(0, 1).reshape(n, ranks * blocks)
    os_ = pair_view(F.pad(os_, (0, (ranks * blocks) % 2)))                   # [n, Nq*D/64, 2]
    o_proj = attn.o_proj_replicated
    return o_proj.quant_method.apply_quantized(o_proj, oq, os_)


def moe_ag_mx(mlp, router_in: torch.Tensor, expert_in: torch.Tensor) -> torch.Tensor:
    """`moe_infer_ag` with the tokens gathered in MXFP8 (the recipe's moe_infer_ag_w4a8mx): own tokens -> [n, H]."""
    topk_weight, topk_idx = mlp.route(router_in)
    ep, experts = mlp.moe_ep.group, mlp.experts
    xq, xs = mx_quant(expert_in)
    xq_all, xs_all = comm.all_gather(xq, ep), comm.all_gather(xs, ep)                        # [P*n, H], scales
    idx_all, weight_all = comm.all_gather(topk_idx, ep), comm.all_gather(topk_weight, ep)   # [P*n, K]
    first = experts.first_expert
    # An fp8 x with MX row scales: init_routing moves each scale row with its data row (quant_mode -1).
    expanded_x, expanded_row_idx, tokens_per_expert, expanded_scale = torch.ops.npu.npu_moe_init_routing_v2(
        xq_all, expert_idx=idx_all, scale=xs_all, active_num=xq_all.shape[0] * mlp.top_k,
        expert_num=mlp.num_experts, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[first, first + experts.local_experts], quant_mode=-1)
    expert_out = experts.quant_method.apply_quantized(experts, expanded_x, expanded_scale, tokens_per_expert)
    out = torch.ops.npu.npu_moe_finalize_routing(
        expert_out, skip1=None, skip2=None, bias=None, scales=weight_all.to(expert_out.dtype),
        expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=idx_all, drop_pad_mode=2)
    return comm.reduce_scatter(out, ep)                                                      # [n, H]


def moe_double_routing_mx(mlp, router_in: torch.Tensor, expert_in: torch.Tensor) -> torch.Tensor:
    """`moe_infer_double_routing` with the expert slots sent in MXFP8: own tokens -> [n, H]."""
    topk_weight, topk_idx = mlp.route(router_in)
    ep, ranks, experts = mlp.moe_ep.group, mlp.moe_ep.size, mlp.experts
    local, tokens = experts.local_experts, expert_in.shape[0]
    xq, xs = mx_quant(expert_in)
    expanded_x, expanded_row_idx, tokens_per_expert, expanded_scale = torch.ops.npu.npu_moe_init_routing_v2(
        xq, expert_idx=topk_idx, scale=xs, active_num=tokens * mlp.top_k, expert_num=mlp.num_experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, mlp.num_experts],
        quant_mode=-1)                                                               # rows sorted by expert id
    tokens_per_expert_group = comm.all_to_all_single(tokens_per_expert, ep)         # [P*L]
    send = tokens_per_expert.view(ranks, local).sum(1).tolist()
    recv = tokens_per_expert_group.view(ranks, local).sum(1).tolist()
    gathered = comm.all_to_all_single(expanded_x, ep, output_split_sizes=recv, input_split_sizes=send)
    gathered_scale = comm.all_to_all_single(expanded_scale, ep, output_split_sizes=recv, input_split_sizes=send)
    permuted, permuted_scale, permute_token_idx, expert_tokens = torch.ops.npu.npu_moe_re_routing(
        gathered, tokens_per_expert_group.view(ranks, local), per_token_scales=gathered_scale)
    expert_out = experts.quant_method.apply_quantized(experts, permuted, permuted_scale, expert_tokens)
    expert_out = expert_out.index_select(0, torch.argsort(permute_token_idx))        # back to arrival order
    combined = comm.all_to_all_single(expert_out, ep, output_split_sizes=send, input_split_sizes=recv)
    return torch.ops.npu.npu_moe_finalize_routing(
        combined, skip1=None, skip2=None, bias=None, scales=topk_weight.to(combined.dtype),
        expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=None, drop_pad_mode=2)
