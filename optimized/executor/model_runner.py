"""The model and its step machinery: a step's inputs and metadata, the decode call (eager or the compiled graph
buckets), the KV cache dtype, the start-up checks (MC2 window and limits, memory).

The engine (executor/engine.py) is the one loop that runs these steps; `ModelRunner.generate` is the library's
short form of it: the engine run to completion over a batch of prompts, timed per step (the time of a step ends
at its one host read, so it is honest on asynchronous devices too).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field, replace

import torch

from optimized.executor import graph
from optimized import platform
from optimized.forward_metadata import ForwardMetadata
from optimized.executor.kv_cache import QUANTIZED_DTYPES, slot_mapping
from optimized.executor.sampling import GREEDY, SamplingParams
from optimized.executor.scheduler import Request
from optimized.layers.quantization.kv_cache import kv_cache_dtype as resolve_kv_cache_dtype
from optimized.ops.required import FP8_KV_CACHE, check_operators

BLOCK_GRANULARITY = 16  # the paged attention kernel's block size granularity (tokens)


class NonFiniteLogitsError(RuntimeError):
    """A step produced NaN / inf logits: generation stops (naming the step and request) instead of choosing
    token 0 forever from a row of NaNs."""


def check_prompts(prompts: list[list[int]], max_new_tokens: int, vocab_size: int, max_positions: int) -> None:
    """ValueError naming the first prompt that cannot be generated from (not token ids, empty, bad id, too long)."""
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise ValueError(
            f"prompts must be a list of token-id lists, e.g. [[1, 2, 3]]; got {type(prompts).__name__} "
            f"{str(prompts)[:80]}"
        )
    if not prompts:
        raise ValueError("prompts is an empty batch: give at least one prompt, e.g. [[1, 2, 3]]")
    empty = next((i for i, p in enumerate(prompts) if len(p) == 0), None)
    if empty is not None:
        raise ValueError(f"prompt {empty} is empty: every prompt needs at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    for i, prompt in enumerate(prompts):
        j = next((j for j, t in enumerate(prompt) if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if j is not None:
            raise ValueError(
                f"prompts[{i}][{j}] = {prompt[j]!r} ({type(prompt[j]).__name__}) is not an integer token id"
            )
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(prompt) + max_new_tokens > max_positions:
            raise ValueError(
                f"prompt {i}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed "
                f"max_position_embeddings={max_positions}"
            )


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per request (the EOS id included when hit)
    prefill_seconds: float = 0.0
    decode_seconds: list[float] = field(default_factory=list)  # one entry per decode step
    finish_reasons: list[str] = field(default_factory=list)  # per request: "eos" or "length"
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
        raise ValueError(
            f"block_size={block_size!r} must be a positive multiple of {BLOCK_GRANULARITY} (the paged "
            f"attention kernel's block granularity), e.g. 128"
        )
    return block_size


def extend_kv_lengths(cached_lens: list[int], prompts: list[list[int]]) -> list[int]:
    """An extend row's KV length: its cached tokens and its new ones."""
    return [c + len(p) for c, p in zip(cached_lens, prompts)]


def _eos_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    return frozenset([int(eos_token_id)] if isinstance(eos_token_id, int) else map(int, eos_token_id))


class ModelRunner:
    def __init__(
        self,
        model,
        block_size: int = 128,
        device: torch.device | str | None = None,
        *,
        exe_mode: str = "eager",
        compile_cache=None,
        kv_cache_dtype: str = "auto",
        kv_pool_blocks: int | None = None,
        max_prefill_tokens: int = 0,
        mem_fraction_static: float | None = None,
        enable_prefix_caching: bool = False,
        batch_invariant: bool = False,
        enable_chunked_prefill: bool = False,
        max_num_batched_tokens: int = 2048,
        graph_buckets: tuple[int, ...] | None = None,
        memory=None,
        async_scheduling: bool = False,
    ):
        """kv_pool_blocks: blocks of the paged KV pool per layer, the null block included (a serving engine's
        fixed pool); None: each generate() sizes its pool to what its requests need.
        max_prefill_tokens (scheduler_config): prompt tokens one prefill step packs at most; the prompts are
        prefilled in consecutive groups within it (0: all at once). mem_fraction_static (scheduler_config): the
        share of the device's memory the weights and the KV cache may take, checked before the cache is
        allocated (None: no check). enable_prefix_caching (scheduler_config): the engines built over
        this runner (generate's, serve's) reuse cached prompt prefixes (prompts prefilled in one step share nothing;
        later groups under max_prefill_tokens and later requests do). batch_invariant
        (model_config): every step computes each row as if it were alone (optimized/ops/batch_invariant.py), so a
        request's logits do not depend on what it is batched with. enable_chunked_prefill and
        max_num_batched_tokens (scheduler_config): the engines built over this runner prefill in chunks of at most
        that many tokens per step, decode rows riding in the same steps. graph_buckets: a graph mode's captured decode
        batches (the plan's); None: the default rule's (1, 2, 4, 8, then every 16), each captured on first use.
        memory: where the memory figures come from (optimized/executor/memory.py; None: the device's own).
        async_scheduling (scheduler_config): the decode steps of the engines built over this runner overlap, each
        scheduled and launched before the previous one's results are read back."""
        # The runner's tensors (KV cache, block table, metadata) live where the model's weights do.
        model_device = next(model.parameters()).device
        if device is not None and torch.device(device) != model_device:
            raise ValueError(
                f"ModelRunner device {device} differs from the model's device {model_device}; "
                f"build the model on the device it runs on (load_model(..., device=...))"
            )
        self.model, self.block_size, self.device = model, check_block_size(block_size), model_device
        if kv_pool_blocks is not None and (not isinstance(kv_pool_blocks, int) or kv_pool_blocks < 2):
            raise ValueError(f"kv_pool_blocks={kv_pool_blocks!r} must be an int >= 2 (block 0 is the null block)")
        self.kv_pool_blocks = kv_pool_blocks
        if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens!r} must be an int >= 0 (0: no limit)")
        self.max_prefill_tokens, self.mem_fraction_static = max_prefill_tokens, mem_fraction_static
        from optimized.executor.memory import device_memory

        self.memory = memory if memory is not None else device_memory(model_device)
        self.activation_bytes = 0  # the activation peak `profile_activations` measured (the memory check adds it)
        self.enable_prefix_caching = enable_prefix_caching
        self.batch_invariant = bool(batch_invariant)
        self.enable_chunked_prefill, self.max_num_batched_tokens = enable_chunked_prefill, max_num_batched_tokens
        self.async_scheduling = bool(async_scheduling)
        self.clock = time.perf_counter  # phase timer; the latency harness may swap it (e.g. thread CPU time)
        # One decode step, ids [B] (one token per running request) -> logits [B, V]: the model (eager) or its
        # compiled decode graph (ge_graph / acl_graph, optimized/executor/graph.py; a batch shrunk by finished requests
        # runs in its own, smaller captured bucket).
        groups = model.groups
        self.dp_size, self.dp_rank, self.attn_tp_size = (
            groups.parallel.attn_dp_size,
            groups.dp_rank,
            groups.attn_tp.size,
        )
        self.decode_forward = graph.decode_forward(model, exe_mode, compile_cache, graph_buckets)
        self._static_pool = 0  # the largest KV pool a generate used with a static decode graph
        config = model.config
        attn = model.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.num_layers, self.max_positions = config.num_hidden_layers, config.max_position_embeddings
        self.vocab_size = config.vocab_size
        # 'auto': the checkpoint's quantization_config.kv_cache_scheme decides (per-token FP8 or 16-bit).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, kv_cache_dtype, model.dtype)
        if self.kv_cache_dtype in QUANTIZED_DTYPES:  # an old torch_npu without it fails here, not mid-step
            check_operators(FP8_KV_CACHE)

    def describe_kv_cache(self, choice: str = "auto") -> str:
        """The start-up line's KV cache: its dtype and where that came from."""
        origin = "the checkpoint's kv_cache_scheme" if choice == "auto" else f"kv_cache_dtype: {choice}"
        kind = (
            "per-token FP8, fp32 scale caches"
            if self.kv_cache_dtype in QUANTIZED_DTYPES
            else "unquantized, the model dtype"
        )
        return f"{str(self.kv_cache_dtype).replace('torch.', '')} ({kind}; from {origin})"

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        eos_token_id: int | list[int] | None = None,
        prompt_logits_positions: list[list[int]] | None = None,
        return_logits: bool = False,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` per prompt: the engine (executor/engine.py) run to completion.

        sampling: greedy when None (or temperature 0); request i samples with stream i of the seed. eos_token_id:
        id(s) that end a request (kept as its last token); None: always `max_new_tokens` (e.g.
        `reference.tokenizer.eos_token_ids(path)` gives a checkpoint's). prompt_logits_positions: per request,
        prompt positions whose logits to return. return_logits: also return the logits every generated token was
        chosen from.
        """
        from optimized.executor.engine import Engine, shared_seed

        check_prompts(prompts, max_new_tokens, self.vocab_size, self.max_positions)
        sampling = sampling or GREEDY
        if not sampling.greedy and sampling.seed is None:  # one collective when sharded; greedy and seeded: none
            sampling = replace(sampling, seed=shared_seed(self.device))
        positions = self._check_positions(prompts, prompt_logits_positions)
        self._check_prefill_budget(prompts)
        eos = _eos_set(eos_token_id)
        requests = [
            Request(
                str(i),
                list(p),
                max_new_tokens,
                sampling,
                eos,
                record_logits=return_logits,
                prompt_positions=None if positions is None else positions[i],
                stream=i,
            )
            for i, p in enumerate(prompts)
        ]
        engine = Engine(
            self,
            batch_size=len(prompts),
            max_prefill_tokens=self.max_prefill_tokens,
            num_blocks=self.pool_blocks(prompts, max_new_tokens),
        )
        for request in requests:
            engine.add(request)
        result = GenerationResult(tokens=[r.tokens for r in requests], finish_reasons=["length"] * len(prompts))
        while not engine.idle:
            _, events = engine.step()
            timing = engine.last_timing
            if timing.kind in ("prefill", "mixed"):  # mixed: chunked prefill's steps (decode rows beside chunks)
                result.prefill_seconds += timing.seconds
            elif timing.kind == "decode":
                result.decode_seconds.append(timing.seconds)
            failed = next((e for e in events if e.error is not None), None)
            if failed is not None:
                step = len(result.decode_seconds)
                raise NonFiniteLogitsError(
                    f"{'the prefill' if timing.kind == 'prefill' else f'decode step {step}'} produced non-finite "
                    f"logits (NaN or inf) for request {int(failed.request.request_id)}, after "
                    f"{len(failed.request.tokens)} generated token(s): generation stopped; a weight is not finite "
                    f"(the load-time weight check names it) or the activations overflowed"
                )
        result.finish_reasons = ["eos" if r.finish_reason == "stop" else "length" for r in requests]
        if positions is not None:
            result.prompt_logits = [r.prompt_logits for r in requests]
        if return_logits:
            result.logits = [torch.stack(r.logits) for r in requests]
        return result

    def pool_blocks(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """The KV pool (per DP group) a `generate` of these prompts needs, the null block included, or the
        runner's fixed `kv_pool_blocks` when it holds them (ValueError when it does not). Under attention DP the
        engine deals a batch added together by load in tokens (scheduler.deal)."""
        from optimized.executor.plan import pool_blocks

        need = pool_blocks([len(p) + max_new_tokens for p in prompts], self.block_size, self.dp_size)
        if self.kv_pool_blocks is not None:
            if self.kv_pool_blocks < need:
                where = " per DP group" if self.dp_size > 1 else ""
                raise ValueError(
                    f"kv_pool_blocks={self.kv_pool_blocks} is too small: these requests need {need} "
                    f"blocks of {self.block_size} tokens{where} (the null block included)"
                )
            need = self.kv_pool_blocks
        elif getattr(self.decode_forward, "static", False):
            # A static graph (ge_graph) has the KV pool among its shapes: the runner's pool only grows, in powers of
            # two, so a few graphs per bucket serve every generate instead of one per pool size.
            need = self._static_pool = max(self._static_pool, 1 << (need - 1).bit_length())
        return need

    def _check_prefill_budget(self, prompts) -> None:
        budget = self.max_prefill_tokens
        for i, prompt in enumerate(prompts):
            if budget and len(prompt) > budget:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, more than max_prefill_tokens={budget} "
                    f"(scheduler_config): no prefill step can hold it"
                )

    def weight_bytes(self) -> int:
        """The model's parameters on this rank, in bytes."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def block_bytes(self) -> int:
        """One block of the KV cache on this rank: K and V of every layer (and their scales when quantized)."""
        from optimized.executor.kv_cache import bytes_per_token

        return self.block_size * bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.kv_cache_dtype)

    def check_memory(self, num_blocks: int) -> None:
        """mem_fraction_static: the weights, the measured activation peak, the memory in use outside the tensors
        (communication buffers) and a KV pool of `num_blocks` blocks fit that share of the device."""
        if self.mem_fraction_static is None:
            return
        weights, kv, act = self.weight_bytes(), num_blocks * self.block_bytes(), self.activation_bytes
        total, other = self.memory.total_bytes(), self.memory.other_bytes()
        if weights + act + other + kv > self.mem_fraction_static * total:
            from optimized.executor.kv_pool import size_text

            raise ValueError(
                f"the weights ({size_text(weights)}), the activation peak ({size_text(act)}), other device memory "
                f"({size_text(other)}) and the KV cache "
                f"({size_text(kv)}, {num_blocks} blocks of {self.block_size} tokens) need more than "
                f"mem_fraction_static={self.mem_fraction_static} of the device's {size_text(total)}; shorten the "
                f"requests, lower the batch or the KV pool, or raise scheduler_config.mem_fraction_static"
            )

    @torch.no_grad()
    def profile_activations(self, prefill_rows: int, prefill_len: int, decode_rows: int) -> int:
        """The activation peak (bytes) of one eager prefill of `prefill_rows` prompts of `prefill_len` tokens and one
        eager decode of `decode_rows` rows, every DP group alike (every rank runs it together), over a scratch cache
        holding the prefill (its bytes not counted); kept in `activation_bytes` for the memory check."""
        from optimized.executor.kv_cache import PagedKVCache, block_table
        from optimized.forward_metadata import DataParallelBatch

        per_row = -(-(prefill_len + 1) // self.block_size)
        cache = PagedKVCache(
            self.num_layers,
            1 + prefill_rows * per_row,
            self.block_size,
            self.kv_heads,
            self.head_dim,
            self.kv_cache_dtype,
            self.device,
        )
        rows = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(prefill_rows)]
        table = block_table(rows, self.device)
        dp = self.dp_size > 1

        def forward():
            ids, meta, indices = self.prefill_inputs([[0] * prefill_len] * prefill_rows, table)
            if dp:
                meta.dp = DataParallelBatch(
                    (prefill_rows * prefill_len,) * self.dp_size, self.attn_tp_size, (prefill_rows,) * self.dp_size
                )
            self.model(ids, meta, cache.layers, logits_indices=indices)
            del ids, meta, indices
            decode_table = table[torch.arange(decode_rows, device=self.device) % prefill_rows]
            positions = torch.ones(decode_rows, dtype=torch.int64, device=self.device)
            meta = ForwardMetadata(
                is_prefill=False,
                positions=positions,
                actual_seq_lengths_cu_q=list(range(1, decode_rows + 1)),
                actual_seq_lengths_kv=[2] * decode_rows,
                slot_mapping=decode_table[:, 0].long() * self.block_size + 1,
                block_table=decode_table[:, :1].contiguous(),
                block_size=self.block_size,
                dp=DataParallelBatch((decode_rows,) * self.dp_size, self.attn_tp_size) if dp else None,
            )
            self.model(torch.zeros(decode_rows, dtype=torch.int64, device=self.device), meta, cache.layers)

        self.activation_bytes = self.memory.peak_bytes(forward)
        return self.activation_bytes

    def check_mc2(self, batch: int) -> None:
        """The MC2 group's HCCL window holds this decode batch (as dispatched: padded to its graph bucket in graph
        mode) and the batch is within the MC2 kernels' limits
        (enforced on an NPU host or in strict mode, where the kernel would refuse it), else a clear error before any
        step."""
        mc2 = getattr(self.model.groups, "moe_ep_mc2", None)
        if mc2 is not None:
            from optimized.distributed.decode_plan import check_mc2_limits, check_mc2_window
            from optimized.ops.validation import DIMS, strict_npu_limits
            from optimized.executor.plan import dispatch_batch

            parallel = self.model.groups.parallel
            # a graph decode pads each DP group's share to its bucket: the padding rows are real rows to MC2
            graph_mode = self.decode_forward is not self.model
            batch = dispatch_batch(batch, self.dp_size, graph_mode, getattr(self.decode_forward, "buckets", None))
            check_mc2_window(self.model.config, parallel, batch, self.model.dtype.itemsize, mc2.window_mb)
            check_mc2_limits(
                self.model.config, parallel, batch, enforce=platform.backend_name() == "npu" or strict_npu_limits(DIMS)
            )

    def _check_positions(self, prompts, positions):
        if positions is None:
            return None
        if len(positions) != len(prompts):
            raise ValueError(f"prompt_logits_positions has {len(positions)} entries for {len(prompts)} prompts")
        for i, (prompt, pos) in enumerate(zip(prompts, positions)):
            bad = [j for j in pos if not (isinstance(j, int) and 0 <= j < len(prompt))]
            if bad:
                raise ValueError(
                    f"prompt_logits_positions[{i}]: position {bad[0]!r} is outside prompt {i} (length {len(prompt)})"
                )
        return [list(pos) for pos in positions]

    def prefill_inputs(
        self,
        prompts: list[list[int]],
        table: torch.Tensor,
        keep: list[list[int]] | None = None,
        cached_lens: list[int] | None = None,
    ):
        """ids [T], the prefill metadata, the index of each prompt's last token [B] (with `keep`, per prompt the
        positions whose logits to keep besides: their indices first, then the last tokens'). The runner knows the
        prompts on the host: the host lists (cumulative lengths) are computed here, once per step, and every
        tensor is created on the model's device from them (the step's metadata build).

        cached_lens (prefill over cached KV, "extend"): per row, the tokens of that request already in the paged
        cache through its `table` row (written by earlier steps); `prompts[b]` is then the row's next tokens, at
        positions cached_lens[b] onwards, and `keep` positions count within them. The table's columns must cover
        cached + new tokens. None (or all zeros): a plain prefill, each prompt from position 0. This is the entry a
        chunked scheduler drives: a prompt prefilled in pieces, each piece one row with the length already done."""
        if cached_lens is not None:
            cached_lens = self._check_cached_lens(prompts, table, cached_lens)
        starts_at = cached_lens or [0] * len(prompts)
        cu = [sum(len(p) for p in prompts[: i + 1]) for i in range(len(prompts))]
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        request_of_token = torch.tensor([i for i, p in enumerate(prompts) for _ in p], device=self.device)
        positions = torch.tensor([c + j for c, p in zip(starts_at, prompts) for j in range(len(p))], device=self.device)
        meta = ForwardMetadata(
            is_prefill=True,
            positions=positions,
            actual_seq_lengths_cu_q=cu,
            # extend: per row, cached + new (the paged kernel's per-batch KV lengths); prefill: cumulative
            actual_seq_lengths_kv=list(cu) if cached_lens is None else extend_kv_lengths(cached_lens, prompts),
            slot_mapping=slot_mapping(table, request_of_token, positions, self.block_size),
            block_table=table,
            block_size=self.block_size,
            cached_lens=cached_lens,
            context_slots=None
            if cached_lens is None
            else self._context_slots(extend_kv_lengths(cached_lens, prompts), table),
        )
        starts = [0, *cu[:-1]]
        kept = [start + j for start, positions in zip(starts, keep or []) for j in positions]
        return ids, meta, torch.tensor(kept + [n - 1 for n in cu], device=self.device)

    def _context_slots(self, kv_lengths: list[int], table: torch.Tensor) -> torch.Tensor:
        """The cache slot of every key of every extend row (positions 0 .. kv_lengths[b] - 1), row by row."""
        rows = torch.tensor([b for b, n in enumerate(kv_lengths) for _ in range(n)], device=self.device)
        positions = torch.tensor([j for n in kv_lengths for j in range(n)], device=self.device)
        return slot_mapping(table, rows, positions, self.block_size)

    def _check_cached_lens(self, prompts, table, cached_lens) -> list[int] | None:
        """The extend rows' cached lengths, checked (UsageError naming the row); None when no row has any (a plain
        prefill). The sequence-parallel prefill cannot take them: each rank holds a slice of the new tokens and its
        attention is the gathered sequence's own, so it is refused by name."""
        from optimized.errors import UsageError
        from optimized.phases import SequenceParallelPrefill

        if len(cached_lens) != len(prompts):
            raise UsageError(f"cached_lens has {len(cached_lens)} entries for {len(prompts)} prefill rows")
        for b, (c, p) in enumerate(zip(cached_lens, prompts)):
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise UsageError(f"cached_lens[{b}] = {c!r} must be an int >= 0 (tokens of row {b} already cached)")
            if -(-(c + len(p)) // self.block_size) > table.shape[1]:
                raise UsageError(
                    f"row {b}: {c} cached + {len(p)} new tokens need {-(-(c + len(p)) // self.block_size)} blocks of "
                    f"{self.block_size}; its block table row has {table.shape[1]} columns"
                )
        if not any(cached_lens):
            return None
        if isinstance(self.model.prefill, SequenceParallelPrefill):
            raise UsageError(
                "prefill over cached KV (cached_lens > 0) is not supported by the sequence-parallel prefill "
                "(parallel_config.prefill_opt): run it with the tensor-parallel prefill (prefill_opt: false)"
            )
        return list(cached_lens)
