"""Device discipline over whole engine steps, not only the forward: on the fake npu:0
(equivalence/support/fake_device.py)
with its transfer counter around `Engine.step`, prefill and decode, single process and under real gloo ranks.

The documented budget of an engine step (optimized/executor/engine.py):
- one device-to-host read by the engine (`Engine._read`: the chosen ids and the logprobs asked for, packed), plus
  the reads the model itself documents: the double routing's split sizes (`exchange.split_sizes`), exactly one per
  MoE layer in a step whose exchange is the double routing, none in any other step;
- no host-to-device copy in a decode step, but in the decode steps where running requests of this rank's DP group
  took a KV block (their next token starts one): one copy of the new (row, column, block) entries of their table
  rows (`DeviceBatch.grow`); a preemption in that step only drops the last rows (no copy);
- in a prefill step only the step's metadata build (the prompts' ids, positions and slots in
  `ModelRunner.prefill_inputs`) and the admitted requests' rows (`DeviceBatch.admit`), a request recomputed after
  a preemption included.
A decode step that rebuilt its block table, ids or positions on the host, or a sampler that moved logits to the
host, fails here, naming the line.
"""

from __future__ import annotations

import functools

import pytest
import torch

from optimized.config import is_sparse_layer

from equivalence.support.dist import get_pool
from equivalence.support.strategies import BLOCK_SIZE

ENGINE_READ = "optimized/executor/engine.py"
METADATA_BUILD = ("optimized/executor/model_runner.py", "optimized/executor/device_batch.py")
MODEL_READS = ("optimized/layers/exchange.py",)  # the double routing's all_to_all_v split sizes (host lists)
# an odd batch; one crosses a block at admission, one takes its second block in its second decode
PROMPTS = [[1, 2, 3], list(range(4, 21)), [9, 10, 11, 12, 13], list(range(30, 45))]
GROW = "optimized/executor/device_batch.py"


def _engine_steps(
    model, prompts, max_tokens, sampling=None, logprobs=None, kv_cache_dtype="auto", num_blocks=12, overlapped=False
):
    """Run an engine to completion on the fake device; per step: (kind, host reads, host -> device copies, rows of
    this rank's group that took a block, requests preempted, the model's MoE layers). overlapped: with
    async_scheduling (a call then copies the blocks of the step it launches, not of the step it returns)."""
    from equivalence.support.fake_device import on_fake_device
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner
    from optimized.executor.sampling import GREEDY
    from optimized.executor.scheduler import Request

    runner = ModelRunner(model, BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    moe_layers = sum(is_sparse_layer(model.config, i) for i in range(model.config.num_hidden_layers))
    steps, tokens = [], []
    with on_fake_device() as mode:
        engine = Engine(runner, batch_size=4, num_blocks=num_blocks, async_scheduling=overlapped)
        requests = [
            Request(f"r{i}", p, max_tokens, sampling or GREEDY, logprobs=logprobs, stream=i)
            for i, p in enumerate(prompts)
        ]
        for r in requests:
            engine.add(r)
        while not engine.idle:
            reads, transfers = len(mode.host_reads), len(mode.transfers)
            step, _ = engine.step()
            grown = sum(r.dp_group == engine.dp_rank for r, _ in step.grown)
            steps.append(
                (step.kind, mode.host_reads[reads:], mode.transfers[transfers:], grown, len(step.preempted), moe_layers)
            )
        tokens = [r.tokens for r in requests]
    return steps, tokens


def check_budget(steps, double_routing_prefill: bool = False) -> None:
    """double_routing_prefill: the layout's prefill exchange is the double routing (one split-size read per MoE
    layer in every prefill step); its decode steps, and every step of the other layouts, read nothing there."""
    kinds = {kind for kind, *_ in steps}
    assert kinds == {"prefill", "decode"}, kinds
    for i, (kind, reads, transfers, grown, _, moe_layers) in enumerate(steps):
        mine = [r for r in reads if ENGINE_READ in r]
        exchange = [r for r in reads if any(m in r for m in MODEL_READS)]
        others = [r for r in reads if ENGINE_READ not in r and r not in exchange]
        assert len(mine) == 1, f"step {i} ({kind}): the engine read the device {len(mine)} times: {mine}"
        assert not others, f"step {i} ({kind}): undocumented device reads: {others}"
        expected = moe_layers if double_routing_prefill and kind == "prefill" else 0
        assert len(exchange) == expected, (
            f"step {i} ({kind}): the exchange read the device {len(exchange)} times; expected {expected} "
            f"({moe_layers} MoE layers, one split-size read per double-routing layer): {exchange}"
        )
        if kind == "decode" and grown:
            assert len(transfers) == 1 and GROW in transfers[0], (
                f"step {i} (decode, {grown} row(s) took a block) copied more than the new table entries: {transfers}"
            )
        elif kind == "decode":
            assert not transfers, f"step {i} (decode) copied host data onto the device: {transfers}"
        else:
            stray = [t for t in transfers if not any(m in t for m in METADATA_BUILD)]
            assert not stray, f"step {i} (prefill) copied host data outside its metadata build: {stray}"


@functools.lru_cache(maxsize=None)
def _fake_model(name: str):
    from equivalence.support.fake_device import on_fake_device, register
    from fixtures.checkpoints import checkpoint
    from optimized.model_loader.build import load_model

    with on_fake_device():
        return load_model(checkpoint(name), dtype=torch.float32, device=register())


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "sampled", [False, True, "penalized"], ids=["greedy", "sampled-with-logprobs", "penalties-logit-bias-min-tokens"]
)
def test_engine_steps_read_once_and_copy_only_their_metadata(sampled):
    from optimized.executor.sampling import SamplingParams

    sampling = SamplingParams(0.8, 5, 0.9, seed=7) if sampled is True else None
    if sampled == "penalized":  # the processors' device state: written at admission, counts stepped on the device
        sampling = SamplingParams(
            0.8,
            seed=7,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.2,
            logit_bias={3: 1.0, 9: -2.0},
            min_tokens=2,
        )
    steps, _ = _engine_steps(_fake_model("tiny"), PROMPTS, 4, sampling, logprobs=2 if sampled else None)
    check_budget(steps)
    assert any(grown for _, _, _, grown, *_ in steps), "no step took a block: the budget's growth rule is untested"


@pytest.mark.equivalence
def test_overlapped_steps_read_once_and_copy_only_their_table_entries():
    """Overlapped scheduling keeps the budget: each call reads the device once (the step it returns), a decode call
    copies nothing but the new table entries of the step it launches, and the run copies as many as the synchronous
    one, with the same tokens."""
    from optimized.executor.sampling import SamplingParams

    model, sampling = _fake_model("tiny"), SamplingParams(0.8, 5, 0.9, seed=7)
    sync, sync_tokens = _engine_steps(model, PROMPTS, 6, sampling, logprobs=2)
    steps, tokens = _engine_steps(model, PROMPTS, 6, sampling, logprobs=2, overlapped=True)
    assert tokens == sync_tokens
    for i, (kind, reads, transfers, *_) in enumerate(steps):
        assert len(reads) == 1 and ENGINE_READ in reads[0], f"call {i} ({kind}) read the device: {reads}"
        if kind == "decode":
            assert all(GROW in t for t in transfers), f"call {i} (decode) copied host data: {transfers}"

    def grows(run):
        return sum(GROW in t for kind, _, transfers, *_ in run if kind == "decode" for t in transfers)

    assert grows(steps) == grows(sync) > 0


@pytest.mark.equivalence
def test_steps_that_preempt_and_recompute_keep_the_budget():
    """A pool too small for the batch (3 blocks; three requests of one block at admission and two at the end):
    decode steps preempt and take blocks, and the recomputes are prefills; each keeps the budget."""
    prompts = [list(range(30, 45)), list(range(50, 64)), list(range(70, 85))]
    steps, _ = _engine_steps(_fake_model("tiny"), prompts, 6, num_blocks=4)
    check_budget(steps)
    assert any(preempted for *_, preempted, _ in steps) and any(grown for _, _, _, grown, *_ in steps)


@pytest.mark.equivalence
def test_a_growth_copied_row_by_row_fails_the_budget(monkeypatch):
    """The proof can fail: blocks written into the table with one copy per entry are caught."""
    from optimized.executor.device_batch import DeviceBatch

    def row_by_row(self, blocks):
        for row, column, block in blocks:
            self.table[row, column : column + 1] = torch.tensor([block], dtype=self.table.dtype, device=self.device)
            self.table[row, column : column + 1] = torch.tensor([block], dtype=self.table.dtype, device=self.device)

    monkeypatch.setattr(DeviceBatch, "grow", row_by_row)
    steps, _ = _engine_steps(_fake_model("tiny"), PROMPTS, 4)
    with pytest.raises(AssertionError, match="copied more than the new table entries"):
        check_budget(steps)


@pytest.mark.equivalence
def test_a_planted_host_rebuild_of_the_block_table_fails_the_budget(monkeypatch):
    """The proof can fail: a decode step that rebuilds its block table from the host lists (as the engine once did)
    is caught, naming the line."""
    from optimized.executor import engine as engine_module
    from optimized.executor.kv_cache import block_table

    original = engine_module.decode_metadata

    def rebuilt(positions, kv_lens, table, block_size, dp=None):
        table[:, :1] = block_table([[1]] * positions.shape[0], positions.device)  # a host rebuild, every step
        return original(positions, kv_lens, table, block_size, dp)

    monkeypatch.setattr(engine_module, "decode_metadata", rebuilt)
    steps, _ = _engine_steps(_fake_model("tiny"), PROMPTS, 3)
    with pytest.raises(AssertionError, match="copied host data onto the device"):
        check_budget(steps)


# ---------------------------------------------------------------------------------------------- multi-rank

LAYOUTS = {
    "tp2": dict(world_size=2, attn_tp_size=2, moe_tp_size=2, moe_ep_size=1, embed_tp_size=2, lmhead_tp_size=2),
    "mc2": dict(world_size=2, attn_tp_size=2, moe_tp_size=1, moe_ep_size=2, embed_tp_size=2, lmhead_tp_size=2),
    "tp2xdp2": dict(
        world_size=4, attn_tp_size=2, moe_tp_size=1, moe_ep_size=4, embed_tp_size=2, lmhead_tp_size=2, attn_dp=True
    ),
}


@torch.no_grad()
def _rank_steps_task(rank, world, layout_name, fixture, fp8):
    from equivalence.support.fake_device import on_fake_device, register
    from fixtures.checkpoints import checkpoint
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model

    state = ParallelState.build(**LAYOUTS[layout_name])
    dtype = torch.bfloat16 if fp8 else torch.float32  # the per-token FP8 KV cache quantizes 16-bit K/V
    with on_fake_device():
        model = load_model(checkpoint(fixture), parallel=state, dtype=dtype, device=register())
    steps, tokens = _engine_steps(model, PROMPTS, 3, kv_cache_dtype="float8" if fp8 else "auto")
    return {"steps": steps, "tokens": tokens}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, fp8, double_routing_prefill", [("tp2", False, False), ("mc2", False, False), ("tp2xdp2", True, True)]
)
def test_engine_steps_keep_the_budget_on_every_rank(layout, fp8, double_routing_prefill):
    world = LAYOUTS[layout]["world_size"]
    results = get_pool(world).run(_rank_steps_task, layout, "tiny", fp8, timeout=300)
    for rank, got in enumerate(results):
        check_budget(got["steps"], double_routing_prefill)
        assert got["tokens"] == results[0]["tokens"], f"rank {rank} saw other tokens than rank 0"
