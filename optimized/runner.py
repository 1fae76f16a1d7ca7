"""Prefill/decode loop with greedy sampling over the paged cache.

One prefill step packs all prompts (TND), then each decode step feeds one token per request. Timings
are measured per phase with a device sync, so they are honest on asynchronous devices too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import graph
from .forward_metadata import ForwardMetadata
from .kv_cache import PagedKVCache, block_table, slot_mapping


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, vocab_size: int, max_positions: int) -> None:
    """ValueError naming the first prompt that cannot be generated from (empty, bad id, too long)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(prompt) + max_new_tokens > max_positions:
            raise ValueError(f"prompt {i}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed "
                             f"max_position_embeddings={max_positions}")


@dataclass
class GenerationResult:
    tokens: list[list[int]]                       # generated ids per request
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)   # one entry per decode step

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * sum(self.decode_seconds) / max(len(self.decode_seconds), 1)


class ModelRunner:
    def __init__(self, model, block_size: int = 128, device: torch.device | str = "cpu", *,
                 exe_mode: str = "eager", compile_cache=None):
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        # Decode steps: the model (eager) or its compiled decode graph (ge_graph / acl_graph, optimized/graph.py).
        self.decode_forward = graph.decode_forward(model, exe_mode, compile_cache)
        config = model.config
        attn = model.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_layers, self.max_positions = config.num_hidden_layers, config.max_position_embeddings
        self.vocab_size = config.vocab_size

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenerationResult:
        check_prompts(prompts, max_new_tokens, self.vocab_size, self.max_positions)
        budget = [len(p) + max_new_tokens for p in prompts]
        num_blocks = 1 + sum(-(-n // self.block_size) for n in budget)
        cache = PagedKVCache(self.num_layers, num_blocks, self.block_size, self.kv_heads, self.head_dim,
                             self.model.dtype, self.device)
        table = block_table([cache.allocate(n) for n in budget], self.device)
        lengths = [len(p) for p in prompts]
        result = GenerationResult(tokens=[[] for _ in prompts])

        start = time.perf_counter()
        ids, meta, last = self.prefill_inputs(prompts, table)
        next_ids = self.model(ids, meta, cache.layers, logits_indices=last).argmax(-1)
        synchronize(self.device)
        result.prefill_seconds = time.perf_counter() - start

        for step in range(max_new_tokens):
            for request, token in enumerate(next_ids.tolist()):
                result.tokens[request].append(token)
            if step == max_new_tokens - 1:
                break
            start = time.perf_counter()
            meta = self.decode_metadata(lengths, table)
            next_ids = self.decode_forward(next_ids, meta, cache.layers).argmax(-1)
            synchronize(self.device)
            result.decode_seconds.append(time.perf_counter() - start)
            lengths = [n + 1 for n in lengths]
        return result

    def prefill_inputs(self, prompts: list[list[int]], table: torch.Tensor):
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        request_of_token = torch.repeat_interleave(torch.arange(len(prompts)), lengths).to(self.device)
        cu = torch.cumsum(lengths, 0)
        positions = (torch.arange(int(cu[-1])) - torch.repeat_interleave(cu - lengths, lengths)).to(self.device)
        meta = ForwardMetadata(
            is_prefill=True, positions=positions, actual_seq_lengths_cu_q=cu.tolist(),
            actual_seq_lengths_kv=cu.tolist(),
            slot_mapping=slot_mapping(table, request_of_token, positions, self.block_size),
            block_table=table, block_size=self.block_size)
        return ids, meta, (cu - 1).to(self.device)

    def decode_metadata(self, lengths: list[int], table: torch.Tensor) -> ForwardMetadata:
        """One new token per request at position `lengths[b]`; it attends to lengths[b] + 1 keys."""
        batch = len(lengths)
        positions = torch.tensor(lengths, device=self.device)
        return ForwardMetadata(
            is_prefill=False, positions=positions, actual_seq_lengths_cu_q=list(range(1, batch + 1)),
            actual_seq_lengths_kv=[n + 1 for n in lengths],
            slot_mapping=slot_mapping(table, torch.arange(batch, device=self.device), positions, self.block_size),
            block_table=table, block_size=self.block_size)
