"""`bench serve --max-concurrency N` and `--goodput` (optimized/benchmarks/serve_bench.py), without a server: the
request coroutine is replaced by one that counts the requests in flight, and goodput is computed on given outcomes
(no timing is asserted)."""

from __future__ import annotations

import asyncio
import json

import pytest

from optimized.benchmarks import serve_bench
from optimized.benchmarks.serve_bench import Outcome, parse_goodput, report
from optimized.errors import UsageError

pytest.importorskip("httpx")


def _bench(argv, monkeypatch, tmp_path):
    """Run `bench serve` with a fake request: each one holds its slot for a few event-loop turns. Returns the most
    requests seen in flight at once and the JSON report."""
    from optimized.cli.main import main

    flight = {"now": 0, "peak": 0}

    async def fake_one(client, url, model, prompt, output_len, timeout):
        flight["now"] += 1
        flight["peak"] = max(flight["peak"], flight["now"])
        for _ in range(5):
            await asyncio.sleep(0)
        flight["now"] -= 1
        return Outcome(len(prompt), ok=True, ttft=0.001, latency=0.001 * output_len, tokens=output_len)

    monkeypatch.setattr(serve_bench, "_one", fake_one)
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--num-prompts",
            "7",
            "--output-len",
            "3",
            "--json",
            str(out),
            "--no-progress",
            *argv,
        ]
    )
    return rc, flight["peak"], json.loads(out.read_text())


@pytest.mark.parametrize("cap", [1, 3])
def test_max_concurrency_caps_the_requests_in_flight(cap, monkeypatch, tmp_path, capsys):
    rc, peak, r = _bench(["--max-concurrency", str(cap)], monkeypatch, tmp_path)
    assert rc == 0 and r["completed"] == 7 and r["max_concurrency"] == cap
    assert peak == cap, f"{peak} requests were in flight at once with --max-concurrency {cap}"
    assert f"max concurrency: {cap}" in capsys.readouterr().out


def test_without_a_cap_every_request_is_in_flight_at_once(monkeypatch, tmp_path):
    rc, peak, r = _bench([], monkeypatch, tmp_path)
    assert rc == 0 and peak == 7 and r["max_concurrency"] is None and "goodput" not in r


def test_goodput_counts_the_requests_within_every_target():
    outcomes = [
        Outcome(4, ok=True, ttft=0.100, latency=0.100 + 3 * 0.020, tokens=4),  # TTFT 100, TPOT 20: good
        Outcome(4, ok=True, ttft=0.300, latency=0.300 + 3 * 0.020, tokens=4),  # TTFT too long
        Outcome(4, ok=True, ttft=0.100, latency=0.100 + 3 * 0.080, tokens=4),  # TPOT too long
        Outcome(4, ok=True, ttft=0.150, latency=0.150, tokens=1),  # one token: no TPOT, good
        Outcome(4, ok=False, error="HTTP 500"),  # failed: never good
    ]
    r = report(outcomes, 2.0, parse_goodput(["ttft:200", "tpot:50"]))
    assert r["goodput"] == {"targets_ms": {"ttft": 200.0, "tpot": 50.0}, "good": 2, "share": 2 / 5, "rate": 1.0}
    assert report(outcomes, 2.0, parse_goodput(["ttft:200"]))["goodput"]["good"] == 3
    assert report(outcomes, 2.0, parse_goodput(["tpot:50"]))["goodput"]["good"] == 3
    text = serve_bench.format_report(r)
    assert "goodput (TTFT <= 200 ms, TPOT <= 50 ms): 2 of 5 requests (40.0 %), 1.00 req/s" in text


@pytest.mark.parametrize(
    "items, match",
    [
        (["ttft"], "ttft"),
        (["itl:5"], "itl:5"),
        (["ttft:-1"], "ttft:-1"),
        (["tpot:abc"], "tpot:abc"),
        (["ttft:5", "ttft:6"], "ttft twice"),
    ],
)
def test_bad_goodput_targets_are_usage_errors_naming_them(items, match):
    with pytest.raises(UsageError, match=match):
        parse_goodput(items)


def test_a_cap_below_one_is_refused(capsys):
    from optimized.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--max-concurrency", "0", "--model", "m", "--no-progress"])
    assert e.value.code == 2 and "--max-concurrency must be >= 1; got 0" in capsys.readouterr().err


def test_shared_prefix_gives_every_prompt_the_same_first_tokens():
    import random
    from types import SimpleNamespace

    from optimized.benchmarks.serve_bench import make_prompts

    args = SimpleNamespace(shared_prefix=0.75, max_token_id=255)
    prompts = make_prompts(args, [64, 64, 32], random.Random(0))
    assert [len(p) for p in prompts] == [64, 64, 32]
    assert prompts[0][:48] == prompts[1][:48] and prompts[2][:24] == prompts[0][:24]
    assert prompts[0][48:] != prompts[1][48:]
    unshared = make_prompts(SimpleNamespace(shared_prefix=0.0, max_token_id=255), [64, 64], random.Random(0))
    assert unshared[0][:8] != unshared[1][:8]
    with pytest.raises(UsageError, match="--shared-prefix"):
        make_prompts(SimpleNamespace(shared_prefix=1.5, max_token_id=255), [4], random.Random(0))
