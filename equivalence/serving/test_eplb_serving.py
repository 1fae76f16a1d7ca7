"""A torchrun server with expert load balancing (world 2: attention TP 2, MoE EP 2, MC2 decode; 2 redundant expert
slots, a rebalance every 2 engine steps from a window of 3) answers concurrent clients arriving mid-flight with the
reference's greedy tokens per prompt alone (fp32), and its /metrics counts the rebalances it ran (above zero) and
shows each MoE layer's measured imbalance."""

from __future__ import annotations

import re

import pytest

from equivalence.endpoint import servers
from equivalence.support.serving_prompts import PROMPTS, ref_greedy, staggered_clients
from fixtures.checkpoints import checkpoint

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

START_S, TIMEOUT_S, MAX_TOKENS = 180, 60, 8
CONFIG = """model_config: {model_path: "fixture:tiny", dtype: float32}
data_config: {input_max_len: 48}
parallel_config: {world_size: 2, attn_tp_size: 2, moe_tp_size: 1, moe_ep_size: 2, embed_tp_size: 2,
  lmhead_tp_size: 2, enable_eplb: true, num_redundant_experts: 2, eplb_window_size: 3, eplb_step_interval: 2}
scheduler_config: {batch_size: 2, max_new_tokens: 8, block_size: 16, max_prefill_tokens: 32}
"""


@pytest.mark.distributed
@pytest.mark.equivalence
def test_a_rebalancing_server_gives_the_reference_tokens_and_counts_its_rebalances(tmp_path):
    checkpoint("tiny")  # built before the ranks race for it
    config = tmp_path / "eplb.yaml"
    config.write_text(CONFIG)
    with servers.server_process(servers.ours(config, ranks=2), tmp_path / "server.log", start_s=START_S) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0)

        def ask(i, prompt):
            r = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].model_extra["token_ids"]

        results = staggered_clients(ask, PROMPTS[:4], TIMEOUT_S)
        for i, prompt in enumerate(PROMPTS[:4]):
            assert results[i] == ref_greedy(prompt, MAX_TOKENS), f"request {i}"
        text = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
        found = re.search(r"^qwen3_moe_eplb_rebalances_total (\d+)$", text, re.M)
        assert found and int(found.group(1)) > 0, text
        assert re.search(r'^qwen3_moe_expert_rank_imbalance\{layer="1"\} [0-9.]+$', text, re.M), text
