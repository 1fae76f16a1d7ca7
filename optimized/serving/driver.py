"""The engine's own thread: it owns the engine (nothing else touches it), takes new requests and aborts from a
thread-safe inbox between steps, steps while there is work, and hands every token event to the request's sink
(the HTTP handler's queue). A step that fails (a rank failure, non-finite logits) stops the driver: every
waiting handler gets the error and `on_fatal` is called, which stops the server.

With overlapped scheduling (scheduler_config.async_scheduling) a step returns once the next decode is launched, so
handing its events to the sinks and taking the inbox (on rank 0 of a multi-rank server: its broadcast) run while the
device computes that next step."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
import time
from typing import Callable

from optimized.executor.engine import Engine, with_seed
from optimized.executor.scheduler import Request
from optimized.serving.metrics import Metrics


class EngineStopped(RuntimeError):
    """The engine thread stopped on an error; the message names it."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine (non-finite logits); the engine and the other requests go on."""


class Driver:
    def __init__(
        self,
        engine: Engine,
        metrics: Metrics | None = None,
        on_fatal: Callable | None = None,
        broadcast=None,
        pd=None,
    ):
        """broadcast: a `ranks.StepBroadcast` on rank 0 of a multi-rank server (None: a single process).
        pd: the instance's `pd.instance.PdInstance` under prefill-decode disaggregation (its operations: `call`)."""
        self.engine, self.metrics, self.broadcast, self.pd = engine, metrics or Metrics(), broadcast, pd
        self.metrics.eplb = getattr(engine, "eplb", None)  # parallel_config.enable_eplb's metrics
        self._retry: list = []  # KV reservations waiting for room, tried again at every drain
        self.on_fatal = on_fatal
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[str, Callable] = {}
        self.times: dict[str, list[float]] = {}  # request id -> [arrival, first token, last token]
        self.error: BaseException | None = None
        self._pending: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> "Driver":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    # ---- called from the HTTP side
    def submit(self, request: Request, sink: Callable) -> None:
        """Check now (raises ValueError / RequestTooLarge), run later; `sink(event_or_error)` from the engine thread."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.error}")
        self.engine.check(request)
        self.inbox.put(("add", with_seed(request), sink, time.perf_counter()))
        if not self._thread.is_alive() and self.error is not None:  # it stopped meanwhile: nobody will answer
            raise EngineStopped(f"the engine stopped: {self.error}")

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Drop a request; `reason` is what /metrics counts it as ("stop": the handler saw a stop string)."""
        self.inbox.put(("abort", request_id, reason))

    def call(self, op: str, args: tuple, sink: Callable | None = None) -> Future:
        """A KV hand-off operation (`PdInstance.apply`) run on the engine thread between steps, on every rank; its
        result on the future. A reservation without room waits there (tried again before every step). sink: the
        request's event sink, registered as the operation applies (`start`)."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.error}")
        future: Future = Future()
        self.inbox.put(("pd", (op, args), future, sink))
        return future

    # ---- the engine thread
    def _drain(self, block: bool) -> None:
        items, self._retry = self._retry, []
        if self.pd is not None:  # held KV nobody claimed in time goes back
            for rid in self.pd.due():
                self.pd.held_at.pop(rid, None)
                items.append(("pd", ("release", (rid,)), Future(), None))
        try:
            # a reservation waiting for room: look again soon (a step or an abort may have freed blocks)
            items.append(self.inbox.get(timeout=0.05 if items else 0.5) if block else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        items = [i for i in items if i is not None]
        self._pending = items  # told of a failure too, should the broadcast fail
        if self.broadcast is not None:  # every rank applies the same items before the same step
            self.broadcast.send([(i[0], i[1]) for i in items])
        for item in items:
            self._apply(item)
        self._pending = []
        if items:  # an abort frees blocks with no step after it: the gauges must see it
            self._gauges()

    def _gauges(self) -> None:
        s = self.engine.scheduler
        self.metrics.set_gauges(s.num_waiting(), s.num_running(), self.engine.kv_usage)

    def _apply(self, item) -> None:
        if item is None:
            return
        if item[0] == "add":
            _, request, sink, arrival = item
            try:
                self.engine.add(request)
            except ValueError as e:  # checked at submit; a duplicate id can still land here
                sink(e)
                return
            self.sinks[request.request_id] = sink
            self.times[request.request_id] = [arrival, 0.0, 0.0]
        elif item[0] == "pd":
            self._apply_pd(item)
        else:
            self._retry = [i for i in self._retry if not _reserves(i, item[1])]
            self.engine.abort(item[1])
            self._forget(item[1], item[2] if len(item) > 2 else "abort")

    def _apply_pd(self, item) -> None:
        _, (op, args), future, sink = item
        try:
            result = self.pd.apply(op, args)
        except Exception as e:  # noqa: BLE001 - the asking handler answers it
            if not future.done():
                future.set_exception(e)
            return
        if result is False and op == "reserve":
            self._retry.append(item)
            return
        if sink is not None:
            self.sinks[args[0]] = sink
        if not future.done():
            future.set_result(result)

    def _forget(self, request_id: str, reason: str) -> None:
        self.sinks.pop(request_id, None)
        times = self.times.pop(request_id, None)
        if times is None:
            return
        self.metrics.count_finished(reason)

    def _next_queued(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return False

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=self.engine.idle)
                if self.pd is not None:  # KV that arrived: its requests decode from now on
                    self.engine.handoff.start_ready(self.engine)
                if self.engine.idle:
                    continue
                step, events = self.engine.step()
                now = time.perf_counter()
                if self.pd is not None:
                    self.pd.note_held(events)
                self._account(step, events, now)
                for event in events:
                    sink = self.sinks.get(event.request.request_id)
                    error = event.error  # this request failed alone (the engine goes on)
                    if sink is not None:
                        sink(event if error is None else RequestFailed(error))
                    if event.finished or error is not None:
                        self._forget(
                            event.request.request_id, "error" if error is not None else event.request.finish_reason
                        )
            if self.broadcast is not None:
                from optimized.serving.ranks import STOP

                self.broadcast.send(STOP)
        except BaseException as e:  # noqa: BLE001 - every handler must learn that the engine is gone
            self.error = e
            stopped = EngineStopped(f"the engine stopped: {type(e).__name__}: {e}")
            for sink in list(self.sinks.values()):
                sink(stopped)
            self.sinks.clear()
            self._pending += self._retry
            while True:  # requests not yet applied: drained this iteration or still queued
                item = self._pending.pop() if self._pending else self._next_queued()
                if item is False:
                    break
                if item is not None and item[0] == "add":
                    item[2](stopped)
                elif item is not None and item[0] == "pd" and not item[2].done():
                    item[2].set_exception(stopped)
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _account(self, step, events, now: float) -> None:
        m = self.metrics
        with m.lock:
            if step.kind in ("prefill", "mixed"):  # a request recomputed after a preemption is not a new prompt
                admitted = step.admitted if step.kind == "mixed" else step.requests  # chunked: at its first chunk
                m.prompt_tokens += sum(len(r.prompt) for r in admitted if not r.preemptions)
            m.preemptions += len(step.preempted)
            m.prefix_queries, m.prefix_hits = self.engine.scheduler.prefix_queries, self.engine.scheduler.prefix_hits
            m.generation_tokens += len(events)
            for event in events:
                t = self.times.get(event.request.request_id)
                if t is None:
                    continue
                if len(event.request.tokens) == 1:
                    t[1] = now
                    m.ttft.observe(now - t[0])
                t[2] = now
                if event.finished and len(event.request.tokens) > 1:
                    m.tpot.observe((t[2] - t[1]) / (len(event.request.tokens) - 1))
        self._gauges()


def _reserves(item, request_id: str) -> bool:
    """The item is a waiting KV reservation of `request_id`."""
    return item[0] == "pd" and item[1][0] == "reserve" and item[1][1][0].request_id == request_id
