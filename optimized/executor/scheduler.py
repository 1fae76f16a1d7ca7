"""Continuous batching: which requests the next engine step runs, and the KV blocks each holds (host bookkeeping
only, no tensors).

`Scheduler.schedule(pools) -> Step`: a prefill (the admitted requests, FIFO per attention-DP group, prefill first,
within the group's batch share, `max_prefill_tokens` and free blocks), else a decode of every running request (with
the blocks taken as tokens start new ones, `Step.grown`, and the group's most recent request preempted when its pool
is empty, `Step.preempted`), else idle. A group with nothing to run in a non-idle step runs a dummy row.

With chunked prefill (`chunk_budget`), `_schedule_chunked` decides instead: per group, decode rows first, then
prefill chunks within the step's tokens, all in one "mixed" step of extends (`Step.chunks`); a plain decode when no
group has a chunk. docs/architecture.md.

Under attention DP a request joins a group when it is added, for good: the group with the least load in tokens, a
group's load being the token budgets (prompt + max_tokens: the most KV each may come to hold) of its running and
waiting requests; on a tie the lowest-numbered group (`least_loaded`). Requests of equal budgets are dealt round
robin; every rank adds the same requests in the same order, so every rank deals them alike (`deal` is the rule for a
batch added together, which sizes `generate`'s pool).

Invariants: the decode after a prefill never preempts (admission leaves the running requests' next blocks free); a
request admitted can always finish (`check_admissible` refuses one whose whole budget cannot fit its pool alone); a
preempted request goes back to the head of its queue keeping its tokens and is recomputed (`Request.prefill_ids`);
every rank running the same scheduler over the same requests takes the same decisions. docs/architecture.md.

With prefix caching (`prefix_identity` given), a request is admitted over the longest run of its full blocks already
cached in its group's pool (`Request.cached_tokens`: its prefill computes only the rest, at least its last token,
whose logits choose the next one); the full blocks it computes are registered at admission and those its decode
filled when it leaves (finished or preempted). A request that returns prompt logits (echo, prompt_positions) is
computed whole (its prompt's logits are needed), its blocks still registered for others.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from optimized.executor.prefix_cache import block_hashes
from optimized.executor.sampling import GREEDY, SamplingParams


@dataclass(eq=False)
class Request:
    """One generation request as the engine sees it (token ids in, token ids out)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_ids: frozenset[int] = frozenset()  # EOS ids of the checkpoint, unless ignored
    logprobs: int | None = None  # top-k logprobs per generated token (0: only the chosen one)
    prompt_logprobs: bool = False  # echo: the logprob of every prompt token after the first
    record_logits: bool = False  # keep fp32 logits of every chosen token (tests, debugging)
    prompt_positions: list[int] | None = None  # prompt positions whose fp32 logits to keep (generate --save-logits)
    stream: int = 0  # the sampling stream of its seed (a batch's request index)
    hold_kv: bool = False  # prefill-decode disaggregation: finished, its blocks are held for the KV transfer
    # filled by the engine
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    dp_group: int = 0
    finish_reason: str | None = None  # "stop" (EOS / stop string), "length", "abort" or "error"
    error: str | None = None  # with finish_reason "error": what went wrong
    arrival_step: int = -1
    first_token_step: int = -1
    logits: list = field(default_factory=list)  # with record_logits: [V] fp32 host rows, one per token
    prompt_logits: object = None  # with prompt_positions: [len(prompt_positions), V] fp32 host rows
    prompt_logprob_values: list | None = None  # with prompt_logprobs: (logprob, top) per prompt token 1..
    preemptions: int = 0  # times its blocks were taken back (it was recomputed after)
    cached_tokens: int = 0  # of prefill_ids, found in the prefix cache at its last admission (not computed again)
    block_hashes: list = field(default_factory=list)  # prefix-cache keys of prefill_ids' full blocks (so far)
    prefill_left: int = 0  # chunked prefill: tokens of prefill_ids not yet in the KV cache (0: it decodes)
    in_flight: int = 0  # overlapped scheduling: tokens chosen on the device and not read yet (counted in length)

    @property
    def budget(self) -> int:
        """Tokens the request may occupy in the KV cache: its prompt and every token it may generate."""
        return len(self.prompt) + self.max_tokens

    @property
    def length(self) -> int:
        """Tokens in the KV cache after the next step's input is written: prompt + generated - 1 (generated: read
        back, and chosen but not read yet)."""
        return len(self.prompt) + len(self.tokens) + self.in_flight - 1

    @property
    def prefill_ids(self) -> list[int]:
        """What its next prefill writes to the KV cache: the prompt, then (recomputed after a preemption) the tokens
        it generated; the prefill's last row chooses its next token."""
        return self.prompt + self.tokens

    @property
    def echo(self) -> bool:
        """Its prefill returns the prompt's logprobs (asked for, and not already returned before a preemption)."""
        return self.prompt_logprobs and not self.tokens

    @property
    def kept_prompt_positions(self) -> list[int]:
        """Prompt positions whose logits the prefill returns besides the last: echo's (0 .. len - 2), then
        prompt_positions' (none when it is recomputed: the first prefill returned them)."""
        if self.tokens:
            return []
        echo = list(range(len(self.prompt) - 1)) if self.prompt_logprobs else []
        return echo + list(self.prompt_positions or [])


def least_loaded(loads: list[int]) -> int:
    """The group a new request joins: the least load, the lowest index on a tie."""
    return min(range(len(loads)), key=lambda g: (loads[g], g))


def deal(budgets: list[int], dp_groups: int) -> list[int]:
    """The groups of requests of these token budgets added in this order to an idle scheduler (`Scheduler.add`)."""
    loads, groups = [0] * dp_groups, []
    for n in budgets:
        groups.append(least_loaded(loads))
        loads[groups[-1]] += n
    return groups


@dataclass(frozen=True)
class Chunk:
    """One row of a mixed step: `length` tokens of the request written from position `start` over its KV so far
    (an extend); a decode row is its one input token. `last`: the row's logits choose the request's next token."""

    request: Request
    start: int
    length: int
    last: bool
    decode: bool = False


@dataclass(frozen=True)
class Step:
    kind: str  # "prefill" | "decode" | "mixed" | "idle"
    requests: tuple[Request, ...] = ()  # every group's, group by group (a group's in its batch order)
    # a decode step's block changes, in the order taken: (request, its row in its group's batch before it left)
    # for each preempted request, (request, table column) for each block a running request took
    preempted: tuple[tuple[Request, int], ...] = ()
    grown: tuple[tuple[Request, int], ...] = ()
    # a mixed step's rows, every group's (a group's in its batch order: decode rows, then prefill chunks), and the
    # requests admitted in it (their batch rows are new)
    chunks: tuple[Chunk, ...] = ()
    admitted: tuple[Request, ...] = ()


class Scheduler:
    def __init__(
        self,
        batch_size: int,
        max_prefill_tokens: int,
        block_size: int,
        total_blocks: int,
        dp_groups: int = 1,
        prefix_identity: tuple[str, ...] | None = None,
        chunk_budget: int = 0,
    ):
        """total_blocks: blocks a request may ever hold, i.e. a group's pool without its null block.
        dp_groups: attention-DP groups; each runs at most ceil(batch_size / dp_groups) requests at once.
        prefix_identity: the KV cache's identity (prefix_cache.cache_identity) with prefix caching on; None: off.
        chunk_budget: chunked prefill's tokens per step per group (decode rows first, then prefill chunks); 0: off,
        a step is a prefill or a decode."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} must be >= 0 (0: no prefill token budget)")
        if dp_groups < 1:
            raise ValueError(f"dp_groups={dp_groups} must be >= 1")
        self.batch_size, self.max_prefill_tokens = batch_size, max_prefill_tokens
        self.block_size, self.total_blocks, self.dp_groups = block_size, total_blocks, dp_groups
        self.group_batch = -(-batch_size // dp_groups)
        self.waiting: list[deque[Request]] = [deque() for _ in range(dp_groups)]
        self.running: list[list[Request]] = [[] for _ in range(dp_groups)]
        self.group_tokens = [0] * dp_groups  # each group's load: its running and waiting requests' budgets
        self.prefix_identity = prefix_identity
        # prefix caching: prompt tokens looked up in the cache at admission, and those found (every group's)
        self.prefix_queries = self.prefix_hits = 0
        if chunk_budget and chunk_budget < self.group_batch:
            raise ValueError(
                f"scheduler_config.max_num_batched_tokens={chunk_budget} is less than the {self.group_batch} "
                f"requests a DP group decodes at once: every decode row needs its token in each step"
            )
        self.chunk_budget = chunk_budget
        # chunked prefill: prefill rows run (pieces of prompts), those that stopped short of the prompt's end, and
        # steps that carried decode rows and prefill chunks together
        self.prefill_chunks = self.partial_chunks = self.mixed_steps = 0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def blocks_needed(self, request: Request) -> int:
        """The most blocks the request can ever hold: its whole budget's."""
        return self.blocks_for(request.budget)

    def blocks_at_admission(self, request: Request) -> int:
        """Blocks its prefill writes (prompt and tokens so far) and the one its first decode token is written to
        (none past the last token it may write: budget - 1, the last generated token is never fed back)."""
        return self.blocks_for(min(len(request.prefill_ids) + 1, request.budget - 1))

    def _growth(self, request: Request) -> int:
        """Blocks a running request takes at its next decode: the one its next token starts, if it does."""
        return max(0, self.blocks_for(request.length + 1) - len(request.blocks))

    def next_blocks(self, group: int) -> int:
        """Blocks the group's running requests take at their next decode: what an admission leaves free (a request
        still prefilling holds its blocks already: none)."""
        return sum(self._growth(r) for r in self.running[group])

    def check_admissible(self, request: Request) -> None:
        """ValueError when the request could never run (so it is refused, never left waiting forever)."""
        if not self.chunk_budget and self.max_prefill_tokens and len(request.prompt) > self.max_prefill_tokens:
            raise ValueError(
                f"the prompt has {len(request.prompt)} tokens, more than scheduler_config."
                f"max_prefill_tokens={self.max_prefill_tokens}"
            )
        if self.blocks_needed(request) > self.total_blocks:
            raise ValueError(
                f"{len(request.prompt)} prompt + {request.max_tokens} max tokens need "
                f"{self.blocks_needed(request)} KV blocks of {self.block_size}; the pool has "
                f"{self.total_blocks}"
            )

    def add(self, request: Request) -> None:
        self.check_admissible(request)
        self.join(request, self.least_loaded_group())
        self.waiting[request.dp_group].append(request)

    def least_loaded_group(self) -> int:
        return least_loaded(self.group_tokens)

    def join(self, request: Request, group: int) -> None:
        """The request belongs to `group` from now on and counts in its load until it `leave`s."""
        request.dp_group = group
        self.group_tokens[group] += request.budget

    def leave(self, request: Request) -> None:
        self.group_tokens[request.dp_group] -= request.budget

    def schedule(self, pools) -> Step:
        """The next step. pools: each group's `BlockPool` (kv_cache.py), from which admitted requests take their
        blocks here (`Request.blocks`) and running requests their next one; admitted requests move from waiting to
        running, preempted ones back to waiting."""
        if self.chunk_budget:
            return self._schedule_chunked(pools)
        admitted = [self._admit(g, pools[g]) for g in range(self.dp_groups)]
        if any(admitted):
            for g, new in enumerate(admitted):
                for r in new:  # after every admission: a prefix computed in this step is no hit in it
                    self._cache_blocks(r, pools[g], len(r.prefill_ids))
                self.running[g].extend(new)
            return Step("prefill", tuple(r for new in admitted for r in new))
        if any(self.running):
            preempted, grown = [], []
            for g in range(self.dp_groups):
                self._grow(g, pools[g], preempted, grown)
            return Step("decode", tuple(r for group in self.running for r in group), tuple(preempted), tuple(grown))
        return Step("idle")

    def _admit(self, group: int, pool) -> list[Request]:
        running, waiting = self.running[group], self.waiting[group]
        admitted, tokens = [], 0
        reserve = self.next_blocks(group)  # the running requests' next blocks stay free
        while waiting:
            head = waiting[0]
            hit = self._cached_prefix(head, pool)
            n = len(head.prefill_ids) - len(hit) * self.block_size  # tokens its prefill computes
            room = len(running) + len(admitted) < self.group_batch
            within = (
                not self.max_prefill_tokens or tokens + n <= self.max_prefill_tokens or (not admitted and head.tokens)
            )  # a recompute past the budget: alone
            new = self.blocks_at_admission(head) - len(hit)
            if not (room and within and new + pool.evictable(hit) <= pool.free_blocks - reserve):
                break
            self._take_blocks(waiting.popleft(), pool, hit, new)
            admitted.append(head)
            tokens += n
        return admitted

    def _take_blocks(self, request: Request, pool, hit: list[int], new: int) -> None:
        """An admitted request's blocks: its cached prefix `hit` (shared) and `new` fresh ones; counted as a prefix
        cache query when it looked one up."""
        pool.share(hit)
        request.blocks, request.cached_tokens = hit + pool.take(new), len(hit) * self.block_size
        if self._looks_up(request):
            self.prefix_queries += len(request.prefill_ids)
            self.prefix_hits += request.cached_tokens

    def _looks_up(self, request: Request) -> bool:
        """Prefix caching is on and the request may reuse cached blocks (its prefill returns no prompt logits)."""
        return self.prefix_identity is not None and not request.kept_prompt_positions

    def _cached_prefix(self, request: Request, pool) -> list[int]:
        """The cached blocks its admission would reuse: its longest cached run of full blocks, short of its last
        token (which is always computed)."""
        if not self._looks_up(request):
            return []
        ids = request.prefill_ids
        request.block_hashes = block_hashes(ids, self.block_size, self.prefix_identity, request.block_hashes)
        return pool.cached_prefix(request.block_hashes[: (len(ids) - 1) // self.block_size])

    def _cache_blocks(self, request: Request, pool, written: int) -> None:
        """Register the request's full blocks among its first `written` tokens (prompt, then generated)."""
        if self.prefix_identity is None:
            return
        ids = (request.prompt + request.tokens)[:written]
        request.block_hashes = block_hashes(ids, self.block_size, self.prefix_identity, request.block_hashes)
        for i in range(min(len(ids) // self.block_size, len(request.blocks))):
            pool.cache(request.blocks[i], request.block_hashes[i])

    def cache_written(self, request: Request, pool) -> None:
        """A running request leaving (finished or preempted): its blocks the decode filled are cached too (a
        request still in its chunked prefill: the chunks computed)."""
        if request.prefill_left:
            self._cache_blocks(request, pool, len(request.prefill_ids) - request.prefill_left)
        else:
            self._cache_blocks(request, pool, request.length)

    # ---- chunked prefill (chunk_budget): one kind of step carries decode rows and prefill chunks
    def _schedule_chunked(self, pools) -> Step:
        """Per group: every decode row grows its next block (preempting the most recent request when the pool is
        empty, as a decode), then the step's remaining tokens go to the running requests' unfinished prefills in
        admission order, then to new admissions (FIFO, a first chunk each). A step with any chunk in any group is
        "mixed" (every group runs its decode rows in it as one-token extends, a group with none a dummy row);
        without one it is a plain decode."""
        whole = self._whole_prefill(pools)
        if whole is not None:
            return whole
        preempted, grown, groups, admitted = [], [], [], []
        for g in range(self.dp_groups):
            self._grow(g, pools[g], preempted, grown, decoding_only=True)
            groups.append(self._chunks(g, pools[g], admitted))
        rows = tuple(c for group in groups for c in group)
        if not any(not c.decode for c in rows):
            if not any(self.running):
                return Step("idle")
            return Step("decode", tuple(r for group in self.running for r in group), tuple(preempted), tuple(grown))
        for c in rows:  # after every admission: a prefix computed in this step is no hit in it
            if not c.decode:
                self._cache_blocks(c.request, pools[c.request.dp_group], c.start + c.length)
        self.mixed_steps += any(c.decode for c in rows)
        return Step(
            "mixed", tuple(c.request for c in rows if c.last), tuple(preempted), tuple(grown), rows, tuple(admitted)
        )

    def _whole_prefill(self, pools) -> Step | None:
        """A request returning prompt logits (echo, prompt_positions) needs its prompt in one prefill: once it heads
        its group's queue and no prefill of the group is under way, it is admitted alone in a plain prefill step
        (every decode row waits that step, as unchunked; past the budget if it must)."""
        for g in range(self.dp_groups):
            waiting = self.waiting[g]
            if not waiting or not waiting[0].kept_prompt_positions or any(r.prefill_left for r in self.running[g]):
                continue
            new = self._admit_one(g, pools[g])
            if new is None:
                continue
            new.prefill_left = 0
            self._cache_blocks(new, pools[g], len(new.prefill_ids))
            self.running[g].append(new)
            self.prefill_chunks += 1
            return Step("prefill", (new,))
        return None

    def _chunks(self, group: int, pool, admitted: list) -> list[Chunk]:
        """The group's rows: its decode rows, then prefill chunks within the step's remaining tokens (unfinished
        prefills first, then admissions); `Request.prefill_left` counts down as chunks are taken."""
        rows, budget = [], self.chunk_budget
        for r in self.running[group]:
            if not r.prefill_left:
                rows.append(Chunk(r, r.length, 1, True, decode=True))
                budget -= 1
        for r in self.running[group]:
            if r.prefill_left and budget > 0:
                rows.append(self._take_chunk(r, budget))
                budget -= rows[-1].length
        waiting = self.waiting[group]
        while budget > 0 and not (waiting and waiting[0].kept_prompt_positions):  # those: `_whole_prefill`
            new = self._admit_one(group, pool)
            if new is None:
                break
            admitted.append(new)
            self.running[group].append(new)
            rows.append(self._take_chunk(new, budget))
            budget -= rows[-1].length
        return rows

    def _take_chunk(self, request: Request, budget: int) -> Chunk:
        total = len(request.prefill_ids)
        start, n = total - request.prefill_left, min(request.prefill_left, budget)
        request.prefill_left -= n
        self.prefill_chunks += 1
        self.partial_chunks += bool(request.prefill_left)
        return Chunk(request, start, n, not request.prefill_left)

    def _admit_one(self, group: int, pool) -> Request | None:
        """The group's next waiting request, admitted with every block its prefill writes and the one its first
        token starts (the chunks then only extend over them), over its cached prefix; None when the batch share
        or the pool has no room for it (the running requests' next blocks stay free)."""
        running, waiting = self.running[group], self.waiting[group]
        if not waiting or len(running) >= self.group_batch:
            return None
        head = waiting[0]
        hit = self._cached_prefix(head, pool)
        new = self.blocks_at_admission(head) - len(hit)
        if new + pool.evictable(hit) > pool.free_blocks - self.next_blocks(group):
            return None
        self._take_blocks(waiting.popleft(), pool, hit, new)
        head.prefill_left = len(head.prefill_ids) - head.cached_tokens
        return head

    def _grow(self, group: int, pool, preempted: list, grown: list, decoding_only: bool = False) -> None:
        """Every running request of the group gets the block its next token needs, in batch order; when none is
        free, the most recently admitted running request is preempted, until one is (or the request itself was).
        decoding_only (chunked prefill): a request still prefilling holds its blocks already."""
        running, i = self.running[group], 0
        while i < len(running):
            request = running[i]
            if decoding_only and request.prefill_left:
                i += 1
                continue
            need = self._growth(request)
            while need > pool.free_blocks and running[-1] is not request:
                self._preempt(group, pool, preempted)
            if need > pool.free_blocks:  # it is the most recent itself
                self._preempt(group, pool, preempted)
                break
            for block in pool.take(need):
                grown.append((request, len(request.blocks)))
                request.blocks.append(block)
            i += 1

    def _preempt(self, group: int, pool, preempted: list) -> None:
        victim = self.running[group].pop()
        self.cache_written(victim, pool)
        pool.release(victim.blocks)
        victim.blocks = []
        victim.prefill_left = 0  # recomputed whole at its next admission
        victim.preemptions += 1
        self.waiting[group].appendleft(victim)
        preempted.append((victim, len(self.running[group])))

    def remove(self, request: Request) -> None:
        """A finished or aborted request leaves the batch (or the queue, if it never ran)."""
        group = request.dp_group
        if request in self.running[group]:
            self.running[group].remove(request)
        elif request in self.waiting[group]:
            self.waiting[group].remove(request)
        else:
            return
        self.leave(request)

    def num_waiting(self) -> int:
        return sum(len(w) for w in self.waiting)

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    @property
    def idle(self) -> bool:
        return not any(self.waiting) and not any(self.running)
