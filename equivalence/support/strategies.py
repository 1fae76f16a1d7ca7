"""Shared hypothesis strategies for the multi-rank equivalence tests.

- `layouts(world_size, config)`: a valid parallel layout (keyword sizes for `ParallelState.build`) for a model
  config: attn_tp divides the query heads and either divides the KV heads or is a multiple of them (KV heads
  replicate), moe_tp divides moe_intermediate_size (and intermediate_size when the model has dense layers),
  moe_ep = world / moe_tp divides num_experts, embed_tp and lmhead_tp divide the vocabulary. The rules are
  restated here from the design, not imported from `optimized.config`, so a wrong validator cannot narrow
  what is tested. `corner_layouts` lists the layouts every world size must cover whatever hypothesis draws
  (the largest attention TP, hence KV replication, and the largest expert parallelism).
- `prompt_lengths` / `prompt_batches`: batches of 1-3 prompts of 1-40 tokens, biased towards the 16-token
  block boundaries (15, 16, 17, 31, 32, 33) so packed prefill and paged decode cross blocks.
- `hidden_kinds` + `hidden_states(kind, seed, ...)`: layer inputs, drawn as a seed and a kind so that
  hypothesis never builds big tensors: "random" (randn), "identical" (one token repeated: every token routes
  to the same experts, so other experts and whole EP ranks get nothing), "two_distinct" (two tokens
  alternating), "large" (randn * 4: router logits 4x larger, peaked routing; inputs
  to a layer are RMS-normalized in the model, so larger scales only test fp32 cancellation).
- `tiny_model_configs()`: changes to the "tiny" fixture config that give another tiny structure (head ratios,
  head_dim, odd expert counts, top-k, dense layers by each rule, eps, RoPE base, vocabulary), for the
  drawn-config properties of equivalence/model/test_config_sensitivity.py.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

BLOCK_SIZE = 16  # the paged KV cache block size the parallel tests use (attention op rule: multiple of 16)
BOUNDARY_LENGTHS = (15, 16, 17, 31, 32, 33)
HIDDEN_KINDS = ("random", "identical", "two_distinct", "large")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _has_dense_layers(config) -> bool:
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return any(i in only or (i + 1) % step for i in range(config.num_hidden_layers))


def allowed_sizes(world_size: int, config) -> dict[str, list[int]]:
    """Per kind, the sizes valid for `config` at `world_size` (moe_tp fixes moe_ep = world / moe_tp)."""
    ws = divisors(world_size)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    attn = [a for a in ws if heads % a == 0 and (kv % a == 0 or a % kv == 0)]
    moe_tp = [
        t
        for t in ws
        if config.moe_intermediate_size % t == 0
        and config.num_experts % (world_size // t) == 0
        and (not _has_dense_layers(config) or config.intermediate_size % t == 0)
    ]
    vocab = [v for v in ws if config.vocab_size % v == 0]
    return {"attn_tp_size": attn, "moe_tp_size": moe_tp, "embed_tp_size": vocab, "lmhead_tp_size": vocab}


def layout(
    world_size: int,
    attn_tp_size: int = 1,
    moe_tp_size: int | None = None,
    embed_tp_size: int = 1,
    lmhead_tp_size: int = 1,
    prefill_opt: bool = False,
    moe_ep_scheme: str = "auto",
    attn_dp: bool = False,
) -> dict:
    """Keyword sizes for `ParallelState.build` (moe_tp defaults to 1, i.e. pure expert parallelism).

    Attention is replicated over the world_size / attn_tp_size attention TP groups unless `attn_dp` (the config's
    default derives attention DP from attn_tp_size < world_size; test_attn_dp_parallel proves that layout).

    The tensor-parallel prefill unless `prefill_opt` (the sequence-parallel prefill, needs attn_tp_size ==
    world_size and moe_tp_size 1; see `sp_layout`), so a layout names the path it proves.
    """
    moe_tp_size = 1 if moe_tp_size is None else moe_tp_size
    return dict(
        world_size=world_size,
        attn_tp_size=attn_tp_size,
        moe_tp_size=moe_tp_size,
        moe_ep_size=world_size // moe_tp_size,
        embed_tp_size=embed_tp_size,
        lmhead_tp_size=lmhead_tp_size,
        prefill_opt=prefill_opt,
        moe_ep_scheme=moe_ep_scheme,
        attn_dp=attn_dp,
    )


def sp_layout(world_size: int, moe_ep_scheme: str, embed_tp_size: int = 1, lmhead_tp_size: int = 1) -> dict:
    """The sequence-parallel prefill layout: attention TP = MoE EP = world, with the given EP scheme."""
    return layout(
        world_size,
        attn_tp_size=world_size,
        moe_tp_size=1,
        embed_tp_size=embed_tp_size,
        lmhead_tp_size=lmhead_tp_size,
        prefill_opt=True,
        moe_ep_scheme=moe_ep_scheme,
    )


@st.composite
def layouts(draw, world_size: int, config) -> dict[str, int]:
    sizes = allowed_sizes(world_size, config)
    # Larger sizes first: hypothesis shrinks towards the first choice, i.e. the most sharded layout.
    pick = {k: draw(st.sampled_from(sorted(v, reverse=True))) for k, v in sizes.items()}
    return layout(world_size, **pick)


def corner_layouts(world_size: int, config) -> list[dict[str, int]]:
    """Layouts every world size covers: everything at its largest, and max attention TP with max MoE TP."""
    sizes = allowed_sizes(world_size, config)
    top = {k: max(v) for k, v in sizes.items()}
    out = [layout(world_size, **{**top, "moe_tp_size": min(sizes["moe_tp_size"])})]  # max EP, max attn TP
    if max(sizes["moe_tp_size"]) != min(sizes["moe_tp_size"]):
        out.append(
            layout(
                world_size,
                attn_tp_size=top["attn_tp_size"],
                moe_tp_size=top["moe_tp_size"],
                embed_tp_size=1,
                lmhead_tp_size=top["lmhead_tp_size"],
            )
        )
    return out


def describe_layout(lay: dict) -> str:
    sp = f" SP prefill, EP {lay['moe_ep_scheme']}" if lay.get("prefill_opt") else ""
    return (
        f"W={lay['world_size']} attn_tp={lay['attn_tp_size']} moe_tp={lay['moe_tp_size']} "
        f"moe_ep={lay['moe_ep_size']} embed_tp={lay['embed_tp_size']} lmhead_tp={lay['lmhead_tp_size']}{sp}"
    )


def prompt_length(max_len: int = 40):
    boundary = [n for n in BOUNDARY_LENGTHS if n <= max_len]
    return st.one_of(st.sampled_from(boundary), st.integers(1, max_len)) if boundary else st.integers(1, max_len)


def prompt_lengths(min_batch: int = 1, max_batch: int = 3, max_len: int = 40):
    return st.lists(prompt_length(max_len), min_size=min_batch, max_size=max_batch)


@st.composite
def prompt_batches(
    draw, vocab_size: int, min_batch: int = 1, max_batch: int = 3, max_len: int = 40, distinct_lengths: bool = False
) -> list[list[int]]:
    """Prompts (lists of token ids in [0, vocab_size)); `distinct_lengths` forces different lengths."""
    lengths = draw(st.lists(prompt_length(max_len), min_size=min_batch, max_size=max_batch, unique=distinct_lengths))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


hidden_kinds = st.sampled_from(HIDDEN_KINDS)
seeds = st.integers(0, 2**31 - 1)


def hidden_states(kind: str, seed: int, tokens: int, hidden: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[tokens, hidden] layer input of the given kind, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        x = torch.randn(tokens, hidden, generator=g)
    elif kind == "identical":
        x = torch.randn(1, hidden, generator=g).expand(tokens, hidden).clone()
    elif kind == "two_distinct":
        x = torch.randn(2, hidden, generator=g)[torch.arange(tokens) % 2]
    elif kind == "large":
        x = torch.randn(tokens, hidden, generator=g) * 4
    else:
        raise ValueError(f"unknown hidden kind {kind!r}; kinds: {HIDDEN_KINDS}")
    return x.to(dtype)


@st.composite
def tiny_model_configs(draw) -> dict:
    """Keyword changes to the "tiny" fixture config (`equivalence.model.sensitivity.config_of`): a tiny Qwen3-MoE of
    another structure. Query heads 1-6 per KV head; head_dim never hidden_size / num_attention_heads; expert
    counts mostly odd, top-k anywhere in 1..E; dense layers by `decoder_sparse_step` and, on layers that step
    leaves sparse, by `mlp_only_layers` (each rule alone decides its layers; `DENSE_RULES`); eps 1e-6..1e-3;
    RoPE bases 1e2..1e6; odd vocabularies."""
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.integers(1, 6))
    hidden = draw(st.sampled_from([32, 48, 64]))
    head_dim = draw(st.sampled_from([d for d in (8, 12, 16, 24) if d != hidden // heads]))
    experts = draw(st.sampled_from([3, 5, 7, 8, 9]))
    layers, step, mlp_only = draw(st.sampled_from(DENSE_RULES).flatmap(lambda rule: _dense_layers(rule)))
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_experts=experts,
        num_experts_per_tok=draw(st.integers(1, experts)),
        norm_topk_prob=draw(st.booleans()),
        num_hidden_layers=layers,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
        intermediate_size=draw(st.sampled_from([24, 40, 64])),
        moe_intermediate_size=draw(st.sampled_from([8, 12, 20])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3])),
        rope_theta=draw(st.sampled_from([100.0, 1e4, 5e5, 1e6])),
        vocab_size=draw(st.sampled_from([64, 97, 131])),
        max_position_embeddings=draw(st.sampled_from([48, 64, 100])),
    )


# Which rule makes layers dense: "both" has a layer dense by decoder_sparse_step only and another by
# mlp_only_layers only (never a layer dense by both), and a sparse layer.
DENSE_RULES = ("both", "step", "mlp_only", "none")


def _dense_layers(rule: str):
    """(num_hidden_layers, decoder_sparse_step, mlp_only_layers) for a dense-layer rule; >= 1 sparse layer."""
    if rule == "both":  # layers 0, 2 dense by the step; 1 or 3 by mlp_only_layers; the other sparse
        return st.tuples(st.just(4), st.just(2), st.sampled_from([[1], [3]]))
    if rule == "step":
        return st.sampled_from([(2, 2, []), (3, 2, []), (3, 3, []), (4, 3, []), (4, 2, [])])
    if rule == "mlp_only":  # mlp_only_layers: a proper subset of the layers
        return st.integers(2, 4).flatmap(
            lambda n: st.tuples(
                st.just(n),
                st.just(1),
                st.lists(st.integers(0, n - 1), min_size=1, max_size=n - 1, unique=True).map(sorted),
            )
        )
    return st.tuples(st.integers(2, 4), st.just(1), st.just([]))


# ------------------------------------------------------------------------------ adversarial expert routings

ROUTING_KINDS = ("random", "one_expert_set", "rank_gets_nothing", "one_rank_overloaded")
routing_kinds = st.sampled_from(ROUTING_KINDS)


def expert_routing(kind: str, seed: int, tokens: int, num_experts: int, top_k: int, ep: int):
    """Expert ids [tokens, top_k] int32 (distinct per token) and positive fp32 weights [tokens, top_k].

    "random": uniform; "one_expert_set": every token to the same top_k experts (all other experts, and
    every EP rank without one of them, get nothing); "rank_gets_nothing": no token picks an expert of one
    drawn EP rank (rank e holds experts [e*L, (e+1)*L)); "one_rank_overloaded": every token picks the
    experts starting at one drawn rank's first expert (that rank, and its next ranks when L < top_k, get
    every slot; the rest nothing).
    """
    g = torch.Generator().manual_seed(seed)
    local = num_experts // ep
    if kind == "random":
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    elif kind == "one_expert_set":
        ids = torch.randperm(num_experts, generator=g)[:top_k].expand(tokens, top_k)
    elif kind == "rank_gets_nothing":
        idle = int(torch.randint(0, ep, (1,), generator=g))
        allowed = torch.tensor([e for e in range(num_experts) if e // local != idle])
        ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    elif kind == "one_rank_overloaded":
        start = int(torch.randint(0, ep, (1,), generator=g)) * local
        base = (start + torch.arange(top_k)) % num_experts
        ids = torch.stack([base[torch.randperm(top_k, generator=g)] for _ in range(tokens)])
    else:
        raise ValueError(f"unknown routing kind {kind!r}; kinds: {ROUTING_KINDS}")
    weights = torch.rand(tokens, top_k, generator=g) + 0.05
    return ids.to(torch.int32).contiguous(), (weights / weights.sum(-1, keepdim=True)).float()
