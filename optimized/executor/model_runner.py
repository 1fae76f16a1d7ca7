"""Prefill/decode loop over the paged cache: greedy by default, seeded sampling, EOS, returned logits.

One prefill step packs all prompts (TND), then each decode step feeds one token per request that is
still running: a request stops at one of its EOS ids (or after max_new_tokens) and from then on costs no
decode work. Every decode step goes through `decode_forward`, the one place a compiled step plugs in.
Timings are measured per phase with a device sync, so they are honest on asynchronous devices too.
"""
from __future__ import annotations

import itertools
import numbers
import secrets
import time
from dataclasses import dataclass, field

import torch

from optimized.distributed import collectives as comm
from optimized.executor import graph
from optimized import platform
from optimized.platform import synchronize
from optimized.forward_metadata import DataParallelBatch, ForwardMetadata
from optimized.executor.kv_cache import QUANTIZED_DTYPES, PagedKVCache, block_table, slot_mapping
from optimized.executor.sampling import GREEDY, Sampler, SamplingParams
from optimized.layers.quantization import kv_cache_dtype as resolve_kv_cache_dtype
from optimized.ops.required import FP8_KV_CACHE, check_operators

BLOCK_GRANULARITY = 16  # the paged attention kernel's block size granularity (tokens)


class NonFiniteLogitsError(RuntimeError):
    """A step produced NaN / inf logits: generation stops (naming the step and request) instead of choosing
    token 0 forever from a row of NaNs."""


def check_prompts(prompts: list[list[int]], max_new_tokens: int, vocab_size: int, max_positions: int) -> None:
    """ValueError naming the first prompt that cannot be generated from (not token ids, empty, bad id, too long)."""
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise ValueError(f"prompts must be a list of token-id lists, e.g. [[1, 2, 3]]; got {type(prompts).__name__} "
                         f"{str(prompts)[:80]}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    for i, prompt in enumerate(prompts):
        j = next((j for j, t in enumerate(prompt) if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if j is not None:
            raise ValueError(f"prompts[{i}][{j}] = {prompt[j]!r} ({type(prompt[j]).__name__}) is not an integer "
                             f"token id")
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
                 kv_pool_blocks: int | None = None, max_prefill_tokens: int = 0,
                 mem_fraction_static: float | None = None):
        """kv_pool_blocks: blocks of the paged KV pool per layer, the null block included (a serving engine's
        fixed pool); None: each generate() sizes its pool to what its requests need.
        max_prefill_tokens (scheduler_config): prompt tokens one prefill step packs at most; the prompts are
        prefilled in consecutive groups within it (0: all at once). mem_fraction_static (scheduler_config): the
        share of the device's memory the weights and the KV cache may take, checked before the cache is
        allocated (None: no check)."""
        # The runner's tensors (KV cache, block table, metadata) live where the model's weights do.
        model_device = next(model.parameters()).device
        if device is not None and torch.device(device) != model_device:
            raise ValueError(f"ModelRunner device {device} differs from the model's device {model_device}; "
                             f"build the model on the device it runs on (load_model(..., device=...))")
        self.model, self.block_size, self.device = model, check_block_size(block_size), model_device
        if kv_pool_blocks is not None and (not isinstance(kv_pool_blocks, int) or kv_pool_blocks < 2):
            raise ValueError(f"kv_pool_blocks={kv_pool_blocks!r} must be an int >= 2 (block 0 is the null block)")
        self.kv_pool_blocks = kv_pool_blocks
        if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens!r} must be an int >= 0 (0: no limit)")
        self.max_prefill_tokens, self.mem_fraction_static = max_prefill_tokens, mem_fraction_static
        self.clock = time.perf_counter   # phase timer; the latency harness may swap it (e.g. thread CPU time)
        # One decode step, ids [B] (one token per running request) -> logits [B, V]: the model (eager) or its
        # compiled decode graph (ge_graph / acl_graph, optimized/executor/graph.py; a batch shrunk by finished requests
        # runs in its own, smaller captured bucket).
        groups = model.groups
        self.dp_size, self.dp_rank, self.attn_tp_size = groups.parallel.attn_dp_size, groups.dp_rank, groups.attn_tp.size
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
        kind = ("per-token FP8, fp32 scale caches" if self.kv_cache_dtype in QUANTIZED_DTYPES else "unquantized, the model dtype")
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
        self.check_mc2(len(prompts))
        sampling = sampling or GREEDY
        eos = _eos_set(eos_token_id)
        positions = self._check_positions(prompts, prompt_logits_positions)
        if self.dp_size > 1:
            return self._generate_dp(prompts, max_new_tokens, sampling, eos, positions, return_logits)
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
        self._check_memory(num_blocks)
        cache = PagedKVCache(self.num_layers, num_blocks, self.block_size, self.kv_heads, self.head_dim,
                             self.kv_cache_dtype, self.device)
        table = block_table([cache.allocate(n) for n in budget], self.device)
        lengths = [len(p) for p in prompts]
        result = GenerationResult(tokens=[[] for _ in prompts], finish_reasons=["length"] * len(prompts),
                                  logits=[[] for _ in prompts] if return_logits else None)

        start = self.clock()
        chunks = [self._prefill(prompts, table, positions, rows, cache) for rows in self._prefill_groups(prompts)]
        logits = torch.cat([last for _, last in chunks])
        if positions is not None:
            result.prompt_logits = [rows for kept, _ in chunks for rows in kept]
        active, active_table = list(range(len(prompts))), table   # the running requests and their block rows
        next_ids = _choose(sampler, logits, active)
        synchronize(self.device)
        result.prefill_seconds = self.clock() - start

        while True:
            if return_logits:
                for row, request in enumerate(active):
                    result.logits[request].append(logits[row].float().cpu())
            still = [row for row, (request, token) in enumerate(zip(active, next_ids.tolist()))
                     if _take_token(result, request, token, eos, max_new_tokens)]
            if not still:
                break
            if len(still) < len(active):  # finished requests leave the batch: no more decode work for them
                keep = torch.tensor(still, device=self.device)
                next_ids, active_table = next_ids[keep], active_table[keep]
                active = [active[row] for row in still]
            start = self.clock()
            meta = self.decode_metadata([lengths[r] for r in active], active_table)
            logits = self.decode_forward(next_ids, meta, cache.layers)
            next_ids = _choose(sampler, logits, active)
            synchronize(self.device)
            result.decode_seconds.append(self.clock() - start)
            for r in active:
                lengths[r] += 1
        if return_logits:
            result.logits = [torch.stack(rows) for rows in result.logits]
        return result

    def _generate_dp(self, prompts, max_new_tokens, sampling, eos, positions, return_logits) -> GenerationResult:
        """`generate` under attention DP. DP group d runs requests [d*m, (d+1)*m), m = ceil(B / D) (the batch padded
        with one-token dummy requests, whose results are dropped), with a paged KV cache of its own requests only.
        As in the recipe, each DP group's ranks compute its logits and sample its requests; the chosen ids (with the
        non-finite flag they carry) are then shared over the job (`_share`), so every rank knows every request's
        tokens and takes the same decisions: a group whose requests have all finished keeps stepping its first
        request (results dropped) until every group is done, as the MoE exchanges need every rank in each step.
        Logits cross DP groups only when the caller asks for them (prompt positions, return_logits)."""
        batch, groups_n = len(prompts), self.dp_size
        per = -(-batch // groups_n)
        requests = prompts + [[0]] * (groups_n * per - batch)                    # dummies pad the batch
        groups = [list(range(d * per, (d + 1) * per)) for d in range(groups_n)]
        mine = groups[self.dp_rank]
        heaviest = max(sum(len(requests[r]) for r in g) for g in groups)
        if self.max_prefill_tokens and heaviest > self.max_prefill_tokens:
            raise ValueError(f"a DP group's prompts hold {heaviest} tokens, more than max_prefill_tokens="
                             f"{self.max_prefill_tokens} (scheduler_config): prefill in several steps under "
                             f"attention DP is not implemented; raise it or lower the batch")
        unseeded = not sampling.greedy and sampling.seed is None
        sampler = Sampler(sampling, len(requests), seed=shared_seed(self.device) if unseeded else None)
        budget = [len(requests[r]) + max_new_tokens for r in mine]
        self._check_memory(1 + sum(-(-n // self.block_size) for n in budget))
        cache = PagedKVCache(self.num_layers, 1 + sum(-(-n // self.block_size) for n in budget), self.block_size,
                             self.kv_heads, self.head_dim, self.kv_cache_dtype, self.device)
        table = block_table([cache.allocate(n) for n in budget], self.device)   # row j: request mine[j]
        lengths = [len(p) for p in requests]
        result = GenerationResult(tokens=[[] for _ in prompts], finish_reasons=["length"] * batch,
                                  logits=[[] for _ in prompts] if return_logits else None)

        # Prefill: the logits of each request's last token, after those of its asked prompt positions (real ones).
        asked = [positions[r] if positions is not None and r < batch else [] for r in range(len(requests))]
        picks = tuple(sum(len(asked[r]) + 1 for r in g) for g in groups)
        offsets = [sum(lengths[r] for r in mine[:j]) for j in range(len(mine))]
        wanted = [offsets[j] + i for j, r in enumerate(mine) for i in [*asked[r], lengths[r] - 1]]
        start = self.clock()
        ids, meta, _ = self.prefill_inputs([requests[r] for r in mine], table)
        meta.dp = DataParallelBatch(tuple(sum(lengths[r] for r in g) for g in groups), self.attn_tp_size, picks)
        logits = self.model(ids, meta, cache.layers,
                            logits_indices=torch.tensor(wanted, dtype=torch.long, device=self.device))
        ends = list(itertools.accumulate(len(asked[r]) + 1 for r in mine))    # each request's rows end with its last
        own = logits[torch.tensor([e - 1 for e in ends], device=self.device)]    # [per, V] this group's requests
        next_ids = self._share(_choose(sampler, own, mine), [len(g) for g in groups])
        if positions is not None or return_logits:
            every = self._share(logits, list(picks)).float().cpu()               # asked for: logits cross groups
            rows = iter(every.split([len(asked[r]) + 1 for r in range(len(requests))]))
            per_request = [next(rows) for _ in requests]
            if positions is not None:
                result.prompt_logits = [per_request[r][:-1] for r in range(batch)]
            logits = torch.stack([rows_r[-1] for rows_r in per_request])
        synchronize(self.device)
        result.prefill_seconds = self.clock() - start

        order = list(range(len(requests)))
        running = set(range(batch))
        next_token = {}
        while True:
            for row, (request, token) in enumerate(zip(order, next_ids.tolist())):   # the step's one host read
                next_token[request] = max(token, 0)   # a dropped row's non-finite logits (-1): any id keeps it going
                if request not in running:                                        # a dummy or a keep-alive row
                    continue
                if return_logits:
                    result.logits[request].append(logits[row].float().cpu())
                if not _take_token(result, request, token, eos, max_new_tokens):
                    running.discard(request)
            if not running:
                break
            step = [[r for r in g if r in running] or g[:1] for g in groups]    # g[:1]: the group's keep-alive
            rows = step[self.dp_rank]
            start = self.clock()
            meta = self.decode_metadata([lengths[r] for r in rows],
                                        table[torch.tensor([mine.index(r) for r in rows], device=self.device)])
            meta.dp = DataParallelBatch(tuple(len(g) for g in step), self.attn_tp_size)
            logits = self.decode_forward(torch.tensor([next_token[r] for r in rows], device=self.device), meta,
                                         cache.layers)                            # [len(rows), V] this group's
            counts = [len(g) for g in step]
            next_ids = self._share(_choose(sampler, logits, rows), counts)
            if return_logits:
                logits = self._share(logits, counts)
            order = [r for g in step for r in g]
            synchronize(self.device)
            result.decode_seconds.append(self.clock() - start)
            for r in order:
                lengths[r] += 1
        if return_logits:
            result.logits = [torch.stack(rows) for rows in result.logits]
        return result

    def _share(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every DP group's rows of `x`, group by group: gathered over the attention DP group
        (one rank per DP group, the ranks of equal attention TP rank); `counts[d]`: group d's rows."""
        return comm.all_gather(x, self.model.groups.attn_dp.group, sizes=counts)

    def _prefill_groups(self, prompts) -> list[list[int]]:
        """Consecutive groups of requests, each packing at most max_prefill_tokens prompt tokens (FIFO, the
        recipe's prefill budget); one group when there is no budget."""
        budget = self.max_prefill_tokens
        if not budget:
            return [list(range(len(prompts)))]
        groups, tokens = [[]], 0
        for i, prompt in enumerate(prompts):
            if len(prompt) > budget:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, more than max_prefill_tokens={budget} "
                                 f"(scheduler_config): no prefill step can hold it")
            if tokens + len(prompt) > budget:
                groups.append([])
                tokens = 0
            groups[-1].append(i)
            tokens += len(prompt)
        return groups

    def _prefill(self, prompts, table, positions, rows: list[int], cache):
        """One prefill step of requests `rows`: (their asked prompt-position logits on the host, or [], and the
        logits [len(rows), V] at their last prompt token)."""
        group = [prompts[r] for r in rows]
        rows_t = torch.tensor(rows, device=self.device) if len(rows) < table.shape[0] else None
        ids, meta, last = self.prefill_inputs(group, table if rows_t is None else table[rows_t])
        offsets = [sum(len(p) for p in group[:i]) for i in range(len(group))]
        wanted = [offsets[i] + j for i, r in enumerate(rows) for j in (positions[r] if positions else [])]
        indices = torch.cat([torch.tensor(wanted, dtype=last.dtype, device=self.device), last])
        logits = self.model(ids, meta, cache.layers, logits_indices=indices)
        kept = []
        if positions is not None:
            kept = list(logits[:len(wanted)].float().cpu().split([len(positions[r]) for r in rows]))
        return kept, logits[len(wanted):]

    def _check_memory(self, num_blocks: int) -> None:
        """mem_fraction_static: the weights and a KV pool of `num_blocks` blocks fit that share of the device."""
        if self.mem_fraction_static is None:
            return
        from optimized.executor.kv_cache import bytes_per_token
        from optimized.platform import memory_bytes
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = num_blocks * self.block_size * bytes_per_token(self.num_layers, self.kv_heads, self.head_dim,
                                                            self.kv_cache_dtype)
        total = memory_bytes(self.device)
        if weights + kv > self.mem_fraction_static * total:
            gib = 1 << 30
            raise ValueError(f"the weights ({weights / gib:.2f} GiB) and the KV cache ({kv / gib:.2f} GiB, "
                             f"{num_blocks} blocks of {self.block_size} tokens) need more than mem_fraction_static="
                             f"{self.mem_fraction_static} of the device's {total / gib:.2f} GiB; shorten the "
                             f"requests, lower the batch, or raise scheduler_config.mem_fraction_static")

    def check_mc2(self, batch: int) -> None:
        """The MC2 group's HCCL window holds this decode batch and the batch is within the MC2 kernels' limits
        (enforced on an NPU host or in strict mode, where the kernel would refuse it), else a clear error before any
        step."""
        mc2 = getattr(self.model.groups, "moe_ep_mc2", None)
        if mc2 is not None:
            from optimized.distributed.decode_plan import check_mc2_limits, check_mc2_window
            from optimized.ops.validation import DIMS, strict_npu_limits
            parallel = self.model.groups.parallel
            check_mc2_window(self.model.config, parallel, batch, self.model.dtype.itemsize, mc2.window_mb)
            check_mc2_limits(self.model.config, parallel, batch,
                             enforce=platform.backend_name() == "npu" or strict_npu_limits(DIMS))

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


def _take_token(result: GenerationResult, request: int, token: int, eos, max_new_tokens: int) -> bool:
    """Append `token` (from `_choose`) to `request`'s tokens; True while the request goes on (no EOS, budget left).
    A -1 (non-finite logits) stops generation with an error naming the step and the request."""
    if token < 0:
        step = len(result.decode_seconds)
        raise NonFiniteLogitsError(
            f"{'the prefill' if step == 0 else f'decode step {step}'} produced non-finite logits (NaN or "
            f"inf) for request {request}, after {len(result.tokens[request])} generated token(s): "
            f"generation stopped; a weight is not finite (the load-time weight check names it) or the "
            f"activations overflowed")
    result.tokens[request].append(token)
    if token in eos:
        result.finish_reasons[request] = "eos"
        return False
    return len(result.tokens[request]) < max_new_tokens


def _choose(sampler: Sampler, logits: torch.Tensor, requests: list[int]) -> torch.Tensor:
    """The sampled ids [B], -1 where a row of logits is not finite. The flag rides in the ids the loop reads
    anyway (one `tolist()` per step): no extra device-to-host sync. Sampling gets finite rows (multinomial
    would refuse a NaN row before the flag is read)."""
    finite = torch.isfinite(logits).all(-1)                                      # [B]
    if not sampler.params.greedy:
        logits = logits.masked_fill(~finite.unsqueeze(-1), 0.0)
    return torch.where(finite, sampler(logits, requests), -1)


def shared_seed(device: torch.device) -> int:
    """A fresh random seed, the same on every rank (rank 0's, broadcast) when the model is sharded."""
    import torch.distributed as dist
    # From the OS, not torch's default generator (which every process starts with the same fixed seed).
    seed = torch.tensor([secrets.randbits(31)], device=device)   # hccl / nccl broadcast device tensors only
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed)
