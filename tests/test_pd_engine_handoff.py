"""Two engines in one process, a prefill and a decode, with the real Mooncake transfer (protocol tcp on 127.0.0.1)
between their paged caches: the prefill engine computes the prompts and chooses the first tokens, holds the blocks;
the decode engine reserves blocks, receives the KV, checks the digest and continues from the first token. Every
request's tokens and logprobs equal the colocated engine's bit for bit (greedy, seeded sampled with a penalty whose
counts are rebuilt from the first token, FP8 KV), and both pools' free counts return. Faults: a flipped byte and a
token count off by one are caught by the digest, a decode pool without room makes the reservation wait, and a
request dropped at any point of the hand-off gives its blocks back."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.engine_runs import BLOCK, _models
from optimized.executor.engine import Engine, TokenEvent
from optimized.executor.sampling import SamplingParams
from optimized.executor.scheduler import Request
from optimized.pd.block_transfer import CacheDescriptor
from optimized.pd.digest import KvIntegrityError
from optimized.pd.kv_send import RankTarget, rank_digest, send
from optimized.pd.rank_mapping import AttentionLayout
from optimized.pd.transfer_engine import MooncakeTransferEngine

HOST = "127.0.0.1"
ONE = AttentionLayout(1)
PROMPTS = [[5, 17, 3, 99, 41, 7, 250, 12, 8, 1, 77, 300, 2, 6, 18, 40, 33, 9], [11, 4, 200, 63, 5]]
MAX_TOKENS = 7
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.7)
BLOCKS = 12


@functools.lru_cache(maxsize=None)
def _runner(kv: str):
    """The fp32 tiny model's runner; for the FP8 KV cache, a bfloat16 one (FP8 quantizes 16-bit K/V)."""
    from fixtures.checkpoints import checkpoint
    from optimized import ModelRunner, load_model

    if kv == "auto":
        return _models()[0]
    return ModelRunner(load_model(checkpoint("tiny"), dtype=torch.bfloat16), BLOCK, kv_cache_dtype=kv)


def _registered(engine: Engine) -> MooncakeTransferEngine:
    mc = MooncakeTransferEngine()
    mc.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    for layer in engine.cache.layers:
        for tensor in layer:
            mc.register_tensor(tensor)
    return mc


SPECS = tuple((tuple(p), MAX_TOKENS) for p in PROMPTS)  # (prompt, max_tokens) of each request


def _requests(sampling, specs=SPECS, hold: bool = False) -> list[Request]:
    """Request i of `specs`; `hold`: the prefill's copy (one token, its blocks held)."""
    return [
        Request(f"r{i}", list(p), 1 if hold else n, sampling, stop_ids=frozenset(), logprobs=2, hold_kv=hold)
        for i, (p, n) in enumerate(specs)
    ]


def _run(engine: Engine) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}
    for _ in range(200):
        engine.handoff.start_ready(engine)
        if engine.idle:
            return events
        for e in engine.step()[1]:
            events.setdefault(e.request.request_id, []).append(e)
    raise AssertionError("the engine did not finish its requests")


def _seen(events) -> dict[str, list[tuple]]:
    return {rid: [(e.token, e.logprob, e.top_logprobs) for e in evs] for rid, evs in events.items()}


def _colocated(kv: str, sampling, specs=SPECS, engine: Engine | None = None) -> dict[str, list[tuple]]:
    engine = engine or Engine(_runner(kv), batch_size=2, num_blocks=BLOCKS)
    for r in _requests(sampling, specs):
        engine.add(r)
    return _seen(_run(engine))


class Pair:
    """A prefill engine and a decode engine over the same model, each with its own Mooncake engine."""

    def __init__(self, kv: str, decode_blocks: int = BLOCKS, **decode_options):
        self.prefill = Engine(_runner(kv), batch_size=2, num_blocks=BLOCKS)
        self.decode = Engine(_runner(kv), batch_size=2, num_blocks=decode_blocks, **decode_options)
        self.p_mc, self.d_mc = _registered(self.prefill), _registered(self.decode)
        self.free = (self.prefill.cache.free_blocks, self.decode.cache.free_blocks)

    def prefill_all(self, sampling, specs=SPECS) -> dict[str, TokenEvent]:
        self.max_tokens = {f"r{i}": n for i, (_, n) in enumerate(specs)}
        for r in _requests(sampling, specs, hold=True):
            self.prefill.add(r)
        events = _run(self.prefill)
        return {rid: evs[0] for rid, evs in events.items()}

    def decode_request(self, first: TokenEvent, sampling) -> Request:
        p = first.request
        n = self.max_tokens[p.request_id]
        r = Request(p.request_id, list(p.prompt), n, sampling, stop_ids=frozenset(), logprobs=2)
        r.tokens = [first.token]
        return r

    def transfer(self, held: Request, reserved: Request, num_tokens: int | None = None) -> None:
        target = RankTarget(self.d_mc.session_id, CacheDescriptor.of(self.decode.cache), tuple(reserved.blocks))
        n = len(held.prompt) if num_tokens is None else num_tokens
        send(self.p_mc, self.prefill.cache, held.blocks, n, ONE, 0, [target], ONE, _runner("auto").kv_heads)

    def check(self, held: Request, reserved: Request, received_tokens: int | None = None) -> None:
        heads = _runner("auto").kv_heads
        sent = rank_digest(self.prefill.cache, held.blocks, len(held.prompt), ONE, 0, heads)
        n = len(reserved.prompt) if received_tokens is None else received_tokens
        rank_digest(self.decode.cache, reserved.blocks, n, ONE, 0, heads).check_against(sent)


def _disaggregated(kv: str, sampling, specs=SPECS, pair: Pair | None = None, **decode_options):
    """Every request of `specs` prefilled, handed off and decoded: its events' (token, logprob, top) per id."""
    pair = pair or Pair(kv, **decode_options)
    firsts = pair.prefill_all(sampling, specs)
    held = pair.prefill.handoff.held
    assert set(held) == {f"r{i}" for i in range(len(specs))} and all(r.blocks for r in held.values()), (
        "finished prefills hold their blocks"
    )
    assert pair.prefill.cache.free_blocks < pair.free[0] and pair.prefill.idle
    for rid, first in firsts.items():
        reserved = pair.decode_request(first, sampling)
        if reserved.max_tokens == 1:  # done at its first token: nothing to hand off
            with pytest.raises(ValueError, match="nothing to decode"):
                pair.decode.handoff.reserve(pair.decode, reserved)
            assert pair.prefill.handoff.release(pair.prefill, rid)
            continue
        assert pair.decode.handoff.reserve(pair.decode, reserved)
        pair.transfer(held[rid], reserved)
        pair.check(held[rid], reserved)
        assert pair.prefill.handoff.release(pair.prefill, rid)
        pair.decode.handoff.start(rid)
    assert pair.prefill.cache.free_blocks == pair.free[0], "released blocks are free again"
    rest = _run(pair.decode)
    assert pair.decode.cache.free_blocks == pair.free[1]
    assert pair.decode.scheduler.group_tokens == [0], "every handed-over request left its group's load"
    return _seen({rid: [firsts[rid], *rest.get(rid, [])] for rid in firsts})


@pytest.mark.parametrize("kv", ["auto", "float8"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_decode_from_transferred_kv_equals_the_colocated_engine(kv, sampled):
    sampling = SAMPLED if sampled else SamplingParams()
    want = _colocated(kv, sampling)
    got = _disaggregated(kv, sampling)
    assert all(len(v) == MAX_TOKENS for v in want.values())
    assert got == want


def _held_and_reserved(pair: Pair):
    firsts = pair.prefill_all(SamplingParams())
    held = pair.prefill.handoff.held["r0"]
    reserved = pair.decode_request(firsts["r0"], SamplingParams())
    assert pair.decode.handoff.reserve(pair.decode, reserved)
    return held, reserved


def test_the_digest_catches_one_flipped_byte_in_one_block():
    pair = Pair("float8")
    held, reserved = _held_and_reserved(pair)
    pair.transfer(held, reserved)
    pair.check(held, reserved)
    k = pair.decode.cache.layers[1][1]  # layer 1's V, the request's second block, one byte of one token
    k[reserved.blocks[1], 0].view(torch.uint8).view(-1)[3] ^= 0x10
    with pytest.raises(KvIntegrityError, match="values digest mismatch for KV head"):
        pair.check(held, reserved)


def test_the_digest_catches_a_token_count_off_by_one():
    pair = Pair("auto")
    held, reserved = _held_and_reserved(pair)
    pair.transfer(held, reserved, num_tokens=len(held.prompt) - 1)  # the last token's KV never sent
    with pytest.raises(KvIntegrityError, match="mismatch"):
        pair.check(held, reserved)
    with pytest.raises(KvIntegrityError, match="decode took over 17 tokens of KV, prefill sent 18"):
        pair.check(held, reserved, received_tokens=len(held.prompt) - 1)


def test_a_decode_pool_without_room_makes_the_reservation_wait_not_fail():
    need = -(-(len(PROMPTS[0]) + 1) // BLOCK)
    pair = Pair("auto", decode_blocks=1 + need)
    firsts = pair.prefill_all(SamplingParams())
    first, second = (pair.decode_request(firsts[r], SamplingParams()) for r in ("r0", "r1"))
    assert pair.decode.handoff.reserve(pair.decode, first)
    free = pair.decode.cache.free_blocks
    assert not pair.decode.handoff.reserve(pair.decode, second) and not second.blocks
    assert pair.decode.cache.free_blocks == free, "a reservation that waits takes nothing"
    pair.decode.abort("r0")  # the first goes away: the second's reservation now succeeds
    assert pair.decode.handoff.reserve(pair.decode, second)


@pytest.mark.parametrize("stage", ["held", "reserved", "filled", "running"])
def test_a_request_dropped_during_the_hand_off_gives_its_blocks_back_on_both_sides(stage):
    pair = Pair("auto")
    held, reserved = _held_and_reserved(pair)
    if stage != "held":
        pair.transfer(held, reserved)
    if stage in ("filled", "running"):
        pair.decode.handoff.start("r0")
    if stage == "running":
        pair.decode.handoff.start_ready(pair.decode)
        pair.decode.step()
    pair.prefill.abort("r0")
    pair.prefill.abort("r1")
    pair.decode.abort("r0")
    assert pair.prefill.cache.free_blocks == pair.free[0]
    assert pair.decode.cache.free_blocks == pair.free[1]
    assert "r0" not in pair.decode.handoff and not pair.decode.requests and pair.decode.idle
    assert pair.prefill.scheduler.group_tokens == pair.decode.scheduler.group_tokens == [0], "loads back to 0"


def test_a_decode_engine_with_chunked_prefill_and_prefix_caching_takes_over_alike():
    """Its batch puts decode rows before prefill chunks and registers blocks as they fill: a request taken over at
    decode fits both."""
    options = dict(chunked_prefill_tokens=8, enable_prefix_caching=True)
    assert _disaggregated("auto", SAMPLED, **options) == _colocated("auto", SAMPLED)


@functools.lru_cache(maxsize=None)
def _reused() -> tuple[Engine, Pair]:
    """A colocated engine and a pair kept across examples: blocks are reused with the last request's bytes in them."""
    return Engine(_runner("auto"), batch_size=2, num_blocks=BLOCKS), Pair("auto")


@settings(max_examples=10, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.lists(st.integers(0, 511), min_size=1, max_size=40), st.integers(1, 8)), min_size=1, max_size=2
    ),
    seed=st.none() | st.integers(0, 2**32),
    penalty=st.sampled_from([0.0, 0.6]),
)
def test_any_prompts_hand_off_equal_to_the_colocated_engine(specs, seed, penalty):
    sampling = SamplingParams() if seed is None else SamplingParams(0.8, seed=seed, presence_penalty=penalty)
    colocated, pair = _reused()
    want = _colocated("auto", sampling, specs, colocated)
    assert _disaggregated("auto", sampling, specs, pair) == want
    assert [len(want[f"r{i}"]) for i in range(len(specs))] == [n for _, n in specs]
