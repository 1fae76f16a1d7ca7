"""The recipe's PD decode file (qwen3_moe_pd/decode.yaml: attention DP, ge_graph, batch 64, max_new_tokens 65536,
mem_fraction_static 0.9) starts with the KV pool sized by memory: scaled as the recipe tests scale it (world 4, DP 4,
the tiny fixture; max_new_tokens kept, each request's budget capped at the model's positions), `serve`'s start-up
runs on every rank against a stated device on which the batch's whole budget does not fit, and the start-up check
(the engine's MC2 and memory checks) passes for the pool the plan printed."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from equivalence.support.dist import get_pool
from fixtures.recipe_configs import scaled

pytestmark = pytest.mark.distributed

WORLD = 4
HOLDS = 40  # blocks the stated device leaves for the pool on every rank


def _start(rank, world, config, device=None, peak=None):
    """serve's start-up on this rank (no warm-up compile, no port): its pool, what rank 0 printed, the engine's pool,
    and whether the batch's whole budget would pass the memory check."""
    from optimized.config import InferenceConfig
    from optimized.executor import assembly, memory

    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    run = None
    try:
        cfg = InferenceConfig.from_dict(config)
        s = cfg.scheduler_config
        launch = assembly.prepare(cfg, "serve")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            run = launch.start(
                batch=s.batch_size,
                prefill_tokens=s.batch_size * cfg.data_config.input_max_len,
                agree=dict(serve=True),
                memory=memory.StatedMemory(device[rank] if device else 1 << 40, None if peak is None else peak[rank]),
            )
        engine = run.engine()  # the start-up check: MC2 window and limits, memory, for the planned pool
        pool = run.plan.kv_pool
        try:
            run.runner.check_memory(pool.need_blocks)
            whole_budget_fits = True
        except ValueError:
            whole_budget_fits = False
        return dict(
            pool=pool,
            printed=printed.getvalue(),
            engine_blocks=engine.cache.num_blocks,
            whole_budget_fits=whole_budget_fits,
            buckets=run.plan.buckets,
        )
    finally:
        if run is not None and run.state is not None:
            run.state.close()  # the pool's default group stays
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_pd_decode_file_starts_with_the_pool_sized_by_memory():
    config = scaled("qwen3_moe_pd_decode", WORLD, "fixture:tiny", max_new_tokens=65536)
    assert config["scheduler_config"]["batch_size"] == 16 and config["model_config"]["exe_mode"] == "ge_graph"
    pool_of = get_pool(WORLD)
    # a large device: the pool is what the batch can use, 4 requests per group of min(1024 + 65536, 256) tokens
    large = pool_of.run(_start, config, timeout=240)
    assert all(r["pool"].blocks == r["pool"].need_blocks == 1 + 4 * 16 for r in large), [r["pool"] for r in large]
    assert large[0]["buckets"] == (1, 2, 4)
    # the stated device: HOLDS blocks beside each rank's weights and activation peak (as measured above)
    peak = [r["pool"].activation_bytes for r in large]
    device = [
        int((r["pool"].weights_bytes + r["pool"].activation_bytes + (HOLDS + 0.5) * r["pool"].block_bytes) / 0.9)
        for r in large
    ]
    ranks = pool_of.run(_start, config, device, peak, timeout=240)
    for rank, r in enumerate(ranks):
        pool = r["pool"]
        assert pool.blocks == pool.memory_blocks == HOLDS < pool.need_blocks, (rank, pool)
        assert r["engine_blocks"] == HOLDS and not r["whole_budget_fits"], (rank, r)
        assert pool.weights_bytes + pool.activation_bytes + pool.nbytes <= 0.9 * device[rank]
    printed = ranks[0]["printed"]
    line = next(ln for ln in printed.splitlines() if ln.startswith("KV pool: ") and "sized by memory:" in ln)
    blocks, held = re.match(r"KV pool: (\d+) blocks of 16 tokens per DP group .* holds (\d+) blocks;", line).groups()
    assert int(blocks) == int(held) == ranks[0]["engine_blocks"], line
    assert "mem_fraction_static 0.9 of " in line and "the batch could use 4 requests of 256 tokens (65 blocks)" in line
