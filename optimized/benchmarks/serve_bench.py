"""`python -m optimized bench serve`: load a running `python -m optimized serve` with streaming completions.

Requests arrive as a Poisson process of `--request-rate` per second (`inf`: all at once), each a prompt of random
token ids (lengths uniform in input_len * (1 -+ range_ratio), or `--prompt-lens`) generating exactly `--output-len`
tokens (ignore_eos); `--max-concurrency N` holds an arrival past the cap until one finishes. Per request, from the
SSE stream: TTFT (send to first token), ITL (gaps between tokens), TPOT ((last - first) / (tokens - 1)). `report`
gives p50 / p90 / p99 of each, request and output-token throughput, and with `--goodput ttft:MS tpot:MS` the
requests that met every target given, as a share and as a rate.

`--workload` names the load (`plan`, every request's prompt, output length and send time, decided before the run):
- `random` (default): the above;
- `shared-prefix`: the same, each prompt's first three quarters (`--shared-prefix`, default 0.75 here) one prefix
  common to all, exactly: each prompt's next token differs from the common one (a prefix cache's workload: TTFT,
  throughput);
- `long-prompt-mix`: `--num-prompts` short "decode" requests sent at once, then `--long-prompts` prompts of
  `--long-prompt-len` tokens ("long"), one every `--long-prompt-every` seconds from then on, arriving among the
  running decodes (each generating `--long-output-len` tokens); the report adds each role's TTFT and ITL, the decode
  requests' ITL being what a long prompt's prefill stalls.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

from optimized.errors import UsageError


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", help="model id (default: the server's only model, from /v1/models)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests to send (default 32)")
    p.add_argument("--request-rate", default="inf", help="requests per second, Poisson arrivals; inf: all at once")
    p.add_argument("--input-len", type=int, default=32, help="mean prompt length in tokens (default 32)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="prompt lengths uniform in len*(1 +- r)")
    p.add_argument("--prompt-lens", help="comma-separated prompt lengths, cycled (instead of --input-len)")
    p.add_argument("--output-len", type=int, default=16, help="tokens each request generates (default 16)")
    p.add_argument("--max-token-id", type=int, default=255, help="prompt ids are drawn from [0, this] (default 255)")
    p.add_argument("--seed", type=int, default=0, help="prompt and arrival seed")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random (default); shared-prefix: prompts sharing --shared-prefix of their tokens; long-prompt-mix: "
        "long prompts arriving among running decodes",
    )
    p.add_argument(
        "--shared-prefix",
        type=float,
        default=None,
        help="share of each prompt's tokens, from its start, that every prompt has in common (0 to 1; default 0, "
        "0.75 with --workload shared-prefix)",
    )
    p.add_argument("--long-prompts", type=int, default=4, help="long-prompt-mix: long prompts sent (default 4)")
    p.add_argument("--long-prompt-len", type=int, default=192, help="long-prompt-mix: their length (default 192)")
    p.add_argument(
        "--long-prompt-every",
        type=float,
        default=0.5,
        help="long-prompt-mix: seconds between long prompts, the first this long after the decodes (default 0.5)",
    )
    p.add_argument(
        "--long-output-len", type=int, default=4, help="long-prompt-mix: tokens each long prompt generates (default 4)"
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight; later arrivals wait for a free slot (default: no cap)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="goodput targets, e.g. ttft:500 tpot:50: requests meeting every target given",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--json", help="also write the report as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


WORKLOADS = ("random", "shared-prefix", "long-prompt-mix")
SHARED_PREFIX_DEFAULT = 0.75  # --workload shared-prefix: three quarters of every prompt in common


@dataclass(frozen=True)
class Send:
    """One request of a run: its prompt, the tokens it generates and when it is sent (seconds from the start)."""

    at: float
    prompt: list[int]
    output_len: int
    role: str = ""  # long-prompt-mix: "decode" or "long"


@dataclass
class Outcome:
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    role: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def shared_share(args) -> float:
    """--shared-prefix, or its workload's default."""
    if args.shared_prefix is not None:
        return args.shared_prefix
    return SHARED_PREFIX_DEFAULT if getattr(args, "workload", "random") == "shared-prefix" else 0.0


def make_prompts(args, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Random token ids; with --shared-prefix r the first round(r * n) tokens of a prompt of n are one common
    prefix (what a prefix cache can reuse), exactly: the prompt's next token is never the common one."""
    r = shared_share(args)
    if not 0 <= r <= 1:
        raise UsageError(f"--shared-prefix={r} must be between 0 and 1")
    top = args.max_token_id
    common = [rng.randint(0, top) for _ in range(max(lengths, default=0))] if r else []
    prompts = []
    for n in lengths:
        k = round(r * n)
        own = [rng.randint(0, top) for _ in range(n - k)]
        if r and own and top > 0:  # any id but the common one at k
            own[0] = (common[k] + 1 + rng.randint(0, top - 1)) % (top + 1)
        prompts.append(common[:k] + own)
    return prompts


def prompt_lengths(args, rng: random.Random) -> list[int]:
    if args.prompt_lens:
        try:
            given = [int(x) for x in args.prompt_lens.split(",")]
        except ValueError:
            raise UsageError(f"--prompt-lens={args.prompt_lens!r} must be comma-separated integers") from None
        if any(n < 1 for n in given):
            raise UsageError(f"--prompt-lens={args.prompt_lens!r}: every length must be >= 1")
        return [given[i % len(given)] for i in range(args.num_prompts)]
    lo = max(1, round(args.input_len * (1 - args.range_ratio)))
    hi = max(lo, round(args.input_len * (1 + args.range_ratio)))
    return [rng.randint(lo, hi) for _ in range(args.num_prompts)]


def arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Send times of n requests as a Poisson process of `rate` per second from 0 (inf: all at 0)."""
    at, times = 0.0, []
    for _ in range(n):
        times.append(at)
        if math.isfinite(rate):
            at += rng.expovariate(rate)
    return times


def plan(args, rate: float, rng: random.Random) -> list[Send]:
    """Every request of the run, in send order (see the module docstring for the workloads)."""
    prompts = make_prompts(args, prompt_lengths(args, rng), rng)
    if args.workload != "long-prompt-mix":
        return [Send(at, p, args.output_len) for at, p in zip(arrivals(rate, len(prompts), rng), prompts)]
    sends = [Send(0.0, p, args.output_len, "decode") for p in prompts]
    for i in range(args.long_prompts):
        prompt = [rng.randint(0, args.max_token_id) for _ in range(args.long_prompt_len)]
        sends.append(Send(args.long_prompt_every * (i + 1), prompt, args.long_output_len, "long"))
    return sends


async def _one(client, url, model, prompt, output_len, timeout) -> Outcome:
    out = Outcome(len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                n = sum(len(c.get("token_ids", [])) for c in chunk.get("choices", []))
                if not n:
                    continue
                now = time.perf_counter()
                if out.tokens == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last, out.tokens = now, out.tokens + n
        out.latency, out.ok = last - start, out.tokens == output_len
        if not out.ok:
            out.error = f"got {out.tokens} tokens, asked {output_len}"
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, the run goes on
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _run(args, sends: list[Send]) -> tuple[list[Outcome], float]:
    import httpx

    async with httpx.AsyncClient() as client:
        model = args.model
        if model is None:
            r = await client.get(args.url + "/v1/models", timeout=args.timeout)
            model = r.json()["data"][0]["id"]
        done, tasks = 0, []

        def tick(_):
            nonlocal done
            done += 1
            if not args.no_progress:
                bar = "#" * (30 * done // len(sends))
                print(f"\r[{bar:<30}] {done}/{len(sends)}", end="", file=sys.stderr, flush=True)

        slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def send(s: Send) -> Outcome:
            if slots is None:
                out = await _one(client, args.url, model, s.prompt, s.output_len, args.timeout)
            else:
                async with slots:
                    out = await _one(client, args.url, model, s.prompt, s.output_len, args.timeout)
            out.role = s.role
            return out

        start = time.perf_counter()
        for s in sends:
            wait = start + s.at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(send(s))
            task.add_done_callback(tick)
            tasks.append(task)
        outcomes = await asyncio.gather(*tasks)
        if not args.no_progress:
            print(file=sys.stderr)
        return outcomes, time.perf_counter() - start


GOODPUT_METRICS = ("ttft", "tpot")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); UsageError naming a bad item."""
    targets: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in GOODPUT_METRICS or not math.isfinite(ms) or ms <= 0:
            raise UsageError(
                f"--goodput {item!r}: give METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)} "
                f"and MS a positive number of milliseconds, e.g. ttft:500 tpot:50"
            )
        if name in targets:
            raise UsageError(f"--goodput gives {name} twice")
        targets[name] = ms
    return targets


def tpot(o: Outcome) -> float | None:
    """Seconds per output token after the first; None for a one-token request."""
    return (o.latency - o.ttft) / (o.tokens - 1) if o.tokens > 1 else None


def meets(o: Outcome, targets: dict[str, float]) -> bool:
    """A completed request within every target (milliseconds)."""
    if not o.ok:
        return False
    if "ttft" in targets and 1000 * o.ttft > targets["ttft"]:
        return False
    t = tpot(o)
    return not ("tpot" in targets and t is not None and 1000 * t > targets["tpot"])


def report(
    outcomes: list[Outcome],
    duration: float,
    goodput: dict[str, float] | None = None,
    max_concurrency: int | None = None,
) -> dict:
    ok = [o for o in outcomes if o.ok]
    ms = lambda xs: {f"p{q}": 1000 * percentile(xs, q) for q in (50, 90, 99)}  # noqa: E731
    extra = {"max_concurrency": max_concurrency}
    if goodput:
        good = sum(meets(o, goodput) for o in outcomes)
        extra["goodput"] = {
            "targets_ms": dict(goodput),
            "good": good,
            "share": good / max(len(outcomes), 1),
            "rate": good / duration,
        }
    roles = sorted({o.role for o in outcomes if o.role})
    if roles:  # per role: its requests' latencies (long-prompt-mix: the decodes' ITL beside the long prompts')
        extra["roles"] = {
            role: {
                "completed": sum(o.role == role for o in ok),
                "ttft_ms": ms([o.ttft for o in ok if o.role == role]),
                "itl_ms": ms([g for o in ok if o.role == role for g in o.itl]),
            }
            for role in roles
        }
    return {
        **extra,
        "requests": len(outcomes),
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(o.tokens for o in ok) / duration,
        "total_input_tokens": sum(o.prompt_len for o in ok),
        "total_output_tokens": sum(o.tokens for o in ok),
        "ttft_ms": ms([o.ttft for o in ok]),
        "tpot_ms": ms([tpot(o) for o in ok if o.tokens > 1]),
        "itl_ms": ms([g for o in ok for g in o.itl]),
        "e2e_ms": ms([o.latency for o in ok]),
    }


def format_report(r: dict) -> str:
    rows = [
        f"requests: {r['completed']} completed, {r['failed']} failed in {r['duration_s']:.2f} s",
        f"throughput: {r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} output tok/s "
        f"({r['total_input_tokens']} input, {r['total_output_tokens']} output tokens)",
        f"{'metric':<12}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        v = r[f"{name}_ms"]
        rows.append(f"{name.upper():<12}{v['p50']:>10.2f}{v['p90']:>10.2f}{v['p99']:>10.2f}")
    for role, v in r.get("roles", {}).items():
        for name in ("ttft", "itl"):
            m = v[f"{name}_ms"]
            rows.append(f"{role + ' ' + name.upper():<12}{m['p50']:>10.2f}{m['p90']:>10.2f}{m['p99']:>10.2f}")
    if r.get("max_concurrency"):
        rows.insert(1, f"max concurrency: {r['max_concurrency']} requests in flight")
    if r.get("goodput"):
        g = r["goodput"]
        targets = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in g["targets_ms"].items())
        rows.append(
            f"goodput ({targets}): {g['good']} of {r['requests']} requests ({100 * g['share']:.1f} %), "
            f"{g['rate']:.2f} req/s"
        )
    rows += [f"error: {e}" for e in r["errors"]]
    return "\n".join(rows)


def run(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise UsageError("bench serve needs httpx: pip install 'qwen3-moe-npu[serve]'") from None
    try:
        rate = float(args.request_rate)
    except ValueError:
        raise UsageError(f"--request-rate={args.request_rate!r} must be a number or inf") from None
    if not rate > 0:
        raise UsageError(f"--request-rate={args.request_rate!r} must be > 0 (or inf)")
    names = ["num_prompts", "input_len", "output_len"]
    if args.workload == "long-prompt-mix":
        names += ["long_prompts", "long_prompt_len", "long_output_len"]
        if not args.long_prompt_every > 0:
            raise UsageError(f"--long-prompt-every={args.long_prompt_every} must be > 0 seconds")
    for name in names:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not 0 <= args.range_ratio < 1:
        raise UsageError(f"--range-ratio={args.range_ratio} must be in [0, 1)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError(f"--max-concurrency must be >= 1; got {args.max_concurrency}")
    goodput = parse_goodput(args.goodput)
    sends = plan(args, rate, random.Random(args.seed))
    outcomes, duration = asyncio.run(_run(args, sends))
    r = {"workload": args.workload, **report(outcomes, duration, goodput, args.max_concurrency)}
    print(format_report(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0 if r["failed"] == 0 else 1
