"""A serving instance's side of the KV hand-off: the operations the HTTP routes ask the engine thread for, run on
every rank of the instance at the same point of the same item sequence (rank 0 broadcasts them with the engine's
other items, optimized/serving/ranks.py), each rank doing its part with its own transfer engine and cache, and the
parts gathered on rank 0 over the serving group.

Prefill: `transfer` (every rank of the request's DP group writes the KV heads the rank mapping gives it into the
decode ranks, and digests what it holds), `release` (held blocks back: the decode side confirmed, or
`hold_timeout_s` passed with nobody claiming them, `due`). Decode: `reserve` (blocks for the prompt's KV; the
driver retries it until the pool has room), `digest` (over what arrived), `start` (it decodes from its first token).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from optimized.executor.scheduler import Request
from optimized.pd.block_transfer import CacheDescriptor
from optimized.pd.digest import KvDigest
from optimized.pd.kv_send import RankTarget, merge, rank_digest, send, target_of
from optimized.pd.rank_mapping import AttentionLayout
from optimized.pd.transfer_engine import TransferError

ROLES = ("prefill", "decode")
HOLD_TIMEOUT_S = 120.0


class UnknownTransfer(LookupError):
    """No request holds KV under that transfer id (released already, timed out, or never prefilled here)."""


class PdInstance:
    def __init__(self, role: str, engine, transfer, group=None, hold_timeout_s: float = HOLD_TIMEOUT_S):
        """transfer: this rank's `KvTransferEngine`, initialized; its cache tensors are registered here. group: the
        serving group of a multi-rank instance (None: one process)."""
        if role not in ROLES:
            raise ValueError(f"pd role {role!r}: expected one of {ROLES}")
        self.role, self.engine, self.transfer, self.group = role, engine, transfer, group
        self.hold_timeout_s = hold_timeout_s
        runner = engine.runner
        self.layout = AttentionLayout(runner.attn_tp_size, runner.dp_size)
        self.dp_rank, self.tp_rank = runner.dp_rank, runner.model.groups.attn_tp.rank
        self.num_kv_heads = runner.model.config.num_key_value_heads
        for layer in engine.cache.layers:
            for tensor in layer:
                transfer.register_tensor(tensor)
        me = (self.dp_rank, self.tp_rank, transfer.session_id, CacheDescriptor.of(engine.cache))
        # rank 0: every rank's (dp rank, tp rank, session, cache), to name them to the prefill side
        self.ranks = self._gather(me)
        self.held_at: dict[str, float] = {}  # rank 0, prefill: transfer id -> when its blocks were held

    @property
    def is_rank0(self) -> bool:
        return self.group is None or dist.get_rank(self.group) == 0

    def _gather(self, part):
        """Every rank's `part` on rank 0 (None elsewhere); every rank calls it at the same point."""
        if self.group is None:
            return [part]
        out = [None] * dist.get_world_size(self.group) if self.is_rank0 else None
        dist.gather_object(part, out, dst=0, group=self.group)
        return out

    # ---- every rank: one operation, rank 0's result returned
    def apply(self, op: str, args):
        return getattr(self, f"_{op}")(*args)

    def _reserve(self, request: Request):
        """The decode ranks' targets for the request (rank 0), or False while its group's pool has no room."""
        if not self.engine.handoff.reserve(self.engine, request):
            return False
        if not self.is_rank0:
            return True
        group = sorted((tp, s, c) for dp, tp, s, c in self.ranks if dp == request.dp_group)
        return [RankTarget(s, c, tuple(request.blocks)) for _, s, c in group]

    def _own_digest(self, request: Request, num_tokens: int) -> KvDigest | None:
        if request.dp_group != self.dp_rank:
            return None
        return rank_digest(self.engine.cache, request.blocks, num_tokens, self.layout, self.tp_rank, self.num_kv_heads)

    def _digest(self, request_id: str, num_tokens: int) -> KvDigest | None:
        request = self.engine.handoff.reserved.get(request_id)
        part = None
        if request is not None:
            try:
                part = ("ok", self._own_digest(request, num_tokens))
            except ValueError as e:
                part = ("error", str(e))
        parts = self._gather(part)
        if not self.is_rank0:
            return None
        if request is None:
            raise UnknownTransfer(f"request {request_id!r} holds no reserved blocks here")
        return _merged(parts, ValueError)

    def _start(self, request_id: str) -> None:
        self.engine.handoff.start(request_id)

    def _transfer(self, request_id: str, targets: list, decode: dict):
        request = self.engine.handoff.held.get(request_id)
        part = None
        if request is not None and request.dp_group == self.dp_rank:
            try:
                layout = AttentionLayout(int(decode["tp"]), int(decode.get("dp", 1)))
                n = len(request.prompt)
                send(
                    self.transfer,
                    self.engine.cache,
                    request.blocks,
                    n,
                    self.layout,
                    self.tp_rank,
                    [target_of(t) for t in targets],
                    layout,
                    self.num_kv_heads,
                )
                part = ("ok", self._own_digest(request, n))
            except Exception as e:  # noqa: BLE001 - every rank must reach the gather; rank 0 raises it
                part = ("error", f"{type(e).__name__}: {e}")
        parts = self._gather(part)
        if not self.is_rank0:
            return None
        if request is None:
            raise UnknownTransfer(f"transfer id {request_id!r} holds no KV here (released, timed out, or unknown)")
        return _merged(parts, TransferError)

    def _release(self, request_id: str) -> bool:
        self.held_at.pop(request_id, None)
        return self.engine.handoff.release(self.engine, request_id)

    # ---- rank 0 (the driver's thread)
    def note_held(self, events, now: float | None = None) -> None:
        """The prefills that finished into held blocks start their hold clock."""
        now = time.monotonic() if now is None else now
        for e in events:
            if e.finished and e.request.request_id in self.engine.handoff.held:
                self.held_at[e.request.request_id] = now

    def due(self, now: float | None = None) -> list[str]:
        """Transfer ids held longer than `hold_timeout_s` (their release is due)."""
        now = time.monotonic() if now is None else now
        return [rid for rid, at in self.held_at.items() if now - at > self.hold_timeout_s]


def _merged(parts, error) -> KvDigest:
    failed = [p[1] for p in parts if p is not None and p[0] == "error"]
    if failed:
        raise error("; ".join(failed))
    digests = [p[1] for p in parts if p is not None and p[1] is not None]
    if not digests:
        raise error("no rank holds the request")
    return merge(digests)
