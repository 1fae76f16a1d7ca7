"""Qwen3-MoE sparse block on the fused operators: router, routing, grouped-matmul experts, combine.

Parallelism: experts split across the MoE EP group (rank e holds experts [e*L, (e+1)*L)) and each expert's
intermediate dimension split across the MoE TP group. With expert load balancing (parallel_config.enable_eplb) the
slots are physical: slot s holds the logical expert its `ExpertPlacement` names (optimized/layers/eplb/placement.py),
and routing's logical ids become physical ones before the exchange. How tokens reach the experts is the phase's
token exchange (`moe_infer_tp` / `moe_infer_ag` / `moe_infer_double_routing`, optimized/layers/exchange.py), chosen
once at build time by the model's phase strategies (optimized/phases.py) and passed in; the block names no layout.
"""

from __future__ import annotations

import torch
from torch import nn

from optimized.layers.eplb.placement import ExpertPlacement, to_physical
from optimized.layers.eplb.rearrange import rearrange_experts
from optimized.layers.exchange import MoeInferTP
from optimized.layers.force_eplb import OWN, BalancedRouting, EplbRows
from optimized.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    _split,
)
from optimized.layers.quantization.config import QuantConfig, moe_method
from optimized.ops import batch_invariant


class FusedMoEGMM(nn.Module):
    """This rank's experts merged for grouped matmul; the quant method owns the weights (unquantized:
    w13 [L, H, 2*I_r] (gate | up), w2 [L, I_r, H]; W4A8: MXFP4, W8A8: MXFP8 w13_weight / w2_weight with scales)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        moe_tp,
        moe_ep,
        dtype: torch.dtype,
        quant_method=None,
        placement: ExpertPlacement | None = None,
    ):
        """placement: the physical slots' logical experts (None: slot e holds expert e, no redundant slot)."""
        super().__init__()
        self.moe_tp, self.moe_ep = moe_tp, moe_ep
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation_dtype = dtype
        # local_experts / first_expert: this rank's physical slots (the exchanges' expert range)
        key = "num_experts + num_redundant_experts" if placement else "num_experts"
        self.local_experts = _split(placement.num_physical if placement else num_experts, moe_ep.size, key)
        self.placement = placement or ExpertPlacement(tuple(range(num_experts)), num_experts, moe_ep.size)
        self.first_expert = moe_ep.rank * self.local_experts
        self.inter_per_rank = _split(intermediate_size, moe_tp.size, "moe_intermediate_size")
        self.quant_method = quant_method or moe_method(None)
        self.quant_method.create_weights(self, self.local_experts, hidden_size, self.inter_per_rank, dtype)

    def load(self, source, prefix: str) -> None:
        """Per-expert checkpoint tensors `{prefix}.E.{gate,up,down}_proj.weight`, this rank's slices only."""
        i_r = self.inter_per_rank
        cols = slice(self.moe_tp.rank * i_r, (self.moe_tp.rank + 1) * i_r)
        mine = [self.placement.physical_to_logical[s] for s in self.placement.rank_slots(self.moe_ep.rank)]
        for local, expert in enumerate(mine):
            self.quant_method.load(self, source, f"{prefix}.{expert}", local, cols)
        # The other EP ranks' experts are theirs to read: deliberately unused here, not unexpected.
        for expert in set(range(self.num_experts)) - set(mine):  # other EP ranks load these
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for tensor in self.quant_method.tensors:
                    source.skip(f"{prefix}.{expert}.{proj}.{tensor}")

    def forward(self, x, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: rows [M, H] grouped by local expert (a tensor, or MxRows already MXFP8 for the W4A8 matmul), counts
        [L]; rows past the counts are padding."""
        return self.quant_method.apply(self, x, tokens_per_expert)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router and experts; the token exchange is the phase's (layers/exchange.py), tensor parallel by default."""

    def __init__(
        self,
        config,
        moe_tp,
        moe_ep,
        dtype: torch.dtype,
        force_eplb: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "mlp",
        placement: ExpertPlacement | None = None,
    ):
        """quant_config: the model's (parsed once); prefix: this block's checkpoint prefix (`model.layers.N.mlp`);
        placement: expert load balancing's initial placement (None: off, slot e holds expert e)."""
        super().__init__()
        quant = quant_config or QuantConfig.from_hf_config(config)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # The router runs in float32 (as the NPU recipe does), whatever the activation dtype.
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, torch.float32)
        self.gate.router = True  # kept ND and contiguous when the weights go NZ (process_weights_after_loading)
        self.experts = FusedMoEGMM(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            moe_tp,
            moe_ep,
            dtype,
            quant.moe_method(f"{prefix}.experts"),
            placement,
        )
        self.eplb = placement is not None
        if self.eplb:
            if force_eplb:
                raise ValueError("model_config.force_eplb replaces routing; it cannot be combined with enable_eplb")
            table, counts = placement.tables()
            # The replica rule's tables (one shape for every placement: rebalancing copies into them) and the routed
            # rows counted on the device: per logical expert and per physical slot.
            self.register_buffer("replica_table", table, persistent=False)
            self.register_buffer("replica_count", counts, persistent=False)
            self.register_buffer("expert_load", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
            self.register_buffer("slot_load", torch.zeros(placement.num_physical, dtype=torch.int64), persistent=False)
            # Rows every rank holds (not a rank's own) are counted once: on MoE TP rank 0 of MoE EP rank 0.
            self.counts_shared_rows = moe_tp.rank == 0 and moe_ep.rank == 0
        self.moe_infer_tp = MoeInferTP(config.num_experts, config.num_experts_per_tok, moe_tp, moe_ep)
        # model_config.force_eplb: the recipe's balanced expert ids replace the top-k ids (layers/force_eplb.py).
        self.balanced = (
            BalancedRouting(config.num_experts, config.num_experts_per_tok, moe_tp.size, moe_ep) if force_eplb else None
        )

    def load(self, source, prefix: str) -> None:
        self.gate.load(source, f"{prefix}.gate.weight")
        self.experts.load(source, f"{prefix}.experts")

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [T, K] (float32, renormalized if configured) and expert ids [T, K] int32."""
        router_logits = self.gate(hidden.float())  # [T, E]
        topk_weight, topk_idx, _ = torch.ops.npu.npu_moe_gating_top_k_softmax(router_logits, None, k=self.top_k)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (batch_invariant.sum_last(topk_weight) + 1e-20)
        return topk_weight, topk_idx.to(torch.int32)

    def forward_step(self, step, router_in, expert_in):
        """This block under a phase's step (optimized/phases.py): the step moves its tokens (`step.moe`)."""
        return step.moe(self, router_in, expert_in)

    def forward(
        self, hidden, exchange=None, router_in: torch.Tensor | None = None, eplb_rows: EplbRows | None = None
    ) -> torch.Tensor:
        """hidden: the expert input (a tensor or MxRows); router_in: what the router reads (default: hidden);
        eplb_rows: whose rows these are, for force_eplb (the phase step's; default every rank's same prefill rows)."""
        topk_weight, topk_idx = self.route(hidden if router_in is None else router_in)
        if self.balanced is not None:  # the gate's top-k weights stay, paired with the balanced ids
            topk_idx = self.balanced(topk_idx.shape[0], eplb_rows or EplbRows(decode=False), topk_idx.device)
        if self.eplb:  # logical ids -> physical slots; the weights stay the logical choices'
            topk_idx = self.to_physical(topk_idx, eplb_rows)
        return (exchange or self.moe_infer_tp)(self.experts, hidden, topk_idx, topk_weight)

    def apply_placement(self, placement: ExpertPlacement) -> int:
        """Move this layer's experts (weights and scales) to `placement` and route by it from the next call on; in
        lockstep on every rank of the MoE EP group, between steps. Returns the slots of this rank that changed."""
        changed = rearrange_experts(self.experts, placement)
        table, counts = placement.tables(self.replica_table.device)
        self.replica_table.copy_(table)
        self.replica_count.copy_(counts)
        return changed

    def to_physical(self, topk_idx: torch.Tensor, eplb_rows: EplbRows | None) -> torch.Tensor:
        """The replica rule (layers/eplb/placement.py), counting the routed rows on the device as it goes."""
        slots = to_physical(topk_idx, self.replica_table, self.replica_count)
        if (eplb_rows is not None and eplb_rows.owner == OWN) or self.counts_shared_rows:
            real = None if eplb_rows is None else eplb_rows.real  # padding rows route nowhere real: not counted
            experts, chosen = topk_idx[:real].flatten().long(), slots[:real].flatten().long()
            ones = torch.ones(experts.numel(), dtype=torch.int64, device=topk_idx.device)
            self.expert_load.index_add_(0, experts, ones)
            self.slot_load.index_add_(0, chosen, ones)
        return slots


class Qwen3MoeMLP(nn.Module):
    """Dense SwiGLU MLP (mlp_only_layers / decoder_sparse_step), tensor-parallel over the MoE TP group.

    Each projection's quant method is the model's QuantConfig's for its prefix: in a W4A8 / W8A8 checkpoint a dense
    gate_proj may be stored 16-bit beside MXFP8 up/down (the recipe's converter does so, config.py), and then gate
    and up are two column-parallel linears instead of the merged gate_up_proj, each in its own format."""

    def __init__(
        self, config, moe_tp, dtype: torch.dtype, quant_config: QuantConfig | None = None, prefix: str = "mlp"
    ):
        """quant_config: the model's (parsed once); prefix: this MLP's checkpoint prefix (`model.layers.N.mlp`)."""
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        quant = quant_config or QuantConfig.from_hf_config(config)
        gate, up, down = (quant.linear_method(f"{prefix}.{p}_proj") for p in ("gate", "up", "down"))
        self.gate_up_proj = self.gate_proj = self.up_proj = None
        if type(gate) is type(up):
            self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], moe_tp, dtype, gate)
        else:
            self.gate_proj = ColumnParallelLinear(hidden, inter, moe_tp, dtype, quant_method=gate)
            self.up_proj = ColumnParallelLinear(hidden, inter, moe_tp, dtype, quant_method=up)
        self.down_proj = RowParallelLinear(inter, hidden, moe_tp, dtype, down)

    def load(self, source, prefix: str) -> None:
        gate, up, down = (f"{prefix}.{p}_proj.weight" for p in ("gate", "up", "down"))
        if self.gate_up_proj is not None:
            self.gate_up_proj.load(source, [gate, up])
        else:
            self.gate_proj.load(source, gate)
            self.up_proj.load(source, up)
        self.down_proj.load(source, down)

    def forward_step(self, step, router_in, expert_in):
        """This MLP under a phase's step (optimized/phases.py): it exchanges no tokens (`step.dense_mlp`)."""
        return step.dense_mlp(self, expert_in)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(hidden)  # [T, 2*I_r]
        else:
            gate_up = torch.cat([self.gate_proj(hidden), self.up_proj(hidden)], dim=-1)
        return self.down_proj(torch.ops.npu.npu_swiglu(gate_up))
