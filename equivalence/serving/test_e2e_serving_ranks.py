"""Multi-rank serving: `torchrun --nproc-per-node N -m optimized serve` answers concurrent openai clients, arriving
mid-flight, with the reference's greedy tokens per prompt alone (fp32), under attention TP 2 with MoE EP 2, and under
attention DP (TP 1 x DP 2 with EP 2, TP 2 x DP 2 with EP 4: MC2 decode, each request in one DP group, idle groups
stepping dummy rows; this one decodes in exe_mode ge_graph, its static graphs compiled at warm-up), and the endpoint
checker (equivalence.endpoint: every position's logprobs) agrees with the
TP 2 x EP 2 and TP 2 x DP 2 servers; and a driver whose rank broadcast fails (a rank that died) stops, telling every
waiting request and the server."""

from __future__ import annotations

import threading

import pytest
import torch

from equivalence.endpoint import run_check, servers
from equivalence.support.serving_prompts import PROMPTS, ref_greedy, staggered_clients
from fixtures.checkpoints import checkpoint

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

START_S, TIMEOUT_S = 180, 60
CONFIG = """model_config: {{model_path: "fixture:tiny", dtype: float32, exe_mode: {exe_mode}}}
data_config: {{input_max_len: 48}}
parallel_config: {{{parallel}}}
scheduler_config: {{batch_size: {batch}, max_new_tokens: 8, block_size: 16, max_prefill_tokens: 32}}
"""
LAYOUTS = {  # name: (world size, parallel_config, batch_size, exe_mode)
    "tp2_ep2": (
        2,
        "world_size: 2, attn_tp_size: 2, moe_tp_size: 1, moe_ep_size: 2, embed_tp_size: 2, lmhead_tp_size: 2",
        2,
        "eager",
    ),
    "tp1xdp2_ep2": (
        2,
        "world_size: 2, attn_tp_size: 1, moe_tp_size: 1, embed_tp_size: 1, lmhead_tp_size: 1",
        2,
        "eager",
    ),
    # ge_graph: each rank compiles its static decode graph before the port opens (warm-up); batch 2 over 2 DP groups
    # is one row per group, so one bucket (1) to compile, which keeps the start within START_S on a small CPU.
    "tp2xdp2_ep4_ge_graph": (
        4,
        "world_size: 4, attn_tp_size: 2, moe_tp_size: 1, embed_tp_size: 2, lmhead_tp_size: 2",
        2,
        "ge_graph",
    ),
}


# The endpoint checker (equivalence.endpoint) also runs against these servers: attention TP 2 x MoE EP 2, and
# attention TP 2 x DP 2 with MoE EP 4 (MC2 decode under attention DP).
ENDPOINT_CHECKED = ("tp2_ep2", "tp2xdp2_ep4_ge_graph")
ENDPOINT_PROMPTS = [[5, 9, 200, 17, 3, 44, 1], [100, 101, 102, 103]]


@pytest.mark.distributed
@pytest.mark.equivalence
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torchrun_server_equals_reference_per_request(tmp_path, layout):
    checkpoint("tiny")  # built before the ranks race for it
    world, parallel, batch, exe_mode = LAYOUTS[layout]
    config = tmp_path / f"{layout}.yaml"
    config.write_text(CONFIG.format(parallel=parallel, batch=batch, exe_mode=exe_mode))
    log = tmp_path / "server.log"
    launch = servers.ours(config, ranks=world)
    with servers.server_process(launch, log, start_s=START_S) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)

        def ask(i, prompt):
            if i % 2:
                return [
                    t
                    for ch in client.completions.create(
                        model="tiny",
                        prompt=prompt,
                        max_tokens=5,
                        temperature=0,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    for t in ch.choices[0].model_extra["token_ids"]
                ]
            r = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].model_extra["token_ids"]

        started = log.read_text()
        if "dp" in layout:  # the plan says the decode runs MC2 under attention DP
            assert "under attention DP" in started and "MC2 window" in started, started
        if exe_mode == "ge_graph":  # the plan's decode graphs, every bucket compiled before the port opened
            assert "decode steps as ge_graph graphs: buckets [1]" in started, started
        results = staggered_clients(ask, PROMPTS[:4], TIMEOUT_S)
        for i, prompt in enumerate(PROMPTS[:4]):
            assert results[i] == ref_greedy(prompt, 5), f"request {i}"
        if layout in ENDPOINT_CHECKED:  # the endpoint checker on the same server: every position's logprobs (echo)
            r = run_check(url + "/v1", checkpoint("tiny"), prompts=ENDPOINT_PROMPTS, max_tokens=4, concurrency=2)
            assert r.ok, r.summary()
            assert r.meta["mode"] == "echo" and sum(len(x.positions) for x in r.requests) == sum(
                len(p) - 1 + 4 for p in ENDPOINT_PROMPTS
            )


class _DeadPeer:
    """A broadcast whose peer is gone, as gloo reports it."""

    def send(self, items):
        raise RuntimeError("[gloo] Connection closed by peer")


@pytest.mark.equivalence
def test_driver_stops_with_the_error_when_a_rank_fails():
    from equivalence.support.engine_runs import _models
    from optimized.executor.engine import Engine
    from optimized.executor.scheduler import Request
    from optimized.serving.driver import Driver, EngineStopped

    fatal, got = [], []
    driver = Driver(Engine(_models()[0], batch_size=2, num_blocks=4), on_fatal=fatal.append, broadcast=_DeadPeer())
    driver.start()
    done = threading.Event()
    driver.submit(Request("r0", [1, 2, 3], 4), lambda item: (got.append(item), done.set()))
    assert done.wait(TIMEOUT_S), "the waiting request was not told"
    driver.stop()
    assert isinstance(got[0], EngineStopped) and "Connection closed by peer" in str(got[0])
    assert fatal and "Connection closed by peer" in str(driver.error)
    with pytest.raises(EngineStopped, match="the engine stopped"):
        driver.submit(Request("r1", [1], 1), got.append)
    assert torch.is_tensor(driver.engine.cache.layers[0][0])
