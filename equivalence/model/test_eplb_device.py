"""Expert load balancing on a device that is not the CPU (`equivalence.support.fake_device`'s npu:0): the placement's
tables and the routed-token counters are built there; a forward step (prefill and decode) with EPLB reads nothing
back from the device and copies nothing onto it (the replica rule and the counting are device operators); closing a
step's counts into the window reads nothing either, and a rebalance reads the device once (the window's and the
slots' counts, summed over the world), nothing per step."""

from __future__ import annotations

import pytest
import torch

from equivalence.support.device_discipline import assert_no_reads_nor_transfers, fake_npu, one_step
from equivalence.support.fake_device import on_fake_device
from fixtures.checkpoints import checkpoint

pytestmark = pytest.mark.equivalence

PROMPTS = [[5, 9, 200, 17, 3], [44, 1, 2]]


def _eplb_model():
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model

    state = ParallelState.build(
        world_size=1, enable_eplb=True, num_redundant_experts=2, eplb_window_size=2, eplb_step_interval=3
    )
    with on_fake_device():
        return load_model(checkpoint("tiny"), parallel=state, dtype=torch.float32, device=fake_npu())


@pytest.mark.parametrize("decode", [False, True])
def test_an_eplb_step_reads_nothing_and_its_rebalance_reads_once(decode):
    from optimized.layers.eplb.controller import EplbController

    model = _eplb_model()
    blocks = [layer.mlp for layer in model.layers]
    assert all(b.eplb for b in blocks)
    placed = {n: t.device for b in blocks for n, t in b.named_buffers() if n.startswith(("replica", "expert", "slot"))}
    assert placed and set(placed.values()) == {fake_npu()}, placed
    step = one_step(model, PROMPTS, decode)
    assert_no_reads_nor_transfers(step, f"EPLB {'decode' if decode else 'prefill'} step")
    with on_fake_device() as mode:
        controller = EplbController.for_model(model)
        controller.between_steps()  # the first call drops the counts so far (warm-up rows)
        controller.between_steps()  # closes the counts into the window
        assert not mode.host_reads and not mode.transfers, (mode.host_reads, mode.transfers)
        assert int(controller.window.sum()) == 0  # one_step's counts were dropped by the first call
        before = len(mode.host_reads)
        controller.between_steps()  # eplb_step_interval 3: a rebalance
        assert controller.rebalances == 1
        reads = mode.host_reads[before:]
        assert len(reads) == 1 and "controller.py" in reads[0], reads
