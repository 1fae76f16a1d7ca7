"""Multi-rank serving: rank 0 serves HTTP and sends every engine iteration's inbox (new requests, aborts) to the
other ranks over a CPU gloo group; every rank applies the same items and steps the same engine, so the
deterministic scheduler gives every rank the same batch and the model's collectives line up (TP / EP layouts).

Each iteration costs one broadcast of a one-int header: the byte count of the pickled items, which travel in a
second broadcast only when there are some; 0 when the inbox was empty (every rank then steps, or waits, as its own
engine's state says: they are all the same); -1 for stop. Rank 0 also sends while idle (a heartbeat every `Driver`
poll), so a follower's wait never reaches the group's timeout, and a rank that died makes the next send fail: the
server stops with that error named."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

STOP = "stop"
_STOP_HEADER = -1


class StepBroadcast:
    def __init__(self, group):
        self.group = group
        self.headers = self.payloads = 0  # broadcasts sent or received: one header per iteration, items when any

    def send(self, items) -> None:
        payload = b"" if items == STOP or not items else pickle.dumps(items)
        self._header(_STOP_HEADER if items == STOP else len(payload))
        if payload:
            self.payloads += 1
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def recv(self):
        n = self._header(0)
        if n == _STOP_HEADER:
            return STOP
        if n == 0:
            return []
        self.payloads += 1
        payload = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return pickle.loads(payload.numpy().tobytes())

    def _header(self, value: int) -> int:
        self.headers += 1
        header = torch.tensor([value], dtype=torch.int64)  # gloo: a CPU tensor
        dist.broadcast(header, src=0, group=self.group)
        return int(header)


def follow(engine, broadcast: StepBroadcast, pd=None) -> None:
    """A follower rank's loop: apply rank 0's items, step when there is work, until rank 0 says stop. pd: the
    instance's `PdInstance` (KV hand-off operations: this rank's part)."""
    while True:
        items = broadcast.recv()
        if items == STOP:
            return
        for kind, value in items:
            if kind == "add":
                try:
                    engine.add(value)
                except ValueError:  # rank 0 refused it the same way (same engine state)
                    pass
            elif kind == "pd":
                try:
                    pd.apply(*value)
                except Exception:  # noqa: BLE001 - rank 0 answers the request; this rank goes on alike
                    pass
            else:
                engine.abort(value)
        if pd is not None:
            engine.handoff.start_ready(engine)
        if not engine.idle:
            engine.step()
