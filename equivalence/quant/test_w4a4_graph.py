"""Graph mode (exe_mode ge_graph: the decode step compiled, inductor on a CPU) of the rotated W4A4 model decodes
bitwise what eager mode decodes: the rotation's fp32 matmul and the FP4 operators' fake kernels trace, and the
compiled step changes no rounding on a CPU. tiny-h128 cut to one decoder layer, the invertible rotation."""

from __future__ import annotations

import pytest
import torch

from equivalence.support.compare import assert_bitwise_equal
from fixtures.checkpoints import rotation_dir, w4a4_checkpoint
from optimized.executor.model_runner import ModelRunner
from optimized.model_loader.build import load_model

pytestmark = [pytest.mark.equivalence, pytest.mark.slow]


def test_rotated_w4a4_graph_decode_equals_eager_bitwise():
    model = load_model(
        w4a4_checkpoint("tiny-h128", "invertible"),
        dtype=torch.bfloat16,
        device="cpu",
        num_hidden_layers=1,
        hadamard_weight_path=rotation_dir("invertible"),
    )
    prompts = [[5, 1, 7, 300, 2, 9, 44], [17, 3]]
    eager = ModelRunner(model, 16).generate(prompts, 4, return_logits=True)
    graph = ModelRunner(model, 16, exe_mode="ge_graph").generate(prompts, 4, return_logits=True)
    assert graph.tokens == eager.tokens
    for i, (g, e) in enumerate(zip(graph.logits, eager.logits)):
        assert_bitwise_equal(g, e, f"request {i} decode logits")


def test_the_compile_cache_key_holds_enable_hadamard_and_the_rotation_files_content(tmp_path):
    """The rotations are constants of a compiled graph: a model without them, with them, and with other rotation
    files in the same place key apart (enable_hadamard, then the files' digest)."""
    from fixtures.checkpoints import ROTATION_SEED, write_rotation_dir
    from optimized.executor.compile_cache import cache_key, key_hash

    path = w4a4_checkpoint("tiny-h128", "invertible")
    mine = write_rotation_dir(tmp_path / "rotations", "invertible", 1)

    def key():
        model = load_model(
            path, dtype=torch.bfloat16, device="cpu", num_hidden_layers=1, hadamard_weight_path=rotations
        )
        return cache_key(model, batch_bucket=4, block_size=16, exe_mode="ge_graph", kv_cache_dtype=torch.bfloat16)

    rotations = None
    plain = key()
    rotations = mine
    rotated = key()
    write_rotation_dir(mine, "invertible", 1, seed=ROTATION_SEED + 7)  # other matrices, the same file names
    other = key()
    assert plain["enable_hadamard"] is False and plain["hadamard_rotation"] is None, plain
    assert rotated["enable_hadamard"] is True and other["enable_hadamard"] is True
    assert rotated["hadamard_rotation"] != other["hadamard_rotation"]
    assert len({key_hash(k) for k in (plain, rotated, other)}) == 3
