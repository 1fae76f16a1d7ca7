"""Which path each phase takes: decided once, by `decide_paths`, from the layout, the model's config and the
checkpoint's quantization scheme; everything else reads the answer (`PhasePaths`).

The execution plan (optimized/executor/plan.py) holds it; `build_phases` builds the strategies it names; the model
keeps it (`model.paths`); the start-up block, the operator check and the benches read it. No other module decides
whether prefill runs sequence parallel, which EP scheme it uses, what travels on its wire, or whether decode runs MC2
(tests/test_path_plan.py keeps it so).

The rules (the recipe's):
- Attention DP (`attn_dp_size > 1`): each DP group prefills its own requests over its attention TP ranks, the MoE by
  double routing (alltoall) of each rank's own 16-bit rows; decode: MC2 on each rank's rows.
- Otherwise decode runs MC2 when the layout spreads the experts untensor-split over EP ranks
  (`ParallelConfig.mc2_decode`), else `moe_infer_tp`.
- Prefill runs sequence parallel when the layout asks for it (`ParallelConfig.sp_prefill`: prefill_opt or its
  default) and the checkpoint's scheme allows it (the table's `sp_prefill`: not W4A4, whose prefill_opt: true is
  refused naming the key); its EP scheme is moe_ep_scheme, or for `auto` allgather when top_k >= moe_ep_size, else
  alltoall; its activations travel as the scheme's `sp_wire` (MXFP8 for W4A8: each rank's attention width must be
  whole 32-element MX blocks), else in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimized.config import ParallelConfig, head_dim_of
from optimized.errors import UsageError
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.mx_layout import BLOCK
from optimized.layers.quantization.schemes import MXFP8_WIRE, QuantScheme, scheme_row

# Prefill paths
TP = "tensor_parallel"  # every rank runs every token; MoE EP by expert range + all_reduce
SP = "sequence_parallel"  # each rank runs ceil(T / P) tokens (Attention SP+TP), MoE through the EP exchange
DP = "data_parallel"  # attention DP: each DP group its own requests
# Decode paths: TP (moe_infer_tp), MC2 (dispatch / combine, results all-gathered), DP (MC2 on each rank's own rows)
MC2 = "mc2"
ALLGATHER, ALLTOALL = "allgather", "alltoall"  # the prefill's EP exchanges (alltoall: double routing)
WIRE_16_BIT = "16-bit"  # activations travel in the model dtype


class PathPlanError(UsageError, ValueError):
    """A layout the checkpoint's path cannot run (the keys named)."""


@dataclass(frozen=True)
class PhasePaths:
    """The decisions, as data. prefill: TP / SP / DP; ep_scheme: the prefill MoE's exchange (SP: allgather or
    alltoall; DP: alltoall; TP: None); wire: what the prefill's activations travel as between ranks (MXFP8_WIRE or
    WIRE_16_BIT; None for the TP prefill, which moves none); decode: TP / MC2 / DP; why: the reason for the prefill
    path and EP scheme, in words (for the start-up line)."""

    prefill: str
    ep_scheme: str | None
    wire: str | None
    decode: str
    why: str = ""

    @property
    def mc2(self) -> bool:
        """Decode dispatches through MC2 (with or without attention DP)."""
        return self.decode in (MC2, DP)


def decide_paths(hf_config, parallel: ParallelConfig, scheme: str | QuantScheme | None = None) -> PhasePaths:
    """The one decision of every phase's path (module docstring). scheme: the checkpoint's, already parsed (a name of
    the quantization table or its row; None: 16-bit). Raises QuantConfigError for prefill_opt: true with a scheme the
    SP prefill excludes, PathPlanError for an MXFP8 wire that would split an MX block across ranks."""
    row = scheme_row(scheme)
    if parallel.attn_dp_size > 1:
        # W4A8 / W8A8 run the same steps: rows travel 16-bit (spec npu_ops_moe.md §1: double routing scale=None,
        # dispatch quant_mode 0) and each MXFP8 linear / expert quantizes its own input per row.
        why = f"{parallel.attn_dp_size} DP groups x attention TP {parallel.attn_tp_size}"
        return PhasePaths(DP, ALLTOALL, WIRE_16_BIT, DP, why)
    decode = MC2 if parallel.mc2_decode else TP
    if not parallel.sp_prefill:
        return PhasePaths(TP, None, None, decode, f"prefill_opt {parallel.prefill_opt}")
    if not row.sp_prefill:
        if parallel.prefill_opt:
            raise QuantConfigError(
                f"parallel_config.prefill_opt: true is not supported with a {row.label} checkpoint (the recipe's "
                f"sequence-parallel prefill excludes {row.label}); set it false or null"
            )
        return PhasePaths(TP, None, None, decode, f"{row.label} checkpoint: the recipe's prefill_opt excludes it")
    k, ep = hf_config.num_experts_per_tok, parallel.moe_ep_size
    if parallel.moe_ep_scheme == "auto":
        ep_scheme = ALLGATHER if k >= ep else ALLTOALL
        why = f"auto: top_k {k} {'>=' if k >= ep else '<'} moe_ep_size {ep}"
    else:
        ep_scheme, why = parallel.moe_ep_scheme, "moe_ep_scheme"
    wire = row.sp_wire or WIRE_16_BIT
    if wire == MXFP8_WIRE:
        _check_mx_blocks(hf_config, parallel, row.label)
    return PhasePaths(SP, ep_scheme, wire, decode, why)


def _check_mx_blocks(hf_config, parallel: ParallelConfig, label: str) -> None:
    """The MXFP8 wire quantizes each rank's attention output in 32-element blocks: its width must be whole blocks."""
    width = hf_config.num_attention_heads // parallel.attn_tp_size * head_dim_of(hf_config)
    if width % BLOCK:
        raise PathPlanError(
            f"the {label} sequence-parallel prefill quantizes each rank's attention output "
            f"(num_attention_heads / attn_tp_size * head_dim = {hf_config.num_attention_heads} / "
            f"{parallel.attn_tp_size} * {head_dim_of(hf_config)} = {width}) in {BLOCK}-element MX blocks: "
            f"it must be a multiple of {BLOCK}; choose another attn_tp_size or turn prefill_opt off"
        )
