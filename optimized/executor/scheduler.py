"""Continuous batching: which requests the next engine step runs (host bookkeeping only, no tensors).

Rules, in order, every step:
- prefill has priority: if the head of the FIFO waiting queue fits, the step is a prefill of as many waiting
  requests as fit, taken in arrival order (no overtaking: the first that does not fit stops admission);
- a request fits when the batch has room (running + admitted < `batch_size`), the step's prompt tokens stay within
  `max_prefill_tokens` (0: no token budget) and the paged KV cache has the blocks for its whole budget
  (prompt + max_tokens) free: a running request never waits for memory, so nothing is ever preempted;
- otherwise the step decodes every running request (at most `batch_size`);
- nothing to do: an idle step (a multi-rank server still steps all ranks together, see serving/ranks.py).

Blocks are taken at admission and given back when a request finishes or is aborted (a client disconnect),
which is what admits the next waiting request.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from optimized.executor.sampling import GREEDY, SamplingParams


@dataclass
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
    # filled by the engine
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None               # "stop" (EOS / stop string), "length" or "abort"
    arrival_step: int = -1
    first_token_step: int = -1
    logits: list = field(default_factory=list)     # with record_logits: [V] fp32 host rows, one per token
    prompt_logprob_values: list | None = None      # with prompt_logprobs: (logprob, top) per prompt token 1..

    @property
    def budget(self) -> int:
        """Tokens the request may occupy in the KV cache: its prompt and every token it may generate."""
        return len(self.prompt) + self.max_tokens

    @property
    def length(self) -> int:
        """Tokens in the KV cache after the next step's input is written: prompt + generated - 1."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclass(frozen=True)
class Step:
    kind: str                 # "prefill" | "decode" | "idle"
    requests: tuple[Request, ...] = ()


class Scheduler:
    def __init__(self, batch_size: int, max_prefill_tokens: int, block_size: int, total_blocks: int):
        """total_blocks: blocks a request may ever hold, i.e. the pool without its null block."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} must be >= 0 (0: no prefill token budget)")
        self.batch_size, self.max_prefill_tokens = batch_size, max_prefill_tokens
        self.block_size, self.total_blocks = block_size, total_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
        self.waiting.append(request)

    def schedule(self, free_blocks: int) -> Step:
        """The next step; admitted requests move from waiting to running (the engine allocates their blocks)."""
        admitted, tokens = [], 0
        while self.waiting:
            head = self.waiting[0]
            room = len(self.running) + len(admitted) < self.batch_size
            within = not self.max_prefill_tokens or tokens + len(head.prompt) <= self.max_prefill_tokens
            need = self.blocks_needed(head)
            if not (room and within and need <= free_blocks):
                break
            admitted.append(self.waiting.popleft())
            tokens += len(head.prompt)
            free_blocks -= need
        if admitted:
            self.running.extend(admitted)
            return Step("prefill", tuple(admitted))
        if self.running:
            return Step("decode", tuple(self.running))
        return Step("idle")

    def remove(self, request: Request) -> None:
        """A finished or aborted request leaves the batch (or the queue, if it never ran)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
