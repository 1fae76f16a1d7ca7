"""Continuous batching: which requests the next engine step runs (host bookkeeping only, no tensors).

Rules, in order, every step:
- each request belongs to one attention-DP group (one group without DP), chosen when it is added: the group with
  the fewest requests (waiting or running), the lowest-numbered on a tie, so a batch added together is dealt round
  robin;
- prefill has priority: in every group, if the head of its FIFO waiting queue fits, it is admitted, with as many
  of the group's waiting requests as fit, in arrival order (no overtaking: the first that does not fit stops the
  group's admission). If any group admitted a request the step is a prefill (groups that admitted none run a
  one-token dummy prefill, so the collectives stay in lockstep);
- a request fits when its group's batch has room (running + admitted < the group's share of `batch_size`), the
  group's prompt tokens stay within `max_prefill_tokens` (0: no token budget) and the group's paged KV pool has
  the blocks for its whole budget (prompt + max_tokens) free: a running request never waits for memory;
- otherwise the step decodes every running request of every group (a group with none runs a dummy decode);
- nothing to do: an idle step (a multi-rank server still steps all ranks together, see serving/ranks.py).

Every rank runs the same scheduler over the same requests, so every rank takes the same decisions with no
communication. Blocks are taken at admission and given back when a request finishes or is aborted (a client
disconnect), which is what admits the next waiting request.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from optimized.executor.sampling import GREEDY, SamplingParams


@dataclass(eq=False)
class Request:
    """One generation request as the engine sees it (token ids in, token ids out)."""
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_ids: frozenset[int] = frozenset()        # EOS ids of the checkpoint, unless ignored
    logprobs: int | None = None                    # top-k logprobs per generated token (0: only the chosen one)
    prompt_logprobs: bool = False                  # echo: the logprob of every prompt token after the first
    record_logits: bool = False                    # keep fp32 logits of every chosen token (tests, debugging)
    prompt_positions: list[int] | None = None      # prompt positions whose fp32 logits to keep (generate --save-logits)
    stream: int = 0                                # the sampling stream of its seed (a batch's request index)
    # filled by the engine
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    dp_group: int = 0
    finish_reason: str | None = None               # "stop" (EOS / stop string), "length", "abort" or "error"
    error: str | None = None                       # with finish_reason "error": what went wrong
    arrival_step: int = -1
    first_token_step: int = -1
    logits: list = field(default_factory=list)     # with record_logits: [V] fp32 host rows, one per token
    prompt_logits: object = None                   # with prompt_positions: [len(prompt_positions), V] fp32 host rows
    prompt_logprob_values: list | None = None      # with prompt_logprobs: (logprob, top) per prompt token 1..

    @property
    def budget(self) -> int:
        """Tokens the request may occupy in the KV cache: its prompt and every token it may generate."""
        return len(self.prompt) + self.max_tokens

    @property
    def length(self) -> int:
        """Tokens in the KV cache after the next step's input is written: prompt + generated - 1."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def kept_prompt_positions(self) -> list[int]:
        """Prompt positions whose logits the prefill returns besides the last: echo's and prompt_positions'."""
        if self.prompt_positions is not None:
            return list(self.prompt_positions)
        return list(range(len(self.prompt) - 1)) if self.prompt_logprobs else []


@dataclass(frozen=True)
class Step:
    kind: str                 # "prefill" | "decode" | "idle"
    requests: tuple[Request, ...] = ()   # every group's, group by group (a group's in its batch order)


class Scheduler:
    def __init__(self, batch_size: int, max_prefill_tokens: int, block_size: int, total_blocks: int,
                 dp_groups: int = 1):
        """total_blocks: blocks a request may ever hold, i.e. a group's pool without its null block.
        dp_groups: attention-DP groups; each runs at most ceil(batch_size / dp_groups) requests at once."""
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

    def blocks_needed(self, request: Request) -> int:
        return math.ceil(request.budget / self.block_size)

    def check_admissible(self, request: Request) -> None:
        """ValueError when the request could never run (so it is refused, never left waiting forever)."""
        if self.max_prefill_tokens and len(request.prompt) > self.max_prefill_tokens:
            raise ValueError(f"the prompt has {len(request.prompt)} tokens, more than scheduler_config."
                             f"max_prefill_tokens={self.max_prefill_tokens}")
        if self.blocks_needed(request) > self.total_blocks:
            raise ValueError(f"{len(request.prompt)} prompt + {request.max_tokens} max tokens need "
                             f"{self.blocks_needed(request)} KV blocks of {self.block_size}; the pool has "
                             f"{self.total_blocks}")

    def add(self, request: Request) -> None:
        self.check_admissible(request)
        load = [len(w) + len(r) for w, r in zip(self.waiting, self.running)]
        request.dp_group = load.index(min(load))
        self.waiting[request.dp_group].append(request)

    def schedule(self, free_blocks: list[int]) -> Step:
        """The next step; admitted requests move from waiting to running (the engine allocates their blocks).
        free_blocks: each group's free blocks."""
        admitted = [self._admit(g, free_blocks[g]) for g in range(self.dp_groups)]
        if any(admitted):
            for g, new in enumerate(admitted):
                self.running[g].extend(new)
            return Step("prefill", tuple(r for new in admitted for r in new))
        if any(self.running):
            return Step("decode", tuple(r for group in self.running for r in group))
        return Step("idle")

    def _admit(self, group: int, free: int) -> list[Request]:
        admitted, tokens, waiting = [], 0, self.waiting[group]
        while waiting:
            head = waiting[0]
            room = len(self.running[group]) + len(admitted) < self.group_batch
            within = not self.max_prefill_tokens or tokens + len(head.prompt) <= self.max_prefill_tokens
            need = self.blocks_needed(head)
            if not (room and within and need <= free):
                break
            admitted.append(waiting.popleft())
            tokens += len(head.prompt)
            free -= need
        return admitted

    def remove(self, request: Request) -> None:
        """A finished or aborted request leaves the batch (or the queue, if it never ran)."""
        group = request.dp_group
        if request in self.running[group]:
            self.running[group].remove(request)
        elif request in self.waiting[group]:
            self.waiting[group].remove(request)

    def num_waiting(self) -> int:
        return sum(len(w) for w in self.waiting)

    def num_running(self) -> int:
        return sum(len(r) for r in self.running)

    @property
    def idle(self) -> bool:
        return not any(self.waiting) and not any(self.running)
