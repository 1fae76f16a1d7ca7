"""Sampling over several ranks: every rank draws the same tokens (the seed is rank 0's when none is given),
and EOS ends a request on every rank at the same step, so the sharded model never sees diverging inputs."""

from __future__ import annotations

import pytest
import torch

from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import rank_model, runner_of, same_on_all_ranks
from fixtures.checkpoints import checkpoint
from optimized.executor.sampling import SamplingParams

pytestmark = pytest.mark.distributed

LAYOUT = dict(world_size=2, attn_tp_size=2, moe_tp_size=2, moe_ep_size=1, embed_tp_size=2, lmhead_tp_size=2)
PROMPTS = [[288, 337, 283], [7, 8, 9, 10]]


@torch.no_grad()
def _sample_task(rank, world, path):
    runner = runner_of(rank_model(path, LAYOUT, torch.float32))
    unseeded = runner.generate(PROMPTS, 6, sampling=SamplingParams(temperature=1.0, top_p=0.9))
    seeded = runner.generate(PROMPTS, 6, sampling=SamplingParams(temperature=1.0, seed=5))
    # EOS: a token request 0 draws at step 2 (seeded, so the rerun draws the same tokens up to it)
    eos = seeded.tokens[0][2]
    stopped = runner.generate(PROMPTS, 6, sampling=SamplingParams(temperature=1.0, seed=5), eos_token_id=[eos])
    return {
        "unseeded": unseeded.tokens,
        "seeded": seeded.tokens,
        "eos": eos,
        "stopped": stopped.tokens,
        "finish": stopped.finish_reasons,
    }


def test_ranks_draw_the_same_tokens_with_and_without_a_seed():
    got = same_on_all_ranks(get_pool(2).run(_sample_task, str(checkpoint("tiny")), timeout=120), "sampling")
    assert all(len(t) == 6 for t in got["unseeded"] + got["seeded"])
    seeded, eos = got["seeded"], got["eos"]
    assert eos not in seeded[0][:2] and eos not in seeded[1], f"pick another seed: {seeded}, eos {eos}"
    # EOS ends request 0 on every rank at step 2; request 1 draws exactly what it drew without EOS
    assert got["stopped"] == [seeded[0][:3], seeded[1]] and got["finish"] == ["eos", "length"]
