"""Qwen3-MoE sparse block on the fused operators: router, routing, grouped-matmul experts, combine.

Parallelism: experts split across the MoE EP group (rank e holds experts [e*L, (e+1)*L)) and each
expert's intermediate dimension split across the MoE TP group. Three ways to bring tokens to experts,
named as in the recipe:
- `moe_infer_tp`: every rank sees the same tokens, routes them to its local experts only
  (`active_expert_range`), and the partial sums are all-reduced (decode, and prefill without SP);
- `moe_infer_ag` (sequence-parallel prefill): each EP rank holds its own tokens; hidden states, expert ids
  and weights are all-gathered, each rank computes its experts' share of every token, and
  `reduce_scatter` returns each rank the sums for its own tokens;
- `moe_infer_double_routing` (sequence-parallel prefill): each rank routes its own tokens over all
  experts, sends every expert slot to the rank holding the expert (all_to_all with uneven splits),
  re-routes them into local-expert order, and sends the results back to be combined.
The SP prefill's scheme is picked once, at build time (`ep_scheme`, see optimized/distributed/prefill_plan.py).
"""
from __future__ import annotations

import torch
from torch import nn

from optimized.distributed import collectives as comm
from optimized.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear, _split
from optimized.layers.quantization import linear_method, moe_method, quant_scheme


class FusedMoEGMM(nn.Module):
    """This rank's experts merged for grouped matmul; the quant method owns the weights (unquantized:
    w13 [L, H, 2*I_r] (gate | up), w2 [L, I_r, H]; W4A8: MXFP4 w13_weight / w2_weight with scales)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, moe_tp, moe_ep,
                 dtype: torch.dtype, quant_method=None):
        super().__init__()
        self.moe_tp, self.moe_ep = moe_tp, moe_ep
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
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

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, H] rows grouped by local expert, counts [L]; rows past the counts are padding. With
        `x_scale` x is already MXFP8 (its MX scales [M, H/64, 2]) and goes to the W4A8 matmul as it is."""
        if x_scale is not None:
            return self.quant_method.apply_quantized(self, x, x_scale, tokens_per_expert)
        return self.quant_method.apply(self, x, tokens_per_expert)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config, moe_tp, moe_ep, dtype: torch.dtype, ep_scheme: str | None = None):
        super().__init__()
        self.moe_tp, self.moe_ep = moe_tp, moe_ep
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # The router runs in float32 (as the NPU recipe does), whatever the activation dtype.
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, torch.float32)
        self.experts = FusedMoEGMM(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                   moe_tp, moe_ep, dtype, moe_method(quant_scheme(config)))
        # The sequence-parallel prefill's way to reach the experts, by method name (None: no SP prefill in this
        # layout); a name, not a bound method, so the block holds no reference cycle to itself.
        self.moe_infer_ep = {None: None, "allgather": "moe_infer_ag", "alltoall": "moe_infer_double_routing"}[ep_scheme]

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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weight, topk_idx = self.route(hidden)
        return self.moe_infer_tp(hidden, topk_idx, topk_weight)

    def moe_infer_tp(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        first = self.experts.first_expert
        expanded_x, expanded_row_idx, tokens_per_expert, _ = torch.ops.npu.npu_moe_init_routing_v2(
            hidden, expert_idx=topk_idx, active_num=tokens * self.top_k, expert_num=self.num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True,
            active_expert_range=[first, first + self.experts.local_experts], quant_mode=-1)
        expert_out = self.experts(expanded_x, tokens_per_expert)
        # Slots routed to experts of other EP ranks carry -1 and contribute nothing here.
        out = torch.ops.npu.npu_moe_finalize_routing(
            expert_out, skip1=None, skip2=None, bias=None, scales=topk_weight.to(expert_out.dtype),
            expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=None, drop_pad_mode=2)
        # Partial sums over this rank's intermediate slice (TP) and its experts (EP).
        return comm.all_reduce(comm.all_reduce(out, self.moe_tp.group), self.moe_ep.group)

    def forward_ep(self, hidden: torch.Tensor) -> torch.Tensor:
        """Sequence-parallel prefill: this EP rank's own tokens [n, H] -> their MoE output [n, H]."""
        topk_weight, topk_idx = self.route(hidden)
        return self.infer_ep(hidden, topk_idx, topk_weight)

    def infer_ep(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The SP prefill's EP scheme chosen at build time. `x_scale`: `hidden` is MXFP8 with these MX scales
        (the W4A8 prefill moves its expert input quantized; the scale rows travel with their data rows)."""
        return getattr(self, self.moe_infer_ep)(hidden, topk_idx, topk_weight, x_scale)

    def moe_infer_ag(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                     x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """AllGather / ReduceScatter EP: every rank holds n tokens (the same n on every rank)."""
        ep = self.moe_ep.group
        hidden_all = comm.all_gather(hidden, ep)                                  # [P*n, H]
        scale_all = None if x_scale is None else comm.all_gather(x_scale, ep)     # [P*n, H/64, 2]
        idx_all, weight_all = comm.all_gather(topk_idx, ep), comm.all_gather(topk_weight, ep)   # [P*n, K]
        first = self.experts.first_expert
        # With MX row scales (an fp8 x), init_routing moves each scale row with its data row (quant_mode -1).
        expanded_x, expanded_row_idx, tokens_per_expert, expanded_scale = torch.ops.npu.npu_moe_init_routing_v2(
            hidden_all, expert_idx=idx_all, scale=scale_all, active_num=hidden_all.shape[0] * self.top_k,
            expert_num=self.num_experts, expert_tokens_num_type=1, expert_tokens_num_flag=True,
            active_expert_range=[first, first + self.experts.local_experts], quant_mode=-1)
        expert_out = self.experts(expanded_x, tokens_per_expert, None if x_scale is None else expanded_scale)
        # Slots of other ranks' experts carry -1: this rank's partial sum of every token.
        out = torch.ops.npu.npu_moe_finalize_routing(
            expert_out, skip1=None, skip2=None, bias=None, scales=weight_all.to(expert_out.dtype),
            expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=idx_all, drop_pad_mode=2)
        return comm.reduce_scatter(out, ep)                                        # [n, H]: own tokens, summed

    def moe_infer_double_routing(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                                 x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """AlltoAll EP: route own tokens over all experts, dispatch slots to the experts' ranks, combine."""
        ep, ranks, local = self.moe_ep.group, self.moe_ep.size, self.experts.local_experts
        tokens = hidden.shape[0]
        expanded_x, expanded_row_idx, tokens_per_expert, expanded_scale = torch.ops.npu.npu_moe_init_routing_v2(
            hidden, expert_idx=topk_idx, scale=x_scale, active_num=tokens * self.top_k, expert_num=self.num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, self.num_experts],
            quant_mode=-1)                                                         # rows sorted by expert id
        # Counts [P*L]: how many slots each source rank sends to each of this rank's local experts.
        tokens_per_expert_group = comm.all_to_all_single(tokens_per_expert, ep)
        send = tokens_per_expert.view(ranks, local).sum(1).tolist()               # split sizes to the host
        recv = tokens_per_expert_group.view(ranks, local).sum(1).tolist()
        gathered = comm.all_to_all_single(expanded_x, ep, output_split_sizes=recv, input_split_sizes=send)
        gathered_scale = (None if x_scale is None else
                          comm.all_to_all_single(expanded_scale, ep, output_split_sizes=recv, input_split_sizes=send))
        permuted, permuted_scale, permute_token_idx, expert_tokens = torch.ops.npu.npu_moe_re_routing(
            gathered, tokens_per_expert_group.view(ranks, local), per_token_scales=gathered_scale)
        expert_out = self.experts(permuted, expert_tokens, None if x_scale is None else permuted_scale)
        expert_out = expert_out.index_select(0, torch.argsort(permute_token_idx))  # back to arrival order
        combined = comm.all_to_all_single(expert_out, ep, output_split_sizes=send, input_split_sizes=recv)
        return torch.ops.npu.npu_moe_finalize_routing(
            combined, skip1=None, skip2=None, bias=None, scales=topk_weight.to(combined.dtype),
            expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=None, drop_pad_mode=2)


class Qwen3MoeMLP(nn.Module):
    """Dense SwiGLU MLP (mlp_only_layers / decoder_sparse_step), tensor-parallel over the MoE TP group."""

    def __init__(self, config, moe_tp, dtype: torch.dtype):
        super().__init__()
        inter, scheme = config.intermediate_size, quant_scheme(config)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], moe_tp, dtype,
                                                       linear_method(scheme))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, moe_tp, dtype, linear_method(scheme))

    def load(self, source, prefix: str) -> None:
        self.gate_up_proj.load(source, [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"])
        self.down_proj.load(source, f"{prefix}.down_proj.weight")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.ops.npu.npu_swiglu(self.gate_up_proj(hidden)))
