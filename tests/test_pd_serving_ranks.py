"""Multi-rank instances: `serve --pd-role` under torchrun, the two sides sharding attention differently, every rank
writing (prefill) or digesting (decode) its own part of each request's KV with its own Mooncake engine (protocol tcp
on 127.0.0.1). Prefill attention TP 2 (MoE EP 2) to decode attention TP 1 x DP 2 (MoE EP 2, MC2 decode: the recipe's
wide prefill and DP decode, each request reserved in the least loaded DP group), prefill TP 1 to decode TP 2, and
prefill TP 4 (the 2 KV heads replicated) to decode TP 1: concurrent requests driven by hand as a router would, each
one's greedy fp32 tokens the reference's for its prompt alone, and every block back in both pools (the /metrics
gauges)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from equivalence.endpoint import servers
from equivalence.support.serving_prompts import PROMPTS, ref_greedy
from fixtures.checkpoints import checkpoint

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

START_S, TIMEOUT_S = 240, 120
MAX_TOKENS = 6
CONFIG = """model_config: {{model_path: "fixture:tiny", dtype: float32}}
data_config: {{input_max_len: 48}}
parallel_config: {{{parallel}}}
scheduler_config: {{batch_size: 2, max_new_tokens: 8, block_size: 16, max_prefill_tokens: 64}}
"""
SINGLE = "world_size: 1"
TP2_EP2 = "world_size: 2, attn_tp_size: 2, moe_tp_size: 1, moe_ep_size: 2, embed_tp_size: 2, lmhead_tp_size: 2"
TP1xDP2_EP2 = "world_size: 2, attn_tp_size: 1, moe_tp_size: 1, embed_tp_size: 1, lmhead_tp_size: 1"
TP4_EP4 = "world_size: 4, attn_tp_size: 4, moe_tp_size: 1, moe_ep_size: 4, embed_tp_size: 4, lmhead_tp_size: 4"
LAYOUTS = {  # name: ((prefill world, parallel), (decode world, parallel), decode attention layout)
    "p_tp2_to_d_tp1xdp2": ((2, TP2_EP2), (2, TP1xDP2_EP2), {"tp": 1, "dp": 2}),
    "p_tp1_to_d_tp2": ((1, SINGLE), (2, TP2_EP2), {"tp": 2, "dp": 1}),
    # 2 KV heads over 4 prefill ranks: each replicated twice, sent once (by the first rank holding it)
    "p_tp4_replicated_to_d_tp1": ((4, TP4_EP4), (1, SINGLE), {"tp": 1, "dp": 1}),
}


def _launch(tmp_path, name: str, role: str, world: int, parallel: str):
    config = tmp_path / f"{name}-{role}.yaml"
    config.write_text(CONFIG.format(parallel=parallel))
    return servers.server_process(
        servers.ours(config, "--pd-role", role, ranks=world), tmp_path / f"{role}.log", start_s=START_S
    )


def _one(prefill: str, decode: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = httpx.post(
        prefill + "/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=TIMEOUT_S,
    )
    assert first.status_code == 200, first.text
    params = {**first.json()["kv_transfer_params"], "do_remote_prefill": True, "prefill_url": prefill}
    r = httpx.post(decode + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _drained(url: str) -> bool:
    """The KV usage gauge reaches 0 (the engine thread applies a release just after answering it)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
        if float(re.search(r"^\S*kv_cache_usage\S*\s+(\S+)$", text, re.M).group(1)) == 0.0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multi_rank_instances_hand_off_with_the_reference_tokens(tmp_path, layout):
    checkpoint("tiny")  # built before the ranks race for it
    (p_world, p_parallel), (d_world, d_parallel), d_attention = LAYOUTS[layout]
    with (
        _launch(tmp_path, layout, "prefill", p_world, p_parallel) as (prefill, _),
        _launch(tmp_path, layout, "decode", d_world, d_parallel) as (decode, _),
    ):
        assert httpx.get(decode + "/pd/v1/info", timeout=TIMEOUT_S).json()["attention"] == d_attention
        if d_attention["dp"] > 1:  # the plan says the decode runs MC2 under attention DP
            started = (tmp_path / "decode.log").read_text()
            assert "under attention DP" in started and "MC2 window" in started, started
        prompts = PROMPTS[:4]
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _one(prefill, decode, p), prompts))
        for prompt, tokens in zip(prompts, got):
            assert tokens == ref_greedy(prompt, MAX_TOKENS), f"prompt {prompt}"
        assert _drained(prefill) and _drained(decode), "blocks left held or reserved"
