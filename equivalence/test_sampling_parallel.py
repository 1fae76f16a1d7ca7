"""Sampling over several ranks: every rank draws the same tokens (the seed is rank 0's when none is given),
and EOS ends a request on every rank at the same step, so the sharded model never sees diverging inputs."""
from __future__ import annotations

import pytest
import torch

from equivalence.dist import get_pool
from equivalence.parallel_support import rank_model, runner_of, same_on_all_ranks
from fixtures.checkpoints import checkpoint
from optimized.sampling import SamplingParams

pytestmark = pytest.mark.distributed

LAYOUT = dict(world_size=2, attn_tp_size=2, moe_tp_size=2, moe_ep_size=1, embed_tp_size=2, lmhead_tp_size=2)
PROMPTS = [[288, 337, 283], [7, 8, 9, 10]]


@torch.no_grad()
def _sample_task(rank, world, path):
    runner = runner_of(rank_model(path, LAYOUT, torch.float32))
    unseeded = runner.generate(PROMPTS, 6, sampling=SamplingParams(temperature=1.0, top_p=0.9))
    seeded = runner.generate(PROMPTS, 6, sampling=SamplingParams(temperature=1.0, seed=5), eos_token_id=[
        unseeded.tokens[0][1]])
    return {"unseeded": unseeded.tokens, "seeded": seeded.tokens, "finish": seeded.finish_reasons}


def test_ranks_draw_the_same_tokens_with_and_without_a_seed():
    got = same_on_all_ranks(get_pool(2).run(_sample_task, str(checkpoint("tiny")), timeout=120), "sampling")
    assert all(len(t) == 6 for t in got["unseeded"])
    assert all(len(t) <= 6 for t in got["seeded"]) and set(got["finish"]) <= {"eos", "length"}
