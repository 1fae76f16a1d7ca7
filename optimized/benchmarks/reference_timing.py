"""The plain reference model as the benchmarks' comparator: built on given weights, timed as the runner times.

The only module of the product that imports `reference` (installed beside `optimized`): bench and the CPU
relative budgets report the optimized model against it. Nothing on the generate / convert path comes here.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def reference_model(config, weights: Callable[[str, tuple], torch.Tensor], dtype: torch.dtype):
    """The reference Qwen3MoeForCausalLM with `weights(name, shape)` as its tensors, built without a second copy."""
    from reference.model import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    state = {name: weights(name, tuple(t.shape)).to(dtype) for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def reference_shapes(config) -> dict[str, torch.Tensor]:
    """The reference's state_dict on the meta device (names and shapes, no memory)."""
    from reference.model import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config).state_dict()


@torch.no_grad()
def time_reference(
    model,
    ids: torch.Tensor,
    steps: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = lambda: None,
):
    """Greedy prefill + `steps` decode steps on the reference's own KV cache: (prefill s, [decode s], tokens)."""
    cache = model.new_cache()
    start = clock()
    token = model(ids, cache)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    sync()
    prefill, decode, tokens = clock() - start, [], [token]
    for _ in range(steps):
        start = clock()
        token = model(token, cache)[:, -1].argmax(-1, keepdim=True)
        sync()
        decode.append(clock() - start)
        tokens.append(token)
    return prefill, decode, torch.cat(tokens, 1).tolist()
