"""The serving proofs' prompts and the reference's greedy tokens for them."""

from __future__ import annotations

import functools

import torch

from fixtures.checkpoints import checkpoint
from reference import tokenizer as ref_tok
from reference.generate import greedy_generate, trim_at_eos


@functools.lru_cache(maxsize=None)
def _reference():
    from reference.checkpoint import load_model

    path = checkpoint("tiny")
    return (
        load_model(path, torch.float32, router_dtype="float32"),
        ref_tok.load_tokenizer(path),
        ref_tok.eos_token_ids(path),
    )


def ref_greedy(prompt: list[int], n: int, eos=()) -> list[int]:
    ref = _reference()[0]
    return trim_at_eos(greedy_generate(ref, torch.tensor([prompt]), n, eos_token_ids=eos)[0].tolist(), eos)


PROMPTS = [[5, 9, 200, 17, 3], [44, 1, 2], list(range(30, 52)), [7] * 11, [100, 101, 102, 103, 104, 105, 106]]
