"""The W4A4 model with the Hadamard rotation runs on a device that is not the CPU (equivalence.support.fake_device
npu:0).

Built there (`load_model(..., device=npu, hadamard_weight_path=DIR)`): every parameter and buffer, the rotation
matrices included, lands on npu:0; greedy generation gives bitwise the tokens and logits of the same run on the CPU;
one forward step (prefill or decode) reads nothing back from the device and copies no host data onto it (the
rotation's matmul and the FP4 operators take only device tensors).
"""

from __future__ import annotations

import pytest
import torch

from equivalence.support.device_discipline import assert_no_reads_nor_transfers, fake_npu, generate, one_step
from equivalence.support.fake_device import on_fake_device
from fixtures.checkpoints import rotation_dir, w4a4_checkpoint
from optimized.model_loader.build import load_model

pytestmark = pytest.mark.equivalence

NAME, ROTATION = "tiny-h128", "invertible"


def build(device):
    path = w4a4_checkpoint(NAME, ROTATION)
    return load_model(path, dtype=torch.bfloat16, device=device, hadamard_weight_path=rotation_dir(ROTATION))


def test_rotated_w4a4_model_on_a_non_cpu_device_generates_what_the_cpu_model_generates():
    with on_fake_device():
        model = build(fake_npu())
    elsewhere = {n: t.device for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device != fake_npu()}
    assert not elsewhere, f"built for {fake_npu()}, these tensors are elsewhere: {elsewhere}"
    rotations = [m.input_rotation for m in model.modules() if getattr(m, "input_rotation", None) is not None]
    assert len(rotations) == 2 * len(model.layers) and all(t.device == fake_npu() for t in rotations)
    prompts = [[5, 1, 7, 300, 2, 9, 44], [17, 3]]
    with on_fake_device():
        tokens, logits = generate(model, prompts)
    want_tokens, want_logits = generate(build("cpu"), prompts)
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_rotated_w4a4_step_neither_reads_the_device_nor_copies_host_data_onto_it(decode):
    with on_fake_device():
        model = build(fake_npu())
    assert_no_reads_nor_transfers(one_step(model, [[1, 2, 3], list(range(4, 21))], decode), f"W4A4 {NAME}")
