"""The model on a fake non-CPU device: generation and one step with host reads and transfers counted."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from equivalence.support.fake_device import DeviceTensor, on_fake_device, register, to_host
from equivalence.support.strategies import BLOCK_SIZE
from equivalence.support.parallel_support import decode_metadata
from optimized.executor.kv_cache import PagedKVCache, block_table
from optimized.executor.model_runner import ModelRunner

NEW_TOKENS = 3

fake_npu = register  # npu:0, registered on first use (not at collection: the rename is for the process)


def generate(model, prompts):
    result = ModelRunner(model, BLOCK_SIZE).generate(prompts, NEW_TOKENS, return_logits=True)
    return result.tokens, torch.cat(to_host(result.logits))


@dataclass
class Step:
    """What one forward step did on the fake device: its host reads, its host -> device copies, the operators it
    called (name -> calls) and its logits."""

    reads: list[str]
    transfers: list[str]
    ops: Counter
    logits: torch.Tensor


def _fake_cache(model, runner, budgets: list[int]):
    """A paged KV cache on the fake device (of the runner's KV cache dtype: the per-token FP8 cache with its scale
    caches for an fp8 checkpoint) and the block table of requests holding `budgets` tokens."""
    attn = model.layers[0].self_attn
    cache = PagedKVCache(
        model.config.num_hidden_layers,
        1 + len(budgets) * 2,
        BLOCK_SIZE,
        attn.num_kv_heads,
        attn.head_dim,
        runner.kv_cache_dtype,
        fake_npu(),
    )
    return cache, block_table([cache.allocate(n) for n in budgets], fake_npu())


def _counted(mode, model, ids, meta, cache) -> Step:
    """The model call alone, its host reads, transfers and operators counted."""
    reads, transfers, ops = len(mode.host_reads), len(mode.transfers), Counter(mode.ops)
    logits = model(ids, meta, cache.layers)
    return Step(mode.host_reads[reads:], mode.transfers[transfers:], mode.ops - ops, logits)


def one_step(model, prompts, decode: bool) -> Step:
    """One forward on the fake device: the runner's metadata and cache, then the model call alone, counted."""
    runner = ModelRunner(model, BLOCK_SIZE)
    with on_fake_device() as mode:
        cache, table = _fake_cache(model, runner, [len(p) + 1 for p in prompts])
        ids, meta, _ = runner.prefill_inputs(prompts, table)
        if decode:
            model(ids, meta, cache.layers)
            ids = ids[: len(prompts)]
            meta = decode_metadata([len(p) for p in prompts], table)
        return _counted(mode, model, ids, meta, cache)


def extend_step(model, prompts, cuts) -> Step:
    """A prefill of prompts[b][:cuts[b]], then the extend step of the rest over the cached KV, counted alone."""
    runner = ModelRunner(model, BLOCK_SIZE)
    with on_fake_device() as mode:
        cache, table = _fake_cache(model, runner, [len(p) for p in prompts])
        ids, meta, _ = runner.prefill_inputs([p[:c] for p, c in zip(prompts, cuts)], table)
        model(ids, meta, cache.layers)
        ids, meta, _ = runner.prefill_inputs([p[c:] for p, c in zip(prompts, cuts)], table, cached_lens=cuts)
        return _counted(mode, model, ids, meta, cache)


def assert_no_reads_nor_transfers(step: Step, what: str) -> None:
    assert isinstance(step.logits, DeviceTensor) and step.logits.device == fake_npu(), what
    assert not step.reads, f"{what}: the forward step read the device {len(step.reads)} times: {step.reads}"
    assert not step.transfers, f"{what}: the forward step copied host data onto the device: {step.transfers}"
