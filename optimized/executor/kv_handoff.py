"""Requests whose KV cache crosses between two engines (prefill-decode disaggregation), host bookkeeping only.

Prefill side: a request marked `hold_kv` that finishes normally keeps its blocks HELD (`held`): it left the batch
and the scheduler, but its blocks are neither free nor evictable until `release` (the decode side confirmed it took
the KV over, or nobody claimed it in time). Decode side: `reserve` takes blocks for a request whose prompt KV another
engine writes and whose first token it already chose (`Request.tokens == [first]`); once the KV has landed and is
checked, `start` queues it and `start_ready` (between steps) gives it a batch row that begins at decode: its next
input is the first token at the position after the prompt, its draw counter at 1, its penalty counts rebuilt from
that token (`DeviceBatch.admit_decoding`). `drop` gives a held, reserved or queued request's blocks back (a client
that went away, a failed transfer), never registering them in the prefix cache (their KV may be partial).

Every rank runs these at the same points of the same item sequence (optimized/serving/ranks.py), so every rank
takes the same blocks.
"""

from __future__ import annotations

from optimized.executor.scheduler import Request


class KvHandoff:
    def __init__(self):
        self.held: dict[str, Request] = {}  # prefill: finished, blocks kept for the transfer
        self.reserved: dict[str, Request] = {}  # decode: blocks reserved, KV arriving
        self.ready: list[Request] = []  # decode: KV in place, waiting for a batch row

    def __contains__(self, request_id: str) -> bool:
        return (
            request_id in self.held
            or request_id in self.reserved
            or any(r.request_id == request_id for r in self.ready)
        )

    # ---- prefill side
    def hold(self, request: Request) -> None:
        self.held[request.request_id] = request

    def release(self, engine, request_id: str) -> bool:
        """The held request's blocks go back to its pool; False when it is not held (released already, or never)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        engine.pools[request.dp_group].release(request.blocks)
        request.blocks = []
        return True

    # ---- decode side
    def reserve(self, engine, request: Request) -> bool:
        """Blocks for the request's prompt KV and the token its first decode writes, in the DP group of least load
        in tokens (the scheduler's rule; it counts in that load from here, `Scheduler.join`); False (nothing taken)
        while that group's pool has no room beside the running requests' next blocks."""
        if len(request.tokens) != 1:
            raise ValueError(f"a request taken over at decode carries exactly its first token; it has {request.tokens}")
        if request.max_tokens <= 1 or request.tokens[0] in request.stop_ids:
            raise ValueError(f"request {request.request_id!r} ended at its first token: it has nothing to decode")
        if request.request_id in self or request.request_id in engine.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        s = engine.scheduler
        group = s.least_loaded_group()  # reserved and queued requests count in their group's load (`join`)
        pool = engine.pools[group]
        need = s.blocks_for(min(len(request.prompt) + 1, request.budget - 1))
        if need > pool.free_blocks - s.next_blocks(group):  # the running requests' next blocks stay free
            return False
        s.join(request, group)
        request.blocks = pool.take(need)
        request.arrival_step = engine.steps
        self.reserved[request.request_id] = request
        return True

    def start(self, request_id: str) -> None:
        """Its KV is in place: it runs from the next step on (`start_ready`)."""
        self.ready.append(self.reserved.pop(request_id))

    def start_ready(self, engine) -> list[Request]:
        """Between steps: queued requests join their group's running batch at decode, in order, while the group has
        a free row (with chunked prefill, only while no prefill of the group is under way: decode rows precede
        prefill chunks in the batch)."""
        s, started, left = engine.scheduler, [], []
        for r in self.ready:
            running = s.running[r.dp_group]
            if len(running) >= s.group_batch or any(x.prefill_left for x in running):
                left.append(r)
                continue
            running.append(r)
            if r.dp_group == engine.dp_rank:
                engine.batch.admit_decoding([r])
            engine.requests[r.request_id] = r
            started.append(r)
        self.ready = left
        return started

    def drop(self, engine, request_id: str) -> bool:
        """A held, reserved or queued request's blocks go back (not cached); False when it is none of those."""
        request = self.held.pop(request_id, None)
        if request is None:  # reserved or queued: it still counts in its group's load (a held one left already)
            request = self.reserved.pop(request_id, None)
            if request is None:
                request = next((r for r in self.ready if r.request_id == request_id), None)
                if request is None:
                    return False
                self.ready.remove(request)
            engine.scheduler.leave(request)
        engine.pools[request.dp_group].release(request.blocks)
        request.blocks = []
        request.finish_reason = request.finish_reason or "abort"
        return True
