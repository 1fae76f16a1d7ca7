"""ModelRunner's generation API: EOS per request, seeded sampling, returned logits, block_size checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from equivalence.support.compare import assert_close
from fixtures.checkpoints import checkpoint
from optimized import ModelRunner, load_model
from optimized.executor.sampling import SamplingParams, choose, filtered_probs
from reference.checkpoint import load_model as load_reference

PROMPTS = [[288, 337, 283, 352, 393], [7, 8, 9], [100, 200, 300, 400]]


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(load_model(checkpoint("tiny"), dtype=torch.float32), block_size=16)


@pytest.fixture(scope="module")
def greedy(runner):
    return runner.generate(PROMPTS, 8).tokens


def test_eos_ends_each_request_and_frees_its_decode_work(runner, greedy):
    # An id request 0 emits at step 2 and the others never emit in their first 8 tokens.
    eos = greedy[0][2]
    assert all(eos not in t for t in greedy[1:]) and eos not in greedy[0][:2], "pick another prompt batch"
    decode_batches = []
    forward = runner.decode_forward

    def counting(ids, meta, kv_caches):
        decode_batches.append(ids.numel())
        return forward(ids, meta, kv_caches)

    runner.decode_forward = counting
    try:
        result = runner.generate(PROMPTS, 8, eos_token_id=[eos, 100000])
    finally:
        runner.decode_forward = forward
    assert result.tokens == [greedy[0][:3], *greedy[1:]]
    assert result.finish_reasons == ["eos", "length", "length"]
    # steps 1 and 2 decode all three requests; from step 3 on request 0 no longer takes part
    assert decode_batches == [3, 3] + [2] * 5


def test_temperature_zero_and_top_k_one_are_greedy(runner, greedy):
    assert runner.generate(PROMPTS, 8, sampling=SamplingParams(temperature=0.0, seed=3)).tokens == greedy
    assert runner.generate(PROMPTS, 8, sampling=SamplingParams(temperature=0.7, top_k=1, seed=3)).tokens == greedy


def test_sampling_is_seeded_per_request(runner):
    def sample(seed, prompts=PROMPTS):
        return runner.generate(prompts, 8, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed)).tokens

    first = sample(11)
    assert sample(11) == first  # same seed, same tokens
    assert sample(12) != first  # another seed, other tokens
    assert sample(11, PROMPTS[:1]) == first[:1]  # a request's draws do not depend on the rest of the batch
    unseeded = [runner.generate(PROMPTS, 8, sampling=SamplingParams(temperature=1.0)).tokens for _ in range(2)]
    assert all(len(t) == 8 and all(0 <= i < 512 for i in t) for t in unseeded[0])
    assert unseeded[0] != unseeded[1]  # no seed: a fresh one every call (from the OS)


@given(st.integers(1, 12), st.floats(0.05, 1.0), st.floats(0.2, 3.0), st.integers(0, 2**16))
def test_top_k_top_p_keep_the_smallest_likely_set(top_k, top_p, temperature, seed):
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(seed)) * 3
    probs = filtered_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    full = torch.softmax(logits / temperature, -1)
    for row in range(2):
        order = torch.argsort(logits[row], descending=True).tolist()
        kept = [i for i in order if probs[row, i] > 0]
        assert kept == order[: len(kept)] and 1 <= len(kept) <= top_k  # a prefix of the ranking, <= k
        topk = full[row, order[:top_k]] / full[row, order[:top_k]].sum()
        mass = topk[: len(kept)].sum()
        assert mass >= top_p - 1e-6 or len(kept) == top_k  # reaches top_p (or all k kept)
        assert len(kept) == 1 or topk[: len(kept) - 1].sum() < top_p + 1e-6  # and no smaller prefix does


def test_returned_logits_equal_the_models_forward(runner, greedy):
    positions = [[0, 4], [2], [1, 2, 3]]
    result = runner.generate(PROMPTS, 5, prompt_logits_positions=positions, return_logits=True)
    reference = load_reference(checkpoint("tiny"))
    for i, prompt in enumerate(PROMPTS):
        tokens = result.tokens[i]
        assert tokens == greedy[i][:5]
        with torch.no_grad():
            full = reference(torch.tensor([prompt + tokens[:-1]]))[0]  # [S, V]
        assert_close(result.prompt_logits[i], full[positions[i]], "model.float32", f"prompt logits {i}")
        steps = full[len(prompt) - 1 :]  # the logits each token came from
        assert_close(result.logits[i], steps, "model.float32", f"generation logits {i}")
        assert result.logits[i].argmax(-1).tolist() == tokens


@pytest.mark.parametrize("bad", [0, 24, -16, 8.0])
def test_block_size_is_validated_at_construction(runner, bad):
    with pytest.raises(ValueError, match=rf"block_size={bad!r} must be a positive multiple of 16"):
        ModelRunner(runner.model, block_size=bad)


def test_logits_positions_outside_the_prompt_are_refused(runner):
    with pytest.raises(ValueError, match=r"prompt_logits_positions\[1\]: position 3 is outside prompt 1"):
        runner.generate(PROMPTS, 2, prompt_logits_positions=[[0], [3], [0]])
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        SamplingParams(temperature=1.0, top_p=0)


@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 300),
    ties=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_greedy_pick_is_the_argmax_of_the_logits_as_given(rows, vocab, ties, seed, dtype):
    """The greedy sampler argmaxes in float32: the index argmax gives on the logits' own dtype, ties included
    (several copies of each row's maximum: the first wins), on values of few distinct levels."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 4, (rows, vocab), generator=g).to(dtype) / 4
    for r in range(rows):
        top = logits[r].max()
        logits[r, torch.randint(0, vocab, (ties,), generator=g)] = top
    picked = choose(logits, None)  # the engine's all-greedy batch
    assert torch.equal(picked, logits.argmax(-1)), (picked, logits.argmax(-1))
