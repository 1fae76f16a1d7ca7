"""Prefill-decode disaggregation end to end: `python -m optimized pd` starts a real prefill instance and a real
decode instance (`serve --pd-role`) and the router; through the router every request equals the reference: the
endpoint checker (`python -m equivalence.endpoint --url ROUTER`) passes, and each request's greedy tokens, JSON
and streamed, are the reference's. Layouts: one rank on each side; a one-rank prefill handing over to a TP 2 decode
(the rank mapping of optimized/pd/rank_mapping.py); and the recipe's `qwen3_moe_pd` pair as the recipe runs it,
scaled to 2 ranks per instance: a TP 2 prefill handing over to a decode of 2 attention DP groups with MoE EP 2 in
graph mode.

Skipped only while `serve` has no `--pd-role` option (read from its argument parser).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from equivalence.support.plans import planned_paths
from fixtures.checkpoints import checkpoint
from fixtures.recipe_configs import scaled
from optimized.path_plan import DP, TP
from optimized.cli.main import parser
from reference.checkpoint import load_model
from reference.generate import greedy_generate, trim_at_eos
from reference.tokenizer import encode, eos_token_ids, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "fixtures" / "configs"
WAIT_S = 300  # a bound on start-up and each request (never a timing assertion)


def serve_options() -> set[str]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in sub.choices["serve"]._actions for s in action.option_strings}


pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif("--pd-role" not in serve_options(), reason="needs serve --pd-role"),
]


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = greedy_generate(load_model(checkpoint("tiny")), torch.tensor([prompt]), n)[0].tolist()
    return trim_at_eos(tokens, eos_token_ids(checkpoint("tiny")))


def recipe_pair(tmp_path: Path) -> tuple[str, str]:
    """The recipe's `qwen3_moe_pd` prefill.yaml and decode.yaml on 2 ranks each, on the tiny fixture: a TP 2 eager
    prefill, a decode of 2 attention DP groups x TP 1 with MoE EP 2 in graph mode."""
    paths = []
    for name in ("qwen3_moe_pd_prefill", "qwen3_moe_pd_decode"):
        config = scaled(name, 2, "fixture:tiny", max_new_tokens=8)
        config.setdefault("data_config", {})["input_max_len"] = 64
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        paths.append(str(path))
    assert (planned_paths(paths[0]).decode, planned_paths(paths[1]).decode) == (TP, DP)
    return paths[0], paths[1]


LAYOUTS = {
    "p1-d1": lambda _: (str(CONFIGS / "tiny_single.yaml"), str(CONFIGS / "tiny_single.yaml"), 1, 1),
    "p1-dtp2": lambda _: (str(CONFIGS / "tiny_single.yaml"), str(CONFIGS / "tiny_tp2.yaml"), 1, 2),
    "recipe-ptp2-ddp2": lambda tmp_path: (*recipe_pair(tmp_path), 2, 2),
}


@pytest.fixture(params=sorted(LAYOUTS))
def router(request, tmp_path):
    """The router's address, with `python -m optimized pd` running both instances behind it."""
    prefill, decode, p_nproc, d_nproc = LAYOUTS[request.param](tmp_path)
    port_file = tmp_path / "router.port"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "optimized", "pd", "--prefill-config", prefill]
    cmd += ["--decode-config", decode, "--prefill-nproc", str(p_nproc)]
    cmd += ["--decode-nproc", str(d_nproc), "--port", "0", "--port-file", str(port_file)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()[0][-5000:]
            assert time.monotonic() < deadline, "the router never started"
            time.sleep(0.5)
        yield f"127.0.0.1:{int(port_file.read_text())}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert proc.returncode == 0, out[-5000:]


def post(address: str, body: dict) -> tuple[int, bytes]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_through_the_router_every_request_equals_the_reference(router, tmp_path):
    tok = load_tokenizer(checkpoint("tiny"))
    prompts = [encode(tok, t) for t in ("1, 2, 3,", "Once upon a time", "The capital of France is")]
    for prompt in prompts:
        expected = reference_tokens(prompt, 6)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        status, raw = post(router, body)
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["token_ids"] == expected
        status, raw = post(router, {**body, "stream": True})
        assert status == 200, raw
        events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", raw
        streamed = [t for e in events[:-1] for c in json.loads(e).get("choices", []) for t in c.get("token_ids", [])]
        assert streamed == expected

    with urllib.request.urlopen(f"http://{router}/metrics", timeout=WAIT_S) as r:
        metrics = r.read().decode()
    # every request went prefill -> decode: its KV handed over, none released, no error
    assert "qwen3_moe_pd_router_handoffs_total 6\n" in metrics, metrics
    assert "qwen3_moe_pd_router_releases_total 0\n" in metrics and "_errors_total{" not in metrics, metrics

    ids = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    check = subprocess.run(
        [sys.executable, "-m", "equivalence.endpoint", "--url", f"http://{router}/v1"]
        + ["--model-path", str(checkpoint("tiny")), *ids, "--max-tokens", "6", "--out", str(tmp_path / "report")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
