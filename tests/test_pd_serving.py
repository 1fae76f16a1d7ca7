"""A prefill server and a decode server (`--pd-role`), each with its own engine and Mooncake transfer engine (protocol
tcp on 127.0.0.1), driven by hand as a router would: the prefill answers the first token and holds the prompt's
blocks, the decode reserves blocks, has the prefill write the KV, checks the digest, releases the prefill's blocks and
continues. Every response equals a colocated server's for the same body (token ids, text, logprobs; completions and
chat, streaming and not, greedy and seeded sampling with a penalty); both pools' free counts return. Faults: a byte
flipped in flight and a token count off by one fail the request with a named JSON error; a transfer error is retried
once, then a 502 naming the prefill; a client that leaves during the transfer, held KV nobody claims, and a decode pool
without room (the requests wait or are recomputed, never ended early) leave no block behind."""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from equivalence.support.pd_served import MODEL, TIMEOUT_S, Served, post, stream_chunks

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

PROMPTS = [[5, 9, 200, 17, 3, 44, 1, 2], list(range(30, 52)), [100, 101, 102, 103, 104, 105, 106]]


@pytest.fixture(scope="module")
def servers():
    started = []
    try:
        for role in (None, "prefill", "decode"):
            started.append(Served(role))
        yield started
    finally:
        for s in started:
            s.close()


def _prefill(prefill, path: str, body: dict) -> dict:
    r = post(
        prefill.url, path, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert (
        params["num_tokens"] == len(params["prompt_token_ids"]) and params["transfer_id"] in prefill.engine.handoff.held
    )
    return params


def _decode_body(prefill, body: dict, params: dict) -> dict:
    return {**body, "kv_transfer_params": {**params, "do_remote_prefill": True, "prefill_url": prefill.url}}


def _comparable(out: dict) -> dict:
    out = {k: v for k, v in out.items() if k not in ("id", "created")}
    return out


CASES = [
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "logprobs": 2, "temperature": 0}),
    (
        "/v1/completions",
        {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0.9, "seed": 7, "frequency_penalty": 0.5},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "the quick brown fox"}],
            "max_tokens": 7,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_then_decode_equals_the_colocated_server(servers, case, stream):
    colocated, prefill, decode = servers
    path, body = CASES[case]
    body = {**body, "model": MODEL, "stream": stream}
    params = _prefill(prefill, path, body)
    if stream:
        want, got = (
            stream_chunks(colocated.url, path, body),
            stream_chunks(decode.url, path, _decode_body(prefill, body, params)),
        )
        assert [c["choices"] for c in got] == [c["choices"] for c in want]
    else:
        want = post(colocated.url, path, body)
        got = post(decode.url, path, _decode_body(prefill, body, params))
        assert got.status_code == want.status_code == 200, got.text
        assert _comparable(got.json()) == _comparable(want.json())
    assert prefill.settled() and decode.settled(), "blocks left held or reserved"


def _greedy(colocated, prompt, max_tokens=8):
    r = post(
        colocated.url, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "model": MODEL}
    )
    return r.json()["choices"][0]["token_ids"]


class FaultyTransfer:
    """Wraps a prefill's transfer engine: `fail` calls raise a TransferError, `flip` XORs one landed byte."""

    def __init__(self, inner, fail: int = 0, flip: bool = False, pause: threading.Event | None = None):
        self.inner, self.fail, self.flip, self.pause, self.calls = inner, fail, flip, pause, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_transfer_sync_write(self, peer, src, dst, lengths):
        from optimized.pd.transfer_engine import TransferError

        self.calls += 1
        if self.pause is not None:
            self.pause.wait(TIMEOUT_S)
        if self.calls <= self.fail:
            raise TransferError(f"planted failure {self.calls}")
        self.inner.batch_transfer_sync_write(peer, src, dst, lengths)
        if self.flip:  # the decode cache lives in this process: one byte of the last range changes after landing
            byte = ctypes.c_uint8.from_address(dst[-1])
            byte.value ^= 0x10


@pytest.fixture
def faulty(servers):
    prefill = servers[1]
    inner = prefill.pd.transfer
    yield lambda **kw: setattr(prefill.pd, "transfer", FaultyTransfer(inner, **kw)) or prefill.pd.transfer
    prefill.pd.transfer = inner


def _hand_off(servers, prompt, num_tokens_delta=0):
    _, prefill, decode = servers
    body = {"prompt": prompt, "max_tokens": 8, "model": MODEL, "temperature": 0}
    params = _prefill(prefill, "/v1/completions", body)
    params["num_tokens"] += num_tokens_delta
    return post(decode.url, "/v1/completions", _decode_body(prefill, body, params))


def test_a_transfer_error_is_retried_once(servers, faulty):
    wrapper = faulty(fail=1)
    r = _hand_off(servers, PROMPTS[2])
    assert r.status_code == 200, r.text
    assert wrapper.calls == 2 and r.json()["choices"][0]["token_ids"] == _greedy(servers[0], PROMPTS[2])
    assert servers[1].settled() and servers[2].settled()


def test_a_second_transfer_error_is_a_502_naming_the_prefill(servers, faulty):
    faulty(fail=2)
    r = _hand_off(servers, PROMPTS[2])
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "kv_transfer_error" and servers[1].url in error["message"]
    assert "planted failure 1" in error["message"] and "planted failure 2" in error["message"]
    assert servers[1].settled() and servers[2].settled()


def test_a_byte_flipped_in_flight_fails_the_request_with_a_named_error(servers, faulty):
    faulty(flip=True)
    r = _hand_off(servers, PROMPTS[0])
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "kv_integrity_error" and "digest mismatch" in error["message"], error
    assert servers[1].settled() and servers[2].settled()


def test_a_token_count_off_by_one_fails_the_request_with_a_named_error(servers):
    r = _hand_off(servers, PROMPTS[0], num_tokens_delta=-1)
    assert r.status_code == 500, r.text
    assert "KvIntegrityError" in r.json()["error"]["message"]
    assert servers[1].settled() and servers[2].settled()


def test_a_client_that_leaves_during_the_transfer_leaves_no_block_behind(servers, faulty):
    _, prefill, decode = servers
    pause = threading.Event()
    wrapper = faulty(pause=pause)
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "model": MODEL}
    params = _prefill(prefill, "/v1/completions", body)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the prefill is writing
        httpx.post(decode.url + "/v1/completions", json=_decode_body(prefill, body, params), timeout=1.0)
    assert wrapper.calls >= 1
    pause.set()
    assert prefill.settled() and decode.settled()


def test_held_kv_nobody_claims_is_released_after_the_hold_timeout():
    prefill = Served("prefill", hold_timeout_s=0.2)
    try:
        params = _prefill(prefill, "/v1/completions", {"prompt": PROMPTS[1], "model": MODEL})
        assert prefill.engine.cache.free_blocks < prefill.free
        assert prefill.settled()
        r = post(
            prefill.url,
            "/pd/v1/transfer",
            {"transfer_id": params["transfer_id"], "decode": [{}], "decode_layout": {"tp": 1}},
        )
        assert r.status_code == 404 and "holds no KV" in r.json()["error"]["message"]
    finally:
        prefill.close()


def test_a_decode_pool_without_room_makes_requests_wait_never_end_early(servers):
    colocated, prefill = servers[0], servers[1]
    decode = Served("decode", pool=3)  # two blocks: one request's 8 + 16 tokens at a time
    try:
        bodies = [
            {"prompt": p, "max_tokens": 8, "model": MODEL, "ignore_eos": True, "temperature": 0}
            for p in (PROMPTS[0], PROMPTS[2], PROMPTS[0])
        ]
        params = [_prefill(prefill, "/v1/completions", b) for b in bodies]
        with ThreadPoolExecutor(3) as pool:
            out = list(
                pool.map(
                    lambda bp: post(decode.url, "/v1/completions", _decode_body(prefill, *bp)), zip(bodies, params)
                )
            )
        for r, b in zip(out, bodies):
            assert r.status_code == 200, r.text
            want = post(colocated.url, "/v1/completions", b).json()["choices"][0]["token_ids"]
            assert r.json()["choices"][0]["token_ids"] == want and len(want) == 8
        assert prefill.settled() and decode.settled()
    finally:
        decode.close()


def test_info_names_the_role_and_the_cache(servers):
    _, prefill, decode = servers
    for s, role in ((prefill, "prefill"), (decode, "decode")):
        info = httpx.get(s.url + "/pd/v1/info", timeout=TIMEOUT_S).json()
        assert info == {
            "role": role,
            "max_model_len": 256,
            "max_prompt_tokens": 48,
            "block_size": 16,
            "kv_cache_dtype": "float32",
            "attention": {"tp": 1, "dp": 1},
            "num_kv_heads": 2,
            "served_model_name": MODEL,
        }
    r = httpx.get(servers[0].url + "/pd/v1/info", timeout=TIMEOUT_S)
    assert r.status_code == 404 and "--pd-role" in r.json()["error"]["message"]
    r = post(
        decode.url,
        "/v1/completions",
        {"prompt": [1, 2], "model": MODEL, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 400 and "needs a prefill instance" in r.json()["error"]["message"]


def test_a_client_that_leaves_while_waiting_for_decode_blocks_leaves_no_block_behind(servers, faulty):
    colocated, prefill = servers[0], servers[1]
    decode = Served("decode", pool=2)  # one block: one request of PROMPTS[2] (7 + 8 tokens) at a time
    try:
        pause = threading.Event()
        body = {"prompt": PROMPTS[2], "max_tokens": 8, "model": MODEL, "temperature": 0, "ignore_eos": True}
        first, second = (_prefill(prefill, "/v1/completions", body) for _ in range(2))
        wrapper = faulty(pause=pause)
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(post, decode.url, "/v1/completions", _decode_body(prefill, body, first))
            deadline = time.monotonic() + TIMEOUT_S
            while not wrapper.calls:  # the first request holds the decode pool's one block, its KV being written
                assert time.monotonic() < deadline, "the first transfer never started"
                time.sleep(0.02)
            with pytest.raises(httpx.ReadTimeout):  # the second waits for a block; its client gives up
                httpx.post(decode.url + "/v1/completions", json=_decode_body(prefill, body, second), timeout=1.0)
            assert second["transfer_id"] in prefill.engine.handoff.held
            pause.set()
            r = done.result(TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["token_ids"]
            == post(colocated.url, "/v1/completions", body).json()["choices"][0]["token_ids"]
        )
        assert prefill.settled() and decode.settled()
    finally:
        decode.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"n": 2}, "serves one prompt with n=1"),
        ({"echo": True, "logprobs": 1}, "stay on the prefill side"),
        ({"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "x", "first_token": 1}}, "prefill_url"),
        ({"kv_transfer_params": {"do_remote_prefill": True, "prefill_url": "u", "transfer_id": "x"}}, "first_token"),
        ({"kv_transfer_params": {"prefill_url": "u"}}, "needs do_remote_decode"),
        (
            {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "prefill_url": "u",
                    "transfer_id": "x",
                    "first_token": 512,
                    "num_tokens": 3,
                }
            },
            "outside the vocabulary",
        ),
    ],
)
def test_a_decode_body_the_hand_off_cannot_serve_is_a_400_naming_why(servers, extra, message):
    _, prefill, decode = servers
    params = {"do_remote_prefill": True, "prefill_url": prefill.url, "transfer_id": "x", "first_token": 1}
    params |= {"num_tokens": 3, "prompt_token_ids": [1, 2, 3]}
    body = {"prompt": [1, 2, 3], "model": MODEL, "kv_transfer_params": params} | extra
    r = post(decode.url, "/v1/completions", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert decode.settled() and prefill.settled()


def test_fp8_kv_and_its_scales_hand_off_equal_to_the_colocated_server():
    started = []
    try:
        for role in (None, "prefill", "decode"):
            started.append(Served(role, fp8=True))
        colocated, prefill, decode = started
        assert httpx.get(decode.url + "/pd/v1/info", timeout=TIMEOUT_S).json()["kv_cache_dtype"] == "float8_e4m3fn"
        for path, body in CASES[:2]:
            body = {**body, "model": MODEL}
            params = _prefill(prefill, path, body)
            want = post(colocated.url, path, body)
            got = post(decode.url, path, _decode_body(prefill, body, params))
            assert got.status_code == want.status_code == 200, got.text
            assert _comparable(got.json()) == _comparable(want.json())
        assert prefill.settled() and decode.settled()
    finally:
        for s in started:
            s.close()


def test_a_prefill_instance_that_is_gone_is_a_502_naming_it_and_frees_the_decode_blocks(servers):
    from equivalence.endpoint.servers import unused_port

    _, prefill, decode = servers
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "model": MODEL, "temperature": 0}
    params = _prefill(prefill, "/v1/completions", body)
    with unused_port() as port:  # nothing listens there: the prefill died after answering
        gone = f"http://127.0.0.1:{port}"
        r = post(
            decode.url,
            "/v1/completions",
            {**body, "kv_transfer_params": {**params, "do_remote_prefill": True, "prefill_url": gone}},
        )
    assert r.status_code == 502 and gone in r.json()["error"]["message"], r.text
    assert decode.settled()
    assert post(prefill.url, "/pd/v1/release", {"transfer_id": params["transfer_id"]}).json()["released"]
    assert prefill.settled()
