"""An older torch_npu that lacks an operator the model calls, or has it under another schema, fails at model build
with one error listing every such operator and the torch_npu version (simulated here: no torch_npu on this host).
"""

from __future__ import annotations

import pytest
import torch

from fixtures.checkpoints import checkpoint, w4a8_checkpoint
from optimized.model_loader.build import load_model
from optimized.ops import required
from optimized.ops.required import MissingNpuOperatorError, check_operators
from optimized.ops.schemas import SCHEMAS


def _old_torch_npu(monkeypatch, schemas: dict):
    """torch_npu 2.1.0 whose registry holds `schemas` (qualname -> schema string, or None: absent) over ours."""
    real = required.find_schema
    monkeypatch.setattr(required, "torch_npu_available", lambda: True)
    monkeypatch.setattr(required, "torch_npu_version", lambda: "2.1.0.post8")

    def find(qualname):
        if qualname in schemas:
            text = schemas[qualname]
            return None if text is None else torch._C.parse_schema(f"npu::{text}")
        return real(qualname)

    monkeypatch.setattr(required, "find_schema", find)


def test_model_build_lists_every_missing_operator_and_the_torch_npu_version(monkeypatch):
    _old_torch_npu(monkeypatch, {"npu_fused_infer_attention_score_v2": None, "npu_swiglu_mx_quant": None})
    with pytest.raises(MissingNpuOperatorError) as err:
        load_model(w4a8_checkpoint("tiny"))
    message = str(err.value)
    assert "torch_npu 2.1.0.post8" in message
    assert "npu_fused_infer_attention_score_v2: missing" in message and "npu_swiglu_mx_quant: missing" in message
    assert "npu_rms_norm:" not in message


def test_model_build_rejects_an_operator_under_another_schema(monkeypatch):
    older = SCHEMAS["npu_swiglu"].replace("int dim=-1", "int dim=-1, *, int mode")  # a new required argument
    _old_torch_npu(monkeypatch, {"npu_swiglu": older})
    with pytest.raises(MissingNpuOperatorError, match=r"npu_swiglu: extra arguments without defaults: \['mode'\]"):
        load_model(checkpoint("tiny"), dtype=torch.float32)


def test_a_bf16_model_does_not_require_the_mx_operators(monkeypatch):
    _old_torch_npu(
        monkeypatch, {name: None for name in required.MXFP8 | required.W4A8_EXPERTS | required.MX_SP_PREFILL}
    )
    assert load_model(checkpoint("tiny"), dtype=torch.float32) is not None


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda s: s.replace("int dim=-1", "int dim=-1, int extra=0"), None),  # a later defaulted argument
        (lambda s: s.replace("int dim=-1", "float dim=-1"), "argument 'dim' is float"),
        (lambda s: s.replace("int dim=-1", "*, int dim=-1"), "argument 'dim' is int (keyword-only)"),
        (lambda s: s.replace("int dim=-1", "int axis=-1"), "no argument 'dim'"),
        (lambda s: s.replace("-> Tensor", "-> (Tensor, Tensor)"), "returns"),
    ],
)
def test_schema_mismatch_rules(change, why):
    ours = torch._C.parse_schema(f"npu::{SCHEMAS['npu_swiglu']}")
    got = required.schema_mismatch(ours, torch._C.parse_schema(f"npu::{change(SCHEMAS['npu_swiglu'])}"))
    assert (got is None) if why is None else (got is not None and got.startswith(why)), got


def test_the_portable_kernels_provide_every_operator_of_every_configuration():
    from fixtures.tiny import tiny_config
    from optimized.config import ParallelConfig
    from optimized.layers.quantization.schemes import SCHEMES
    from optimized.model_loader.build import operators_for
    from optimized.path_plan import decide_paths

    layouts = [
        dict(world_size=1),
        dict(world_size=2, attn_tp_size=2, moe_tp_size=1, prefill_opt=True, moe_ep_scheme="allgather"),
        dict(world_size=2, attn_tp_size=2, moe_tp_size=1, prefill_opt=True, moe_ep_scheme="alltoall"),
        dict(world_size=4, attn_tp_size=2, moe_tp_size=1),  # attention DP, MC2 decode
    ]
    for name, row in SCHEMES.items():
        for fixture in ("tiny", "tiny-dense"):
            config = tiny_config(fixture)
            for sizes in layouts:
                parallel = ParallelConfig(**sizes)
                if not row.sp_prefill and parallel.prefill_opt:
                    continue
                check_operators(operators_for(decide_paths(config, parallel, name), row, config))
