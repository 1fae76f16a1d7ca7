"""Greedy decoding with the reference model."""
from __future__ import annotations

import torch

from reference.model import Qwen3MoeForCausalLM


@torch.no_grad()
def greedy_generate(model: Qwen3MoeForCausalLM, input_ids: torch.Tensor, max_new_tokens: int,
                    use_cache: bool = True) -> torch.Tensor:
    """input_ids [B, S] -> new tokens [B, max_new_tokens] (argmax; first index on ties, like torch.argmax).

    use_cache=True: prefill once, then feed one token at a time through the KV cache.
    use_cache=False: recompute the whole sequence every step.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    new = input_ids.new_empty(input_ids.shape[0], 0)  # [B, 0]
    if max_new_tokens == 0:
        return new
    cache = model.new_cache() if use_cache else None
    logits = model(input_ids, cache)  # [B, S, V]
    for step in range(max_new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        new = torch.cat([new, token], dim=1)
        if step + 1 == max_new_tokens:
            break
        logits = model(token, cache) if use_cache else model(torch.cat([input_ids, new], dim=1))
    return new
