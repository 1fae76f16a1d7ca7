"""Prefill/decode loop over the paged cache: greedy by default, seeded sampling, EOS, returned logits.

One prefill step packs all prompts (TND), then each decode step feeds one token per request that is
still running: a request stops at one of its EOS ids (or after max_new_tokens) and from then on costs no
decode work. Every decode step goes through `decode_forward`, the one place a compiled step plugs in.
Timings are measured per phase with a device sync, so they are honest on asynchronous devices too.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import torch

from optimized.executor import graph
from optimized.platform import synchronize
from optimized.forward_metadata import ForwardMetadata
from optimized.executor.kv_cache import QUANTIZED_DTYPES, PagedKVCache, block_table, slot_mapping
from optimized.executor.sampling import GREEDY, Sampler, SamplingParams
from optimized.layers.quantization import kv_cache_dtype as resolve_kv_cache_dtype
from optimized.ops.required import FP8_KV_CACHE, check_operators

BLOCK_GRANULARITY = 16  # the paged attention kernel's block size granularity (tokens)


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
    tokens: list[list[int]]                       # generated ids per request (the EOS id included when hit)
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)   # one entry per decode step
    finish_reasons: list[str] = field(default_factory=list)     # per request: "eos" or "length"
    # float32 logits on the host, when asked for: prompt_logits[i] [len(positions[i]), V] at the requested
    # prompt positions (row j predicts the token after position j); logits[i] [len(tokens[i]), V], the
    # logits each generated token was chosen from (row 0 from the prefill's last position).
    prompt_logits: list[torch.Tensor] | None = None
    logits: list[torch.Tensor] | None = None

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * sum(self.decode_seconds) / max(len(self.decode_seconds), 1)


def check_block_size(block_size) -> int:
    if not isinstance(block_size, int) or block_size < 1 or block_size % BLOCK_GRANULARITY:
        raise ValueError(f"block_size={block_size!r} must be a positive multiple of {BLOCK_GRANULARITY} (the paged "
                         f"attention kernel's block granularity), e.g. 128")
    return block_size


def _eos_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    return frozenset([int(eos_token_id)] if isinstance(eos_token_id, int) else map(int, eos_token_id))


class ModelRunner:
    def __init__(self, model, block_size: int = 128, device: torch.device | str | None = None, *,
                 exe_mode: str = "eager", compile_cache=None, kv_cache_dtype: str = "auto",
                 kv_pool_blocks: int | None = None):
        """kv_pool_blocks: blocks of the paged KV pool per layer, the null block included (a serving engine's
        fixed pool); None: each generate() sizes its pool to what its requests need."""
        # The runner's tensors (KV cache, block table, metadata) live where the model's weights do.
        model_device = next(model.parameters()).device
        if device is not None and torch.device(device) != model_device:
            raise ValueError(f"ModelRunner device {device} differs from the model's device {model_device}; "
                             f"build the model on the device it runs on (load_model(..., device=...))")
        self.model, self.block_size, self.device = model, check_block_size(block_size), model_device
        if kv_pool_blocks is not None and (not isinstance(kv_pool_blocks, int) or kv_pool_blocks < 2):
            raise ValueError(f"kv_pool_blocks={kv_pool_blocks!r} must be an int >= 2 (block 0 is the null block)")
        self.kv_pool_blocks = kv_pool_blocks
        self.clock = time.perf_counter   # phase timer; the latency harness may swap it (e.g. thread CPU time)
        # One decode step, ids [B] (one token per running request) -> logits [B, V]: the model (eager) or its
        # compiled decode graph (ge_graph / acl_graph, optimized/executor/graph.py; a batch shrunk by finished requests
        # runs in its own, smaller captured bucket).
        self.decode_forward = graph.decode_forward(model, exe_mode, compile_cache)
        config = model.config
        attn = model.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_layers, self.max_positions = config.num_hidden_layers, config.max_position_embeddings
        self.vocab_size = config.vocab_size
        # 'auto': the checkpoint's quantization_config.kv_cache_scheme decides (per-token FP8 or 16-bit).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, kv_cache_dtype, model.dtype)
        if self.kv_cache_dtype in QUANTIZED_DTYPES:     # an old torch_npu without it fails here, not mid-step
            check_operators(FP8_KV_CACHE)

    def describe_kv_cache(self, choice: str = "auto") -> str:
        """The start-up line's KV cache: its dtype and where that came from."""
        origin = "the checkpoint's kv_cache_scheme" if choice == "auto" else f"kv_cache_dtype: {choice}"
        kind = ("per-token FP8, fp32 scale caches" if self.kv_cache_dtype in QUANTIZED_DTYPES else "16-bit")
        return f"{str(self.kv_cache_dtype).replace('torch.', '')} ({kind}; from {origin})"

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, sampling: SamplingParams | None = None,
                 eos_token_id: int | list[int] | None = None, prompt_logits_positions: list[list[int]] | None = None,
                 return_logits: bool = False) -> GenerationResult:
        """Generate up to `max_new_tokens` per prompt.

        sampling: greedy when None (or temperature 0). eos_token_id: id(s) that end a request (kept as its last
        token); None: always `max_new_tokens` (e.g. `reference.tokenizer.eos_token_ids(path)` gives a
        checkpoint's). prompt_logits_positions: per request, prompt positions whose logits to return.
        return_logits: also return the logits every generated token was chosen from.
        """
        check_prompts(prompts, max_new_tokens, self.vocab_size, self.max_positions)
        sampling = sampling or GREEDY
        eos = _eos_set(eos_token_id)
        positions = self._check_positions(prompts, prompt_logits_positions)
        # Only unseeded sampling needs a random seed (one collective when sharded); greedy and seeded need none.
        unseeded = not sampling.greedy and sampling.seed is None
        sampler = Sampler(sampling, len(prompts), seed=shared_seed(self.device) if unseeded else None)
        budget = [len(p) + max_new_tokens for p in prompts]
        num_blocks = 1 + sum(-(-n // self.block_size) for n in budget)
        if self.kv_pool_blocks is not None:
            if self.kv_pool_blocks < num_blocks:
                raise ValueError(f"kv_pool_blocks={self.kv_pool_blocks} is too small: these requests need {num_blocks} "
                                 f"blocks of {self.block_size} tokens (the null block included)")
            num_blocks = self.kv_pool_blocks
        cache = PagedKVCache(self.num_layers, num_blocks, self.block_size, self.kv_heads, self.head_dim,
                             self.kv_cache_dtype, self.device)
        table = block_table([cache.allocate(n) for n in budget], self.device)
        lengths = [len(p) for p in prompts]
        result = GenerationResult(tokens=[[] for _ in prompts], finish_reasons=["length"] * len(prompts),
                                  logits=[[] for _ in prompts] if return_logits else None)

        start = self.clock()
        ids, meta, last = self.prefill_inputs(prompts, table)
        offsets = [sum(lengths[:i]) for i in range(len(prompts))]
        wanted = [offsets[i] + j for i, pos in enumerate(positions or []) for j in pos]
        indices = torch.cat([torch.tensor(wanted, dtype=last.dtype, device=self.device), last])
        logits = self.model(ids, meta, cache.layers, logits_indices=indices)
        if positions is not None:
            kept = logits[:len(wanted)].float().cpu()
            result.prompt_logits = list(kept.split([len(pos) for pos in positions]))
        logits = logits[len(wanted):]
        active, active_table = list(range(len(prompts))), table   # the running requests and their block rows
        next_ids = sampler(logits, active)
        synchronize(self.device)
        result.prefill_seconds = self.clock() - start

        while True:
            if return_logits:
                for row, request in enumerate(active):
                    result.logits[request].append(logits[row].float().cpu())
            still = []
            for row, (request, token) in enumerate(zip(active, next_ids.tolist())):
                result.tokens[request].append(token)
                if token in eos:
                    result.finish_reasons[request] = "eos"
                elif len(result.tokens[request]) < max_new_tokens:
                    still.append(row)
            if not still:
                break
            if len(still) < len(active):  # finished requests leave the batch: no more decode work for them
                keep = torch.tensor(still, device=self.device)
                next_ids, active_table = next_ids[keep], active_table[keep]
                active = [active[row] for row in still]
            start = self.clock()
            meta = self.decode_metadata([lengths[r] for r in active], active_table)
            logits = self.decode_forward(next_ids, meta, cache.layers)
            next_ids = sampler(logits, active)
            synchronize(self.device)
            result.decode_seconds.append(self.clock() - start)
            for r in active:
                lengths[r] += 1
        if return_logits:
            result.logits = [torch.stack(rows) for rows in result.logits]
        return result

    def _check_positions(self, prompts, positions):
        if positions is None:
            return None
        if len(positions) != len(prompts):
            raise ValueError(f"prompt_logits_positions has {len(positions)} entries for {len(prompts)} prompts")
        for i, (prompt, pos) in enumerate(zip(prompts, positions)):
            bad = [j for j in pos if not (isinstance(j, int) and 0 <= j < len(prompt))]
            if bad:
                raise ValueError(f"prompt_logits_positions[{i}]: position {bad[0]!r} is outside prompt {i} "
                                 f"(length {len(prompt)})")
        return [list(pos) for pos in positions]

    def prefill_inputs(self, prompts: list[list[int]], table: torch.Tensor):
        """ids [T], the prefill metadata, the index of each prompt's last token [B]. The runner knows the
        prompts on the host: the host lists (cumulative lengths) are computed here, once per step, and every
        tensor is created on the model's device from them."""
        cu = [sum(len(p) for p in prompts[:i + 1]) for i in range(len(prompts))]
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        request_of_token = torch.tensor([i for i, p in enumerate(prompts) for _ in p], device=self.device)
        positions = torch.tensor([j for p in prompts for j in range(len(p))], device=self.device)
        meta = ForwardMetadata(
            is_prefill=True, positions=positions, actual_seq_lengths_cu_q=cu, actual_seq_lengths_kv=list(cu),
            slot_mapping=slot_mapping(table, request_of_token, positions, self.block_size),
            block_table=table, block_size=self.block_size)
        return ids, meta, torch.tensor([n - 1 for n in cu], device=self.device)

    def decode_metadata(self, lengths: list[int], table: torch.Tensor) -> ForwardMetadata:
        """One new token per request at position `lengths[b]`; it attends to lengths[b] + 1 keys."""
        batch = len(lengths)
        positions = torch.tensor(lengths, device=self.device)
        return ForwardMetadata(
            is_prefill=False, positions=positions, actual_seq_lengths_cu_q=list(range(1, batch + 1)),
            actual_seq_lengths_kv=[n + 1 for n in lengths],
            slot_mapping=slot_mapping(table, torch.arange(batch, device=self.device), positions, self.block_size),
            block_table=table, block_size=self.block_size)


def shared_seed(device: torch.device) -> int:
    """A fresh random seed, the same on every rank (rank 0's, broadcast) when the model is sharded."""
    import torch.distributed as dist
    # From the OS, not torch's default generator (which every process starts with the same fixed seed).
    seed = torch.tensor([secrets.randbits(31)], device=device)   # hccl / nccl broadcast device tensors only
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed)
