"""A loopback load test of `python -m optimized serve` (its own process, the tiny fixture in fp32, a KV pool small
enough that requests wait for and preempt each other).

Many concurrent clients, with clients that disconnect mid-stream, bad requests and oversized ones (a prompt beyond
input_max_len, a body beyond the 16 MiB limit) mixed in. Afterwards:
- every good request's token ids equal the reference's greedy tokens for its prompt alone;
- every bad or oversized request got its OpenAI-style error status, and no request got a 5xx;
- the pool is full again (no running or waiting request, KV usage 0) and the server is healthy;
- its resident memory is within 20 % of what it was after its warm-up request;
- `/health` answered every probe made during the load within a second (the event loop was never blocked: a
  liveness bound, far above the milliseconds it takes, not a speed measurement).
Bounded: 48 requests of at most 6 tokens on the tiny model, 6 clients at a time.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from equivalence.endpoint import servers
from equivalence.support.serving_prompts import ref_greedy
from fixtures.checkpoints import checkpoint

pytestmark = pytest.mark.equivalence
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

CONFIG = """model_config: {model_path: "fixture:tiny", dtype: float32}
data_config: {input_max_len: 32}
scheduler_config: {batch_size: 4, max_new_tokens: 6, block_size: 16, max_prefill_tokens: 96}
"""
HEALTH_S = 1.0  # the liveness bound of a /health probe
TIMEOUT_S = 60


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc")


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc (Linux)")
def test_loopback_load_with_disconnects_bad_and_oversized_requests(tmp_path):
    checkpoint("tiny")
    config = tmp_path / "load.yaml"
    config.write_text(CONFIG)
    launch = servers.ours(config, "--kv-pool-blocks", "6")
    with (
        servers.server_process(launch, tmp_path / "server.log") as (url, proc),
        httpx.Client(base_url=url, timeout=TIMEOUT_S) as http,
    ):
        warm = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert warm.status_code == 200, warm.text
        rss_before = _rss_bytes(proc.pid)

        rng = random.Random(0)
        jobs = []
        for i in range(48):
            kind = ["good"] * 5 + ["disconnect", "bad", "oversized"]
            jobs.append((i, kind[rng.randrange(len(kind))], [rng.randrange(256) for _ in range(rng.randint(1, 20))]))
        health, done = [], threading.Event()

        def probe():
            while not done.is_set():
                start = time.monotonic()
                try:
                    ok = httpx.get(url + "/health", timeout=HEALTH_S).status_code == 200
                except httpx.HTTPError as e:
                    ok = repr(e)
                health.append((ok, time.monotonic() - start))
                time.sleep(0.1)

        def run(job):
            i, kind, prompt = job
            if kind == "good":
                r = http.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                )
                return (
                    kind,
                    prompt,
                    r.status_code,
                    r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text,
                )
            if kind == "disconnect":  # read the first chunk of a stream, then go away
                with http.stream(
                    "POST", "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "stream": True}
                ) as r:
                    next(r.iter_lines())
                    return kind, prompt, r.status_code, None
            if kind == "bad":
                bodies = [
                    b"{not json",
                    json.dumps({"model": "other", "prompt": "x"}).encode(),
                    json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(),
                    json.dumps({"model": "tiny", "prompt": "a\\ud800b"}).encode(),
                ]
                r = http.post(
                    "/v1/completions", content=bodies[i % len(bodies)], headers={"content-type": "application/json"}
                )
                return kind, prompt, r.status_code, r.text
            body = (
                {"model": "tiny", "prompt": list(range(40)), "max_tokens": 2}
                if i % 2
                else {"model": "tiny", "prompt": "x" * (17 << 20)}
            )
            r = http.post("/v1/completions", json=body)
            return kind, prompt, r.status_code, r.text

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            with ThreadPoolExecutor(6) as pool:
                results = list(pool.map(run, jobs))
        finally:
            done.set()
            prober.join(TIMEOUT_S)

        kinds = {k for k, *_ in results}
        assert kinds == {"good", "disconnect", "bad", "oversized"}, kinds
        for kind, prompt, status, body in results:
            assert status < 500, (kind, status, body)
            if kind == "good":
                assert status == 200 and body == ref_greedy(prompt, 6), (prompt, body)
            elif kind == "bad":
                assert status in (400, 404, 422), (status, body)
            elif kind == "oversized":
                assert status == 413, (status, body)
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # the aborts are applied between engine steps
            metrics = http.get("/metrics").text
            if (
                _metric(metrics, "qwen3_moe_requests_running"),
                _metric(metrics, "qwen3_moe_requests_waiting"),
                _metric(metrics, "qwen3_moe_kv_cache_usage_ratio"),
            ) == (0, 0, 0):
                break
            assert time.monotonic() < deadline, f"the pool did not return to full:\n{metrics}"
            time.sleep(0.2)
        assert http.get("/health").json() == {"status": "ok"}
        slow = [(ok, s) for ok, s in health if ok is not True or s > HEALTH_S]
        assert health and not slow, f"/health probes slower than {HEALTH_S} s or failed: {slow[:5]}"
        rss_after = _rss_bytes(proc.pid)
        assert rss_after <= 1.2 * rss_before, f"RSS {rss_before >> 20} MiB before the load, {rss_after >> 20} after"
        print(
            f"load: {len(results)} requests, {len(health)} health probes (max {max(s for _, s in health):.3f} s), "
            f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB"
        )
