"""Through real HTTP with the official `openai` client: every request's greedy fp32 tokens equal the reference's
for that prompt alone (completions and chat, streaming and not, concurrent clients arriving at different engine
steps), the logprobs (echo included) equal the reference's log-softmax within `model.float32`, stop strings cut the
text where the reference's completion has them, and bad requests get OpenAI-style errors without hurting the server.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from equivalence.support.compare import assert_close
from equivalence.support.serving_prompts import (
    PROMPTS,
    _reference,
    ref_greedy,
    staggered_clients,
)
from reference import tokenizer as ref_tok

pytestmark = pytest.mark.equivalence
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

MODEL = "tiny"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server():
    """The tiny fixture (fp32) served in a thread on the port 127.0.0.1:0 was bound to; always shut down."""
    from optimized.cli.serve import build_engine, make_server
    from optimized.serving.listen import bind, bound_port
    from optimized.config import InferenceConfig

    cfg = InferenceConfig.from_dict(
        {
            "model_config": {"model_path": "fixture:tiny", "dtype": "float32"},
            "data_config": {"input_max_len": 48},
            "scheduler_config": {"batch_size": 3, "max_new_tokens": 8, "block_size": 16, "max_prefill_tokens": 64},
        }
    )
    engine, tokenizer, stop_ids, _ = build_engine(cfg, kv_pool_blocks=9)  # room for about 2 requests at a time
    sock = bind("127.0.0.1", 0)
    port = bound_port(sock)
    srv, driver = make_server(cfg, engine, tokenizer, stop_ids, MODEL, sock)
    driver.start()
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, engine, tokenizer, driver
    finally:
        srv.should_exit = True
        thread.join(TIMEOUT_S)
        driver.stop()
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)


def test_concurrent_clients_get_reference_tokens(server):
    url, engine, _, _ = server
    c = client(url)

    def ask(i, prompt):
        if i % 2:
            r = c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].model_extra["token_ids"], r.usage.completion_tokens
        ids = []
        for chunk in c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids, len(ids)

    results = staggered_clients(ask, PROMPTS, TIMEOUT_S)
    for i, prompt in enumerate(PROMPTS):
        want = ref_greedy(prompt, 6)
        assert results[i] == (want, 6), f"request {i}: {results[i]} != reference {want}"
    assert engine.cache.free_blocks == engine.cache.num_blocks - 1


def test_chat_completion_equals_reference_on_the_chat_template(server):
    url, *_ = server
    ref, tok, eos = _reference()
    text = "Hello there"
    prompt = ref_tok.encode(tok, text, "chat")
    want = ref_greedy(prompt, 8, eos)
    c = client(url)
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_completion_tokens=8, temperature=0
    )
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
    assert r.choices[0].finish_reason == ("stop" if want[-1] in eos else "length")
    streamed = [
        ch
        for ch in c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0, stream=True
        )
    ]
    assert [t for ch in streamed for t in ch.choices[0].model_extra.get("token_ids", [])] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == r.choices[0].message.content


def test_logprobs_and_echo_equal_reference_log_softmax(server):
    url, *_ = server
    ref = _reference()[0]
    prompt = PROMPTS[0]
    r = client(url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True, extra_body={"ignore_eos": True}
    )
    ids = r.choices[0].model_extra["token_ids"]
    assert ids[: len(prompt)] == prompt
    new = ids[len(prompt) :]
    assert new == ref_greedy(prompt, 5)
    full = torch.log_softmax(ref(torch.tensor([ids[:-1]]), None)[0].float(), dim=-1)  # row j predicts ids[j+1]
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    want = full[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert_close(torch.tensor(lp.token_logprobs[1:]), want, "model.float32", "echo + generated token logprobs")
    top = torch.tensor([sorted(d.values(), reverse=True) for d in lp.top_logprobs[len(prompt) :]])
    # top_logprobs maps token text -> logprob: byte-level tokens can share a text, so compare the best value only
    assert_close(top[:, 0], torch.topk(full[len(prompt) - 1 :], 1, dim=-1).values[:, 0], "model.float32", "top-1")


def test_stop_string_cuts_where_the_reference_text_has_it(server):
    url, _, tokenizer, _ = server
    prompt = PROMPTS[2]
    want = ref_greedy(prompt, 8)
    text = tokenizer.decode(want)
    stop = next((text[i : i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2]), None)
    assert stop is not None, f"no usable stop string in {text!r}"
    r = client(url).completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_raw_sse_ends_with_done_and_usage(server):
    url, *_ = server
    body = {
        "model": MODEL,
        "prompt": PROMPTS[1],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    import json

    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "prompt": [1, 2], "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": [1, 2], "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": [1, 2], "max_tokens": "x"}, 422, "max_tokens"),
        ({"model": MODEL}, 422, "prompt"),
        ({"model": MODEL, "prompt": [1, 999999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": list(range(49))}, 413, "prompt"),
        ({"model": MODEL, "prompt": [1, 2], "max_tokens": 300}, 413, "prompt"),
        ({"model": "other", "prompt": [1, 2]}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    url, *_ = server
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=TIMEOUT_S)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=TIMEOUT_S).json() == {"status": "ok"}


def test_client_disconnect_frees_its_blocks_and_metrics_report(server, monkeypatch):
    url, engine, _, _ = server
    held = []  # free blocks after each engine step while the request streams
    step = engine.step

    def slow_step():  # slowed so the client disconnects long before the 100th token
        out = step()
        held.append(engine.cache.free_blocks)
        time.sleep(0.02)
        return out

    monkeypatch.setattr(engine, "step", slow_step)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[2],
        "max_tokens": 100,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # the first token arrived: the request holds blocks
        assert held and min(held) < engine.cache.num_blocks - 1, f"free blocks per step {held}"
    deadline = time.monotonic() + TIMEOUT_S
    while engine.cache.free_blocks != engine.cache.num_blocks - 1:
        assert time.monotonic() < deadline, "the aborted request kept its KV blocks"
        time.sleep(0.05)
    assert len(held) < 100, f"the request ran all {len(held)} steps: the disconnect did not abort it"
    deadline = time.monotonic() + 3  # no step runs after the abort: the gauges are refreshed when it is applied
    while (
        "qwen3_moe_requests_running 0\n" not in (text := httpx.get(url + "/metrics", timeout=TIMEOUT_S).text)
        or "qwen3_moe_kv_cache_usage_ratio 0.0\n" not in text
    ):
        assert time.monotonic() < deadline, f"stale gauges after the abort:\n{text}"
        time.sleep(0.05)
    for name in (
        "qwen3_moe_time_to_first_token_seconds_count",
        "qwen3_moe_time_per_output_token_seconds_count",
        "qwen3_moe_requests_waiting",
        "qwen3_moe_kv_cache_usage_ratio",
        'reason="abort"',
    ):
        assert name in text
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_bench_serve_reports_every_request(server, tmp_path, capsys):
    """`bench serve` against the live server: every request completes with its output length, the percentiles are
    ordered, and the JSON report holds what the table prints (no timing is asserted)."""
    import json

    from optimized.cli.main import main

    url, *_ = server
    out = tmp_path / "serve.json"
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                url,
                "--num-prompts",
                "5",
                "--request-rate",
                "50",
                "--prompt-lens",
                "3,17,9",
                "--output-len",
                "4",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (5, 0, 20)
    assert r["total_input_tokens"] == 3 + 17 + 9 + 3 + 17
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert r[name]["p50"] <= r[name]["p90"] <= r[name]["p99"]
    assert "TTFT" in capsys.readouterr().out


def test_bench_keeps_its_preset_usage_beside_serve():
    from optimized.cli.main import parser

    args = parser().parse_args(["bench", "--preset", "tiny", "--layers", "1"])
    assert (args.preset, args.layers, args.bench_mode) == ("tiny", 1, None)
    args = parser().parse_args(["bench", "serve", "--request-rate", "4", "--num-prompts", "3"])
    assert (args.bench_mode, args.request_rate, args.num_prompts) == ("serve", "4", 3)


def test_temperature_too_small_to_sample_is_greedy_and_the_server_lives(server):
    url, engine, _, _ = server
    c = client(url)
    for t in (1e-300, 1e-38, 1e-6):
        r = c.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=t, seed=3, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].model_extra["token_ids"] == ref_greedy(PROMPTS[1], 5), t
    assert httpx.get(url + "/health", timeout=TIMEOUT_S).json() == {"status": "ok"}


def test_prompt_lists_and_n_choices_through_the_engine(server):
    """A list of prompts: each choice is the reference's greedy generation of its prompt. n seeded choices: choice
    j equals an n = 1 request with protocol.choice_seed(seed, j), so each is reproducible alone."""
    from optimized.serving.protocol import choice_seed

    url, engine, _, _ = server
    c = client(url)
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[:3], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for ch, prompt in zip(r.choices, PROMPTS[:3]):
        assert ch.model_extra["token_ids"] == ref_greedy(prompt, 4)
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True}
    )
    got = [ch.model_extra["token_ids"] for ch in sorted(r.choices, key=lambda ch: ch.index)]
    for j, ids in enumerate(got):
        alone = c.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=6,
            temperature=1.0,
            seed=choice_seed(11, j),
            extra_body={"ignore_eos": True},
        )
        assert alone.choices[0].model_extra["token_ids"] == ids, f"choice {j}"
    assert len({tuple(ids) for ids in got}) > 1, "the choices were not sampled independently"
    assert engine.cache.free_blocks == engine.cache.num_blocks - 1


def test_a_stop_string_finish_is_counted_as_stop(server):
    url, _, tokenizer, _ = server
    want = ref_greedy(PROMPTS[2], 8)
    text = tokenizer.decode(want)
    stop = next((text[i : i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2]), None)

    def count(reason):
        m = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
        line = next(
            (ln for ln in m.splitlines() if ln.startswith(f'qwen3_moe_requests_finished_total{{reason="{reason}"}}')),
            None,
        )
        return float(line.split()[-1]) if line else 0.0

    before = count("stop"), count("abort")
    r = client(url).completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 3
    while count("stop") != before[0] + 1:
        assert time.monotonic() < deadline, "the stop-string finish was not counted as stop"
        time.sleep(0.05)
    assert count("abort") == before[1]


def test_text_offsets_index_the_real_completion(server):
    url, _, tokenizer, _ = server
    r = client(url).completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        max_tokens=6,
        temperature=0,
        logprobs=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.text_offset) == len(PROMPTS[3]) + 6 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    assert lp.text_offset[len(PROMPTS[3])] == len(tokenizer.decode(PROMPTS[3]))  # generated text starts there


def test_logits_processors_through_http_equal_the_reference_loop(server):
    """presence / frequency / repetition penalties, logit_bias and min_tokens from the `openai` client (greedy,
    completions streamed and not, and chat): the tokens equal the reference model's greedy loop with
    reference/sampling.py's processors; logit_bias +100 forces its token; min_tokens holds EOS back; an
    out-of-vocabulary logit_bias id is a 400 naming the field."""
    from optimized.executor.sampling import SamplingParams
    from reference.sampling import greedy_generate_processed

    url, engine, _, _ = server
    ref, tok, eos = _reference()
    c = client(url)
    plain = ref_greedy(PROMPTS[1], 6)
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.4,
        "logit_bias": {str(plain[1]): -100, "3": 2.5},
    }
    want = greedy_generate_processed(
        ref, PROMPTS[1], 6, SamplingParams(**{**fields, "logit_bias": {plain[1]: -100, 3: 2.5}})
    )
    assert want != plain
    r = c.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **fields}
    )
    assert r.choices[0].model_extra["token_ids"] == want
    streamed = [
        t
        for ch in c.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, **fields},
        )
        for t in ch.choices[0].model_extra["token_ids"]
    ]
    assert streamed == want
    r = c.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=5,
        temperature=0,
        logit_bias={"77": 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].model_extra["token_ids"] == [77] * 5
    # min_tokens: an EOS id biased by +100 ends the request at once; min_tokens=3 holds it back for 3 tokens
    text, e = "Hello there", sorted(eos)[0]
    prompt = ref_tok.encode(tok, text, "chat")
    for m in (0, 3):
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            max_tokens=6,
            temperature=0,
            logit_bias={str(e): 100},
            extra_body={"min_tokens": m},
        )
        got = r.choices[0].model_extra["token_ids"]
        assert got == greedy_generate_processed(
            ref, prompt, 6, SamplingParams(min_tokens=m, logit_bias={e: 100}), frozenset(eos)
        )
        assert len(got) == m + 1 and got[-1] == e and r.choices[0].finish_reason == "stop", (m, got)
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "logit_bias": {str(engine.runner.vocab_size): 1}},
        timeout=TIMEOUT_S,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert engine.batch.penalties is None and engine.cache.free_blocks == engine.cache.num_blocks - 1
