"""The engine driven with requests arriving at given steps, over the tiny fixture's model and its reference."""

from __future__ import annotations

import functools

import torch

from fixtures.checkpoints import checkpoint

BLOCK = 16


@functools.lru_cache(maxsize=None)
def _models():
    from optimized import ModelRunner, load_model
    from reference.checkpoint import load_model as load_reference

    path = checkpoint("tiny")
    runner = ModelRunner(load_model(path, dtype=torch.float32), block_size=BLOCK)
    return runner, load_reference(path, torch.float32, router_dtype="float32")


def reference_logits(ref, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the reference's logits each of `tokens` is predicted from (prompt alone, full forward)."""
    seq = torch.tensor([prompt + tokens[:-1]])
    return ref(seq, None)[0, len(prompt) - 1 :].float()


def run_engine(engine, arrivals: list[tuple[int, object]], max_steps: int = 500):
    """Add each request at its arrival step, step until every request is done; the requests in arrival order."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or not engine.idle:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        engine.step()
        step += 1
        assert step < max_steps, "the engine did not finish its requests"
    return [r for _, r in arrivals]


def engine_refusal_task(rank, world, path, lay, engine_options: dict):
    """One rank of a layout building an engine with `engine_options` over the tiny model: the UsageError's message
    (a combination the layout's prefill path cannot take, refused by name), or None when it was built."""
    from equivalence.support.parallel_support import rank_model
    from equivalence.support.strategies import BLOCK_SIZE
    from optimized.errors import UsageError
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner

    runner = ModelRunner(rank_model(path, lay, torch.float32), BLOCK_SIZE)
    try:
        Engine(runner, **engine_options)
    except UsageError as e:
        return str(e)
    return None
