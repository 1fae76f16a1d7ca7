"""The noise floor: `python -m equivalence.endpoint.calibrate --precision bf16 [--prompts N] [--max-tokens N]`.

Starts our own server (`optimized serve`, fixture tiny, one process) at the precision, runs the endpoint check on N
prompts (seeded random token ids, lengths 2-40) and prints how many positions were compared, how many exceed the
bound derived from the tolerance table (false alarms: our own model is right by construction) and the worst ratio;
check.CALIBRATION records these numbers."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from equivalence.endpoint import servers
from equivalence.endpoint.check import PRECISIONS, run_check
from fixtures.checkpoints import checkpoint, w4a8_checkpoint, w8a8_checkpoint

DTYPE = {"fp32": "float32", "bf16": "bfloat16", "w8a8": "bfloat16", "w4a8": "bfloat16", "fp8kv": "bfloat16"}


def served_checkpoint(precision: str, name: str = "tiny") -> Path:
    """The checkpoint our server loads at `precision` (the check's --model-path stays the BF16 `checkpoint(name)`):
    the fixture converted to W8A8 / W4A8 (16-bit KV cache) or to W4A8 with the recipe's per-token FP8 KV cache."""
    return {
        "w8a8": lambda: w8a8_checkpoint(name),
        "w4a8": lambda: w4a8_checkpoint(name),
        "fp8kv": lambda: w4a8_checkpoint(name, kv_cache="fp8"),
    }.get(precision, lambda: checkpoint(name))()


def calibrate(precision: str, n: int, max_tokens: int, seed: int = 0) -> dict:
    model = checkpoint("tiny")
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, 500, (int(torch.randint(2, 41, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "c.yaml"
        cfg.write_text(servers.config_yaml(DTYPE[precision], model=str(served_checkpoint(precision))))
        with servers.serving(servers.ours(cfg), Path(d) / "server.log") as url:
            r = run_check(url, model, prompts=prompts, max_tokens=max_tokens, concurrency=4, precision=precision)
    ratios = [p["ratio"] for x in r.requests + r.concurrent for p in x.positions]
    if r.meta["aggregate"]["judged"]:
        # the aggregate on small runs: every pair of prompts (each alone), as a 2-prompt check would judge it
        from itertools import combinations
        from equivalence.endpoint.check import aggregate

        pairs = [
            aggregate(a.positions + b.positions, precision, always_separation=True)
            for a, b in combinations(r.requests, 2)
        ]
        small = {
            "pairs": len(pairs),
            "pair_false_alarms": sum(not x["ok"] for x in pairs),
            "pair_min_positions": min(x["positions"] for x in pairs),
            "pair_max_rel_l2": round(max(x["rel_l2"] for x in pairs), 4),
            "pair_min_separation": round(min(x["separation"] for x in pairs), 3),
            "pair_false_alarm_min_positions": min([x["positions"] for x in pairs if not x["ok"]], default=None),
        }
        # (pairs judged on both quantities whatever their size, to show what the separation does on small runs)
    else:
        small = {}
    return {
        "positions": len(ratios),
        "max_ratio": round(max(ratios), 4),
        "false_alarms": sum(q > 1 for q in ratios),
        "near_ties": len(r.judgement["near_ties"]),
        "divergences": len(r.judgement["divergences"]),
        **(
            {
                "rel_l2": round(r.meta["aggregate"]["rel_l2"], 4),
                "separation": round(r.meta["aggregate"]["separation"], 3),
                **small,
            }
            if r.meta["aggregate"]["judged"]
            else {}
        ),
        "command": f"python -m equivalence.endpoint.calibrate --precision {precision} --prompts {n} "
        f"--max-tokens {max_tokens}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m equivalence.endpoint.calibrate")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    print(json.dumps(calibrate(args.precision, args.prompts, args.max_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
