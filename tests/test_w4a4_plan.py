"""W4A4 checkpoints never run the sequence-parallel prefill (the recipe's prefill_opt requires mm_quant_mode !=
w4a4mxfloat4, spec a4w4_hadamard.md §1.4): with prefill_opt null the layout's default (SP at attention TP = MoE EP =
world) falls back to the tensor-parallel prefill, and the start-up line says why; prefill_opt true is refused naming
the key. W4A8 keeps the SP prefill."""

from __future__ import annotations

import pytest

from fixtures.checkpoints import w4a4_checkpoint, w4a8_checkpoint
from optimized.config import ParallelConfig
from optimized.distributed.prefill_plan import describe
from optimized.layers.quantization.errors import QuantConfigError
from optimized.model_loader.hf_config import load_hf_config
from optimized.phases import sp_prefill

SP_DEFAULT = ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=1)


def test_w4a4_prefill_is_tensor_parallel_and_said_so():
    w4a4, w4a8 = load_hf_config(w4a4_checkpoint("tiny-h256", "orthogonal")), load_hf_config(w4a8_checkpoint("tiny"))
    assert SP_DEFAULT.sp_prefill
    assert sp_prefill(w4a8, SP_DEFAULT) and not sp_prefill(w4a4, SP_DEFAULT)
    line = describe(w4a4, SP_DEFAULT, 20, 2)
    assert line.startswith("prefill path: tensor parallel") and "W4A4" in line, line
    assert describe(w4a8, SP_DEFAULT, 20, 2).startswith("prefill path: sequence parallel")


def test_prefill_opt_true_with_w4a4_is_refused_naming_the_key():
    w4a4 = load_hf_config(w4a4_checkpoint("tiny-h256", "orthogonal"))
    with pytest.raises(QuantConfigError, match="parallel_config.prefill_opt: true is not supported with a W4A4"):
        sp_prefill(w4a4, ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=1, prefill_opt=True))
    assert not sp_prefill(w4a4, ParallelConfig(world_size=4, attn_tp_size=4, moe_tp_size=1, prefill_opt=False))
