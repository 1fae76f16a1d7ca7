"""Logits processors of one row, written plainly (the optimized engine's batched form: optimized/executor/sampling.py,
whose semantics docs/architecture.md states; the two must give the same float32 values bit for bit).

Order: logit_bias, min_tokens, repetition_penalty (prompt and generated tokens), frequency_penalty and
presence_penalty (generated tokens only).
"""

from __future__ import annotations

from collections import Counter

import torch


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def process_logits(
    logits: torch.Tensor,
    prompt: list[int],
    generated: list[int],
    *,
    logit_bias=(),
    min_tokens: int = 0,
    stop_ids=(),
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> torch.Tensor:
    """[V] logits of the next token after `prompt` + `generated` -> [V] float32 processed logits.
    logit_bias: (token, bias) pairs or a dict; stop_ids: the ids min_tokens holds back."""
    out = logits.float().clone()
    for token, bias in dict(logit_bias).items():  # 1. logit_bias
        out[token] = out[token] + f32(bias)
    if len(generated) < min_tokens:  # 2. min_tokens
        for token in stop_ids:
            out[token] = float("-inf")
    r = f32(repetition_penalty)
    for token in set(prompt) | set(generated):  # 3. repetition_penalty
        x = out[token]
        out[token] = x / r if x > 0 else x * r
    f, p = f32(frequency_penalty), f32(presence_penalty)
    for token, count in Counter(generated).items():  # 4. frequency and presence
        out[token] = out[token] - (f * f32(float(count)) + p)
    return out


def process_with(logits: torch.Tensor, params, prompt: list[int], generated: list[int], stop_ids=()) -> torch.Tensor:
    """`process_logits` with the processors of a params object (any object with the five fields)."""
    return process_logits(
        logits,
        prompt,
        generated,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
        stop_ids=stop_ids,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
    )


@torch.no_grad()
def greedy_generate_processed(model, prompt: list[int], max_new_tokens: int, params, stop_ids=()) -> list[int]:
    """One prompt's greedy tokens with the processors applied to each step's logits (full forward every step; stops
    after a stop id, like the engine)."""
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([prompt + generated]), None)[0, -1]
        token = int(process_with(logits, params, prompt, generated, stop_ids).argmax())
        generated.append(token)
        if token in stop_ids:
            break
    return generated
