"""The engine: the one loop that generates. Continuous batching over a paged KV cache and a device-resident batch.

`Engine.add(request)` queues a request (`RequestTooLarge` when it can never fit), `abort(request_id)` drops one, and
`step() -> (Step, [TokenEvent])` runs one step the scheduler chose: a prefill of the newly admitted requests or a
decode of every running one, then one batched token choice and one device-to-host read (the chosen ids and the
logprobs asked for, packed in one float32 vector; raw logits rows only for requests that asked). With chunked
prefill a step may instead be "mixed" (`_mixed_step`): decode rows and prefill chunks as one extend forward.
With async_scheduling a decode that follows a decode is scheduled and launched before the previous step is read back
(`_overlapped_step`: one step of lag, the shown tokens unchanged).
`generate` is the engine run to completion (`ModelRunner.generate`), `serve` feeds it from HTTP.

Invariants: a request's tokens depend only on its prompt and sampling (its own blocks and seeded draws), not on who
else is in the batch; non-finite logits end that request with finish_reason "error", never the engine. Under
attention DP every rank runs the same scheduler over the same requests, a group with nothing to run steps a dummy
token, and the packed read vectors are gathered over the DP groups, so every rank knows every request's tokens.
docs/architecture.md tells the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from optimized.distributed import collectives as comm
from optimized.executor.device_batch import PAD_KV_LEN, DeviceBatch
from optimized.layers.eplb.controller import EplbController
from optimized.executor.kv_cache import BlockPool, PagedKVCache, slot_mapping
from optimized.executor.kv_handoff import KvHandoff
from optimized.executor.sampling import MAX_STOP_IDS, fresh_seed
from optimized.executor.scheduler import Request, Scheduler, Step
from optimized.errors import UsageError
from optimized.ops import batch_invariant
from optimized.forward_metadata import DataParallelBatch, ForwardMetadata


class RequestTooLarge(UsageError, ValueError):
    """A request that can never fit (context length, KV pool, prefill token budget): HTTP 413."""


@dataclass
class TokenEvent:
    """One generated token of one request, as a step produced it."""

    request: Request
    token: int
    logprob: float | None = None  # log-softmax of the chosen token (when asked)
    top_logprobs: list[tuple[int, float]] | None = None  # the request's top-k (token, logprob), best first
    finished: bool = False
    error: str | None = None  # the request failed at this step (non-finite logits)


@dataclass
class Launched:
    """A decode step on the device whose results are not read yet (overlapped scheduling): its rows per group and
    every group's packed read vector, gathered, still a device tensor."""

    step: Step
    groups: list[list[Request]]
    packed: torch.Tensor
    sizes: list[int]


@dataclass(frozen=True)
class StepTiming:
    kind: str
    seconds: float


def with_seed(request: Request) -> Request:
    """Unseeded sampling gets a fresh seed here, once, so every rank that runs the request draws the same."""
    if request.sampling.greedy or request.sampling.seed is not None:
        return request
    return replace(request, sampling=replace(request.sampling, seed=fresh_seed()))


def decode_metadata(
    positions: torch.Tensor,
    kv_lens: list[int],
    table: torch.Tensor,
    block_size: int,
    dp: DataParallelBatch | None = None,
) -> ForwardMetadata:
    """A decode step's metadata as the engine builds it from its device batch: each row's new token at its position
    (a device tensor) attends to `kv_lens[b]` keys (host: the scheduler's lengths + 1), the table cut to the columns
    the longest row uses (contiguous, as the attention kernel takes it) and each token's cache slot computed on the
    device. No host-to-device copy."""
    batch = positions.shape[0]
    width = max(math.ceil(n / block_size) for n in kv_lens)
    table = table[:, :width].contiguous()
    rows = torch.arange(batch, device=positions.device)
    return ForwardMetadata(
        is_prefill=False,
        positions=positions,
        actual_seq_lengths_cu_q=list(range(1, batch + 1)),
        actual_seq_lengths_kv=list(kv_lens),
        slot_mapping=slot_mapping(table, rows, positions, block_size),
        block_table=table,
        block_size=block_size,
        dp=dp,
    )


class Engine:
    def __init__(
        self,
        runner,
        *,
        batch_size: int,
        max_prefill_tokens: int = 0,
        num_blocks: int,
        enable_prefix_caching: bool | None = None,
        chunked_prefill_tokens: int | None = None,
        async_scheduling: bool | None = None,
    ):
        """num_blocks: the KV pool per layer (per DP group under attention DP), the null block included.
        enable_prefix_caching (scheduler_config): a request's cached full-block prefix is reused, its prefill an
        extend over it (optimized/executor/prefix_cache.py); None: the runner's setting (the assembly sets it from
        the config, so every engine built over that runner honours the key).
        chunked_prefill_tokens: chunked prefill's tokens per step per DP group (scheduler_config
        max_num_batched_tokens with enable_chunked_prefill), 0: off; None: the runner's setting.
        async_scheduling (scheduler_config): a decode step that follows a decode is scheduled and launched before
        the previous step's results are read back (`_overlapped_step`); None: the runner's setting."""
        self.runner, self.model, self.device = runner, runner.model, runner.device
        self.dp_size, self.dp_rank = runner.dp_size, runner.dp_rank
        if enable_prefix_caching is None:
            enable_prefix_caching = getattr(runner, "enable_prefix_caching", False)
        identity = _prefix_identity(runner) if enable_prefix_caching else None
        if chunked_prefill_tokens is None:
            chunked_prefill_tokens = _runner_chunk_budget(runner)
        if chunked_prefill_tokens:
            _check_extends(runner, "enable_chunked_prefill")
            _check_chunk_budget(chunked_prefill_tokens, batch_size, self.dp_size)
        self.scheduler = Scheduler(
            batch_size,
            max_prefill_tokens,
            runner.block_size,
            num_blocks - 1,
            self.dp_size,
            identity,
            chunked_prefill_tokens,
        )
        runner.check_mc2(batch_size)  # the largest decode batch: MC2 window and kernel limits
        runner.check_memory(num_blocks)  # mem_fraction_static: the weights and this pool fit
        self.cache = PagedKVCache(
            runner.num_layers,
            num_blocks,
            runner.block_size,
            runner.kv_heads,
            runner.head_dim,
            runner.kv_cache_dtype,
            self.device,
        )
        # Every DP group's block bookkeeping (host), this rank's with its tensors.
        self.pools = [
            self.cache if g == self.dp_rank else BlockPool(num_blocks, runner.block_size) for g in range(self.dp_size)
        ]
        width = math.ceil(runner.max_positions / runner.block_size)
        self.batch = DeviceBatch(self.scheduler.group_batch, width, self.device, runner.vocab_size)
        self.requests: dict[str, Request] = {}
        self.handoff = KvHandoff()  # prefill-decode disaggregation: held, reserved and KV-filled requests
        self.steps = 0
        # parallel_config.enable_eplb: routed-token counts and rebalances, between steps (None when off)
        self.eplb = EplbController.for_model(self.model)
        if async_scheduling is None:
            async_scheduling = getattr(runner, "async_scheduling", False)
        self.async_scheduling = bool(async_scheduling)
        self._pending: Launched | None = None  # the launched decode step not read yet
        self.overlapped_steps = 0  # steps launched while the previous one was still unread
        # The last step's kind and wall time (a serving engine runs for days: one value, not a growing log), and
        # each warm-up bucket's.
        self.last_timing: StepTiming | None = None
        self.warm_up_timings: dict[int, float] = {}

    # ---- requests in and out
    def check(self, request: Request) -> None:
        """ValueError (RequestTooLarge for sizes) naming what is wrong; nothing is truncated."""
        r = self.runner
        if not request.prompt:
            raise ValueError("the prompt is empty: it needs at least one token")
        bad = [t for t in request.prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < r.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {r.vocab_size})")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens!r} must be an integer >= 1")
        if len(request.prompt) + request.max_tokens > r.max_positions:
            raise RequestTooLarge(
                f"{len(request.prompt)} prompt tokens + max_tokens {request.max_tokens} exceed the "
                f"model's context length max_position_embeddings={r.max_positions}"
            )
        q = request.sampling
        bad = [t for t, _ in q.logit_bias if t >= r.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {r.vocab_size})")
        if q.min_tokens > request.max_tokens:
            raise ValueError(f"min_tokens={q.min_tokens} is more than max_tokens={request.max_tokens}")
        if q.min_tokens and len(request.stop_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"min_tokens holds back at most {MAX_STOP_IDS} stop ids; the request has {len(request.stop_ids)}"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        try:
            self.scheduler.check_admissible(request)
        except ValueError as e:
            raise RequestTooLarge(str(e)) from None

    def add(self, request: Request) -> None:
        self.check(request)
        if not request.sampling.greedy and request.sampling.seed is None:
            raise ValueError("sampling without a seed: give the request one (engine.with_seed) before adding it")
        request.arrival_step = self.steps
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Drop a request (a client that went away): its blocks go back to the pool now."""
        if self.handoff.drop(self, request_id):
            return
        request = self.requests.get(request_id)
        if request is not None:
            request.finish_reason = request.finish_reason or "abort"
            self._finish(request)

    def _finish(self, request: Request) -> None:
        self._finish_all([request])

    def _finish_all(self, requests: list[Request]) -> None:
        """Requests that leave together (a step's finished ones): this group's rows close up in one compaction
        (`DeviceBatch.remove_rows`: one gather per tensor), then each leaves the scheduler and frees its blocks
        (a prefill instance's request whose KV is sent on keeps them, held)."""
        running = self.scheduler.running[self.dp_rank]
        self.batch.remove_rows([running.index(r) for r in requests if r.dp_group == self.dp_rank and r in running])
        for request in requests:
            request.in_flight = 0  # a token still on the device is never shown; its KV is not cached
            group = request.dp_group
            self.scheduler.remove(request)
            if request.finish_reason != "error":  # what it wrote is cached (a failed request's KV is not trusted)
                self.scheduler.cache_written(request, self.pools[group])
            self.requests.pop(request.request_id, None)
            if request.hold_kv and request.finish_reason in ("stop", "length"):  # its KV is sent on: blocks stay
                self.handoff.hold(request)
                continue
            self.pools[group].release(request.blocks)
            request.blocks = []

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and self._pending is None

    @property
    def kv_usage(self) -> float:
        """Share of the pools' blocks (null blocks excluded) held by requests, over every DP group."""
        total = sum(p.num_blocks - 1 for p in self.pools)
        return (total - sum(p.free_blocks for p in self.pools)) / total

    @torch.no_grad()
    def warm_up(self, buckets) -> None:
        """Run one decode step of every graph bucket (its graph compiled, or loaded from the compile cache) on
        dummy rows into the null block, every rank together: done before a server opens its port."""
        if self.runner.decode_forward is self.model:
            return
        for bucket in buckets:
            start = self.runner.clock()
            zeros = torch.zeros(bucket, dtype=torch.int64, device=self.device)
            meta = ForwardMetadata(
                is_prefill=False,
                positions=zeros,
                actual_seq_lengths_cu_q=list(range(1, bucket + 1)),
                actual_seq_lengths_kv=[PAD_KV_LEN] * bucket,
                slot_mapping=zeros,
                block_table=torch.zeros(bucket, 1, dtype=torch.int32, device=self.device),
                block_size=self.runner.block_size,
                dp=self._dp([bucket] * self.dp_size),
            )
            with self._invariant():
                self.runner.decode_forward(zeros, meta, self.cache.layers).float().sum().item()
            self.warm_up_timings[bucket] = self.runner.clock() - start

    # ---- one step
    @torch.no_grad()
    def step(self) -> tuple[Step, list[TokenEvent]]:
        """One step run and read back: the step and its token events. With async_scheduling a call may also launch
        the next decode step before it reads this one (`_overlapped_step`)."""
        if self.async_scheduling:
            return self._overlapped_step()
        start = self.runner.clock()  # the step's wall time: scheduling to bookkeeping (the host overhead's base)
        return self._step(start, self._schedule())

    def _step(self, start: float, step: Step) -> tuple[Step, list[TokenEvent]]:
        """A scheduled step run synchronously: its forward, its token choice and its one host read."""
        if step.kind == "idle":
            self.last_timing = StepTiming("idle", 0.0)
            return step, []
        if step.kind == "mixed":
            events = self._mixed_step(step)
            self.last_timing = StepTiming(step.kind, self.runner.clock() - start)
            return step, events
        groups = self._by_group(step)
        if step.kind == "prefill":
            own = groups[self.dp_rank]
            span = self.batch.admit(own)
            logits, kept, ids = self._prefill(groups, span)
        else:
            self._apply_blocks(step)
            span = (0, self.batch.n)
            logits, kept, ids = self._decode(groups), None, None
        events = self._events(step, groups, self._read(groups, logits, span, step.kind, kept, ids))
        self._finish_all([event.request for event in events if event.finished])
        self.last_timing = StepTiming(step.kind, self.runner.clock() - start)
        return step, events

    def _schedule(self) -> Step:
        if self.eplb is not None:  # before the step, on every rank alike: the last step's counts, a rebalance
            self.eplb.between_steps()
        step = self.scheduler.schedule(self.pools)  # admitted requests take their blocks, running ones grow
        self.steps += 1
        return step

    # ---- overlapped scheduling
    def _overlapped_step(self) -> tuple[Step, list[TokenEvent]]:
        """Step N (launched by the previous call, else now) is read back only after step N + 1 is scheduled and
        launched: N + 1's inputs are N's chosen ids and positions, already in the device batch (`record`), and the
        scheduler counts N's tokens as `Request.in_flight`. One step of lag: a request that N finishes (EOS, stop,
        abort) has computed one more token in N + 1, dropped here unread. Only a decode that follows a decode
        overlaps; anything else (a possible admission, a mixed step, recorded logits) first reads the launched
        step back and then runs synchronously."""
        start = self.runner.clock()
        launched, self._pending = self._pending, None
        if launched is None:
            step = self._schedule()
            if not self._launchable(step):
                return self._step(start, step)
            launched = self._launch(step)
        if self._follows(launched):
            step = self._schedule()
            if not self._launchable(step):
                raise RuntimeError(f"an overlapped step was scheduled as {step.kind!r}, not a plain decode")
            self._pending = self._launch(step)
            self.overlapped_steps += 1
        events = self._complete(launched)
        self.last_timing = StepTiming(launched.step.kind, self.runner.clock() - start)
        return launched.step, events

    def _launchable(self, step: Step) -> bool:
        """A step that may run without its results read at once: a decode whose rows keep no logits on the host."""
        return step.kind == "decode" and not any(r.record_logits for r in step.requests)

    def _follows(self, launched: Launched) -> bool:
        """The next step may be scheduled before `launched` is read: it can only be a decode of the running requests
        (no group with room in its batch has a request waiting, no prefill under way, no row keeps raw logits: a
        request waiting for room is admitted a step after the read that frees it), and some row may still show
        a token (not every row stops at max_tokens with its token in flight). A decode that preempts overlaps too:
        the preempted request leaves with its token in flight, read with the launched step before any admission."""
        s = self.scheduler
        if not any(s.running) or any(w and len(r) < s.group_batch for w, r in zip(s.waiting, s.running)):
            return False
        rows = [r for group in s.running for r in group]
        if any(r.prefill_left or r.record_logits for r in rows):
            return False
        return not all(len(r.tokens) + r.in_flight >= r.max_tokens for r in rows)

    def _launch(self, step: Step) -> Launched:
        """Run a decode step's forward, choose its tokens into the device batch and gather the packed read vectors,
        with no host read."""
        groups = self._by_group(step)
        self._apply_blocks(step)
        packed, sizes = self._gather(groups, self._decode(groups), (0, self.batch.n), "decode", None, None)
        for r in step.requests:
            r.in_flight += 1
        return Launched(step, groups, packed, sizes)

    def _complete(self, launched: Launched) -> list[TokenEvent]:
        """The launched step's one host read and its events; a request finished meanwhile shows nothing."""
        values = _split(launched.packed.tolist(), launched.sizes)
        for r in launched.step.requests:
            r.in_flight = max(0, r.in_flight - 1)
        events = self._events(launched.step, launched.groups, values)
        self._finish_all([e.request for e in events if e.finished])
        return events

    def _apply_blocks(self, step: Step) -> None:
        """This group's rows follow the decode step's block changes: a preempted request's row leaves (the last row:
        the most recently admitted), and the blocks running requests took are written into their table rows, all
        in one small host-to-device copy."""
        running = self.scheduler.running[self.dp_rank]
        self.batch.remove_rows([row for request, row in step.preempted if request.dp_group == self.dp_rank])
        grown = [(running.index(r), column, r.blocks[column]) for r, column in step.grown if r.dp_group == self.dp_rank]
        if grown:
            self.batch.grow(grown)

    def _by_group(self, step: Step) -> list[list[Request]]:
        groups = [[] for _ in range(self.dp_size)]
        for r in step.requests:
            groups[r.dp_group].append(r)
        return groups

    def _dp(self, sizes: list[int], picks: list[int] | None = None, groups=None) -> DataParallelBatch | None:
        """The step's DP sizes; `groups`: each DP group's rows (requests or chunks), empty where it steps a dummy."""
        if self.dp_size == 1:
            return None
        picks = None if picks is None else tuple(picks)
        idle = () if groups is None else tuple(not g for g in groups)
        return DataParallelBatch(tuple(sizes), self.runner.attn_tp_size, picks, idle)

    def _prefill(self, groups, span):
        """Logits [picks, V]: this group's kept prompt rows, then each request's last-token row; a group with no
        admitted request runs one dummy token into the null block (logits row dropped)."""
        own = groups[self.dp_rank]
        if own:
            table = self.batch.table[span[0] : span[1]]
            # the columns the prompts use, contiguous as the attention kernel takes it (a device copy)
            table = table[:, : max(math.ceil(len(r.prefill_ids) / self.runner.block_size) for r in own)].contiguous()
            cached = [r.cached_tokens for r in own]  # a prefix-cache hit: an extend over the cached blocks
            ids, meta, indices = self.runner.prefill_inputs(
                [r.prefill_ids[c:] for r, c in zip(own, cached)],
                table,
                keep=[r.kept_prompt_positions for r in own],
                cached_lens=cached if any(cached) else None,
            )
        else:
            dummy = self.batch.dummy
            ids, meta, indices = self.runner.prefill_inputs([[0]], self.batch.table[dummy : dummy + 1, :1])
        n_kept = sum(len(r.kept_prompt_positions) for r in own)
        meta.dp = self._dp(
            [sum(len(r.prefill_ids) - r.cached_tokens for r in g) or 1 for g in groups],
            [sum(len(r.kept_prompt_positions) + 1 for r in g) or 1 for g in groups],
            groups,
        )
        with self._invariant():
            logits = self.runner.model(ids, meta, self.cache.layers, logits_indices=indices)
        return logits[n_kept:], logits[:n_kept], ids

    def _decode(self, groups) -> torch.Tensor:
        own, b, dummy = groups[self.dp_rank], self.batch, self.batch.dummy
        start, end = (0, b.n) if own else (dummy, dummy + 1)
        kv_lens = [r.length + 1 for r in own] or [PAD_KV_LEN]
        meta = decode_metadata(
            b.positions[start:end],
            kv_lens,
            b.table[start:end],
            self.runner.block_size,
            self._dp([len(g) or 1 for g in groups], groups=groups),
        )
        with self._invariant():
            return self.runner.decode_forward(b.last_ids[start:end], meta, self.cache.layers)

    def _invariant(self):
        """The runner's batch-invariant mode around a forward (a compiled decode graph is traced inside it)."""
        return batch_invariant.mode(getattr(self.runner, "batch_invariant", False))

    # ---- chunked prefill: a mixed step
    def _mixed_step(self, step: Step) -> list[TokenEvent]:
        """Decode rows and prefill chunks in one extend forward: the block changes applied, the admitted requests'
        rows written, one logits row per chunk; the rows whose chunk ends their prefill and the decode rows choose
        their tokens exactly as a prefill and a decode would (their batch rows' sampling state, read back once)."""
        self._apply_blocks(step)
        self.batch.admit([r for r in step.admitted if r.dp_group == self.dp_rank])
        chunks = [[] for _ in range(self.dp_size)]
        for c in step.chunks:
            chunks[c.request.dp_group].append(c)
        own = chunks[self.dp_rank]
        running = self.scheduler.running[self.dp_rank]
        if [c.request for c in own] != running[: len(own)]:
            raise RuntimeError("a mixed step's rows are not the group's first running rows in batch order")
        logits = self._mixed_forward(chunks)
        groups = [[c.request for c in g if c.last] for g in chunks]
        n = len(groups[self.dp_rank])
        if any(not c.last for c in own[:n]):
            raise RuntimeError("only a group's last row of a mixed step may stop short of its prefill's end")
        values = self._read(groups, logits[:n] if n else logits, (0, n), "mixed", None)
        decoding = sum(c.decode for c in own)
        self.batch.positions[:decoding] += 1  # the decode rows moved one position on (prefills: already past)
        events = self._events(step, groups, values)
        self._finish_all([event.request for event in events if event.finished])
        return events

    def _mixed_forward(self, chunks) -> torch.Tensor:
        own = chunks[self.dp_rank]
        if own:
            block = self.runner.block_size
            width = max(math.ceil((c.start + c.length) / block) for c in own)
            table = self.batch.table[: len(own), :width].contiguous()
            ids, meta, indices = self.runner.prefill_inputs(
                [_chunk_ids(c) for c in own], table, cached_lens=[c.start for c in own]
            )
        else:
            dummy = self.batch.dummy
            ids, meta, indices = self.runner.prefill_inputs([[0]], self.batch.table[dummy : dummy + 1, :1])
        meta.dp = self._dp([sum(c.length for c in g) or 1 for g in chunks], [len(g) or 1 for g in chunks], chunks)
        return self.runner.model(ids, meta, self.cache.layers, logits_indices=indices)

    # ---- choosing and reading back
    def _layout(self, rows: list[Request], kind: str) -> list[int]:
        """Sizes of one group's packed read vector, from host data every rank has: the chosen ids; when a row asked
        for logprobs, every row's chosen logprob and top-k values and ids (k: the most any row asked; no row index
        to copy to the device); in a prefill, the echo rows' prompt logprobs and their top-k."""
        if not rows:
            return [1]  # the dummy's id
        k = max((r.logprobs for r in rows if r.logprobs is not None), default=-1)
        n = len(rows)
        sizes = [n, n if k >= 0 else 0, 2 * n * max(k, 0)]
        if kind == "prefill":
            echo = [r for r in rows if r.echo]
            k_echo = max((r.logprobs or 0 for r in echo), default=0)
            n_echo = sum(len(r.prompt) - 1 for r in echo)
            sizes += [n_echo, 2 * n_echo * k_echo]
        return sizes

    def _pack(self, rows, logits, kept, span, kind, ids) -> torch.Tensor:
        """This group's packed read vector (float32: ids and top-k ids are exact below 2^24)."""
        if not rows:
            return logits.float().argmax(-1)[:1].float()
        sampled = any(not r.sampling.greedy for r in rows)
        chosen = self._choose(logits, span, sampled)
        self.batch.record(*span, chosen, decoded=kind == "decode")
        parts = [chosen.float()]
        k = max((r.logprobs for r in rows if r.logprobs is not None), default=-1)
        if k >= 0:
            lp = self._log_softmax(logits)
            parts.append(lp.gather(1, chosen.clamp(min=0).unsqueeze(1)).squeeze(1))
            if k:
                top = torch.topk(lp, k, dim=-1)
                parts += [top.values.flatten(), top.indices.float().flatten()]
        if kind == "prefill" and any(r.echo for r in rows):
            k = max(r.logprobs or 0 for r in rows if r.echo)
            lp, targets, offset, token = [], [], 0, 0
            for r in rows:
                n = len(r.kept_prompt_positions)
                if r.echo:  # its first kept rows, 0 .. len-2, predict prompt tokens 1 .. len-1 (on the device: ids)
                    lp.append(self._log_softmax(kept[offset : offset + len(r.prompt) - 1]))
                    targets.append(ids[token + 1 : token + len(r.prompt)])
                offset += n
                token += len(r.prefill_ids) - r.cached_tokens  # the tokens it computed (echo: all)
            lp = torch.cat(lp)
            parts.append(lp.gather(1, torch.cat(targets).long().unsqueeze(1)).squeeze(1))
            if k:
                top = torch.topk(lp, k, dim=-1)
                parts += [top.values.flatten(), top.indices.float().flatten()]
        return torch.cat(parts)

    def _log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 log-probabilities of each row; batch-invariant: each row alone, from a fresh copy (the CPU kernel's
        result for a row depends on where the row starts in memory)."""
        if getattr(self.runner, "batch_invariant", False):
            return batch_invariant.by_row(lambda row: torch.log_softmax(row.float(), dim=-1), logits)
        return torch.log_softmax(logits.float(), dim=-1)

    def _choose(self, logits: torch.Tensor, span, sampled: bool) -> torch.Tensor:
        from optimized.executor.sampling import choose

        b = self.batch
        if getattr(self.runner, "batch_invariant", False) and logits.shape[0] > 1:  # each row as if alone
            rows = [(span[0] + i, logits[i : i + 1].clone()) for i in range(logits.shape[0])]
            return torch.cat([self._choose(row, (at, at + 1), sampled) for at, row in rows])
        return choose(
            logits,
            b.sampling_rows(*span) if sampled else None,
            b.penalty_rows(*span),
            b.sampling.draws[span[0] : span[1]],
        )

    def _share(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every DP group's rows of `x`, group by group, gathered over the attention DP group (one rank per DP
        group: the ranks of equal attention TP rank); `counts[d]`: group d's rows."""
        if self.dp_size == 1:
            return x
        return comm.all_gather(x, self.model.groups.attn_dp.group, sizes=counts)

    def _read(self, groups, logits, span, kind, kept, ids=None) -> list[list[float]]:
        """The step's one host read: every group's packed vector (this group's computed here, the others'
        gathered), split per group."""
        packed, sizes = self._gather(groups, logits, span, kind, kept, ids)
        values = packed.tolist()
        self._keep_logits_rows(groups, logits, kept, kind)
        return _split(values, sizes)

    def _gather(self, groups, logits, span, kind, kept, ids) -> tuple[torch.Tensor, list[int]]:
        """Every group's packed vector on the device, group by group (this group's chosen and packed here, the
        others' gathered), and each group's length."""
        packed = self._pack(groups[self.dp_rank], logits, kept, span, kind, ids)
        sizes = [sum(self._layout(g, kind)) for g in groups]
        return self._share(packed, sizes), sizes

    def _keep_logits_rows(self, groups, logits, kept, kind) -> None:
        """Raw fp32 rows for the requests that asked (record_logits, prompt_positions): gathered over DP groups
        when any request of the step asked, then copied to the host."""
        asks = [[r.record_logits for r in g] for g in groups]
        prompt = kind == "prefill" and any(r.prompt_positions is not None and not r.tokens for g in groups for r in g)
        if not prompt and not any(map(any, asks)):
            return
        own = groups[self.dp_rank]
        rows = logits if own else logits[:1]
        if kind == "prefill":
            kept_own = kept if own else logits[:0]
            rows = torch.cat([kept_own, rows])
            sizes = [sum(len(r.kept_prompt_positions) for r in g) + (len(g) or 1) for g in groups]
        else:
            sizes = [len(g) or 1 for g in groups]
        every = self._share(rows.float(), sizes).cpu()
        at = 0
        for g, n in zip(groups, sizes):
            block, at = every[at : at + n], at + n
            if not g:
                continue
            n_kept = sum(len(r.kept_prompt_positions) for r in g) if kind == "prefill" else 0
            prompt_rows, last_rows = block[:n_kept], block[n_kept:]
            offset = 0
            for i, r in enumerate(g):
                if kind == "prefill":
                    n = len(r.kept_prompt_positions)
                    if r.prompt_positions is not None and not r.tokens:  # after echo's rows, when both
                        r.prompt_logits = prompt_rows[offset + n - len(r.prompt_positions) : offset + n]
                    offset += n
                if r.record_logits:
                    r.logits.append(last_rows[i])

    def _events(self, step: Step, groups, values: list[list[float]]) -> list[TokenEvent]:
        events = []
        for g, rows in enumerate(groups):
            if not rows:
                continue
            sizes, v = self._layout(rows, step.kind), values[g]
            n = len(rows)
            ids = [int(t) for t in v[:n]]
            k = sizes[2] // (2 * n)
            chosen_lp, top_v, top_i = (
                v[n : n + sizes[1]],
                v[2 * n : 2 * n + n * k],
                v[2 * n + n * k : 2 * n + 2 * n * k],
            )
            if step.kind == "prefill":
                self._prompt_logprobs(rows, v[sum(sizes[:3]) :])
            for i, (request, token) in enumerate(zip(rows, ids)):
                if request.finish_reason is not None:  # finished before this step was read (overlapped scheduling)
                    continue
                lp = top = None
                if request.logprobs is not None:
                    lp = chosen_lp[i]
                    top = [(int(top_i[i * k + j]), top_v[i * k + j]) for j in range(request.logprobs)]
                events.append(self._take(request, token, lp, top))
        return events

    def _prompt_logprobs(self, rows, v) -> None:
        echo = [r for r in rows if r.echo]
        if not echo:
            return
        k = max(r.logprobs or 0 for r in echo)
        n_echo = sum(len(r.prompt) - 1 for r in echo)
        values, top_v, top_i = (
            v[:n_echo],
            v[n_echo : n_echo + n_echo * k],
            v[n_echo + n_echo * k : n_echo + 2 * n_echo * k],
        )
        at = 0
        for r in echo:
            n, m = len(r.prompt) - 1, r.logprobs or 0
            r.prompt_logprob_values = [
                (values[at + j], [(int(top_i[(at + j) * k + t]), top_v[(at + j) * k + t]) for t in range(m)])
                for j in range(n)
            ]
            at += n

    def _take(self, request: Request, token: int, lp, top) -> TokenEvent:
        if token < 0:
            request.finish_reason = "error"
            request.error = (
                f"step {self.steps} produced non-finite logits (NaN or inf) for request "
                f"{request.request_id!r} after {len(request.tokens)} generated token(s)"
            )
            return TokenEvent(request, token, finished=True, error=request.error)
        if not request.tokens:
            request.first_token_step = self.steps
        request.tokens.append(token)
        finished = None
        if token in request.stop_ids:
            finished = "stop"
        elif len(request.tokens) >= request.max_tokens:
            finished = "length"
        request.finish_reason = finished
        return TokenEvent(request, token, lp, top, finished is not None)


def _split(values: list[float], sizes: list[int]) -> list[list[float]]:
    """The read vector cut into each group's part."""
    out, at = [], 0
    for n in sizes:
        out.append(values[at : at + n])
        at += n
    return out


def _check_extends(runner, key: str) -> None:
    """The sequence-parallel prefill cannot run an extend (prefill over cached KV): `key` is refused by name."""
    from optimized.phases import SequenceParallelPrefill

    if isinstance(runner.model.prefill, SequenceParallelPrefill):
        raise UsageError(
            f"scheduler_config.{key} needs prefill over cached KV, which the sequence-parallel "
            "prefill (parallel_config.prefill_opt) cannot run: turn one of them off"
        )


def _prefix_identity(runner) -> tuple[str, ...]:
    """The cache identity prefix caching keys blocks by; the sequence-parallel prefill cannot run the extend a hit
    needs, so the combination is refused by name."""
    from optimized.executor.prefix_cache import cache_identity

    _check_extends(runner, "enable_prefix_caching")
    return cache_identity(runner)


def _check_chunk_budget(budget: int, batch_size: int, dp_size: int) -> None:
    """Every decode row takes a token of each step's budget: it must hold a DP group's batch share."""
    share = -(-batch_size // dp_size)
    if budget < share:
        raise UsageError(
            f"scheduler_config.max_num_batched_tokens={budget} is less than the {share} requests a DP group "
            "decodes at once: every decode row needs its token in each step"
        )


def _runner_chunk_budget(runner) -> int:
    """The runner's chunked-prefill step budget (the assembly sets it from scheduler_config), 0 when off."""
    if not getattr(runner, "enable_chunked_prefill", False):
        return 0
    return runner.max_num_batched_tokens


def _chunk_ids(chunk) -> list[int]:
    """A mixed-step row's input tokens: a decode row's last token, or the chunk of its prompt (and, recomputed,
    its tokens so far)."""
    r = chunk.request
    if chunk.decode:
        return [r.tokens[-1]]
    return r.prefill_ids[chunk.start : chunk.start + chunk.length]


def shared_seed(device: torch.device) -> int:
    """A fresh random seed, the same on every rank (rank 0's, broadcast) when the model is sharded."""
    import torch.distributed as dist

    seed = torch.tensor([fresh_seed()], device=device)  # hccl / nccl broadcast device tensors only
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed)
