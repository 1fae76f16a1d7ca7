"""The serving engine: continuous batching over one long-lived paged KV cache.

`Engine.step()` asks the scheduler (optimized/executor/scheduler.py) what to run, then runs it with the runner's
own step machinery: `ModelRunner.prefill_inputs` + the model for a prefill of the newly admitted requests,
`ModelRunner.decode_metadata` + `runner.decode_forward` (eager, or the compiled graph buckets) for a decode of every
running request. A request's tokens depend only on its own prompt and sampling: each request has its own block
rows and its own seeded generator, so who else is in the batch changes nothing but float reassociation.

Host reads: the chosen ids (and the logprobs asked for) are read once per step, in `_read_step`.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import torch

from optimized.executor.kv_cache import PagedKVCache, block_table
from optimized.executor.model_runner import NonFiniteLogitsError
from optimized.executor.sampling import Sampler
from optimized.executor.scheduler import Request, Scheduler, Step


class RequestTooLarge(ValueError):
    """A request that can never fit (context length, KV pool, prefill token budget): HTTP 413."""


@dataclass
class TokenEvent:
    """One generated token of one request, as a step produced it."""
    request: Request
    token: int
    logprob: float | None = None                        # log-softmax of the chosen token (when asked)
    top_logprobs: list[tuple[int, float]] | None = None  # the request's top-k (token, logprob), best first
    finished: bool = False


def with_seed(request: Request) -> Request:
    """Unseeded sampling gets a fresh seed here, once, so every rank that runs the request draws the same."""
    if request.sampling.greedy or request.sampling.seed is not None:
        return request
    return replace(request, sampling=replace(request.sampling, seed=secrets.randbits(31)))


class Engine:
    def __init__(self, runner, *, batch_size: int, max_prefill_tokens: int = 0, num_blocks: int):
        """num_blocks: the KV pool per layer, the null block included."""
        self.runner, self.model, self.device = runner, runner.model, runner.device
        runner.check_mc2(batch_size)          # the largest decode batch: MC2 window and kernel limits
        self.cache = PagedKVCache(runner.num_layers, num_blocks, runner.block_size, runner.kv_heads, runner.head_dim,
                                  runner.kv_cache_dtype, self.device)
        self.scheduler = Scheduler(batch_size, max_prefill_tokens, runner.block_size, num_blocks - 1)
        self.samplers: dict[str, Sampler] = {}
        self.requests: dict[str, Request] = {}
        self.steps = 0

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
            raise RequestTooLarge(f"{len(request.prompt)} prompt tokens + max_tokens {request.max_tokens} exceed the "
                                  f"model's context length max_position_embeddings={r.max_positions}")
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
        self.samplers[request.request_id] = Sampler(request.sampling, 1)
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Drop a request (a client that went away): its blocks go back to the pool now."""
        request = self.requests.get(request_id)
        if request is not None:
            request.finish_reason = request.finish_reason or "abort"
            self._finish(request)

    def _finish(self, request: Request) -> None:
        self.scheduler.remove(request)
        self.cache.release(request.blocks)
        request.blocks = []
        self.requests.pop(request.request_id, None)
        self.samplers.pop(request.request_id, None)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @property
    def kv_usage(self) -> float:
        """Share of the pool's blocks (null block excluded) held by requests."""
        total = self.cache.num_blocks - 1
        return (total - self.cache.free_blocks) / total

    # ---- one step
    @torch.no_grad()
    def step(self) -> tuple[Step, list[TokenEvent]]:
        step = self.scheduler.schedule(self.cache.free_blocks)
        self.steps += 1
        if step.kind == "idle":
            return step, []
        if step.kind == "prefill":
            for request in step.requests:
                request.blocks = self.cache.allocate(request.budget)
            logits, prompt_rows = self._prefill(step.requests)
        else:
            logits, prompt_rows = self._decode(step.requests), None
        events = self._read_step(step, logits, prompt_rows)
        for event in events:
            if event.finished:
                self._finish(event.request)
        return step, events

    def _table(self, requests) -> torch.Tensor:
        return block_table([r.blocks for r in requests], self.device)

    def _prefill(self, requests):
        """Logits at each prompt's last token [B, V], and per echo request its prompt rows [len - 1, V]."""
        ids, meta, last = self.runner.prefill_inputs([r.prompt for r in requests], self._table(requests))
        offsets, wanted, spans = 0, [], []
        for r in requests:                       # echo: rows 0 .. len-2 predict prompt tokens 1 .. len-1
            if r.prompt_logprobs:
                spans.append((r, len(wanted), len(r.prompt) - 1))
                wanted.extend(range(offsets, offsets + len(r.prompt) - 1))
            offsets += len(r.prompt)
        indices = torch.cat([torch.tensor(wanted, dtype=last.dtype, device=self.device), last])
        logits = self.model(ids, meta, self.cache.layers, logits_indices=indices)
        prompt_rows = {r.request_id: logits[start:start + n] for r, start, n in spans}
        return logits[len(wanted):], prompt_rows

    def _decode(self, requests) -> torch.Tensor:
        ids = torch.tensor([r.tokens[-1] for r in requests], device=self.device)
        meta = self.runner.decode_metadata([r.length for r in requests], self._table(requests))
        return self.runner.decode_forward(ids, meta, self.cache.layers)

    def _choose(self, requests, logits: torch.Tensor) -> torch.Tensor:
        """Chosen ids [B] on the device, -1 where a row is not finite."""
        finite = torch.isfinite(logits).all(-1)
        chosen = logits.float().argmax(-1)                 # greedy rows (the runner's greedy rule)
        sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if sampled:
            safe = logits.masked_fill(~finite.unsqueeze(-1), 0.0)
            picks = [self.samplers[requests[i].request_id](safe[i:i + 1], [0]) for i in sampled]
            chosen = chosen.index_put((torch.tensor(sampled, device=self.device),), torch.cat(picks))
        return torch.where(finite, chosen, -1)

    def _read_step(self, step: Step, logits: torch.Tensor, prompt_rows) -> list[TokenEvent]:
        """The one host read of a step: chosen ids, and the logprobs / logits the requests asked for."""
        requests = step.requests
        ids = self._choose(requests, logits).tolist()
        want = [i for i, r in enumerate(requests) if r.logprobs is not None]
        logprob_rows = {}
        if want:
            lp = torch.log_softmax(logits[want].float(), dim=-1)
            k = max(requests[i].logprobs for i in want)
            top = torch.topk(lp, k, dim=-1) if k else None
            chosen_lp = lp.gather(1, torch.tensor([[max(ids[i], 0)] for i in want], device=self.device))
            chosen_lp, top_v, top_i = (chosen_lp.squeeze(1).tolist(), top.values.tolist() if k else None,
                                       top.indices.tolist() if k else None)
            for j, i in enumerate(want):
                n = requests[i].logprobs
                logprob_rows[i] = (chosen_lp[j], list(zip(top_i[j][:n], top_v[j][:n])) if n else [])
        for request_id, rows in (prompt_rows or {}).items():
            request = self.requests[request_id]
            lp = torch.log_softmax(rows.float(), dim=-1)
            targets = torch.tensor(request.prompt[1:], device=self.device).unsqueeze(1)
            values = lp.gather(1, targets).squeeze(1).tolist()
            n = request.logprobs or 0
            tops = ([list(zip(i, v)) for v, i in zip(*(t.tolist() for t in torch.topk(lp, n, dim=-1)))]
                    if n else [[] for _ in values])
            request.prompt_logprob_values = list(zip(values, tops))
        events = []
        for i, (request, token) in enumerate(zip(requests, ids)):
            if token < 0:
                raise NonFiniteLogitsError(f"step {self.steps} produced non-finite logits (NaN or inf) for request "
                                           f"{request.request_id!r} after {len(request.tokens)} generated token(s)")
            if request.record_logits:
                request.logits.append(logits[i].float().cpu())
            if not request.tokens:
                request.first_token_step = self.steps
            request.tokens.append(token)
            finished = None
            if token in request.stop_ids:
                finished = "stop"
            elif len(request.tokens) >= request.max_tokens:
                finished = "length"
            request.finish_reason = finished
            lp, top = logprob_rows.get(i, (None, None))
            events.append(TokenEvent(request, token, lp, top, finished is not None))
        return events
