"""`bench serve --max-concurrency N` and `--goodput` (optimized/benchmarks/serve_bench.py), without a server: the
request coroutine is replaced by one that counts the requests in flight, and goodput is computed on given outcomes
(no timing is asserted)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def _plan_args(**given):
    from types import SimpleNamespace

    args = dict(
        workload="random",
        num_prompts=32,
        input_len=128,
        range_ratio=0.0,
        prompt_lens=None,
        output_len=16,
        max_token_id=255,
        shared_prefix=None,
        long_prompts=4,
        long_prompt_len=192,
        long_prompt_every=0.5,
        long_output_len=4,
    )
    args.update(given)
    return SimpleNamespace(**args)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_shared_prefix_workload_is_32_prompts_sharing_three_quarters_exactly():
    import random

    from optimized.benchmarks.serve_bench import plan

    sends = plan(_plan_args(workload="shared-prefix"), math.inf, random.Random(0))
    assert len(sends) == 32 and all(len(s.prompt) == 128 and s.at == 0.0 and s.output_len == 16 for s in sends)
    first = sends[0].prompt
    assert min(_common(first, s.prompt) for s in sends[1:]) == 96, "exactly three quarters in common"
    assert all(_common(a.prompt, b.prompt) >= 96 for a in sends for b in sends)
    plain = plan(_plan_args(), math.inf, random.Random(0))
    assert max(_common(plain[0].prompt, s.prompt) for s in plain[1:]) < 8, "the random workload shares nothing"


@given(
    lengths=st.lists(st.integers(1, 48), min_size=2, max_size=8),
    share=st.floats(0.05, 1.0),
    top=st.integers(1, 255),
    seed=st.integers(0, 2**16),
)
def test_each_prompt_shares_exactly_its_share_of_tokens(lengths, share, top, seed):
    """Prompt i's first k_i = round(share * n_i) tokens are the common prefix and its next token is not: where
    prompt j shares more (k_j > k_i), the two part at k_i exactly."""
    import random

    from optimized.benchmarks.serve_bench import make_prompts

    prompts = make_prompts(_plan_args(shared_prefix=share, max_token_id=top), lengths, random.Random(seed))
    k = [round(share * n) for n in lengths]
    assert [len(p) for p in prompts] == lengths and all(0 <= t <= top for p in prompts for t in p)
    for i, a in enumerate(prompts):
        for j, b in enumerate(prompts):
            assert a[: min(k[i], k[j])] == b[: min(k[i], k[j])]
            if k[i] < k[j] and k[i] < len(a):
                assert _common(a, b) == k[i], f"prompt {i} shares {_common(a, b)} tokens with {j}, not {k[i]}"


def test_the_long_prompt_mix_sends_decodes_at_once_then_long_prompts_at_their_interval():
    import random

    from optimized.benchmarks.serve_bench import plan

    args = _plan_args(
        workload="long-prompt-mix", num_prompts=6, input_len=16, output_len=64, long_prompts=3, long_prompt_every=0.25
    )
    sends = plan(args, math.inf, random.Random(1))
    decodes, longs = sends[:6], sends[6:]
    assert [(s.at, len(s.prompt), s.output_len, s.role) for s in decodes] == [(0.0, 16, 64, "decode")] * 6
    assert [(s.at, len(s.prompt), s.output_len, s.role) for s in longs] == [
        (0.25, 192, 4, "long"),
        (0.5, 192, 4, "long"),
        (0.75, 192, 4, "long"),
    ]
    assert len({tuple(s.prompt) for s in sends}) == 9
    assert plan(args, 2.0, random.Random(1)) == sends, "the request rate does not apply to this workload"


def test_random_arrivals_are_a_seeded_poisson_process_from_zero():
    import random

    from optimized.benchmarks.serve_bench import plan

    at = [s.at for s in plan(_plan_args(num_prompts=6), 4.0, random.Random(2))]
    assert at[0] == 0.0 and all(b > a for a, b in zip(at, at[1:]))
    assert at == [s.at for s in plan(_plan_args(num_prompts=6), 4.0, random.Random(2))]
    assert [s.at for s in plan(_plan_args(num_prompts=6), math.inf, random.Random(2))] == [0.0] * 6


def test_bench_serve_long_prompt_mix_reports_each_roles_latencies(monkeypatch, tmp_path, capsys):
    argv = ["--workload", "long-prompt-mix", "--long-prompts", "2", "--long-prompt-every", "0.01"]
    rc, _, r = _bench(argv, monkeypatch, tmp_path)
    assert rc == 0 and r["workload"] == "long-prompt-mix" and r["completed"] == 9
    assert {role: v["completed"] for role, v in r["roles"].items()} == {"decode": 7, "long": 2}
    out = capsys.readouterr().out
    assert "decode ITL" in out and "long TTFT" in out


def test_a_long_prompt_interval_of_zero_is_refused(capsys):
    from optimized.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--workload", "long-prompt-mix", "--long-prompt-every", "0", "--model", "m"])
    assert e.value.code == 2 and "--long-prompt-every=0.0 must be > 0 seconds" in capsys.readouterr().err
