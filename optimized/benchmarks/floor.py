"""Physical floors: the least time a prefill or a decode step can take on given hardware.

A floor is a lower bound, so every figure is taken on the optimistic side (the fastest published `Hardware` number,
routed experts spread evenly over the EP ranks, no launch cost, compute and memory fully overlapped); a measured
latency is reported beside it as "measured / floor".
- `decode_floor`: bytes this rank must read / HBM bandwidth + collectives per step x collective latency. Bytes: its
  shard of the attention projections and norms, the router, the experts the batch hits (`experts_hit`:
  E (1 - (1 - k/E)^B) under uniform routing, k at batch 1), dense MLPs, final norm, lm_head shard, embedding rows,
  plus the KV cache at the given context.
- `prefill_floor`: max(FLOPs / peak, bytes / HBM bandwidth) + bytes sent / link bandwidth, for the TP path or the
  recipe's SP+TP attention with MoE EP by allgather (`sp=True`).
`Layout.of(parallel)` follows optimized.distributed's rank layouts; `Precision` gives bytes per element by weight
kind (MX formats with one E8M0 byte per 32). Shared by `bench` (this CPU at its measured copy bandwidth) and the
NPU latency budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from optimized.executor.kv_cache import bytes_per_token

TB, GB = 1e12, 1e9


# ------------------------------------------------------------------------------------------ hardware


@dataclass(frozen=True)
class Hardware:
    """One device (one rank): what bounds a kernel from below."""

    name: str
    hbm_bandwidth: float  # bytes/s per device
    peak_flops: dict  # FLOP/s per device by compute precision: bf16, mxfp8, ...
    link_bandwidth: float  # bytes/s one device can send to its peers
    collective_latency: float  # seconds, least time of one small-message collective
    sources: tuple = field(default=())


# Per device = per rank. An Atlas A3 card (Ascend 910C) holds two dies, each its own device.
HARDWARE: dict[str, Hardware] = {
    "atlas_a3": Hardware(
        name="Atlas A3 (Ascend 910C, per die)",
        hbm_bandwidth=1.6 * TB,
        peak_flops={"bf16": 400 * TB},
        link_bandwidth=392 * GB,
        collective_latency=5e-6,
        sources=(
            "HBM: 3.2 TB/s and 128 GB per 910C package of two dies (Huawei CloudMatrix384 paper, "
            "arXiv 2506.12708, 2025), so 1.6 TB/s per die",
            "compute: 752 TFLOPS BF16 per package (same paper) / 800 TFLOPS FP16 (Huawei Connect, "
            "18 Sep 2025); the higher figure halved per die: 400 TFLOPS",
            "link: 784 GB/s interconnect per 910C (Huawei Connect, 18 Sep 2025), halved per die",
            "collective latency: no published HCCL figure; 5 us is an assumed lower bound for one "
            "small-message collective between dies (a kernel launch plus one cross-die round trip); "
            "the NPU budget run also measures it and reports the floor with the measured value",
        ),
    ),
    "atlas_950pr": Hardware(
        name="Atlas 950 PR (Ascend 950PR, per card)",
        hbm_bandwidth=1.6 * TB,
        peak_flops={"mxfp8": 1000 * TB, "mxfp4": 2000 * TB, "bf16": 1000 * TB},
        link_bandwidth=2000 * GB,
        collective_latency=5e-6,
        sources=(
            "HBM: HiBL 1.0, 128 GB, 1.6 TB/s; compute: 1 PFLOPS FP8/MXFP8/HiF8, 2 PFLOPS MXFP4; "
            "interconnect 2 TB/s (Huawei Connect, 18 Sep 2025, Ascend 950PR announcement)",
            "bf16: no published figure; taken as the FP8 rate, an upper bound, so the floor stays a lower bound",
            "collective latency: assumed lower bound 5 us, as for A3; measured value reported beside it",
        ),
    ),
}


def cpu_hardware(copy_bandwidth: float, peak_flops: float = 400e9) -> Hardware:
    """This CPU: copy bandwidth measured in the same run (read + write bytes / time of a large copy)."""
    return Hardware(
        name="CPU (measured copy bandwidth)",
        hbm_bandwidth=copy_bandwidth,
        peak_flops={"bf16": peak_flops, "fp32": peak_flops},
        link_bandwidth=float("inf"),
        collective_latency=0.0,
        sources=("bandwidth measured now; ~400 GFLOP/s bf16 matmul measured on 2 threads",),
    )


# ---------------------------------------------------------------------------------------- precision

MX_SCALE = 1 / 32  # one E8M0 scale byte per block of 32 elements


@dataclass(frozen=True)
class Precision:
    """Bytes per element by weight kind, and which peak the matmuls run at."""

    name: str
    attn_weight: float  # q/k/v/o projections (and dense MLP linears)
    expert_weight: float  # routed experts
    other_weight: float  # norms, router, embedding, lm_head
    kv_cache: torch.dtype  # the KV cache that runs (float8_e4m3fn: 1 byte per element + fp32 scales per token)
    wire: float  # hidden states gathered / exchanged between ranks
    reduce_wire: float  # partial sums reduced between ranks
    matmul_peak: str  # key of Hardware.peak_flops for the linears
    attention_peak: str  # key for the attention scores / values


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2, 2, 2, torch.bfloat16, 2, 2, "bf16", "bf16"),
    "fp32": Precision("fp32", 4, 4, 4, torch.float32, 4, 4, "fp32", "fp32"),
    # W4A8 (spec mx_quant.md): MXFP4 experts, MXFP8 q/k/v/o, BF16 norms/router/embedding/lm_head; the
    # per-token FP8 KV cache the converter's kv_cache_scheme selects (the recipe's C8: one byte per element and
    # one fp32 scale per token for K and for V over the rank's KV heads, as PagedKVCache stores them); MXFP8 on
    # the wire for gathers, BF16 for reductions; linears at the MXFP8 rate.
    "w4a8": Precision("w4a8", 1 + MX_SCALE, 0.5 + MX_SCALE, 2, torch.float8_e4m3fn, 1 + MX_SCALE, 2, "mxfp8", "bf16"),
}


def precision_of(p) -> Precision:
    """A Precision from a name ('bf16', 'w4a8', 'bfloat16', 'float32') or a torch dtype."""
    if isinstance(p, Precision):
        return p
    name = str(p).replace("torch.", "")
    name = {"bfloat16": "bf16", "float32": "fp32"}.get(name, name)
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown precision {p!r}; known: {', '.join(PRECISIONS)}, bfloat16, float32") from None


# ------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    attn_tp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    embed_tp: int = 1
    lmhead_tp: int = 1

    @classmethod
    def of(cls, parallel) -> "Layout":
        """From an `optimized.config.ParallelConfig` (or None: one rank)."""
        if parallel is None:
            return cls()
        return cls(
            parallel.attn_tp_size,
            parallel.moe_tp_size,
            parallel.moe_ep_size,
            parallel.embed_tp_size,
            parallel.lmhead_tp_size,
        )


@dataclass(frozen=True)
class _Shape:
    """Per-rank shapes of one config under one layout."""

    H: int
    D: int
    V: int
    E: int
    k: int
    I: int
    dense_I: int
    layers: int
    sparse: int
    dense: int
    q_heads: float  # query heads per rank
    kv_heads: float  # KV heads per rank (>= 1: replicated when attention TP exceeds them)
    all_q_heads: int


def _shape(config, layout: Layout, num_layers: int | None) -> _Shape:
    from optimized.config import dense_layers

    layers = num_layers if num_layers is not None else config.num_hidden_layers
    dense = len(dense_layers(config, layers))
    nq, nkv, A = config.num_attention_heads, config.num_key_value_heads, layout.attn_tp
    return _Shape(
        H=config.hidden_size,
        D=config.head_dim,
        V=config.vocab_size,
        E=config.num_experts,
        k=config.num_experts_per_tok,
        I=config.moe_intermediate_size,
        dense_I=config.intermediate_size,
        layers=layers,
        sparse=layers - dense,
        dense=dense,
        q_heads=nq / A,
        kv_heads=nkv / A if A <= nkv else 1,
        all_q_heads=nq,
    )


def experts_hit(config, tokens: int) -> float:
    """Distinct experts per layer that `tokens` token rows hit, expected under uniform routing."""
    E, k = config.num_experts, config.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


# ------------------------------------------------------------------------------------------- decode


def _weights_read(s, p, lay: "Layout", o_heads: int, experts_per_rank: float, tokens: int) -> dict[str, float]:
    """Bytes of the weights one rank reads in one forward (each once), by part; `o_heads`: the query heads
    whose o_proj columns the rank holds, `experts_per_rank`: the local experts the tokens hit."""
    attn_proj = s.H * s.q_heads * s.D + 2 * s.H * s.kv_heads * s.D + o_heads * s.D * s.H
    return {
        "attention": s.layers * (attn_proj * p.attn_weight + (2 * s.D + 2 * s.H) * p.other_weight),
        "router": s.sparse * s.E * s.H * p.other_weight,
        "experts": s.sparse * experts_per_rank * 3 * s.H * (s.I / lay.moe_tp) * p.expert_weight,
        "dense_mlp": s.dense * 3 * s.H * (s.dense_I / lay.moe_tp) * p.attn_weight,
        "lm_head_norm_embedding": (s.V / lay.lmhead_tp * s.H + s.H + tokens * s.H) * p.other_weight,
    }


def decode_bytes(
    config,
    precision="bf16",
    batch: int = 1,
    context: float = 0,
    num_layers: int | None = None,
    layout: Layout | None = None,
    hit: float | None = None,
) -> dict:
    """Bytes one decode step must read on one rank, by part (see the module docstring).

    hit: distinct experts hit per layer over all EP ranks (default: expected for `batch` tokens).
    """
    p, lay = precision_of(precision), layout or Layout()
    s = _shape(config, lay, num_layers)
    hit = experts_hit(config, batch) if hit is None else hit
    active = hit / lay.moe_ep  # per rank, spread evenly
    out = _weights_read(s, p, lay, s.q_heads, active, batch)
    out["kv_cache"] = bytes_per_token(s.layers, s.kv_heads, s.D, p.kv_cache) * context * batch
    out["total"] = sum(out.values())
    out["active_experts_per_layer"] = active
    return out


def decode_collectives(config, layout: Layout | None = None, num_layers: int | None = None) -> int:
    """Collectives one decode step issues on the project's TP path (optimized/layers): per layer the
    o_proj all-reduce (attention TP > 1) and the MoE partial-sum all-reduces over MoE TP and over EP (or
    the dense MLP's over MoE TP); the embedding all-reduce and the lm_head all-gather."""
    lay, s = layout or Layout(), _shape(config, layout or Layout(), num_layers)
    per_sparse = (lay.attn_tp > 1) + (lay.moe_tp > 1) + (lay.moe_ep > 1)
    per_dense = (lay.attn_tp > 1) + (lay.moe_tp > 1)
    return s.sparse * per_sparse + s.dense * per_dense + (lay.embed_tp > 1) + (lay.lmhead_tp > 1)


def decode_floor(
    config,
    hardware: Hardware,
    precision="bf16",
    batch: int = 1,
    context: float = 0,
    layout: Layout | None = None,
    num_layers: int | None = None,
    hit: float | None = None,
    collective_latency: float | None = None,
) -> dict:
    """Seconds per decode step at least: memory time + collectives x latency (see the module docstring)."""
    b = decode_bytes(config, precision, batch, context, num_layers, layout, hit)
    n = decode_collectives(config, layout, num_layers)
    latency = hardware.collective_latency if collective_latency is None else collective_latency
    memory_s, comm_s = b["total"] / hardware.hbm_bandwidth, n * latency
    return {
        "bytes": b,
        "memory_s": memory_s,
        "collectives": n,
        "collective_latency_s": latency,
        "collective_s": comm_s,
        "floor_s": memory_s + comm_s,
    }


# ------------------------------------------------------------------------------------------ prefill


def prefill_flops(
    config, prompt_lens: list[int], layout: Layout | None = None, num_layers: int | None = None, sp: bool = False
) -> dict:
    """FLOPs of one prefill on one rank, by part: linears (at the matmul peak) and attention (scores and
    values). With `sp` each rank embeds, routes and runs o_proj for its 1/A of the tokens (o_proj
    replicated), on the TP path every rank runs every token; the FLOPs per rank are equal except the
    router. Routed rows are spread evenly over the EP ranks."""
    lay = layout or Layout()
    s = _shape(config, lay, num_layers)
    S, B = sum(prompt_lens), len(prompt_lens)
    own = S / lay.attn_tp if sp else S  # tokens this rank routes
    qkv = 2 * S * s.H * (s.q_heads + 2 * s.kv_heads) * s.D
    o_proj = 2 * S * s.q_heads * s.D * s.H  # = 2 * (S/A) * all heads * D * H under SP
    pairs = sum(n * (n + 1) / 2 for n in prompt_lens)  # causal query-key pairs per head
    linear = {
        "attention_proj": s.layers * (qkv + o_proj),
        "router": s.sparse * 2 * own * s.H * s.E,
        "experts": s.sparse * 2 * 3 * (S * s.k / lay.moe_ep) * s.H * (s.I / lay.moe_tp),
        "dense_mlp": s.dense * 2 * 3 * S * s.H * (s.dense_I / lay.moe_tp),
        "lm_head": 2 * B * s.H * s.V / lay.lmhead_tp,
    }
    return {
        "linear": linear,
        "linear_total": sum(linear.values()),
        "attention": s.layers * 2 * 2 * s.D * s.q_heads * pairs,
    }


def prefill_bytes(
    config,
    precision,
    prompt_lens: list[int],
    layout: Layout | None = None,
    num_layers: int | None = None,
    sp: bool = False,
) -> dict:
    """Bytes one prefill must move through HBM on one rank: weights it holds and the batch hits (all
    experts of a long prompt), KV cache written, lm_head shard, embedding rows."""
    p, lay = precision_of(precision), layout or Layout()
    s = _shape(config, lay, num_layers)
    S = sum(prompt_lens)
    o_heads = s.all_q_heads if sp else s.q_heads  # SP prefill: o_proj replicated
    hit = experts_hit(config, S) / lay.moe_ep  # local experts the prompt hits, spread evenly
    out = _weights_read(s, p, lay, o_heads, hit, S)
    out["kv_cache_write"] = bytes_per_token(s.layers, s.kv_heads, s.D, p.kv_cache) * S
    out["total"] = sum(out.values())
    return out


def prefill_comm_bytes(
    config,
    precision,
    prompt_lens: list[int],
    layout: Layout | None = None,
    num_layers: int | None = None,
    sp: bool = False,
) -> dict:
    """Bytes one rank sends during one prefill, by collective kind (see the module docstring)."""
    p, lay = precision_of(precision), layout or Layout()
    s = _shape(config, lay, num_layers)
    S, B = sum(prompt_lens), len(prompt_lens)
    A, T, EP = lay.attn_tp, lay.moe_tp, lay.moe_ep

    def ring_all_reduce(n, size):
        return 2 * (size - 1) / size * n * p.reduce_wire

    out: dict[str, float] = {}
    if sp:
        # SP+TP attention: all-gather of the hidden states before QKV, all-to-all of the attention output
        # back to each rank's tokens; MoE EP by AllGather: hidden states + top-k ids and weights gathered,
        # expert output reduce-scattered. The volumes are prefill_plan's (what the collectives send), for
        # S / A unpadded tokens per rank; W4A8 moves MXFP8 on the gathers.
        from optimized.distributed.prefill_plan import allgather_volume, attention_volume

        mx = p.name == "w4a8"  # MXFP8 gathers; the reductions stay 16-bit
        attention = attention_volume(S / A, s.H, s.q_heads * s.D, A, p.reduce_wire, mx).parts
        moe = allgather_volume(S / EP, s.H, s.k, EP, p.reduce_wire, mx).parts
        out["attention_all_gather"] = s.layers * attention["all_gather"]
        out["attention_all_to_all"] = s.layers * attention["all_to_all"]
        out["moe_all_gather"] = s.sparse * moe["all_gather"]
        out["moe_reduce_scatter"] = s.sparse * moe["reduce_scatter"]
        out["moe_tp_all_reduce"] = s.sparse * ring_all_reduce(S / A * s.H, T)
    else:
        out["attention_all_reduce"] = s.layers * ring_all_reduce(S * s.H, A)
        out["moe_all_reduce"] = s.sparse * (ring_all_reduce(S * s.H, T) + ring_all_reduce(S * s.H, EP))
    out["dense_mlp_all_reduce"] = s.dense * ring_all_reduce(S * s.H, T)
    out["embedding_all_reduce"] = ring_all_reduce((S / A if sp else S) * s.H, lay.embed_tp)  # SP: own tokens
    out["lm_head_all_gather"] = (lay.lmhead_tp - 1) / lay.lmhead_tp * B * s.V * p.reduce_wire
    out["total"] = sum(out.values())
    return out


def prefill_floor(
    config,
    hardware: Hardware,
    precision="bf16",
    prompt_lens: list[int] = (1,),
    layout: Layout | None = None,
    num_layers: int | None = None,
    sp: bool = False,
) -> dict:
    """Seconds per prefill at least: max(compute, memory) + communication (see the module docstring)."""
    p = precision_of(precision)
    prompt_lens = list(prompt_lens)
    f = prefill_flops(config, prompt_lens, layout, num_layers, sp)
    b = prefill_bytes(config, p, prompt_lens, layout, num_layers, sp)
    c = prefill_comm_bytes(config, p, prompt_lens, layout, num_layers, sp)
    compute_s = (
        f["linear_total"] / hardware.peak_flops[p.matmul_peak] + f["attention"] / hardware.peak_flops[p.attention_peak]
    )
    memory_s = b["total"] / hardware.hbm_bandwidth
    comm_s = c["total"] / hardware.link_bandwidth if c["total"] else 0.0
    return {
        "flops": f,
        "bytes": b,
        "comm_bytes": c,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "comm_s": comm_s,
        "floor_s": max(compute_s, memory_s) + comm_s,
    }
