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
- MoE: the expert input is quantized before the EP exchange and the block's own EP scheme moves it with its
  scales (`moe_infer_ag` / `moe_infer_double_routing` with `x_scale`: the recipe's moe_infer_ag_w4a8mx; the
  scale rows travel through init_routing / all_to_all / re_routing with their data rows) into the W4A8
  grouped matmul.

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

from optimized.distributed import collectives as comm
from optimized.config import head_dim_of
from optimized.ops import mx_format as mxf
from optimized.layers.attention import own_tokens_all_heads
from optimized.layers.quantization import BLOCK, FLOAT8_E4M3FN, W4A8, mx_quant, quant_scheme


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

    def __init__(self, sparse: bool):
        self.sparse = sparse

    def __call__(self, layer, hidden, residual, cos, sin, meta, kv_cache, atten_mask):
        xq, xs, residual = input_norm(layer.input_layernorm, hidden, residual)
        hidden = attention(layer.self_attn, xq, xs, cos, sin, meta, kv_cache, atten_mask)
        norm = layer.post_attention_layernorm
        router_in, expert_in, _, residual = torch.ops.npu.npu_add_rms_norm_cast(hidden, residual, norm.weight,
                                                                                norm.eps)
        out = self.moe(layer.mlp, router_in, expert_in) if self.sparse else layer.mlp(expert_in)
        return out, residual

    @staticmethod
    def moe(mlp, router_in: torch.Tensor, expert_in: torch.Tensor) -> torch.Tensor:
        """The block's EP scheme with the expert input quantized before the exchange: own tokens -> [n, H]."""
        topk_weight, topk_idx = mlp.route(router_in)
        xq, xs = mx_quant(expert_in)                  # travels as MXFP8 data + scales
        return mlp.infer_ep(xq, topk_idx, topk_weight, x_scale=xs)


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
    os_ = comm.all_to_all_single(mxf.unpair_scales(os_, blocks).contiguous(), group)
    oq = own_tokens_all_heads(oq, ranks, n)                                  # [n, Nq*D], heads in rank order
    os_ = mxf.pair_scales(own_tokens_all_heads(os_, ranks, n))              # [n, Nq*D/64, 2]
    o_proj = attn.o_proj_replicated
    return o_proj.quant_method.apply_quantized(o_proj, oq, os_)
