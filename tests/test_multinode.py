"""One instance across machines through torchrun's own rendezvous, simulated on 127.0.0.1: two torchrun agents
(`--nnodes 2 --node-rank i --rdzv-backend c10d --rdzv-endpoint HOST:PORT`), each starting its share of the ranks,
form one job. `generate` over two agents of two ranks each prints the reference's greedy tokens, as one 4-process
job does (tests/test_optimized_cli.py proves that job equal to the reference); `serve` over two agents of one rank
each answers the reference's tokens.

The rendezvous store is this test's own c10d TCPStore on port 0 (its port read back); the agents join it as
clients (`--rdzv-conf is_host=0`), so no port is picked and hoped free. On real machines the store is hosted by the
agent whose host the endpoint names (torchrun's default).
"""

from __future__ import annotations

import datetime
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from fixtures.checkpoints import checkpoint
from reference.checkpoint import load_model
from reference.generate import greedy_generate, trim_at_eos
from reference.tokenizer import encode, eos_token_ids, load_tokenizer

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "fixtures" / "configs"
WAIT_S = 300  # a bound on the jobs (never a timing assertion)


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = greedy_generate(load_model(checkpoint("tiny")), torch.tensor([prompt]), n)[0].tolist()
    return trim_at_eos(tokens, eos_token_ids(checkpoint("tiny")))


def ids_line(ids) -> str:
    return ",".join(map(str, ids))


def rendezvous_store() -> TCPStore:
    return TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=datetime.timedelta(60)
    )


def agents(store: TCPStore, nproc: int, command: list[str]) -> list[subprocess.Popen]:
    """Two torchrun agents (node ranks 0 and 1) of `nproc` ranks each, running `python -m optimized COMMAND`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc)]
    launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=0"]
    launch += ["--rdzv-id", "multinode-test"]
    return [
        subprocess.Popen(
            [*launch, "--node-rank", str(i), "-m", "optimized", *command],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]


def finish(procs) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=WAIT_S)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        out.append((p.returncode, stdout, stderr))
    return out


def test_generate_over_two_agents_equals_one_four_rank_job():
    tok = load_tokenizer(checkpoint("tiny"))
    prompts = [encode(tok, t) for t in ("1, 2, 3,", "Once upon a time", "Hello")]
    store = rendezvous_store()
    config = str(CONFIGS / "tiny_attn2dp2_ep4.yaml")  # attention TP 2 x DP 2, MoE EP 4: groups span both agents
    args = [a for p in prompts for a in ("--prompt-ids", ids_line(p))]
    results = finish(agents(store, 2, ["generate", "--config", config, *args, "--max-new-tokens", "6"]))
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    lines = [line for _, out, _ in results for line in out.splitlines()]
    assert any(line.startswith("model: ") and "world_size 4" in line for line in lines), lines
    for i, p in enumerate(prompts):
        assert f"[{i}] generated ids: {ids_line(reference_tokens(p, 6))}" in lines, lines
    assert sum(line.startswith("[0] generated ids:") for line in lines) == 1, "only global rank 0 prints"


def test_serve_over_two_agents_answers_the_reference_tokens(tmp_path):
    prompt = encode(load_tokenizer(checkpoint("tiny")), "Once upon a time")
    store = rendezvous_store()
    port_file = tmp_path / "port"
    config = str(CONFIGS / "tiny_tp2.yaml")
    procs = agents(store, 1, ["serve", "--config", config, "--port", "0", "--port-file", str(port_file)])
    try:
        deadline = time.monotonic() + WAIT_S
        answer = None
        while answer is None:
            assert all(p.poll() is None for p in procs), finish(procs)
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.5)
            if not port_file.exists():
                continue
            conn = http.client.HTTPConnection("127.0.0.1", int(port_file.read_text()), timeout=WAIT_S)
            try:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                r = conn.getresponse()
                answer = (r.status, json.loads(r.read()))
            except ConnectionRefusedError:  # bound, not yet listening: the model loads
                pass
            finally:
                conn.close()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        finish(procs)
    status, data = answer
    assert status == 200, data
    assert data["choices"][0]["token_ids"] == reference_tokens(prompt, 6)
