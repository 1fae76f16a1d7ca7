"""The serving proofs' prompts, the reference's greedy tokens for them, and concurrent clients sending them."""

from __future__ import annotations

import functools
import threading
import time

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


def staggered_clients(ask, prompts, timeout_s: float, spacing_s: float = 0.05) -> list:
    """`ask(i, prompt)` for every prompt, each on its own thread, arrivals `spacing_s` apart (spread over engine
    steps); their answers in prompt order. Any client's exception, or one still waiting after `timeout_s`, fails."""
    results, errors = {}, []

    def one(i, prompt):
        try:
            time.sleep(spacing_s * i)
            results[i] = ask(i, prompt)
        except Exception as e:  # noqa: BLE001 - reported by the calling thread
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    assert len(results) == len(prompts), f"clients without an answer after {timeout_s} s: {len(prompts) - len(results)}"
    return [results[i] for i in range(len(prompts))]
