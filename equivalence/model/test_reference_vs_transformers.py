"""The reference is checked against transformers' Qwen3MoeForCausalLM on every tiny fixture.

transformers runs with eager attention and eager experts (the per-expert loop), so in float32 the two
compute the same math with (almost) the same reductions. Routing-flip aware: the models may choose
different experts for a token only where the router is at a (near-)tie; torch.topk breaks exact ties
arbitrarily while the reference's stable sort prefers the lower expert id, and bf16 router logits tie often
(16 experts, 8-bit mantissa). Every such flip is checked to be a near-tie (`router_tie.<dtype>`), counted,
and the logits are then compared with the reference replaying transformers' expert choice.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.compare import assert_bitwise_equal, assert_close, describe, tolerance
from fixtures.checkpoints import checkpoint
from fixtures.tiny import TINY_CONFIGS, tiny_config
from reference.checkpoint import load_model, model_from_state_dict, read_state_dict
from reference.generate import greedy_generate
from reference.model import SparseMoeBlock

FIXTURES = sorted(TINY_CONFIGS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

transformers.utils.logging.disable_progress_bar()


@functools.cache
def models(name: str, dtype_name: str, router_dtype: str = "activation"):
    """(reference, transformers) for a fixture, loaded once per process."""
    path, dtype = checkpoint(name), DTYPES[dtype_name]
    ref = load_model(path, dtype=dtype, router_dtype=router_dtype)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    # Greedy generation is compared over a fixed number of tokens: no EOS from generation_config.json (with
    # min_new_tokens, transformers would mask the EOS logits and pick another token than the plain argmax).
    hf.generation_config.eos_token_id = None
    return ref, hf


@st.composite
def token_batches(draw, vocab: int = 512, max_batch: int = 3, max_len: int = 64):
    b = draw(st.integers(1, max_batch))
    s = draw(st.integers(1, max_len))
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=b * s, max_size=b * s))
    return torch.tensor(ids, dtype=torch.long).view(b, s)


@torch.no_grad()
def compare_routing_aware(ref, hf, input_ids: torch.Tensor, dtype_name: str):
    """Run both models; return (hf logits, reference logits replaying hf's routing, flips, routings).

    Fails if the reference's own top-k differs from transformers' anywhere except at a near-tie.
    """
    hf_ids: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, args, out, i=i: hf_ids.__setitem__(i, out[2]))
        for i, layer in enumerate(hf.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    try:
        expected = hf(input_ids).logits
    finally:
        for h in hooks:
            h.remove()

    tie = tolerance(f"router_tie.{dtype_name}")
    stats = {"flips": 0, "routings": 0}

    def replay(block: SparseMoeBlock, i: int, x: torch.Tensor) -> torch.Tensor:
        _, own, probs = block.route(x.reshape(-1, x.shape[-1]))  # [T, K], [T, E]
        theirs = hf_ids[i]
        assert theirs.shape == own.shape, f"layer {i}: hf routed {tuple(theirs.shape)} vs {tuple(own.shape)}"
        own_sorted, theirs_sorted = own.sort(-1).values, theirs.sort(-1).values
        flipped = (own_sorted != theirs_sorted).any(-1).nonzero().flatten()
        for t in flipped.tolist():
            kth = probs[t].gather(0, own[t]).min()  # the reference's k-th probability
            for e in set(theirs[t].tolist()) - set(own[t].tolist()):
                gap = (probs[t, e] - kth).abs().item()
                assert gap <= tie.atol + tie.rtol * kth.item(), (
                    f"layer {i} token {t}: transformers chose expert {e} (p={probs[t, e].item():.6g}) where the "
                    f"reference's k-th choice has p={kth.item():.6g}; that is no near-tie. reference ids "
                    f"{own[t].tolist()}, transformers ids {theirs[t].tolist()}"
                )
        stats["flips"] += flipped.numel()
        stats["routings"] += own.shape[0]
        return SparseMoeBlock.forward(block, x, expert_ids=theirs)

    blocks = [(i, layer.mlp) for i, layer in enumerate(ref.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    for i, block in blocks:
        block.forward = functools.partial(replay, block, i)
    try:
        replayed = ref(input_ids)
    finally:
        for _, block in blocks:
            del block.forward
    return expected, replayed, stats["flips"], stats["routings"]


@pytest.mark.parametrize("name", FIXTURES)
@given(input_ids=token_batches())
def test_reference_logits_equal_transformers_float32(name, input_ids):
    ref, hf = models(name, "float32")
    with torch.no_grad():
        actual = ref(input_ids)
    expected, replayed, flips, _ = compare_routing_aware(ref, hf, input_ids, "float32")
    assert actual.dtype == torch.float32
    assert flips == 0, f"{flips} routing flips in float32 (ties are not expected in fp32 router probabilities)"
    assert_close(actual, expected, "model.float32", f"{name} fp32 logits {tuple(input_ids.shape)}")


@pytest.mark.parametrize("name", FIXTURES)
@given(input_ids=token_batches())
def test_reference_logits_match_transformers_bfloat16(name, input_ids):
    ref, hf = models(name, "bfloat16")
    with torch.no_grad():
        actual = ref(input_ids)
    expected, replayed, flips, routings = compare_routing_aware(ref, hf, input_ids, "bfloat16")
    assert actual.dtype == torch.bfloat16
    if flips == 0:
        assert_close(actual, expected, "model.bfloat16", f"{name} bf16 logits")
    assert_close(
        replayed,
        expected,
        "model.bfloat16",
        f"{name} bf16 logits, reference replaying transformers' routing ({flips}/{routings} flips)",
    )


def test_bfloat16_routing_flips_are_rare():
    """Flip rate over a fixed batch per fixture: every flip is a near-tie, and they stay rare."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 512, (3, 64), generator=gen)
    report = []
    for name in FIXTURES:
        ref, hf = models(name, "bfloat16")
        expected, replayed, flips, routings = compare_routing_aware(ref, hf, input_ids, "bfloat16")
        report.append(f"{name}: {flips}/{routings} token routings flipped; {describe(replayed, expected)}")
        assert flips <= 0.05 * routings, report[-1]
    print("\n".join(report))


@pytest.mark.parametrize("name", FIXTURES)
@settings(max_examples=5)
@given(input_ids=token_batches(max_len=24))
def test_greedy_generation_equals_transformers_float32(name, input_ids):
    ref, hf = models(name, "float32")
    new = greedy_generate(ref, input_ids, 16)
    with torch.no_grad():
        out = hf.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=16, min_new_tokens=16
        )
    assert torch.equal(new, out[:, input_ids.shape[1] :]), f"{name}: {new.tolist()} != {out.tolist()}"


@pytest.mark.parametrize("name", FIXTURES)
@settings(max_examples=10)
@given(input_ids=token_batches(max_len=48), data=st.data())
def test_cached_decode_equals_full_recompute(name, input_ids, data):
    """Feeding the sequence in drawn chunks through the KV cache gives the full forward's logits."""
    ref, _ = models(name, "float32")
    S = input_ids.shape[1]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, S - 1), max_size=4)) if S > 1 else []))
    with torch.no_grad():
        full = ref(input_ids)
        cache = ref.new_cache()
        pieces = [ref(input_ids[:, a:b], cache) for a, b in zip([0] + cuts, cuts + [S])]
    assert cache.length == S
    assert_close(torch.cat(pieces, dim=1), full, "model.float32", f"{name} cached chunks {cuts}")


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_generate_with_cache_equals_without(name):
    ref, _ = models(name, "float32")
    input_ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy_generate(ref, input_ids, 16), greedy_generate(ref, input_ids, 16, use_cache=False))


@pytest.mark.parametrize("name", FIXTURES)
def test_sharded_checkpoint_equals_single_file(name):
    single, sharded = checkpoint(name), checkpoint(name, sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    a, b = read_state_dict(single), read_state_dict(sharded)
    assert a.keys() == b.keys()
    for key in a:
        assert_bitwise_equal(b[key], a[key], key)
    input_ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_bitwise_equal(load_model(sharded)(input_ids), models(name, "float32")[0](input_ids), "logits")


@pytest.mark.parametrize("name", FIXTURES)
@settings(max_examples=5)
@given(input_ids=token_batches())
def test_reference_router_float32_equals_transformers_float32(name, input_ids):
    ref, _ = models(name, "float32", router_dtype="float32")
    _, hf = models(name, "float32")
    with torch.no_grad():
        actual, expected = ref(input_ids), hf(input_ids).logits
    assert_close(actual, expected, "model.float32", f"{name} router_dtype=float32")


def test_fused_expert_tensors_are_split_like_per_expert_names():
    """transformers' in-memory (fused) state dict loads into the same model as the per-expert checkpoint."""
    _, hf = models("tiny", "float32")
    fused = {k: v for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    ref = model_from_state_dict(hf.config, fused)
    per_expert = models("tiny", "float32")[0].state_dict()
    assert ref.state_dict().keys() == per_expert.keys()
    for key, value in per_expert.items():
        assert_bitwise_equal(ref.state_dict()[key], value, key)


def test_tied_embeddings_equal_transformers():
    """tie_word_embeddings=True: lm_head shares the embedding (checkpoint without lm_head.weight)."""
    config = tiny_config("tiny")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ref = model_from_state_dict(config, state)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    input_ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(ref(input_ids), hf(input_ids).logits, "model.float32", "tied embeddings")


@settings(max_examples=5)
@given(rows=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_router_dtype_float32_computes_bf16_router_logits_in_fp32(rows, seed):
    """router_dtype="float32" (the NPU recipe): bf16 activations and gate weight are upcast for the logits,
    so the probabilities are fp32-exact for the bf16 inputs; the HF default rounds the logits to bf16."""
    (ref32, _), (ref, _) = models("tiny", "bfloat16", router_dtype="float32"), models("tiny", "bfloat16")
    block32, block = ref32.model.layers[0].mlp, ref.model.layers[0].mlp
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)  # [T, H]
    exact = torch.softmax(x.double() @ block.gate.weight.double().T, dim=-1)  # [T, E]
    weights, _, probs = block32.route(x)
    assert weights.dtype == torch.float32
    assert_close(probs, exact, "op.float32", "fp32 router probabilities")
    _, _, probs_bf16_logits = block.route(x)
    assert (probs_bf16_logits.double() - exact).abs().max() > 1e-4  # bf16 logits are visibly coarser
