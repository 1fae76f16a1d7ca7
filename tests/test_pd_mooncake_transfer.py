"""Real KV-cache blocks moved between two processes by the Mooncake Transfer Engine (protocol tcp on 127.0.0.1,
P2PHANDSHAKE: each engine binds its own RPC port and reports it): the decode process registers its paged caches'
tensors and reserves blocks, the prefill process registers its own and writes the request's blocks into the
decode caches with `batch_transfer_sync_write`. On arrival the decode caches hold the request's bytes exactly and
the two sides' digests agree. A write to addresses the decode side never registered, or to a decode process that
died, is a TransferError and leaves nothing behind. Both sides are forked children: the test process never starts
an engine, so no engine thread is ever forked."""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from equivalence.support.kv_shards import assert_holds, decode_side, prefill_side, side_digest, transfer
from optimized.pd.block_transfer import CacheDescriptor
from optimized.pd.transfer_engine import MooncakeTransferEngine, TransferError

HOST = "127.0.0.1"
TIMEOUT_S = 120  # a wait on the other process, not a timing bound: a lost child fails the test instead of hanging it
TOKENS, BLOCK_SIZE, SEED = 21, 4, 5


def _engine(caches) -> MooncakeTransferEngine:
    engine = MooncakeTransferEngine()
    engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    for cache in caches:
        for layer in cache.layers:
            for tensor in layer:
                engine.register_tensor(tensor)
    return engine


# Every message is (kind, payload); a side that fails sends ("error", its traceback).


def _decode(case, conn, fault):
    prefill_tp, decode_tp, heads, dtype = case
    kv, _, _ = prefill_side(prefill_tp, heads, TOKENS, BLOCK_SIZE, dtype, SEED)  # the expected bytes, recomputed
    caches, blocks = decode_side(kv, decode_tp, heads, BLOCK_SIZE, SEED)
    engine = _engine(caches)
    conn.send(("ready", (engine.session_id, [CacheDescriptor.of(c) for c in caches], blocks)))
    if fault == "peer_gone":  # the decode instance dies before the writes
        return
    _, sent = conn.recv()  # the prefill side's digest, once every write has landed
    if sent is None:  # the writes were refused: nothing of them arrived
        assert all(not t.any() for c in caches for layer in c.layers for t in layer)
        return
    assert_holds(caches, blocks, kv, prefill_tp, heads)
    side_digest(caches, blocks, TOKENS, heads).check_against(sent)


def _prefill(case, conn, fault):
    prefill_tp, decode_tp, heads, dtype = case
    _, caches, blocks = prefill_side(prefill_tp, heads, TOKENS, BLOCK_SIZE, dtype, SEED)
    engine = _engine(caches)
    _, (peer, descriptors, decode_blocks) = conn.recv()
    if fault:
        if fault == "outside":  # block ids past the decode pool: addresses the decode side never registered
            decode_blocks = [[b + 10_000 for b in rank_blocks] for rank_blocks in decode_blocks]
        with pytest.raises(TransferError, match="batch_transfer_sync_write to 127.0.0.1:"):
            transfer(caches, blocks, descriptors, decode_blocks, TOKENS, heads, engine, peer)
        conn.send(("digest", None))
        return
    transfer(caches, blocks, descriptors, decode_blocks, TOKENS, heads, engine, peer)
    conn.send(("digest", side_digest(caches, blocks, TOKENS, heads)))


def _child(side, case, conn, fault):
    try:
        side(case, conn, fault)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - the parent reports the child's failure
        conn.send(("error", traceback.format_exc()))


def _recv(conn, who):
    if not conn.poll(TIMEOUT_S):
        pytest.fail(f"the {who} process sent nothing in {TIMEOUT_S} s")
    kind, payload = conn.recv()
    if kind == "error":
        pytest.fail(f"the {who} side failed:\n{payload}")
    return kind, payload


def _run_pair(case, fault=None):
    ctx = multiprocessing.get_context("fork")
    decode_conn, decode_child = ctx.Pipe()
    prefill_conn, prefill_child = ctx.Pipe()
    procs = [
        ctx.Process(target=_child, args=(_decode, case, decode_child, fault), daemon=True),
        ctx.Process(target=_child, args=(_prefill, case, prefill_child, fault), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        ready = _recv(decode_conn, "decode")  # its session id, cache descriptors, reserved blocks
        if fault == "peer_gone":
            assert _recv(decode_conn, "decode") == ("ok", None)
            procs[0].join(TIMEOUT_S)  # its engine is gone with it, before prefill writes
            prefill_conn.send(ready)
            assert _recv(prefill_conn, "prefill") == ("digest", None)  # the writes failed
            assert _recv(prefill_conn, "prefill") == ("ok", None)
            return
        prefill_conn.send(ready)
        decode_conn.send(_recv(prefill_conn, "prefill"))  # the digest of what was sent, after the writes
        assert _recv(prefill_conn, "prefill") == ("ok", None)
        assert _recv(decode_conn, "decode") == ("ok", None)  # bytes equal on arrival, digests equal
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize(
    "case",
    [(2, 1, 4, torch.bfloat16), (1, 2, 4, torch.float8_e4m3fn), (4, 2, 2, torch.bfloat16)],
    ids=["bf16-tp2-to-tp1", "fp8-tp1-to-tp2", "bf16-tp4-to-tp2-replicated-heads"],
)
def test_mooncake_moves_kv_blocks_between_processes(case):
    _run_pair(case)


def test_a_write_outside_the_peers_registered_memory_is_a_transfer_error():
    _run_pair((1, 1, 2, torch.bfloat16), fault="outside")


def test_a_write_to_a_decode_process_that_died_is_a_transfer_error():
    _run_pair((1, 1, 2, torch.bfloat16), fault="peer_gone")


def test_session_id_before_initialize_is_refused():
    with pytest.raises(TransferError, match="before initialize"):
        MooncakeTransferEngine().session_id
