"""The MoE token exchanges: how tokens reach the experts of their EP rank and come back, named as in the recipe.

Interface (`MoeExchange`): `exchange(experts, x, topk_idx, topk_weight) -> [rows of x, H]`, the rows' combined
expert output weighted by `topk_weight`. The ids are the layer's expert slots (physical ids under expert load
balancing: `experts.local_experts` slots per EP rank), whatever logical expert each holds. `experts` is the
layer's `FusedMoEGMM` (this rank's experts), `x` the expert input as a payload: a tensor, or MXFP8 `MxRows` (data
+ scales) whose scale rows travel with their data rows (`map_rows`), so the quantized and 16-bit paths are the same
code. An exchange holds only sizes and process groups
(no module: a model keeps no reference cycle through it) and calls only `torch.ops.npu.*` and the collectives.

- `MoeInferTP` ("tp"): every rank holds the same tokens and routes them to its own experts only; the partial sums
  are all-reduced over MoE TP and EP.
- `MoeInferAG` ("allgather", SP prefill): rows, ids and weights all-gathered, `reduce_scatter` back.
- `MoeInferDoubleRouting` ("alltoall", SP prefill and DP prefill): uneven all_to_all to the experts' ranks and back.
- `MoeInferDispatchCombine` ("dispatch_combine", MC2 decode): each EP rank dispatches its share and the results are
  all-gathered; under attention DP (`own_rows`) each rank exchanges its own rows, padding masked, nothing gathered.

`build_exchange(name, config, groups)` builds one by name. Data flow and bytes: docs/parallel.md.
"""

from __future__ import annotations

import torch

from optimized.distributed import collectives as comm
from optimized.distributed.parallel_state import comm_name
from optimized.layers.quantization.mx_wire import MxRows, map_rows


def _rows_and_scale(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (x.data, x.scale) if isinstance(x, MxRows) else (x, None)


def _payload(data: torch.Tensor, scale: torch.Tensor | None):
    return data if scale is None else MxRows(data, scale)


def re_routing(x, counts: torch.Tensor):
    """npu_moe_re_routing of a payload into local-expert order -> (payload, permute_token_idx, expert_tokens).

    The kernel takes 16-bit or int8 tokens, never float8, so MXFP8 rows travel as the recipe moves them (spec
    npu_ops_moe.md §1, path C): the fp8 data as a bf16 view ([A, H/2], each bf16 a pair of fp8 bytes) and the
    scale bytes as per_token_scales ([A, H/32] uint8), both viewed back after; a bit-exact move either way.
    """
    data, scale = _rows_and_scale(x)
    if scale is None:
        permuted, _, idx, expert_tokens = torch.ops.npu.npu_moe_re_routing(data, counts)
        return permuted, idx, expert_tokens
    permuted, permuted_scale, idx, expert_tokens = torch.ops.npu.npu_moe_re_routing(
        data.view(torch.bfloat16), counts, per_token_scales=scale.flatten(1)
    )
    return MxRows(permuted.view(data.dtype), permuted_scale.view(scale.shape)), idx, expert_tokens


class MoeExchange:
    """Sizes and groups every exchange needs; subclasses implement `__call__`."""

    name = ""

    def __init__(self, num_experts: int, top_k: int, moe_tp, moe_ep):
        self.num_experts, self.top_k, self.moe_tp, self.moe_ep = num_experts, top_k, moe_tp, moe_ep

    def slots(self, experts) -> int:
        """The layer's physical expert slots: num_experts, plus the redundant ones under expert load balancing."""
        return experts.local_experts * self.moe_ep.size

    def init_routing(self, x, topk_idx: torch.Tensor, expert_range: list[int], slots: int):
        """npu_moe_init_routing_v2 over `expert_range` of `slots` experts; an MX payload's scale rows move with their
        data rows."""
        data, scale = _rows_and_scale(x)
        expanded_x, expanded_row_idx, tokens_per_expert, expanded_scale = torch.ops.npu.npu_moe_init_routing_v2(
            data,
            expert_idx=topk_idx,
            scale=scale,
            active_num=data.shape[0] * self.top_k,
            expert_num=slots,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=expert_range,
            quant_mode=-1,
        )
        return _payload(expanded_x, None if scale is None else expanded_scale), expanded_row_idx, tokens_per_expert

    @staticmethod
    def local_range(experts) -> list[int]:
        return [experts.first_expert, experts.first_expert + experts.local_experts]

    @staticmethod
    def finalize(expert_out, expanded_row_idx, topk_weight, export_for_source_row=None) -> torch.Tensor:
        # Slots routed to experts of other EP ranks carry -1 and contribute nothing (drop_pad_mode 2).
        return torch.ops.npu.npu_moe_finalize_routing(
            expert_out,
            skip1=None,
            skip2=None,
            bias=None,
            scales=topk_weight.to(expert_out.dtype),
            expanded_src_to_dst_row=expanded_row_idx,
            export_for_source_row=export_for_source_row,
            drop_pad_mode=2,
        )

    def __call__(self, experts, x, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MoeInferTP(MoeExchange):
    name = "tp"

    def __call__(self, experts, x, topk_idx, topk_weight):
        expanded_x, expanded_row_idx, tokens_per_expert = self.init_routing(
            x, topk_idx, self.local_range(experts), self.slots(experts)
        )
        out = self.finalize(experts(expanded_x, tokens_per_expert), expanded_row_idx, topk_weight)
        # Partial sums over this rank's intermediate slice (TP) and its experts (EP).
        return comm.all_reduce(comm.all_reduce(out, self.moe_tp.group), self.moe_ep.group)


class MoeInferAG(MoeExchange):
    name = "allgather"

    def __call__(self, experts, x, topk_idx, topk_weight):
        """Every rank holds n tokens (the same n on every rank) -> [n, H], its own tokens summed."""
        ep = self.moe_ep.group
        x_all = map_rows(x, lambda t: comm.all_gather(t, ep))  # [P*n, H] (+ scales)
        idx_all, weight_all = comm.all_gather(topk_idx, ep), comm.all_gather(topk_weight, ep)  # [P*n, K]
        expanded_x, expanded_row_idx, tokens_per_expert = self.init_routing(
            x_all, idx_all, self.local_range(experts), self.slots(experts)
        )
        out = self.finalize(experts(expanded_x, tokens_per_expert), expanded_row_idx, weight_all, idx_all)
        return comm.reduce_scatter(out, ep)  # this rank's partial sum of all


def split_sizes(sent: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
    """The all_to_all_v split sizes on the host (rows this rank sends to / receives from each rank) from the slot
    counts [P, L] it sends and receives: both stacked on the device and read in one device -> host transfer, the
    one host read of a double-routing exchange."""
    send, recv = torch.stack([sent.sum(1), received.sum(1)]).tolist()  # [2, P]: the one read
    return send, recv


class MoeInferDoubleRouting(MoeExchange):
    name = "alltoall"

    def __call__(self, experts, x, topk_idx, topk_weight):
        """Own tokens [n, H] routed over all experts, slots sent to the experts' ranks and back -> [n, H]."""
        ep, ranks, local = self.moe_ep.group, self.moe_ep.size, experts.local_experts
        expanded_x, expanded_row_idx, tokens_per_expert = self.init_routing(
            x, topk_idx, [0, self.slots(experts)], self.slots(experts)
        )
        # Counts [P*L]: how many slots each source rank sends to each of this rank's local experts.
        tokens_per_expert_group = comm.all_to_all_single(tokens_per_expert, ep)
        send, recv = split_sizes(tokens_per_expert.view(ranks, local), tokens_per_expert_group.view(ranks, local))
        gathered = map_rows(
            expanded_x, lambda t: comm.all_to_all_single(t, ep, output_split_sizes=recv, input_split_sizes=send)
        )
        if sum(recv):
            permuted, permute_token_idx, expert_tokens = re_routing(
                gathered, tokens_per_expert_group.view(ranks, local)
            )
            expert_out = experts(permuted, expert_tokens)
            expert_out = expert_out.index_select(0, torch.argsort(permute_token_idx))  # back to arrival order
        else:  # no slot for this rank's experts: skip them (the NPU kernels take no empty input, e.g. npu_swiglu)
            expert_out = topk_weight.new_zeros(0, experts.hidden_size, dtype=experts.activation_dtype)
        combined = comm.all_to_all_single(expert_out, ep, output_split_sizes=send, input_split_sizes=recv)
        return self.finalize(combined, expanded_row_idx, topk_weight)


class MoeInferDispatchCombine(MoeExchange):
    name = "dispatch_combine"

    def __init__(self, num_experts: int, top_k: int, moe_tp, moe_ep, mc2=None):
        """mc2: the MC2 operators' own EP group (`ParallelState.moe_ep_mc2`: moe_ep's ranks, its own HCCL window);
        the results' all_gather stays on moe_ep."""
        super().__init__(num_experts, top_k, moe_tp, moe_ep)
        self.group_name = comm_name((mc2 or moe_ep).group)  # what the MC2 operators take (HCCL name on NPU)

    def mc2_kwargs(self, x_active_mask, slots: int) -> dict:
        """The arguments dispatch and combine share, as the recipe passes them (no TP domain, no shared experts)."""
        return dict(
            group_ep=self.group_name,
            ep_world_size=self.moe_ep.size,
            ep_rank_id=self.moe_ep.rank,
            moe_expert_num=slots,
            x_active_mask=x_active_mask,
            global_bs=0,
            group_tp=self.group_name,
            tp_world_size=1,
            tp_rank_id=0,
            expert_shard_type=0,
            shared_expert_num=0,
            shared_expert_rank_num=0,
        )

    def __call__(self, experts, x, topk_idx, topk_weight):
        """Every rank's same B tokens [B, H]: EP rank r exchanges tokens [r*n, (r+1)*n), n = ceil(B / P) (past B:
        repeats of the last token, masked out by x_active_mask, never sent) -> [B, H] gathered."""
        if isinstance(x, MxRows):
            raise TypeError("moe_infer_dispatch_combine moves bf16 / fp32 rows (quant_mode 0); got MXFP8 rows")
        ep, tokens = self.moe_ep, x.shape[0]
        n = -(-tokens // ep.size)
        rows = torch.arange(ep.rank * n, (ep.rank + 1) * n, device=x.device)
        mask = None if n * ep.size == tokens else rows < tokens  # a True prefix
        rows = rows.clamp(max=tokens - 1)
        mine, ids, weights = x.index_select(0, rows), topk_idx.index_select(0, rows), topk_weight.index_select(0, rows)
        return comm.all_gather(self.dispatch_combine(experts, mine, ids, weights, mask), ep.group)[:tokens]

    def own_rows(self, active: int):
        """The exchange under attention DP: every rank holds its own n rows (the same n on every rank), the first
        `active` real and the rest padding, masked out by x_active_mask (never sent; they come back 0); no gather."""

        def exchange(experts, x, topk_idx, topk_weight):
            if isinstance(x, MxRows):
                raise TypeError("moe_infer_dispatch_combine moves bf16 / fp32 rows (quant_mode 0); got MXFP8 rows")
            n = x.shape[0]
            mask = None if active == n else torch.arange(n, device=x.device) < active  # a True prefix
            return self.dispatch_combine(experts, x, topk_idx, topk_weight, mask)

        return exchange

    def dispatch_combine(self, experts, mine, ids, weights, mask):
        """npu_moe_distribute_dispatch_v2 of this rank's rows [n, H] (the rows `mask` leaves out stay home), grouped
        matmul, npu_moe_distribute_combine_v2 -> [n, H]."""
        kwargs = self.mc2_kwargs(mask, self.slots(experts))
        expand_x, _, assist, tokens_per_expert, ep_recv_counts, tp_recv_counts = (
            torch.ops.npu.npu_moe_distribute_dispatch_v2(
                mine, expert_ids=ids, scales=None, quant_mode=0, comm_alg="fullmesh_v2", **kwargs
            )[:6]
        )
        expert_out = experts(expand_x, tokens_per_expert)  # rows past the counts: padding
        out = torch.ops.npu.npu_moe_distribute_combine_v2(
            expand_x=expert_out,
            expert_ids=ids,
            assist_info_for_combine=assist,
            ep_send_counts=ep_recv_counts,
            tp_send_counts=tp_recv_counts,
            expert_scales=weights.float(),
            comm_quant_mode=0,
            **kwargs,
        )
        return out


EXCHANGES = {cls.name: cls for cls in (MoeInferTP, MoeInferAG, MoeInferDoubleRouting, MoeInferDispatchCombine)}


def build_exchange(name: str, config, groups) -> MoeExchange:
    """The exchange `name` ('tp', 'allgather', 'alltoall', 'dispatch_combine') for this model config and rank's
    groups."""
    extra = {"mc2": getattr(groups, "moe_ep_mc2", None)} if name == MoeInferDispatchCombine.name else {}
    return EXCHANGES[name](config.num_experts, config.num_experts_per_tok, groups.moe_tp, groups.moe_ep, **extra)
