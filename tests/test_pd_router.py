"""The PD router (`python -m optimized pd-router`) against stand-in instances speaking the PD protocol
(equivalence/support/fake_pd_instance.py): the two steps' bodies, the relay (JSON and SSE, byte for byte), the
choice of instances, the start-up checks, and the faults: an instance down (503 and /health name it), a client gone
mid-stream (the prefill's held blocks released), an instance's error status relayed, a prompt too long refused
before any decode work."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import urllib.request

import pytest
from hypothesis import given, settings, strategies as st

from equivalence.support.fake_pd_instance import MODEL, FakeInstance, expected_tokens
from optimized.__main__ import main as cli_main
from optimized.cli import pd_router
from optimized.errors import UsageError
from optimized.pd.router_instances import normalize_url

WAIT_S = 20  # a bound on waiting for an event the router causes (never a timing assertion)


def start_router(prefill, decode):
    args = argparse.Namespace(
        prefill=[p.url for p in prefill], decode=[d.url for d in decode], host="127.0.0.1", port=0,
        port_file=None, timeout=30.0,
    )  # fmt: skip
    server, port = pd_router.start(args)
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def deployment():
    """(prefill fakes, decode fakes, router address) with one of each; more by calling it with counts."""
    made, routers = [], []

    def make(n_prefill=1, n_decode=1, **decode_kw):
        prefill = [FakeInstance("prefill").start() for _ in range(n_prefill)]
        decode = [FakeInstance("decode", **decode_kw).start() for _ in range(n_decode)]
        made.extend(prefill + decode)
        server, address = start_router(prefill, decode)
        routers.append(server)
        return prefill, decode, address

    yield make
    for server in routers:
        server.shutdown()
        server.server_close()
    for fake in made:
        try:
            fake.stop()
        except OSError:
            pass


def post(address: str, route: str, body: dict) -> tuple[int, bytes, str]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("Content-Type")
    finally:
        conn.close()


def get(address: str, route: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{address}{route}", timeout=WAIT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def sse_tokens(raw: bytes) -> list[int]:
    events = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw
    return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]


# ------------------------------------------------------------------------------------------------ the flow


def test_completion_goes_prefill_then_decode_and_is_relayed_as_the_decode_answered(deployment):
    (prefill,), (decode,), router = deployment()
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 5, "temperature": 0, "min_tokens": 3}
    status, raw, ctype = post(router, "/v1/completions", body)
    assert status == 200 and ctype == "application/json", raw
    assert json.loads(raw)["choices"][0]["token_ids"] == expected_tokens(body, 5)

    (p_body,) = prefill.requests
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and p_body["min_tokens"] == 1
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert p_body["temperature"] == 0 and p_body["prompt"] == body["prompt"]  # sampling fields kept: it draws
    (d_body,) = decode.requests
    params = d_body.pop("kv_transfer_params")
    assert d_body == body, "the decode instance gets the client's own body"
    assert params["do_remote_prefill"] is True and params["prefill_url"] == prefill.url
    assert params["transfer_id"] == "t0" and params["num_tokens"] == len("hello there")
    assert prefill.claimed == ["t0"] and prefill.released == [] and prefill.held == {}
    _, metrics = get(router, "/metrics")
    assert b"qwen3_moe_pd_router_handoffs_total 1" in metrics
    assert b'qwen3_moe_pd_router_requests_total{route="/v1/completions"} 1' in metrics
    assert b"qwen3_moe_pd_router_releases_total 0" in metrics


def test_chat_stream_is_relayed_chunk_by_chunk(deployment):
    (prefill,), (decode,), router = deployment()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, raw, ctype = post(router, "/v1/chat/completions", body)
    assert status == 200 and ctype == "text/event-stream"
    assert sse_tokens(raw) == expected_tokens(body, 6)
    (p_body,) = prefill.requests
    assert p_body["max_completion_tokens"] == 1 and p_body["stream"] is False and "stream_options" not in p_body
    assert decode.requests[0]["stream"] is True and decode.requests[0]["stream_options"] == {"include_usage": True}


@pytest.fixture(scope="module")
def one_pair():
    prefill, decode = FakeInstance("prefill").start(), FakeInstance("decode").start()
    server, router = start_router([prefill], [decode])
    yield prefill, decode, router
    server.shutdown()
    server.server_close()
    prefill.stop()
    decode.stop()


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 99), min_size=1, max_size=30),
    max_tokens=st.integers(1, 30),
    stream=st.booleans(),
)
def test_any_prompt_fitting_the_instances_gets_the_decode_instances_tokens(one_pair, prompt, max_tokens, stream):
    prefill, decode, router = one_pair
    claimed = len(prefill.claimed)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    status, raw, _ = post(router, "/v1/completions", body)
    assert status == 200, raw
    tokens = sse_tokens(raw) if stream else json.loads(raw)["choices"][0]["token_ids"]
    assert tokens == expected_tokens(body, max_tokens)
    assert prefill.held == {} and len(prefill.claimed) == claimed + 1 and prefill.released == []


def test_requests_spread_over_the_instances(deployment):
    prefill, decode, router = deployment(2, 2)
    for i in range(4):
        status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": f"p{i}", "max_tokens": 2})
        assert status == 200, raw
    assert [len(p.requests) for p in prefill] == [2, 2]
    assert [len(d.requests) for d in decode] == [2, 2]
    for d in decode:  # each decode instance pulled from the prefill instance that computed its request
        for body in d.requests:
            owner = next(p for p in prefill if p.url == body["kv_transfer_params"]["prefill_url"])
            assert body["kv_transfer_params"]["transfer_id"] in owner.claimed


def test_models_and_health(deployment):
    _, _, router = deployment()
    status, raw = get(router, "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL
    status, raw = get(router, "/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"


def test_one_prompt_and_one_choice_per_request(deployment):
    (prefill,), _, router = deployment()
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    assert status == 400 and "one prompt" in json.loads(raw)["error"]["message"]
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "a", "n": 2})
    assert status == 400 and json.loads(raw)["error"]["param"] == "n"
    assert prefill.requests == []


# ------------------------------------------------------------------------------------------------- faults


def test_a_dead_decode_instance_is_a_503_naming_it_and_health_names_it(deployment):
    (prefill,), (decode,), router = deployment()
    decode.stop()
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert status == 503, raw
    assert f"decode instance {decode.url} is down" in json.loads(raw)["error"]["message"]
    assert prefill.released == ["t0"] and prefill.held == {}, "the prefill's held blocks were released"
    status, raw = get(router, "/health")
    assert status == 503
    health = json.loads(raw)
    assert f"decode instance {decode.url} is down" in health["error"] and prefill.url not in health["error"]
    assert health["instances"][decode.url]["up"] is False
    _, metrics = get(router, "/metrics")
    assert f'qwen3_moe_pd_router_instance_up{{role="decode",url="{decode.url}"}} 0'.encode() in metrics
    assert b'qwen3_moe_pd_router_errors_total{cause="decode_down"} 1' in metrics


def test_a_dead_prefill_instance_is_a_503_naming_it(deployment):
    (prefill,), (decode,), router = deployment()
    prefill.stop()
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert status == 503 and f"prefill instance {prefill.url} is down" in json.loads(raw)["error"]["message"]
    assert decode.requests == []
    status, raw = get(router, "/health")
    assert status == 503 and f"prefill instance {prefill.url} is down" in json.loads(raw)["error"]


def test_an_unhealthy_instance_is_named_by_health(deployment):
    (prefill,), (decode,), router = deployment()
    prefill.health_error = "RuntimeError: the engine stopped"
    status, raw = get(router, "/health")
    assert status == 503
    assert json.loads(raw)["error"] == (
        f"prefill instance {prefill.url} is unhealthy: HTTP 503 (RuntimeError: the engine stopped)"
    )
    prefill.health_error = None
    assert get(router, "/health")[0] == 200


def test_a_client_gone_mid_stream_releases_the_prefill_and_ends_the_decode_stream(deployment):
    (prefill,), (decode,), router = deployment(chunk_delay_s=0.02, max_model_len=4096)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "stream": True}
    host, port = router.split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as client:
        raw = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        client.sendall(head.encode() + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        received = b""
        while b"data: {" not in received:  # the first token arrived: the stream is under way
            received += client.recv(4096)
    # the client closed: the router stops relaying, closes the decode connection, and releases the transfer
    assert decode.stream_aborted.wait(WAIT_S), "the decode instance's stream was not ended"
    assert prefill.release_event.wait(WAIT_S), "no /pd/v1/release reached the prefill instance"
    assert prefill.released == ["t0"]


def test_a_client_gone_before_a_non_streamed_answer_ends_the_decode_request(deployment):
    """A non-streamed answer comes whole when the generation ends: the router must not sit on the decode connection
    until then, or the decode instance computes to max_tokens for nobody."""
    (prefill,), (decode,), router = deployment(answer_delay_s=3 * WAIT_S)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    host, port = router.split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as client:
        raw = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        client.sendall(head.encode() + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        assert decode.answer_waiting.wait(WAIT_S), "the request never reached the decode instance"
    # the client closed while the decode instance computes: the router closes its decode connection at once
    assert decode.answer_aborted.wait(WAIT_S), "the router kept the decode connection open for a client that left"
    assert prefill.claimed == ["t0"]  # the decode instance had taken the transfer: nothing left to release
    status, metrics = get(router, "/metrics")
    assert status == 200 and 'qwen3_moe_pd_router_errors_total{cause="client_gone"} 1' in metrics.decode()


def test_a_decode_instances_error_status_is_relayed_and_the_prefill_released(deployment):
    (prefill,), (decode,), router = deployment(fail_status=400)
    status, raw, ctype = post(router, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert status == 400 and ctype == "application/json"
    assert json.loads(raw)["error"]["message"] == "the decode instance refuses"
    assert prefill.released == ["t0"] and prefill.held == {}


def test_a_prefill_instances_error_status_is_relayed_and_no_decode_work_starts(deployment):
    (prefill,), (decode,), router = deployment()
    prefill.fail_status = 422
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert status == 422 and json.loads(raw)["error"]["message"] == "the prefill instance refuses"
    assert decode.requests == []


def test_an_error_without_a_json_body_becomes_an_openai_error_naming_the_instance(deployment):
    (prefill,), (decode,), router = deployment(fail_status=500)
    decode.plain_error = True
    status, raw, ctype = post(router, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert status == 500 and ctype == "application/json"
    error = json.loads(raw)["error"]
    assert error["message"] == f"decode instance {decode.url} answered HTTP 500: Internal Server Error"
    assert error["code"] == 500 and prefill.released == ["t0"]


def test_a_prompt_too_long_is_refused_before_any_decode_work(deployment):
    (prefill,), (decode,), router = deployment()
    # too long for the prefill side (max_model_len 64): its 413 comes back
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "x" * 80, "max_tokens": 3})
    assert status == 413 and "max_model_len" in json.loads(raw)["error"]["message"]
    # max_tokens alone does not fit the decode side: refused before the prefill step
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 64})
    assert status == 413 and json.loads(raw)["error"]["param"] == "max_tokens"
    assert len(prefill.requests) == 1
    # the prompt fits the prefill side, prompt + max_tokens does not fit the decode side: released, never decoded
    status, raw, _ = post(router, "/v1/completions", {"model": MODEL, "prompt": "x" * 40, "max_tokens": 30})
    assert status == 413 and "40 tokens plus max_tokens 30" in json.loads(raw)["error"]["message"]
    assert prefill.released == ["t0"] and prefill.held == {}
    assert decode.requests == []


# ---------------------------------------------------------------------------------------------- start-up


@pytest.mark.parametrize(
    "decode_kw, words",
    [
        (dict(role="prefill"), "the instance's role is 'prefill', not 'decode'"),
        (dict(model="other"), "served_model_name is 'other'"),
        (dict(block_size=32), "block_size is 32"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype is 'fp8'"),
        (dict(attention_tp=3), "attention TP 3 and --prefill http://127.0.0.1:"),
    ],
)
def test_an_incompatible_instance_is_refused_by_name(decode_kw, words):
    role = decode_kw.pop("role", "decode")
    prefill, decode = FakeInstance("prefill", attention_tp=2).start(), FakeInstance(role, **decode_kw).start()
    try:
        with pytest.raises(UsageError) as e:
            start_router([prefill], [decode])
        assert str(e.value).startswith(f"--decode {decode.url}: ") and words in str(e.value), str(e.value)
    finally:
        prefill.stop()
        decode.stop()


def test_the_cli_names_an_unreachable_instance_in_one_line(capsys):
    decode = FakeInstance("decode").start()
    with socket.socket() as s:  # a port with nothing listening (bound, never listening)
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(SystemExit) as e:
            cli_main(["pd-router", "--prefill", url, "--decode", decode.url, "--port", "0"])
    decode.stop()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python -m optimized: error: --prefill {url}: cannot read"), err


def test_instance_urls_are_normalized_or_refused():
    assert normalize_url("127.0.0.1:8000", "--prefill") == "http://127.0.0.1:8000"
    assert normalize_url("http://h:1/v1/", "--decode") == "http://h:1"
    for bad in ("http://h", "https://h:1", "h:1/other"):
        with pytest.raises(UsageError, match="expected an instance's address"):
            normalize_url(bad, "--prefill")
