"""Qwen3-MoE sparse block on the fused operators: router, routing, grouped-matmul experts, combine.

Parallelism: experts split across the MoE EP group (rank e holds experts [e*L, (e+1)*L)) and each expert's
intermediate dimension split across the MoE TP group. How tokens reach the experts is the phase's token exchange
(`moe_infer_tp` / `moe_infer_ag` / `moe_infer_double_routing`, optimized/layers/exchange.py), chosen once at
build time by the model's phase strategies (optimized/phases.py) and passed in; the block itself names no layout.
"""
from __future__ import annotations

import torch
from torch import nn

from optimized.layers.exchange import MoeInferTP
from optimized.layers.force_eplb import BalancedRouting, EplbRows
from optimized.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear,
                                     RowParallelLinear, _split)
from optimized.layers.quantization import W4A8, MxFp8LinearMethod, linear_method, moe_method, quant_scheme
from optimized.ops.mx_format import scale_name


class FusedMoEGMM(nn.Module):
    """This rank's experts merged for grouped matmul; the quant method owns the weights (unquantized:
    w13 [L, H, 2*I_r] (gate | up), w2 [L, I_r, H]; W4A8: MXFP4, W8A8: MXFP8 w13_weight / w2_weight with scales)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, moe_tp, moe_ep,
                 dtype: torch.dtype, quant_method=None):
        super().__init__()
        self.moe_tp, self.moe_ep = moe_tp, moe_ep
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation_dtype = dtype
        self.local_experts = _split(num_experts, moe_ep.size, "num_experts")
        self.first_expert = moe_ep.rank * self.local_experts
        self.inter_per_rank = _split(intermediate_size, moe_tp.size, "moe_intermediate_size")
        self.quant_method = quant_method or moe_method(None)
        self.quant_method.create_weights(self, self.local_experts, hidden_size, self.inter_per_rank, dtype)

    def load(self, source, prefix: str) -> None:
        """Per-expert checkpoint tensors `{prefix}.E.{gate,up,down}_proj.weight`, this rank's slices only."""
        i_r = self.inter_per_rank
        cols = slice(self.moe_tp.rank * i_r, (self.moe_tp.rank + 1) * i_r)
        for local in range(self.local_experts):
            self.quant_method.load_expert(self, source, f"{prefix}.{self.first_expert + local}", local, cols)
        # The other EP ranks' experts are theirs to read: deliberately unused here, not unexpected.
        local_range = range(self.first_expert, self.first_expert + self.local_experts)
        for expert in set(range(self.num_experts)) - set(local_range):   # other EP ranks load these
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for tensor in self.quant_method.tensors:
                    source.skip(f"{prefix}.{expert}.{proj}.{tensor}")

    def forward(self, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] grouped by local expert (a tensor, or MxRows already MXFP8 for the W4A8 matmul), counts
        [L]; rows past the counts are padding."""
        return self.quant_method.apply(self, x, tokens_per_expert)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router and experts; the token exchange is the phase's (layers/exchange.py), tensor parallel by default."""

    exchanges_tokens = True

    def __init__(self, config, moe_tp, moe_ep, dtype: torch.dtype, force_eplb: bool = False):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # The router runs in float32 (as the NPU recipe does), whatever the activation dtype.
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, torch.float32)
        self.gate.router = True   # kept ND and contiguous when the weights go NZ (process_weights_after_loading)
        self.experts = FusedMoEGMM(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                   moe_tp, moe_ep, dtype, moe_method(quant_scheme(config)))
        self.moe_infer_tp = MoeInferTP(config.num_experts, config.num_experts_per_tok, moe_tp, moe_ep)
        # model_config.force_eplb: the recipe's balanced expert ids replace the top-k ids (layers/force_eplb.py).
        self.balanced = BalancedRouting(config.num_experts, config.num_experts_per_tok, moe_tp.size, moe_ep) \
            if force_eplb else None

    def load(self, source, prefix: str) -> None:
        self.gate.load(source, f"{prefix}.gate.weight")
        self.experts.load(source, f"{prefix}.experts")

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [T, K] (float32, renormalized if configured) and expert ids [T, K] int32."""
        router_logits = self.gate(hidden.float())                                       # [T, E]
        topk_weight, topk_idx, _ = torch.ops.npu.npu_moe_gating_top_k_softmax(router_logits, None, k=self.top_k)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weight, topk_idx.to(torch.int32)

    def forward(self, hidden, exchange=None, router_in: torch.Tensor | None = None,
                eplb_rows: EplbRows | None = None) -> torch.Tensor:
        """hidden: the expert input (a tensor or MxRows); router_in: what the router reads (default: hidden);
        eplb_rows: whose rows these are, for force_eplb (the phase step's; default every rank's same prefill rows)."""
        topk_weight, topk_idx = self.route(hidden if router_in is None else router_in)
        if self.balanced is not None:   # the gate's top-k weights stay, paired with the balanced ids
            topk_idx = self.balanced(topk_idx.shape[0], eplb_rows or EplbRows(decode=False), topk_idx.device)
        return (exchange or self.moe_infer_tp)(self.experts, hidden, topk_idx, topk_weight)


class Qwen3MoeMLP(nn.Module):
    """Dense SwiGLU MLP (mlp_only_layers / decoder_sparse_step), tensor-parallel over the MoE TP group.

    W4A8: each projection's format is the checkpoint's (a weight with its `weight_scale` partner is MXFP8, one
    without is 16-bit): the recipe's converter keeps a dense gate_proj 16-bit (its ignore pattern `mlp.gate` is a
    substring of `mlp.gate_proj`) beside MXFP8 up/down, and such a layer loads as it is, gate and up then as two
    column-parallel linears instead of the merged gate_up_proj."""

    exchanges_tokens = False

    def __init__(self, config, moe_tp, dtype: torch.dtype):
        super().__init__()
        inter, scheme = config.intermediate_size, quant_scheme(config)
        self.hidden_size, self.inter, self.moe_tp, self.dtype = config.hidden_size, inter, moe_tp, dtype
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], moe_tp, dtype,
                                                       linear_method(scheme))
        self.gate_proj = self.up_proj = None
        self.down_proj = RowParallelLinear(inter, config.hidden_size, moe_tp, dtype, linear_method(scheme))

    def load(self, source, prefix: str) -> None:
        gate, up, down = (f"{prefix}.{p}_proj.weight" for p in ("gate", "up", "down"))
        if isinstance(self.gate_up_proj.quant_method, MxFp8LinearMethod):
            mx = {name: source.has(scale_name(name)) for name in (gate, up, down)}
            device = self.down_proj.weight.device
            with torch.device(device):                 # rebuilt on the model's device, never a default one
                if mx[gate] != mx[up]:
                    self.gate_proj, self.up_proj = (
                        ColumnParallelLinear(self.hidden_size, self.inter, self.moe_tp, self.dtype,
                                             quant_method=linear_method(W4A8 if mx[n] else None)) for n in (gate, up))
                    self.gate_up_proj = None
                elif not mx[gate]:
                    self.gate_up_proj = MergedColumnParallelLinear(self.hidden_size, [self.inter, self.inter],
                                                                   self.moe_tp, self.dtype, linear_method(None))
                if not mx[down]:
                    self.down_proj = RowParallelLinear(self.inter, self.hidden_size, self.moe_tp, self.dtype,
                                                       linear_method(None))
        if self.gate_up_proj is not None:
            self.gate_up_proj.load(source, [gate, up])
        else:
            self.gate_proj.load(source, gate)
            self.up_proj.load(source, up)
        self.down_proj.load(source, down)

    def forward(self, hidden: torch.Tensor, exchange=None, router_in=None, eplb_rows=None) -> torch.Tensor:
        """A dense layer exchanges no tokens: `exchange`, `router_in` and `eplb_rows` (the MoE block's interface)
        are unused."""
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(hidden)                                      # [T, 2*I_r]
        else:
            gate_up = torch.cat([self.gate_proj(hidden), self.up_proj(hidden)], dim=-1)
        return self.down_proj(torch.ops.npu.npu_swiglu(gate_up))
