"""Each optimized layer, sharded over real gloo ranks, equals the reference layer on the same input (fp32).

For world sizes 1, 2, 4, 8, every property runs on the corner layouts of `strategies.corner_layouts` (max
attention TP: KV heads replicated 2x at attn_tp 4 and 4x at attn_tp 8; max expert parallelism: top_k 4
above EP 2, equal to EP 4, below EP 8; max MoE TP) and on layouts hypothesis draws. Every rank processes
the same tokens, so every rank's output must also be bitwise the same (`same_on_all_ranks`).

- attention: packed prefill of 1-3 prompts of different lengths (each compared with the reference run on
  that prompt alone), then 1-3 decode steps over the paged cache (interleaved block tables; lengths drawn
  around the 16-token block boundaries, so decode crosses into new blocks);
- MoE block: vs the reference SparseMoeBlock, on random, identical (all tokens on the same experts: empty
  experts and idle EP ranks), two-token and large-scale inputs; the expert ids must equal the
  reference's top-k (an fp32 flip is allowed only on a `router_tie.float32` near-tie, then the reference
  is re-run forced to the optimized ids);
- decoder layer: the optimized layer returns (mlp_out, residual) with residual = x + attn(norm(x)); the
  reference returns x + attn + mlp. Checked with and without an incoming residual, on sparse and dense
  (tiny-dense: mlp_only_layers / decoder_sparse_step) layers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from equivalence.support.compare import assert_close, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import (
    decode_metadata,
    paged_cache,
    rank_model,
    reference_model,
    routing_check,
    run_property,
    runner_of,
    same_on_all_ranks,
)
from equivalence.support.strategies import (
    corner_layouts,
    describe_layout,
    hidden_kinds,
    hidden_states,
    layouts,
    prompt_lengths,
    seeds,
)
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from reference.model import LayerCache, SparseMoeBlock, rope_cos_sin

pytestmark = pytest.mark.distributed

TOL = "layer.float32"
WORLDS = (1, 2, 4, 8)
# hypothesis examples per (world size, layout source): few for W=8 (8 ranks share 2 cores).
EXAMPLES = {
    1: {"corner": 4, "drawn": 0},
    2: {"corner": 2, "drawn": 3},
    4: {"corner": 2, "drawn": 2},
    8: {"corner": 1, "drawn": 2},
}
CONFIG = tiny_config("tiny")  # every fixture shares the parallel-relevant shapes (heads, experts, sizes)
H = CONFIG.hidden_size


def layout_cases():
    cases = []
    for w in WORLDS:
        for lay in corner_layouts(w, CONFIG):
            cases.append(pytest.param(w, lay, EXAMPLES[w]["corner"], id=f"w{w}-corner-{_short(lay)}"))
        if EXAMPLES[w]["drawn"]:
            cases.append(pytest.param(w, None, EXAMPLES[w]["drawn"], id=f"w{w}-drawn"))
    return cases


def _short(lay) -> str:
    sizes = ("attn_tp_size", "moe_tp_size", "moe_ep_size", "embed_tp_size", "lmhead_tp_size")
    return "".join(f"{letter}{lay[key]}" for letter, key in zip("atevl", sizes))


def _layout_strategy(world, lay):
    return st.just(lay) if lay is not None else layouts(world, CONFIG)


def _salted(seed: int, lay: dict) -> int:
    return (seed * 1000003 + hash(tuple(sorted(lay.items())))) % 2**31


# ------------------------------------------------------------------------------------------ worker tasks


@torch.no_grad()
def _attention_task(rank, world, path, lay, layer_idx, lengths, x_prefill, x_decode):
    model = rank_model(path, lay, torch.float32)
    attn, runner = model.layers[layer_idx].self_attn, runner_of(model)
    cache, table = paged_cache(model, [n + len(x_decode) for n in lengths], num_layers=1)
    _, meta, _ = runner.prefill_inputs([[0] * n for n in lengths], table)
    cos, sin = model.rotary(meta.positions)
    out = {"prefill": attn(x_prefill, cos, sin, meta, cache.layers[0], model.atten_mask)}
    lens = list(lengths)
    for step, x in enumerate(x_decode):
        meta = decode_metadata(lens, table)
        cos, sin = model.rotary(meta.positions)
        out[f"decode{step}"] = attn(x, cos, sin, meta, cache.layers[0], model.atten_mask)
        lens = [n + 1 for n in lens]
    return out


@torch.no_grad()
def _moe_task(rank, world, path, lay, layer_idx, x):
    mlp = rank_model(path, lay, torch.float32).layers[layer_idx].mlp
    return {"out": mlp(x), "ids": mlp.route(x)[1]}


@torch.no_grad()
def _decoder_task(rank, world, path, lay, layer_idx, lengths, hidden, residual):
    model = rank_model(path, lay, torch.float32)
    layer, runner = model.layers[layer_idx], runner_of(model)
    out = {}
    for name, res in (("no_residual", None), ("residual", residual)):
        cache, table = paged_cache(model, lengths, num_layers=1)
        _, meta, _ = runner.prefill_inputs([[0] * n for n in lengths], table)
        cos, sin = model.rotary(meta.positions)
        out[name] = layer(hidden, res, cos, sin, meta, cache.layers[0], model.atten_mask, model.prefill.step)
    return out


# ----------------------------------------------------------------------------------------- reference side


def _requests(lengths):
    off = 0
    for b, n in enumerate(lengths):
        yield b, slice(off, off + n)
        off += n


def _rope(positions):
    return rope_cos_sin(CONFIG, torch.as_tensor(positions), torch.float32)


@torch.no_grad()
def _reference_attention(attn, lengths, x_prefill, x_decode):
    prefill, caches = [], []
    for _, rows in _requests(lengths):
        cache = LayerCache()
        n = rows.stop - rows.start
        prefill.append(attn(x_prefill[rows][None], *_rope(torch.arange(n)), cache)[0])
        caches.append(cache)
    out = {"prefill": torch.cat(prefill)}
    for step, x in enumerate(x_decode):
        out[f"decode{step}"] = torch.cat(
            [attn(x[b][None, None], *_rope([n + step]), caches[b])[0] for b, n in enumerate(lengths)]
        )
    return out


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world, lay, n", layout_cases())
def test_attention_prefill_and_paged_decode_equal_reference(world, lay, n):
    path = str(checkpoint("tiny"))
    ref = reference_model("tiny")

    def check(layout, lengths, steps, layer_idx, seed):
        seed = _salted(seed, layout)
        x_prefill = hidden_states("random", seed, sum(lengths), H)
        x_decode = [hidden_states("random", seed + 1 + s, len(lengths), H) for s in range(steps)]
        got = same_on_all_ranks(
            get_pool(world).run(_attention_task, path, layout, layer_idx, lengths, x_prefill, x_decode, timeout=120),
            "attention",
        )
        want = _reference_attention(ref.model.layers[layer_idx].self_attn, lengths, x_prefill, x_decode)
        for key in want:
            assert_close(
                got[key],
                want[key],
                TOL,
                f"{describe_layout(layout)} lengths={lengths} layer {layer_idx} attention {key}",
            )

    run_property(
        check,
        n,
        layout=_layout_strategy(world, lay),
        lengths=prompt_lengths(1, 3, 40),
        steps=st.integers(1, 3),
        layer_idx=st.integers(0, CONFIG.num_hidden_layers - 1),
        seed=seeds,
    )


@pytest.mark.parametrize("world, lay, n", layout_cases())
def test_moe_block_equals_reference_including_skewed_routing(world, lay, n):
    name = "tiny"
    path = str(checkpoint(name))
    ref = reference_model(name)
    near_tie = tolerance("router_tie.float32").rtol

    def check(layout, tokens, kind, layer_idx, seed):
        x = hidden_states(kind, _salted(seed, layout), tokens, H)
        got = same_on_all_ranks(get_pool(world).run(_moe_task, path, layout, layer_idx, x, timeout=120), "moe")
        block = ref.model.layers[layer_idx].mlp
        assert isinstance(block, SparseMoeBlock)
        with torch.no_grad():
            _, _, probs = block.route(x)
            stats = routing_check(probs, block.top_k, got["ids"], near_tie)
            want = block(x, expert_ids=got["ids"].long())  # == block(x) when nothing flipped
        what = f"{describe_layout(layout)} {kind} x{tokens} layer {layer_idx}"
        assert stats.clear_flips == 0, f"{what}: {stats}"
        assert_close(got["out"], want, TOL, f"{what} MoE block ({stats})")

    run_property(
        check,
        n + 1,
        layout=_layout_strategy(world, lay),
        tokens=st.integers(1, 40),
        kind=hidden_kinds,
        layer_idx=st.integers(0, CONFIG.num_hidden_layers - 1),
        seed=seeds,
    )


@pytest.mark.parametrize("world, lay, n", layout_cases())
def test_decoder_layer_with_residual_equals_reference(world, lay, n):
    def check(layout, name, lengths, layer_idx, seed):
        path = str(checkpoint(name))
        ref = reference_model(name)
        config = ref.config
        layer_idx = layer_idx % config.num_hidden_layers
        seed = _salted(seed, layout)
        hidden = hidden_states("random", seed, sum(lengths), H)
        residual = hidden_states("random", seed + 1, sum(lengths), H)
        got = same_on_all_ranks(
            get_pool(world).run(_decoder_task, path, layout, layer_idx, lengths, hidden, residual, timeout=120),
            "decoder layer",
        )
        layer = ref.model.layers[layer_idx]
        for variant, x in (("no_residual", hidden), ("residual", hidden + residual)):
            mlp_out, new_residual = got[variant]
            want, want_residual = [], []
            with torch.no_grad():
                for _, rows in _requests(lengths):
                    cos, sin = rope_cos_sin(config, torch.arange(rows.stop - rows.start), torch.float32)
                    xb = x[rows][None]
                    want.append(layer(xb, cos, sin, LayerCache())[0])
                    want_residual.append((xb + layer.self_attn(layer.input_layernorm(xb), cos, sin))[0])
            what = f"{describe_layout(layout)} {name} layer {layer_idx} ({type(layer.mlp).__name__}) {variant}"
            assert_close(new_residual, torch.cat(want_residual), TOL, f"{what}: residual = x + attn")
            assert_close(mlp_out + new_residual, torch.cat(want), TOL, f"{what}: mlp_out + residual = layer(x)")

    run_property(
        check,
        n,
        layout=_layout_strategy(world, lay),
        name=st.sampled_from(["tiny-dense", "tiny"]),
        lengths=prompt_lengths(1, 3, 40),
        layer_idx=st.integers(0, 2),
        seed=seeds,
    )
