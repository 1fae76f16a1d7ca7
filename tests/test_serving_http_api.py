"""The HTTP layer through real HTTP (uvicorn on 127.0.0.1, httpx and the `openai` client) over the real `Driver`,
with a scripted stand-in for the engine: each request's tokens (or a per-request error) are given by the test, so
EOS endings, failures after the stream started, seeds and choices are checked exactly and fast. The same layer
over the real engine: equivalence/serving/test_e2e_serving_http.py."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from optimized.executor.engine import TokenEvent
from optimized.executor.scheduler import Step
from optimized.serving import protocol

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

MODEL = "tiny"
TIMEOUT_S = 30
MAX_PROMPT_TOKENS = 40
MAX_BODY = 64 * 1024
SLOW_S = 5.0  # the header and body read bounds of the test server


class _Queues(SimpleNamespace):
    """The scheduler's counts the Driver reads."""

    def num_waiting(self):
        return len(self.waiting)

    def num_running(self):
        return len(self.running)


class ScriptedEngine:
    """What the Driver needs of an engine. `script(request)` -> the request's tokens, an exception in place of a
    token is that request's failure (reported as an event with `error`, as the engine's per-request failures are)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.scheduler = _Queues(waiting=[], running=[], prefix_queries=0, prefix_hits=0)
        self.plans, self.added, self.aborted = {}, [], []
        self.script = self.default_script
        self.step_s = 0.0
        self.runner = SimpleNamespace(vocab_size=len(tokenizer.hf))  # what the app checks logit_bias ids against

    def default_script(self, request):
        return self.tokenizer.hf.encode(" hello world again and again") * 4

    def check(self, request):
        if not request.prompt:
            raise ValueError("the prompt is empty")

    def add(self, request):
        self.added.append(request)
        if request.prompt_logprobs:
            request.prompt_logprob_values = [(-1.0, [])] * (len(request.prompt) - 1)
        self.plans[request.request_id] = list(self.script(request))
        self.scheduler.running.append(request)

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.scheduler.running = [r for r in self.scheduler.running if r.request_id != request_id]

    @property
    def idle(self):
        return not self.scheduler.running

    @property
    def kv_usage(self):
        return len(self.scheduler.running) / 8

    def step(self):
        time.sleep(self.step_s)
        events = []
        for r in list(self.scheduler.running):
            item = self.plans[r.request_id].pop(0)
            if isinstance(item, BaseException):
                self.scheduler.running.remove(r)
                events.append(SimpleNamespace(request=r, token=-1, finished=True, error=item))
                continue
            r.tokens.append(item)
            r.finish_reason = (
                "stop"
                if item in r.stop_ids
                else "length"
                if len(r.tokens) >= r.max_tokens or not self.plans[r.request_id]
                else None
            )
            if r.finish_reason:
                self.scheduler.running.remove(r)
            events.append(
                TokenEvent(
                    r,
                    item,
                    -0.5 if r.logprobs is not None else None,
                    [] if r.logprobs is not None else None,
                    r.finish_reason is not None,
                )
            )
        return Step("decode", tuple(e.request for e in events)), events


@pytest.fixture(scope="module")
def server():
    from fixtures.checkpoints import checkpoint
    from optimized.model_loader.tokenizer import CheckpointTokenizer, eos_token_ids
    from optimized.serving.app import build_app
    from optimized.serving.driver import Driver
    from optimized.serving.http_server import Server
    from optimized.serving.listen import bind, bound_port

    path = checkpoint("tiny")
    tokenizer = CheckpointTokenizer.load(path)
    engine = ScriptedEngine(tokenizer)
    driver = Driver(engine).start()
    app = build_app(
        driver,
        tokenizer,
        MODEL,
        stop_ids=eos_token_ids(path),
        default_max_tokens=8,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_body_bytes=MAX_BODY,
        body_timeout_s=SLOW_S,
    )
    sock = bind("127.0.0.1", 0)
    port = bound_port(sock)
    srv = Server(app, sock, header_timeout_s=SLOW_S)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(
            url=f"http://127.0.0.1:{port}",
            engine=engine,
            tokenizer=tokenizer,
            driver=driver,
            app=app,
            eos=eos_token_ids(path),
        )
    finally:
        srv.should_exit = True
        thread.join(TIMEOUT_S)
        driver.stop()
        sock.close()


@pytest.fixture
def s(server):
    server.engine.script = server.engine.default_script
    server.engine.step_s = 0.0
    yield server
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).json() == {"status": "ok"}  # never the server


def post(s, path, body, **kw):
    return httpx.post(s.url + path, json=body, timeout=TIMEOUT_S, **kw)


def sse_lines(s, path, body):
    with httpx.stream("POST", s.url + path, json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        return [ln for ln in r.iter_lines() if ln]


def chunks_of(lines):
    return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]


def error_of(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["code"] == status, err
    return err


def client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


# ---- 1: temperature too small to sample with
def test_temperature_below_the_greedy_threshold_is_greedy(s):
    for t, greedy in (
        (1e-300, True),
        (5e-324, True),
        (protocol.GREEDY_TEMPERATURE / 2, True),
        (protocol.GREEDY_TEMPERATURE, False),
        (0.7, False),
    ):
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": t, "seed": 1})
        assert r.status_code == 200, r.text
        assert s.engine.added[-1].sampling.greedy is greedy, t
    error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}), 400, "temperature")


# ---- 2: limits before any work
def test_body_over_the_limit_is_refused_before_it_is_read(s):
    big = json.dumps({"model": MODEL, "prompt": "a" * MAX_BODY}).encode()
    error_of(httpx.post(s.url + "/v1/completions", content=big, timeout=TIMEOUT_S), 413, None)

    def chunked():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(2 * MAX_BODY // 1024):
            yield b"a" * 1024
        yield b'"}'

    r = httpx.post(s.url + "/v1/completions", content=chunked(), timeout=TIMEOUT_S)
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]


def test_a_prompt_too_long_in_characters_is_refused_without_tokenizing(s, monkeypatch):
    calls = []
    encode = s.tokenizer.hf.encode
    monkeypatch.setattr(s.tokenizer.hf, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    limit = s.app.state.max_prompt_chars
    assert limit == MAX_PROMPT_TOKENS * max(map(len, s.tokenizer.hf.get_vocab()))
    t0 = time.monotonic()
    error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": "x" * (limit + 1)}), 413, "prompt")
    error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": ["ok", "x" * (limit + 1)]}), 413, "prompt")
    error_of(
        post(
            s,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "x" * (limit // 2)},
                    {"role": "user", "content": "y" * (limit // 2 + 2)},
                ],
            },
        ),
        413,
        "messages",
    )
    assert calls == [] and time.monotonic() - t0 < 5
    # within the character bound it is tokenized, and then the token count decides
    error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": "x y " * MAX_PROMPT_TOKENS}), 413, "prompt")
    assert calls


def test_tokenizing_runs_off_the_event_loop(s, monkeypatch):
    encode = s.tokenizer.hf.encode

    def slow(*a, **k):
        time.sleep(1.5)
        return encode(*a, **k)

    monkeypatch.setattr(s.tokenizer.hf, "encode", slow)
    done = []
    t = threading.Thread(target=lambda: done.append(post(s, "/v1/completions", {"model": MODEL, "prompt": "hi"})))
    t.start()
    time.sleep(0.3)  # the request is inside the tokenizer now
    t0 = time.monotonic()
    assert httpx.get(s.url + "/health", timeout=TIMEOUT_S).status_code == 200
    waited = time.monotonic() - t0
    t.join(TIMEOUT_S)
    assert done and done[0].status_code == 200
    assert waited < 0.5, f"/health waited {waited:.2f} s behind a tokenizing request"


@pytest.mark.parametrize("stream", [False, True])
def test_detokenizing_runs_off_the_event_loop(s, monkeypatch, stream):
    """A token whose text takes 3 s to decode holds its own response, not /health: the decode runs on the server's
    worker thread, and /health answers before it ends (a decode on the event loop makes /health wait for it).
    No timing bound: a loaded machine delays a request by itself, so the proof is which thread decoded and the order."""
    decode = s.tokenizer.decode
    slow_token = s.tokenizer.hf.encode("Q")[0]
    started, finished, threads = threading.Event(), threading.Event(), []

    def slow(ids):
        if slow_token in ids and not started.is_set():  # once
            threads.append(threading.current_thread().name)
            started.set()
            time.sleep(3.0)
            finished.set()
        return decode(ids)

    monkeypatch.setattr(s.tokenizer, "decode", slow)
    s.engine.script = lambda r: [slow_token] + s.tokenizer.hf.encode(" hello world")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": stream}
    done = []
    t = threading.Thread(target=lambda: done.append(post(s, "/v1/completions", body)))
    t.start()
    assert started.wait(TIMEOUT_S), "the slow token was never decoded"
    assert httpx.get(s.url + "/health", timeout=TIMEOUT_S).status_code == 200
    answered_during_decode = not finished.is_set()
    t.join(TIMEOUT_S)
    assert done and done[0].status_code == 200
    assert threads and threads[0].startswith("tokenize"), f"decoded on thread {threads}, not the worker"
    assert answered_during_decode, "/health waited for the slow decode to end"


# ---- 3: the EOS token's text never ends the output
@pytest.mark.parametrize("eos_index", [0, 1])
def test_eos_text_is_not_in_the_output(s, eos_index):
    eos = s.eos[eos_index]
    words = s.tokenizer.hf.encode("Paris is nice 🙂")
    s.engine.script = lambda r: words + [eos]
    want = s.tokenizer.decode(words)
    assert s.tokenizer.decode([eos]).startswith("<|")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 50}
    r = post(s, "/v1/completions", body).json()["choices"][0]
    assert (r["text"], r["finish_reason"], r["token_ids"]) == (want, "stop", words + [eos])
    chunks = chunks_of(sse_lines(s, "/v1/completions", {**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["text"] == "" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    m = post(s, "/v1/chat/completions", chat).json()["choices"][0]
    assert m["message"]["content"] == want and m["finish_reason"] == "stop"
    streamed = client(s).chat.completions.create(**chat, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(deltas) == want and "<|" not in deltas[-1]


def test_text_held_for_a_stop_string_is_released_at_eos(s):
    words = s.tokenizer.hf.encode("Paris X")
    s.engine.script = lambda r: words + [s.eos[0]]
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stop": ["XY"]}).json()
    assert r["choices"][0]["text"] == "Paris X"


# ---- 4: /metrics: fresh gauges after aborts, stop strings counted as stop
def _metric(s, name):
    for line in httpx.get(s.url + "/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_gauges_are_fresh_after_an_abort_and_stop_strings_count_as_stop(s):
    s.engine.step_s = 0.02
    s.engine.script = lambda r: s.tokenizer.hf.encode(" a b c") * 200
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 500, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        assert _metric(s, "qwen3_moe_requests_running") == 1
    deadline = time.monotonic() + 3  # no engine step runs after the abort: only the inbox refresh
    while _metric(s, "qwen3_moe_requests_running") or _metric(s, "qwen3_moe_kv_cache_usage_ratio"):
        assert time.monotonic() < deadline, "the gauges stayed stale after the abort"
        time.sleep(0.05)
    stop = 'qwen3_moe_requests_finished_total{reason="stop"}'
    abort = 'qwen3_moe_requests_finished_total{reason="abort"}'
    before = _metric(s, stop), _metric(s, abort)
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 500, "stop": [" b"]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == " a"
    deadline = time.monotonic() + 3
    while _metric(s, stop) != before[0] + 1:
        assert time.monotonic() < deadline, "a stop-string finish was not counted as stop"
        time.sleep(0.05)
    assert _metric(s, abort) == before[1]


# ---- 5: seeds; errors after the SSE headers
def test_seeds_up_to_2_64_minus_1_are_accepted_and_others_name_seed(s):
    for seed in (0, 2**45, 2**63, 2**64 - 1):
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 1, "seed": seed})
        assert r.status_code == 200, r.text
        assert s.engine.added[-1].sampling.seed == seed
    for seed, status in ((2**64, 400), (-1, 400), (1.5, 422), ("7", 422)):
        for stream in (False, True):  # refused before the stream starts: a JSON error, not an SSE one
            error_of(
                post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": seed, "stream": stream}),
                status,
                "seed",
            )


def test_an_error_after_the_stream_started_is_an_sse_error_event_then_done(s):
    words = s.tokenizer.hf.encode(" one two")
    s.engine.script = lambda r: words + [RuntimeError("sampling failed for this request")]
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        lines = sse_lines(s, path, {"model": MODEL, "max_tokens": 20, "stream": True, **body})
        assert lines[-3:-1] == ["event: error", lines[-2]] and lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["type"] == "server_error" and "sampling failed" in err["message"], err
        assert len(chunks_of(lines[:-3])) >= len(words)
        r = post(s, path, {"model": MODEL, "max_tokens": 20, **body})  # not streamed: a JSON error
        assert r.status_code == 500 and "sampling failed" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="sampling failed"):
        for _ in client(s).completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True):
            pass
    s.engine.script = s.engine.default_script
    assert post(s, "/v1/completions", {"model": MODEL, "prompt": "hi"}).status_code == 200


def test_a_detokenizing_failure_fails_that_request_only(s, monkeypatch):
    decode = s.tokenizer.decode
    hello = s.tokenizer.hf.encode(" hello")
    bad = s.tokenizer.hf.encode("Q")[0]
    assert bad not in hello

    def broken(ids):
        if bad in ids:
            raise RuntimeError("cannot decode")
        return decode(ids)

    monkeypatch.setattr(s.tokenizer, "decode", broken)
    s.engine.script = lambda r: hello + [bad] + hello
    n_aborted = len(s.engine.aborted)
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 20})
    assert r.status_code == 500 and "detokenizing failed" in r.json()["error"]["message"]
    lines = sse_lines(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True})
    assert "event: error" in lines and lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + 3
    while len(s.engine.aborted) < n_aborted + 2:  # both requests were aborted: their blocks go back
        assert time.monotonic() < deadline
        time.sleep(0.02)
    monkeypatch.setattr(s.tokenizer, "decode", decode)
    assert post(s, "/v1/completions", {"model": MODEL, "prompt": "hi"}).status_code == 200


# ---- 6: a lone surrogate, a stream_options that is not an object
def test_lone_surrogates_and_bad_stream_options_get_json_errors(s):
    raw = b'{"model": "tiny", "prompt": "a\\ud800b"}'
    err = error_of(httpx.post(s.url + "/v1/completions", content=raw, timeout=TIMEOUT_S), 400, "prompt")
    assert "surrogate" in err["message"]
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'
    error_of(
        httpx.post(s.url + "/v1/chat/completions", content=raw, timeout=TIMEOUT_S), 400, "messages[0].content[0].text"
    )
    ok = b'{"model": "tiny", "prompt": "a\\ud83d\\ude00b"}'  # a pair is fine
    assert httpx.post(s.url + "/v1/completions", content=ok, timeout=TIMEOUT_S).status_code == 200
    for options, status, param in (
        (1, 422, "stream_options"),
        ("x", 422, "stream_options"),
        ([], 422, "stream_options"),
        ({"include_usage": "yes"}, 422, "stream_options.include_usage"),
        ({"other": True}, 400, "stream_options.other"),
    ):
        error_of(
            post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": options}),
            status,
            param,
        )
    error_of(
        post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}),
        400,
        "stream_options",
    )


# ---- 7: the API surface
def test_text_offset_locates_each_token_in_the_text(s):
    words = s.tokenizer.hf.encode(" Paris is nice, Rome too")
    s.engine.script = lambda r: words
    for echo in (False, True):
        body = {"model": MODEL, "prompt": "The capital", "max_tokens": 50, "logprobs": 0, "echo": echo}
        c = post(s, "/v1/completions", body).json()["choices"][0]
        lp, text = c["logprobs"], c["text"]
        ends = lp["text_offset"][1:] + [len(text)]
        assert [text[a:b] for a, b in zip(lp["text_offset"], ends)] == lp["tokens"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        chunks = chunks_of(sse_lines(s, "/v1/completions", {**body, "stream": True}))
        assert [o for ch in chunks for o in ch["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]


def test_model_by_id(s):
    assert client(s).models.retrieve(MODEL).id == MODEL
    r = httpx.get(s.url + "/v1/models/other", timeout=TIMEOUT_S)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("suffix", "tail"),
        ("best_of", 3),
        ("functions", [{"name": "f"}]),
    ],
)
def test_unsupported_fields_are_refused_naming_them(s, field, value):
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        err = error_of(post(s, path, {"model": MODEL, **body, field: value}), 400, field)
        assert field in err["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(s):
    neutral = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "suffix": "",
        "best_of": 2,
        "n": 2,
        "logit_bias": {},
        "min_tokens": 0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1,
    }
    assert post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", **neutral}).status_code == 200


def test_logits_processor_fields_reach_the_engine(s):
    """presence/frequency/repetition penalties, logit_bias (token-id string keys) and min_tokens are accepted on both
    routes, greedy or sampled, and every choice's engine request carries them (their effect on tokens:
    equivalence/serving/test_e2e_serving_http.py)."""
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "logit_bias": {"5": 1, "17": -100},
        "min_tokens": 2,
    }
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 3, "n": 2}):
            r = post(s, path, {"model": MODEL, **body, **fields, **extra, "max_tokens": 4})
            assert r.status_code == 200, r.text
            for q in [x.sampling for x in s.engine.added[-extra.get("n", 1) :]]:
                assert (q.presence_penalty, q.frequency_penalty, q.repetition_penalty, q.min_tokens) == (
                    0.5,
                    -1.0,
                    1.2,
                    2,
                )
                assert q.logit_bias == ((5, 1.0), (17, -100.0)) and q.penalized


@pytest.mark.parametrize(
    "field, value, status",
    [
        ("presence_penalty", 2.5, 400),
        ("presence_penalty", -2.01, 400),
        ("frequency_penalty", -3, 400),
        ("frequency_penalty", "1", 422),
        ("repetition_penalty", 0, 400),
        ("repetition_penalty", -1.5, 400),
        ("repetition_penalty", True, 422),
        ("min_tokens", -1, 400),
        ("min_tokens", 5, 400),
        ("min_tokens", 1.5, 422),
        ("logit_bias", {"abc": 1}, 400),
        ("logit_bias", {"-1": 1}, 400),
        ("logit_bias", {"5": 101}, 400),
        ("logit_bias", {"5": -100.5}, 400),
        ("logit_bias", {"5": "x"}, 422),
        ("logit_bias", [5], 422),
        ("logit_bias", {"99999999": 1}, 400),
        ("logit_bias", {str(i): 1 for i in range(301)}, 400),
    ],
)
def test_logits_processor_fields_out_of_range_name_the_field(s, field, value, status):
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        added = len(s.engine.added)
        err = error_of(post(s, path, {"model": MODEL, **body, "max_tokens": 4, field: value}), status, field)
        assert field in err["message"]
        assert len(s.engine.added) == added, "a refused request reached the engine"


def test_chat_content_as_text_parts(s):
    def prompt_of(content):
        r = post(s, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return s.engine.added[-1].prompt

    assert prompt_of([{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]) == prompt_of(
        "Hello\nthere"
    )
    r = client(s).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], max_tokens=3
    )
    assert r.choices[0].message.content
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x"}}],
            }
        ],
    }
    error_of(post(s, "/v1/chat/completions", body), 400, "messages[0].content[1].type")


def test_a_list_of_prompts_gives_one_choice_per_prompt(s):
    prompts = ["The capital", "of France", [5, 6, 7]]
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 4}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    got = {tuple(x.prompt) for x in s.engine.added[-3:]}
    want = [s.tokenizer.hf.encode(p) if isinstance(p, str) else p for p in prompts]
    assert got == {tuple(p) for p in want}
    assert r["usage"]["prompt_tokens"] == sum(map(len, want)) and r["usage"]["completion_tokens"] == 12
    chunks = chunks_of(
        sse_lines(s, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 4, "stream": True})
    )
    by_index = {}
    for ch in chunks:
        by_index.setdefault(ch["choices"][0]["index"], []).append(ch["choices"][0]["text"])
    assert sorted(by_index) == [0, 1, 2]
    assert ["".join(by_index[i]) for i in range(3)] == [c["text"] for c in r["choices"]]
    r = post(s, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 4, "echo": True}).json()
    assert [c["text"][: len(p)] for c, p in zip(r["choices"], prompts[:2])] == prompts[:2]


def test_n_choices_are_sampled_with_a_seed_each(s):
    r = post(
        s,
        "/v1/completions",
        {"model": MODEL, "prompt": ["a", "b"], "n": 3, "seed": 2**64 - 2, "temperature": 0.8, "max_tokens": 2},
    ).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    added = s.engine.added[-6:]
    assert sorted((x.request_id.rsplit("-", 1)[1], x.sampling.seed) for x in added) == sorted(
        (str(k), protocol.choice_seed(2**64 - 2, k % 3)) for k in range(6)
    )
    assert protocol.choice_seed(2**64 - 2, 2) == 0  # wraps within [0, 2**64)
    assert r["usage"]["prompt_tokens"] == 2
    post(
        s,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 1},
    )
    seeds = [x.sampling.seed for x in s.engine.added[-2:]]  # unseeded: each choice its own seed
    assert None not in seeds and seeds[0] != seeds[1]
    error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 20, "n": 4}), 400, "n")
    error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": ["a"] * (protocol.MAX_CHOICES + 1)}), 400, "prompt")


# ---- a vanished client stops its work
def raw_request(s, path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    return head.encode() + body


def connect(s):
    import socket

    host, port = s.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)


def wait_for(condition, what: str, limit_s: float = 60):
    deadline = time.monotonic() + limit_s  # a bound for a hung server, not a timing claim
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streamed_request_is_aborted_when_its_client_goes_away(s, route):
    """Tokens flow every step, so the request never waits a second for an event: it must still learn of the
    disconnect (its blocks returned and counted `abort`), not run on to max_tokens and count `length`."""
    max_tokens = 3000
    s.engine.step_s = 0.005
    s.engine.script = lambda r: s.tokenizer.hf.encode(" a") * max_tokens
    abort = 'qwen3_moe_requests_finished_total{reason="abort"}'
    before, added = _metric(s, abort), len(s.engine.added)
    prompt = {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens, **prompt}).encode()
    with connect(s) as c:
        c.sendall(raw_request(s, route, body))
        wait_for(lambda: len(s.engine.added) > added and s.engine.added[-1].tokens, "the request never started")
        request = s.engine.added[-1]
    wait_for(lambda: request not in s.engine.scheduler.running, "the request never ended")
    assert request.request_id in s.engine.aborted and request.finish_reason is None
    assert len(request.tokens) < max_tokens
    wait_for(lambda: _metric(s, abort) == before + 1, "the abort was not counted")


# ---- special tokens other than EOS
def test_special_tokens_are_skipped_by_default_and_kept_when_asked(s):
    hf = s.tokenizer.hf
    special = hf.convert_tokens_to_ids("<|im_start|>")
    head, tail = hf.encode("Paris is"), hf.encode(" nice")
    assert special not in s.eos
    s.engine.script = lambda r: head + [special] + tail + [s.eos[0]]
    d = s.tokenizer.decode
    want = {
        (): d(head) + d(tail),  # vLLM's default: skip_special_tokens true
        (False, True): d(head) + " <|im_start|> " + d(tail),
        (False, False): d(head + [special] + tail),
    }
    for flags, text in want.items():
        extra = dict(zip(("skip_special_tokens", "spaces_between_special_tokens"), flags))
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, **extra}
        r = post(s, "/v1/completions", body).json()["choices"][0]
        assert (r["text"], r["finish_reason"]) == (text, "stop"), flags  # the EOS text never shows
        chunks = chunks_of(sse_lines(s, "/v1/completions", {**body, "stream": True}))
        assert "".join(c["choices"][0]["text"] for c in chunks) == text, flags
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, **extra}
        assert post(s, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"] == text, flags
        deltas = chunks_of(sse_lines(s, "/v1/chat/completions", {**chat, "stream": True}))
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in deltas) == text, flags
    for field in ("skip_special_tokens", "spaces_between_special_tokens"):
        error_of(post(s, "/v1/completions", {"model": MODEL, "prompt": "hi", field: "yes"}), 422, field)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 1}
        error_of(post(s, "/v1/chat/completions", chat), 422, field)


# ---- slow and vanishing senders, unknown routes
class Records(list):
    """The log records of uvicorn's error logger (where a traceback of the app would go) while the block runs."""

    def __enter__(self):
        import logging

        self.handler = logging.Handler()
        self.handler.emit = self.append
        logging.getLogger("uvicorn.error").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("uvicorn.error").removeHandler(self.handler)


def read_to_eof(c) -> bytes:
    out = b""
    while chunk := c.recv(65536):
        out += chunk
    return out


def test_a_client_gone_mid_body_is_one_log_line(s):
    with Records() as records:
        with connect(s) as c:
            c.sendall(raw_request(s, "/v1/completions", b'{"model": "tiny", "pro', content_length=1000))
        wait_for(lambda: records, "nothing was logged")
        assert httpx.get(s.url + "/health", timeout=TIMEOUT_S).status_code == 200
    record = records[0]
    assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
    assert "went away while sending the body of POST /v1/completions" in record.getMessage()


def test_a_client_slow_to_send_its_headers_is_dropped(s):
    with Records() as records, connect(s) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")  # and never the rest
        assert read_to_eof(c) == b""  # closed by the server (the socket's own timeout would raise)
    assert any("--header-timeout" in r.getMessage() for r in records)


def test_a_client_slow_to_send_its_body_gets_408_and_is_dropped(s):
    with connect(s) as c:
        c.sendall(raw_request(s, "/v1/completions", b'{"model": "tiny", "pro', content_length=1000))
        reply = read_to_eof(c).decode()
    assert reply.startswith("HTTP/1.1 408 "), reply[:200]
    error = json.loads(reply.split("\r\n\r\n", 1)[1])["error"]
    assert error["code"] == 408 and "--body-timeout" in error["message"]


def test_unknown_routes_and_methods_get_openai_errors(s):
    r = httpx.get(s.url + "/v1/nothing", timeout=TIMEOUT_S)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(s.url + "/v1/completions", timeout=TIMEOUT_S)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- every sampling parameter: refused naming it, or computed without leaving float32's range
_TINY_FLOATS = [5e-324, 1e-320, 1e-46, 7e-46, 1.4e-45, 1e-40, 1e-39, 1.1754943508222875e-38, 1e-38, 1e-30, 1e-7, 1e-6]
_HUGE_FLOATS = [1e6, 1.0000001e6, 1e20, 3.4028234663852886e38, 3.5e38, 1e300, 1.7976931348623157e308]
_EXTREME_FLOATS = (
    [0.0, -0.0, 1e-5, 0.5, 1.0, 2.0, float("inf"), float("-inf"), float("nan")]
    + _TINY_FLOATS
    + [-v for v in _TINY_FLOATS]
    + _HUGE_FLOATS
    + [-v for v in _HUGE_FLOATS]
)
_EXTREME_INTS = [-(2**70), -2, -1, 0, 1, 5, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30]


def _allowed(field: str, v) -> bool:
    """The documented range of each field (docs/serving.md's field table)."""
    from optimized.executor.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

    return {
        "temperature": lambda: 0 <= v <= 2,
        "top_p": lambda: 0 < v <= 1,
        "top_k": lambda: v >= -1,
        "presence_penalty": lambda: -2 <= v <= 2,
        "frequency_penalty": lambda: -2 <= v <= 2,
        "repetition_penalty": lambda: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
        "logit_bias": lambda: all(-100 <= b <= 100 for b in v.values()),
    }[field]()


def _chosen_from(request, logits):
    """The engine's batched choice for this request's row on `logits` [1, V]: (processed logits, filtered
    probabilities, chosen id)."""
    from optimized.executor.device_batch import DeviceBatch
    from optimized.executor.sampling import apply_penalties, choose, sorted_filtered_probs
    from optimized.executor.scheduler import Request

    row = Request("x", request.prompt, 4, request.sampling, stop_ids=request.stop_ids, blocks=[1])
    batch = DeviceBatch(1, 2, torch.device("cpu"), logits.shape[-1])
    batch.admit([row])
    penalties, sampling = batch.penalty_rows(0, 1), batch.sampling_rows(0, 1)
    draws = batch.sampling.draws[:1]
    processed = logits if penalties is None else apply_penalties(logits, penalties, draws)
    probs, _ = sorted_filtered_probs(processed, sampling.temperature, sampling.top_k, sampling.top_p)
    return processed, probs, int(choose(logits, sampling, penalties, draws)[0])


_floats = st.one_of(st.sampled_from(_EXTREME_FLOATS), st.floats(), st.floats(-2, 2))
_sampling_fields = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.one_of(_floats, st.floats(1e-5, 2)),
        "top_p": _floats,
        "top_k": st.one_of(st.sampled_from(_EXTREME_INTS), st.integers()),
        "presence_penalty": _floats,
        "frequency_penalty": _floats,
        "repetition_penalty": _floats,
        "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "17"]), _floats, min_size=1),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=_sampling_fields, logits=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=1))
@example(fields={"temperature": 1.0, "top_p": 1e-46}, logits=[3.0])
@example(fields={"temperature": 0.7, "repetition_penalty": 1e-39}, logits=[3.0])
@example(fields={"temperature": 0.7, "top_k": 2**64}, logits=[3.0])
def test_sampling_parameters_are_refused_or_stay_in_float32s_range(server, fields, logits):
    """Extreme values (subnormal, past float32's limits, infinities, NaN, huge integers) of every sampling field, on
    both routes: a value outside the documented range is a 400 naming its field; an accepted request's row, through
    the engine's batched processors, temperature, top-k and top-p, has finite probabilities and a token id (top_p
    1e-46 was 0 on the device, every token dropped and the probabilities NaN; repetition_penalty 1e-39 gave x / 0)."""
    from optimized.executor.sampling import MAX_REPETITION_PENALTY
    from reference.sampling import process_with

    server.engine.script = server.engine.default_script
    vocab = len(server.tokenizer.hf)
    bad = sorted(k for k, v in fields.items() if not _allowed(k, v))
    prompt = server.tokenizer.hf.encode("hi there")
    for path, body in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}]}),
    ):
        raw = json.dumps({"model": MODEL, **body, **fields, "seed": 7, "max_tokens": 1})  # NaN, Infinity as Python's
        r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
        if bad:
            assert r.status_code == 400, (fields, r.text)
            assert error_of(r, 400, r.json()["error"]["param"])["param"] in bad, (fields, r.json())
            continue
        assert r.status_code == 200, (fields, r.text)
        request = server.engine.added[-1]
        # the prompt's tokens (which repetition_penalty divides or multiplies) at the highest or the lowest logits
        for prompt_logit in (max(abs(logits[0]), 1.0), -max(abs(logits[0]), 1.0) * MAX_REPETITION_PENALTY):
            row = torch.full((vocab,), logits[0], dtype=torch.float32)
            row[sorted(set(request.prompt))] = prompt_logit
            processed, probs, chosen = _chosen_from(request, row.unsqueeze(0))
            want = process_with(row, request.sampling, request.prompt, request.tokens[:0], request.stop_ids)
            assert torch.equal(processed[0], want), "the batched processors left the per-row rules"
            assert not processed.isnan().any() and not processed.isposinf().any(), (fields, processed)
            assert probs.isfinite().all() and probs[0, 0] > 0, (fields, probs)
            assert 0 <= chosen < vocab, (fields, chosen)
