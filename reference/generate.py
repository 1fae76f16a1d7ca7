"""Greedy decoding with the reference model."""

from __future__ import annotations

import torch

from reference.model import Qwen3MoeForCausalLM


@torch.no_grad()
def greedy_generate(
    model: Qwen3MoeForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True, eos_token_ids=()
) -> torch.Tensor:
    """input_ids [B, S] -> new tokens [B, n] (argmax; first index on ties, like torch.argmax).

    use_cache=True: prefill once, then feed one token at a time through the KV cache.
    use_cache=False: recompute the whole sequence every step.
    eos_token_ids: stop early once every row has produced one of them (n <= max_new_tokens); rows are
    independent, so a row's tokens up to its first EOS do not depend on when the loop stops
    (`trim_at_eos` cuts each row there).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    new = input_ids.new_empty(input_ids.shape[0], 0)  # [B, 0]
    if max_new_tokens == 0:
        return new
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=input_ids.dtype)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    cache = model.new_cache() if use_cache else None
    logits = model(input_ids, cache)  # [B, S, V]
    for step in range(max_new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        new = torch.cat([new, token], dim=1)
        done |= torch.isin(token[:, 0], eos)
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        logits = model(token, cache) if use_cache else model(torch.cat([input_ids, new], dim=1))
    return new


def trim_at_eos(tokens: list[int], eos_token_ids) -> list[int]:
    """`tokens` up to and including the first EOS id."""
    for i, t in enumerate(tokens):
        if t in eos_token_ids:
            return tokens[: i + 1]
    return tokens
