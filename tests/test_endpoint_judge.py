"""The tie-aware judgement of generated tokens (optimized.benchmarks.greedy_ties), shared by bench and
equivalence.endpoint: a flip within the logit noise is a near-tie and the comparison goes on after it, a larger
margin is a divergence; bench's noise constants are the tolerance table's; the per-position logprob bound."""

from __future__ import annotations

import pytest
import torch

from equivalence.support.compare import tolerance
from optimized.benchmarks.greedy_ties import LOGIT_NOISE, judge_tokens, merge


def test_bench_logit_noise_is_the_tolerance_tables():
    for dtype, name in ((torch.float32, "model.float32"), (torch.bfloat16, "model.parallel.bfloat16")):
        t = tolerance(name)
        assert LOGIT_NOISE[dtype] == (t.atol, t.rtol), name


def test_near_tie_is_allowed_and_the_comparison_goes_on_divergence_fails():
    atol, rtol = LOGIT_NOISE[torch.bfloat16]
    logits = torch.zeros(4, 6)
    logits[0, 1] = 3.0  # clear argmax 1
    logits[1, 2], logits[1, 3] = 2.0, 1.9  # near-tie: margin 0.1 <= 2*0.125 + 0.02*(3.9)
    logits[2, 4] = 2.0  # the token chosen (0) is 2.0 below: divergence
    logits[3, 5] = 1.0
    j = judge_tokens(logits, torch.tensor([1, 3, 0, 5]), atol, rtol)
    assert (j.positions, j.agree) == (4, 2)
    assert [p.position for p in j.near_ties] == [1] and [p.position for p in j.divergences] == [2]
    assert j.near_ties[0].margin == pytest.approx(0.1, abs=1e-6) and not j.ok
    assert j.verdict().startswith("near-tie at token 2 (reference top-2 margin 0.1")
    assert "after teacher forcing 2 of 4 agree, 1 near-tie(s), 1 divergence(s)" in j.verdict()
    tie = logits[:1].clone()
    tie[0, 4] = 3.0  # an exact tie with the argmax agrees, whichever index topk names
    assert judge_tokens(tie, torch.tensor([4]), 0.0, 0.0).agree == 1
    ok = judge_tokens(logits[:2], torch.tensor([1, 3]), atol, rtol)
    assert ok.ok and merge([ok, ok]).positions == 4
    f32 = judge_tokens(logits[:2], torch.tensor([1, 3]), *LOGIT_NOISE[torch.float32])
    assert not f32.ok and "DIVERGENCE at token 2" in f32.verdict()  # the same flip is a bug in fp32


def test_bench_says_near_tie_or_divergence():
    from optimized.benchmarks.bench import _agreement

    torch.manual_seed(0)

    class Ref(torch.nn.Module):  # logits [B, S, V] from fixed per-token rows
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)

        def forward(self, ids, cache):
            return self.table[ids]

    ref = Ref()
    ids = torch.tensor([[1, 2]])
    greedy = [int(ref.table[2].argmax())]
    for _ in range(2):
        greedy.append(int(ref.table[greedy[-1]].argmax()))
    assert _agreement(ref, ids, [greedy], [greedy], torch.bfloat16) == "same"
    worst = int(ref.table[2].argmin())
    other = [worst] + [int(ref.table[worst].argmax())]
    other.append(int(ref.table[other[-1]].argmax()))
    verdict = _agreement(ref, ids, [greedy], [other], torch.bfloat16)
    assert verdict.startswith("differ (first 0 of 3 tokens agree): DIVERGENCE at token 1"), verdict
    assert "after teacher forcing 2 of 3 agree" in verdict
