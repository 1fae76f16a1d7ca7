"""How a phase (prefill, decode) moves activations through the decoder layers: strategies chosen once at build time.

A phase owns the layer loop: `run(model, input_ids, cos, sin, meta, kv_caches)` takes this rank's packed ids [T] and
returns final-normed hidden states (TP and SP: [T, H] for every token; DP: this rank's rows), and `logits(...)` turns
them into logits. Its step says, for each piece of the decoder layer (`input_norm`, `attention`,
`post_attention_norm`, `moe` for the sparse block, `dense_mlp`), how the activations move between ranks; the decoder
layer (model.py) calls the step and names no layout.

- `TensorParallelPhase` / `TensorParallelStep`: every rank runs every token (decode; prefill without SP); the MoE
  through the block's own `moe_infer_tp` or, in decode with moe_tp 1 and EP > 1, MC2 dispatch / combine.
- `SequenceParallelPrefill` / `SequenceParallelStep` (`MxSequenceParallelStep`: W4A8, MXFP8 on the wire): rank r
  runs tokens [r*n, (r+1)*n), n = ceil(T / P); the padding is made and stripped in `run` alone.
- `DataParallelPhase` / `DataParallelStep`: attention data parallel, each rank its `ForwardMetadata.dp` rows.

`build_phases(config, groups, scheme)` returns (prefill, decode). Phases and steps hold only exchanges (sizes and
process groups), never a module: the model is passed to `run`. The layouts: docs/parallel.md.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F

from optimized.distributed import collectives as comm
from optimized.forward_metadata import rank_rows
from optimized.layers.exchange import build_exchange
from optimized.layers.force_eplb import EP_SPLIT, JOB, OWN, EplbRows
from optimized.layers.quantization.mx_layout import BLOCK
from optimized.layers.quantization.mx_wire import FLOAT8_E4M3FN, MxRows, map_rows, mx_quant, num_rows
from optimized.layers.quantization.schemes import MXFP8_WIRE
from optimized.ops import mx_format as mxf
from optimized.path_plan import DP, MC2, TP, PhasePaths


def own_tokens_all_heads(exchanged: torch.Tensor, ranks: int, n: int) -> torch.Tensor:
    """The SP all_to_all's output [P*n, W] (block r: this rank's n tokens, rank r's heads) -> [n, P*W], every
    token's columns in rank (head) order."""
    return exchanged.view(ranks, n, -1).transpose(0, 1).reshape(n, -1)


def heads_to_owners(out: torch.Tensor, group, ranks: int, n: int) -> torch.Tensor:
    """[P*n, W] (every token, this rank's heads) -> [n, P*W] (own tokens, every rank's heads)."""
    return own_tokens_all_heads(comm.all_to_all_single(out, group), ranks, n)


class TensorParallelStep:
    """Every rank holds every token: the layers' own tensor-parallel forward; the MoE goes through `exchange`
    (None: the MoE block's own moe_infer_tp)."""

    def __init__(self, exchange=None, decode: bool = False):
        self.exchange = exchange
        # force_eplb's rows: every rank holds every token; the MC2 decode dispatches them split over the EP ranks.
        self.eplb_rows = EplbRows(decode, JOB if exchange is None else EP_SPLIT)

    def input_norm(self, norm, hidden, residual):
        """-> (normed input, residual); the first layer has no residual to add yet."""
        if residual is None:
            return norm(hidden), hidden
        return norm(hidden, residual)

    def attention(self, attn, hidden, cos, sin, meta, kv_cache, atten_mask):
        return attn(hidden, cos, sin, meta, kv_cache, atten_mask)

    def post_attention_norm(self, norm, hidden, residual):
        """-> (router input, expert input, residual)."""
        hidden, residual = norm(hidden, residual)
        return hidden, hidden, residual

    def moe(self, block, router_in, expert_in):
        """The sparse MoE block: its tokens reach the experts through the step's exchange."""
        return block(expert_in, self.exchange, router_in, self.eplb_rows)

    def dense_mlp(self, mlp, hidden):
        """A dense MLP: tensor parallel over the rank's rows as they are, in every step (no token exchange)."""
        return mlp(hidden)


class SequenceParallelStep(TensorParallelStep):
    """This rank's n tokens: attention gathers the sequence, the MoE goes through the EP `exchange`."""

    def __init__(self, exchange):
        super().__init__(exchange)
        self.eplb_rows = EplbRows(decode=False, owner=OWN)

    def for_step(self, real: int) -> "SequenceParallelStep":
        """This forward's copy, knowing how many of this rank's rows are tokens (the tail rank's are padded)."""
        step = copy.copy(self)
        step.eplb_rows = replace(self.eplb_rows, real=real)
        return step

    def wire(self, x: torch.Tensor):
        """What an activation travels as: bf16 as it is."""
        return x

    def attention(self, attn, x, cos, sin, meta, kv_cache, atten_mask):
        """This rank's n packed tokens (rank r: [r*n, (r+1)*n), the tail padded) -> [n, H]; cos / sin and `meta`
        describe the T real tokens of the whole sequence."""
        group, ranks, n, tokens = attn.tp.group, attn.tp.size, num_rows(x), meta.num_tokens
        full = map_rows(x, lambda t: comm.all_gather(t, group)[:tokens])  # [T, H]: padding dropped here
        q, k, v = attn.qkv(full, cos, sin)
        out = attn.attention_prefill(q, k, v, meta, atten_mask)  # [T, Nq_r, D] this rank's heads
        attn.kv_cache_update(k, v, meta, kv_cache)
        out = F.pad(out.reshape(tokens, -1), (0, 0, 0, ranks * n - tokens))  # [P*n, Nq_r*D]
        return attn.o_proj_replicated(self.heads_to_owners(out, group, ranks, n))  # [n, H]

    def heads_to_owners(self, out: torch.Tensor, group, ranks: int, n: int):
        """`heads_to_owners` of the attention output as it travels (bf16: as it is)."""
        return heads_to_owners(out, group, ranks, n)

    def moe(self, block, router_in, expert_in):
        return block(self.wire(expert_in), self.exchange, router_in, self.eplb_rows)


class MxSequenceParallelStep(SequenceParallelStep):
    """The SP step with MXFP8 on the wire (a scheme whose `sp_wire` is MXFP8: W4A8)."""

    def wire(self, x: torch.Tensor) -> MxRows:
        return mx_quant(x)

    def input_norm(self, norm, hidden, residual):
        """-> (this rank's MXFP8 tokens, residual)."""
        if residual is None:
            xq, xs, _ = torch.ops.npu.npu_rms_norm_dynamic_mx_quant(
                hidden, norm.weight, epsilon=norm.eps, dst_type=FLOAT8_E4M3FN
            )
            return MxRows(xq, xs), hidden
        xq, residual, xs, _ = torch.ops.npu.npu_add_rms_norm_dynamic_mx_quant(
            hidden, residual, norm.weight, epsilon=norm.eps, dst_type=FLOAT8_E4M3FN
        )
        return MxRows(xq, xs), residual

    def heads_to_owners(self, out: torch.Tensor, group, ranks: int, n: int) -> MxRows:
        blocks = out.shape[1] // BLOCK  # whole blocks (the plan checked: path_plan.decide_paths)
        q = self.wire(out)
        # Only the real scale bytes travel (the pair layout pads an odd block count with a zero byte).
        rows = map_rows(
            MxRows(q.data, mxf.unpair_scales(q.scale, blocks).contiguous()),
            lambda t: heads_to_owners(t, group, ranks, n),
        )
        return MxRows(rows.data, mxf.pair_scales(rows.scale))  # [n, Nq*D], heads in rank order

    def post_attention_norm(self, norm, hidden, residual):
        router_in, expert_in, _, residual = torch.ops.npu.npu_add_rms_norm_cast(hidden, residual, norm.weight, norm.eps)
        return router_in, expert_in, residual


class DataParallelStep(TensorParallelStep):
    """Attention DP: this rank's `rows` of its DP group's tokens; attention over the group, MoE over every rank."""

    def __init__(self, exchange, masks_padding: bool, active: int = 0, real: int | None = None):
        # masks_padding: the exchange takes every row and masks the padding (MC2 `own_rows`); otherwise it is given
        # the real rows only (double routing). active: real rows of this rank in the step (`for_step`), an idle
        # group's dummy token included; real: without it (what EPLB's load counts; None: every row).
        self.exchange, self.masks_padding, self.active = exchange, masks_padding, active
        self.eplb_rows = EplbRows(decode=masks_padding, owner=OWN, real=real)

    def for_step(self, active: int, real: int) -> "DataParallelStep":
        """This step's copy, knowing its real rows (a new object per step: nothing mutable a graph would bake in)."""
        return DataParallelStep(self.exchange, self.masks_padding, active, real)

    def attention(self, attn, x, cos, sin, meta, kv_cache, atten_mask):
        """This rank's rows [n, H] -> [n, H]; cos / sin and `meta` describe the DP group's T real tokens."""
        tp, tokens = attn.tp, meta.num_tokens
        full = comm.all_gather(x, tp.group)[:tokens]  # [T, H]: the group's tokens
        q, k, v = attn.qkv(full, cos, sin)
        out = attn.attend(q, k, v, meta, kv_cache, atten_mask)
        out = F.pad(out.reshape(tokens, -1), (0, 0, 0, tp.size * x.shape[0] - tokens))  # [P*n, Nq_r*D]
        partial = attn.o_proj(out)  # row-parallel, built not to reduce: partial sums
        return comm.reduce_scatter(partial, tp.group)  # [n, H]: summed, own rows

    def moe(self, block, router_in, expert_in):
        if self.masks_padding:  # decode: MC2, padding masked
            return block(expert_in, self.exchange.own_rows(self.active), router_in, self.eplb_rows)
        # prefill: double routing of the real rows (at least one, so no kernel sees an empty input)
        real = max(self.active, 1)
        out = block(expert_in[:real], self.exchange, router_in[:real], self.eplb_rows)
        return F.pad(out, (0, 0, 0, expert_in.shape[0] - real))


class TensorParallelPhase:
    """Every rank runs every token: ids [T] -> final-normed hidden states [T, H]."""

    ep_scheme = None
    replicated_o_proj = False  # the layers build a replicated o_proj (the SP prefill's)
    reduces_o_proj = True  # the row-parallel o_proj sums its partial products itself (all_reduce)

    def __init__(self, step: TensorParallelStep | None = None):
        self.step = step or TensorParallelStep()

    def logits(self, model, hidden, logits_indices, meta) -> torch.Tensor:
        """Final-normed hidden states [T, H] -> logits [T, V] (or at `logits_indices` only)."""
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return model.lm_head(hidden)

    def run(self, model, input_ids, cos, sin, meta, kv_caches) -> torch.Tensor:
        hidden, residual = model.embed_tokens(input_ids), None  # [T, H]
        for layer, kv_cache in zip(model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache, model.atten_mask, self.step)
        return model.norm(hidden, residual)[0]


class SequenceParallelPrefill(TensorParallelPhase):
    """This rank runs its n = ceil(T / P) tokens: ids [T] -> final-normed hidden states [T, H] (gathered)."""

    replicated_o_proj = True

    def __init__(self, ep_scheme: str, step: SequenceParallelStep):
        self.ep_scheme, self.step = ep_scheme, step

    def run(self, model, input_ids, cos, sin, meta, kv_caches) -> torch.Tensor:
        sp, tokens = model.groups.attn_tp, input_ids.shape[0]
        n = -(-tokens // sp.size)
        ids = F.pad(input_ids, (0, n * sp.size - tokens))  # [P*n], padded with id 0
        mine = slice(sp.rank * n, (sp.rank + 1) * n)
        step = self.step.for_step(rank_rows(tokens, sp.rank, n))
        # A vocab-parallel lookup sums over its group, so every rank of that group looks up the same ids.
        hidden = model.embed_tokens(ids[mine]) if model.groups.embed_tp.size == 1 else model.embed_tokens(ids)[mine]
        residual = None  # [n, H] from here on
        for layer, kv_cache in zip(model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache, model.atten_mask, step)
        hidden, _ = model.norm(hidden, residual)
        return comm.all_gather(hidden, sp.group)[:tokens]  # padding rows stripped


class DataParallelPhase(TensorParallelPhase):
    """Attention DP: ids [T] of this rank's DP group -> its rows [n, H]; `logits` returns the DP group's."""

    reduces_o_proj = False  # the step reduce-scatters o_proj's partial sums to each rank's own rows

    def __init__(self, step: DataParallelStep):
        self.step = step

    def run(self, model, input_ids, cos, sin, meta, kv_caches) -> torch.Tensor:
        tp, dp = model.groups.attn_tp, meta.dp
        if dp is None:
            raise ValueError("attention DP needs ForwardMetadata.dp (every DP group's sizes; ModelRunner sets it)")
        n, tokens = dp.rows, input_ids.shape[0]
        step = self.step.for_step(dp.active(model.groups.dp_rank, tp.rank), dp.real(model.groups.dp_rank, tp.rank))
        ids = F.pad(input_ids, (0, n * tp.size - tokens))  # [P*n], padded with id 0
        mine = slice(tp.rank * n, (tp.rank + 1) * n)
        # The embedding group lies inside the DP group (config rule): its ranks look up the same ids.
        hidden = model.embed_tokens(ids[mine]) if model.groups.embed_tp.size == 1 else model.embed_tokens(ids)[mine]
        residual = None
        for layer, kv_cache in zip(model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache, model.atten_mask, step)
        return model.norm(hidden, residual)[0]  # [n, H] this rank's rows

    def logits(self, model, hidden, logits_indices, meta) -> torch.Tensor:
        """This rank's rows [n, H] -> logits [k, V] of its DP group's tokens at `logits_indices` (indices into the
        group's packed tokens; None: every token), the same on every rank of the group. As the recipe does: the rows
        are gathered over the attention TP group only, and each DP group samples its own requests (the runner shares
        the chosen ids, not logits)."""
        g, dp = model.groups, meta.dp
        tp, tokens = g.attn_tp, meta.num_tokens
        rows = comm.all_gather(hidden, tp.group)[:tokens] if tp.size > 1 else hidden[:tokens]  # [T, H]
        if logits_indices is not None:
            rows = rows[logits_indices]  # [k, H]
        lm = g.lmhead_tp
        if tp.size % lm.size == 0:  # the lm_head group lies inside the DP group (contiguous, nested): same rows
            return model.lm_head(rows)
        # A vocab-parallel lm_head spanning DP groups computes its members' rows together (each DP group's rows
        # once per member rank), then each rank keeps its own.
        first = g.rank - lm.rank
        sizes = [dp.picked((first + i) // tp.size) for i in range(lm.size)]  # host: every member's rows
        logits = model.lm_head(comm.all_gather(rows, lm.group, sizes=sizes))
        start = sum(sizes[: lm.rank])
        return logits[start : start + sizes[lm.rank]]


def build_phases(config, groups, paths: PhasePaths) -> tuple[TensorParallelPhase, TensorParallelPhase]:
    """(prefill, decode): the strategies of the paths the plan decided (optimized/path_plan.py), built once."""
    if paths.prefill == DP:
        # Attention DP runs the prefill data parallel too, as the recipe does (each DP group prefills its own
        # requests, split over its TP ranks); its MoE: double routing in prefill, MC2 in decode.
        prefill = DataParallelStep(build_exchange(paths.ep_scheme, config, groups), masks_padding=False)
        decode = DataParallelStep(build_exchange("dispatch_combine", config, groups), masks_padding=True)
        return DataParallelPhase(prefill), DataParallelPhase(decode)
    mc2 = build_exchange("dispatch_combine", config, groups) if paths.decode == MC2 else None
    decode = TensorParallelPhase(TensorParallelStep(mc2, decode=True))
    if paths.prefill == TP:
        return TensorParallelPhase(), decode
    step_class = MxSequenceParallelStep if paths.wire == MXFP8_WIRE else SequenceParallelStep
    return SequenceParallelPrefill(paths.ep_scheme, step_class(build_exchange(paths.ep_scheme, config, groups))), decode
