"""Multi-rank serving: rank 0 serves HTTP and sends every engine iteration's inbox (new requests, aborts) to the
other ranks over a CPU gloo group; every rank applies the same items and steps the same engine, so the
deterministic scheduler gives every rank the same batch and the model's collectives line up (TP / EP layouts).
Rank 0 also sends while idle (a heartbeat every `Driver` poll), so a follower's wait never reaches the group's
timeout, and a rank that died makes the next send fail: the server stops with that error named."""

from __future__ import annotations

import torch.distributed as dist

STOP = "stop"


class StepBroadcast:
    def __init__(self, group):
        self.group = group

    def send(self, items) -> None:
        dist.broadcast_object_list([items], src=0, group=self.group)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


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
