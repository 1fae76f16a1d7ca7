"""The KV pool sized by memory: mem_fraction_static of the device less the weights and a measured activation peak, in
blocks, capped at what the batch can use (each request within max_position_embeddings); the plan prints it and how it
was sized; --kv-pool-blocks overrides it; a device that cannot hold one request is refused naming what to lower.

The device is stated (`StatedMemory`) so the figures do not depend on the host's memory."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from optimized.errors import UsageError
from optimized.executor import kv_pool, memory
from optimized.executor.kv_cache import bytes_per_token
from optimized.executor.kv_pool import KVPoolTooSmall, sized_by_memory

GIB = 1 << 30


def qwen3_235b_weight_bytes_per_rank(ep: int) -> int:
    """Qwen3-235B-A22B's bf16 parameters on one rank of attention TP 1 and MoE EP `ep` (the PD decode file's
    layout): per layer attention (q 4096 x 8192, k and v 4096 x 512, o 8192 x 4096, q / k norms), two norms, the
    router (4096 x 128) and 128 / ep experts of 3 x 4096 x 1536; 94 layers; embedding and lm_head (151936 x 4096
    each) and the final norm."""
    h, layers, vocab = 4096, 94, 151936
    attention = h * 64 * 128 + 2 * h * 4 * 128 + 64 * 128 * h + 2 * 128
    layer = attention + 2 * h + h * 128 + (128 // ep) * 3 * h * 1536
    return 2 * (layers * layer + 2 * vocab * h + h)


def test_the_pd_decode_file_at_its_scale_fits_a_64_gib_die_only_with_the_pool_sized_by_memory():
    """qwen3_moe_pd/decode.yaml (DP 16, batch 64: 4 requests per rank, max_new_tokens 65536, mem_fraction_static 0.9)
    on Qwen3-235B: 44.4 GB of weights per rank and 192512 B of KV per token. Each request's worst case (1024 +
    65536 tokens) needs 51.3 GB of KV: refused on a 64 GiB die. Sized by memory (a 2 GiB activation peak stated),
    the pool is 621 blocks of 128: below what 4 requests of 40960 tokens (max_position_embeddings) could use, and
    more than one whole request holds."""
    weights = qwen3_235b_weight_bytes_per_rank(16)
    assert weights == 44_381_527_040
    block = 128 * bytes_per_token(94, 4, 128, torch.bfloat16)
    assert block == 128 * 192_512
    device, fraction = 64 * GIB, 0.9
    worst = 1 + 4 * -(-(1024 + 65536) // 128)
    assert worst * block > 51e9 and weights + worst * block > fraction * device  # the uncapped pool: refused
    pool = sized_by_memory(
        device_bytes=device,
        fraction=fraction,
        weights_bytes=weights,
        activation_bytes=2 * GIB,
        block_bytes=block,
        block_size=128,
        group_batch=4,
        request_tokens=kv_pool.request_budget(1024, 65536, 40960),
        dp_groups=16,
    )
    assert (pool.blocks, pool.memory_blocks, pool.need_blocks) == (621, 621, 1 + 4 * 320)
    assert weights + 2 * GIB + pool.nbytes <= fraction * device
    assert pool.tokens == 620 * 128 and pool.tokens >= 40960  # a request at its whole budget fits
    assert pool.line().startswith("KV pool: 621 blocks of 128 tokens per DP group (null block included; 79360 tokens, ")
    assert "the batch could use 4 requests of 40960 tokens (1281 blocks)" in pool.line()


@given(
    device=st.integers(1 << 20, 1 << 40),
    fraction=st.floats(0.05, 1.0),
    weights=st.integers(0, 1 << 38),
    activation=st.integers(0, 1 << 34),
    other=st.integers(0, 1 << 32),
    block=st.integers(1, 1 << 26),
    block_size=st.sampled_from([16, 128]),
    group_batch=st.integers(1, 64),
    request=st.integers(1, 1 << 16),
)
def test_a_pool_sized_by_memory_fits_the_share_holds_one_request_and_never_exceeds_the_batch(
    device, fraction, weights, activation, other, block, block_size, group_batch, request
):
    kw = dict(
        device_bytes=device,
        fraction=fraction,
        weights_bytes=weights,
        activation_bytes=activation,
        other_bytes=other,
        block_bytes=block,
        block_size=block_size,
        group_batch=group_batch,
        request_tokens=request,
    )
    one = 1 + -(-request // block_size)
    try:
        pool = sized_by_memory(**kw)
    except KVPoolTooSmall:
        assert weights + activation + other + one * block > fraction * device
        return
    used = weights + activation + other
    assert used + pool.nbytes <= fraction * device
    assert one <= pool.blocks <= 1 + group_batch * (one - 1)
    if pool.blocks < pool.need_blocks:  # bound by memory: one block more would not fit
        assert used + (pool.blocks + 1) * block > fraction * device


def test_the_ranks_agree_on_the_smallest_count():
    kw = dict(
        device_bytes=GIB,
        fraction=1.0,
        weights_bytes=0,
        activation_bytes=0,
        block_bytes=1 << 20,
        block_size=16,
        group_batch=8,
        request_tokens=64,
    )
    assert sized_by_memory(**kw).blocks == 1 + 8 * 4  # capped at the batch's most
    assert sized_by_memory(**kw, agree=lambda n: min(n, 20)).blocks == 20  # another rank holds 20
    with pytest.raises(KVPoolTooSmall):
        sized_by_memory(**kw, agree=lambda n: 4)


def test_memory_in_use_outside_the_tensors_is_left_out_of_the_pool_and_printed():
    kw = dict(fraction=1.0, weights_bytes=0, activation_bytes=0, block_bytes=1 << 20, block_size=16, group_batch=64)
    alone = sized_by_memory(device_bytes=64 << 20, request_tokens=64, **kw)
    beside = sized_by_memory(device_bytes=64 << 20, request_tokens=64, other_bytes=10 << 20, **kw)
    assert (alone.blocks, beside.blocks) == (64, 54)
    assert "other device memory" not in alone.line() and "other device memory 10.00 MiB" in beside.line()
    device = memory.StatedMemory(64 << 20, other=10 << 20)
    assert (device.total_bytes(), device.other_bytes(), memory.HostMemory().other_bytes()) == (64 << 20, 10 << 20, 0)


def test_live_storage_counts_the_peak_of_tensor_storage():
    def work():
        a = torch.empty(1000)  # 4000 B
        b = a[:10]  # a view: no new storage
        c = torch.empty(500)  # 2000 B: the peak, 6000 B
        del a, b, c
        d = torch.empty(250)  # 1000 B
        return d

    assert memory.live_storage_peak(work) == 6000
    assert memory.StatedMemory(8 * GIB).peak_bytes(work) == 6000
    assert memory.StatedMemory(8 * GIB, peak=7).peak_bytes(work) == 7
    assert isinstance(memory.device_memory(torch.device("cpu")), memory.HostMemory)


# ---- through serve's start-up (a single process, the tiny fixture, a stated device)

BASE = {
    "model_config": {"model_path": "fixture:tiny", "dtype": "float32"},
    "data_config": {"input_max_len": 32},
    # max_new_tokens beyond the model's 256 positions: each request's budget is capped at them
    "scheduler_config": {"batch_size": 2, "max_new_tokens": 65536, "block_size": 16},
}
ACTIVATIONS = 3 << 20  # a stated activation peak


def _serve(tmp_path, monkeypatch, device: int, kv_pool_blocks=None):
    from optimized.cli.serve import load_config, start

    monkeypatch.setattr(memory, "device_memory", lambda _: memory.StatedMemory(device, peak=ACTIVATIONS))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return start(load_config(SimpleNamespace(config=str(path), model_path=None)), kv_pool_blocks)


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """(weights, block bytes) of the tiny fixture's run, from a start-up on a large device."""
    with pytest.MonkeyPatch.context() as mp:
        run, engine = _serve(tmp_path_factory.mktemp("large"), mp, 64 * GIB)
        try:
            pool = run.plan.kv_pool
            assert pool.source == kv_pool.MEMORY and pool.activation_bytes == ACTIVATIONS
            # a large device: capped at the batch's most, 2 requests of min(32 + 65536, 256) tokens in blocks of 16
            assert pool.blocks == pool.need_blocks == engine.cache.num_blocks == 1 + 2 * 16
            return pool.weights_bytes, pool.block_bytes
        finally:
            run.close()


def test_serve_starts_with_the_pool_the_memory_holds_and_prints_it(figures, tmp_path, monkeypatch, capsys):
    weights, block = figures
    device = int((weights + ACTIVATIONS + 20.5 * block) / 0.85)  # 20 blocks beside the weights and activations
    run, engine = _serve(tmp_path, monkeypatch, device)
    try:
        pool = run.plan.kv_pool
        assert run.plan.kv_pool_blocks == engine.cache.num_blocks == pool.blocks == pool.memory_blocks == 20
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("KV pool: 20 blocks"))
        printed = int(re.match(r"KV pool: (\d+) blocks of 16 tokens", line)[1])
        assert printed == engine.cache.num_blocks and "sized by memory: mem_fraction_static 0.85" in line, line
        run.runner.check_memory(printed)  # the start-up check passes for the printed pool ...
        with pytest.raises(ValueError, match="need more than mem_fraction_static=0.85"):
            run.runner.check_memory(pool.need_blocks)  # ... where the batch's whole budget would not
    finally:
        run.close()


def test_kv_pool_blocks_overrides_the_memory_sized_pool(figures, tmp_path, monkeypatch, capsys):
    run, engine = _serve(tmp_path, monkeypatch, 64 * GIB, kv_pool_blocks=7)
    try:
        assert run.plan.kv_pool_blocks == engine.cache.num_blocks == 7 and run.plan.kv_pool.source == "--kv-pool-blocks"
        assert "KV pool: 7 blocks of 16 tokens (null block included; 96 tokens, " in capsys.readouterr().out
    finally:
        run.close()


def test_a_device_that_cannot_hold_one_request_is_refused_naming_what_to_lower(figures, tmp_path, monkeypatch):
    weights, block = figures
    device = int((weights + ACTIVATIONS + 16.5 * block) / 0.85)  # one request of 256 tokens needs 1 + 16 blocks
    with pytest.raises(UsageError) as e:
        _serve(tmp_path, monkeypatch, device)
    message = str(e.value)
    assert isinstance(e.value, KVPoolTooSmall), message
    assert "leaves 16 blocks of 16 tokens" in message and "needs 17 with the null block" in message, message
    for what in ("input_max_len", "max_new_tokens", "mem_fraction_static", "parallel_config"):
        assert what in message, (what, message)


def test_the_profiling_forward_measures_more_for_a_larger_prefill():
    from fixtures.checkpoints import checkpoint
    from optimized.executor.model_runner import ModelRunner
    from optimized.model_loader.build import load_model

    runner = ModelRunner(load_model(checkpoint("tiny"), dtype=torch.float32), 16)
    small = runner.profile_activations(1, 8, 1)
    large = runner.profile_activations(4, 200, 4)
    assert 0 < small < large and runner.activation_bytes == large


@pytest.mark.parametrize(
    "scheduler, want",
    [
        ({}, (4, 100)),  # the group's share of prompts, each of input_max_len
        ({"max_prefill_tokens": 250}, (2, 100)),  # as many whole prompts as the step's budget holds
        ({"max_prefill_tokens": 60}, (1, 60)),  # a budget below one prompt: one prompt of the budget
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 300}, (3, 100)),  # chunked: the step's tokens
    ],
)
def test_the_profiling_prefill_is_the_largest_one_step_can_run(scheduler, want):
    from optimized.config import InferenceConfig
    from optimized.executor.assembly import profile_prefill

    cfg = InferenceConfig.from_dict(
        {"data_config": {"input_max_len": 100}, "scheduler_config": {"batch_size": 4, **scheduler}}
    )
    assert profile_prefill(cfg, 4, 4096) == want
    assert profile_prefill(cfg, 4, 64)[1] <= 63  # a prompt within the model's positions, room for one new token
