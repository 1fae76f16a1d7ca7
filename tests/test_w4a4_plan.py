"""W4A4 checkpoints never run the sequence-parallel prefill (the recipe's prefill_opt requires mm_quant_mode !=
w4a4mxfloat4, spec a4w4_hadamard.md §1.4): one rule, the plan's (`path_plan.decide_paths` asking the scheme table's
`sp_prefill`), read by the start-up plan and by the model's phases alike. With prefill_opt null the layout's default
(SP at attention TP = MoE EP = world) falls back to the tensor-parallel prefill; prefill_opt true is refused naming the
key. W4A8 keeps the SP prefill."""

from __future__ import annotations

import pytest
import torch

from fixtures.checkpoints import w4a4_checkpoint, w4a8_checkpoint
from optimized.config import InferenceConfig, ParallelConfig
from optimized.distributed import ParallelState
from optimized.executor.plan import ExecutionPlan
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.schemes import SCHEMES, W4A4, scheme_row
from optimized.model import Qwen3MoeForCausalLM
from optimized.model_loader.hf_config import load_hf_config
from optimized.path_plan import SP, TP, decide_paths
from optimized.phases import SequenceParallelPrefill, TensorParallelPhase

SP_DEFAULT = dict(world_size=4, attn_tp_size=4, moe_tp_size=1)


def _plan(hf_config, **parallel) -> ExecutionPlan:
    cfg = InferenceConfig.from_dict({"parallel_config": parallel, "scheduler_config": {"batch_size": 4}})
    return ExecutionPlan.build(cfg, hf_config, batch=4, prefill_tokens=20, kv_pool_blocks=9)


def test_only_w4a4_is_excluded_from_the_sp_prefill_in_the_table():
    assert [name for name, row in SCHEMES.items() if not row.sp_prefill] == [W4A4]


def test_w4a4_prefill_is_tensor_parallel_in_the_plan_and_in_the_model_alike():
    w4a4, w4a8 = load_hf_config(w4a4_checkpoint("tiny-h256", "orthogonal")), load_hf_config(w4a8_checkpoint("tiny"))
    assert ParallelConfig(**SP_DEFAULT).sp_prefill  # the layout asks for it
    plan4, plan8 = _plan(w4a4, **SP_DEFAULT), _plan(w4a8, **SP_DEFAULT)
    assert (plan4.quant, plan4.paths.prefill, plan4.paths.ep_scheme) == (W4A4, TP, None)
    assert plan4.paths.why.startswith(scheme_row(W4A4).label)
    assert plan8.paths.prefill == SP
    for config, plan, phase in ((w4a4, plan4, TensorParallelPhase), (w4a8, plan8, SequenceParallelPrefill)):
        groups = ParallelState.build(ParallelConfig(**SP_DEFAULT), 0, create_groups=False)
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(config, groups, torch.bfloat16)  # decides by the same rule
        assert model.paths == plan.paths and type(model.prefill) is phase


def test_prefill_opt_true_with_w4a4_is_refused_naming_the_key():
    w4a4 = load_hf_config(w4a4_checkpoint("tiny-h256", "orthogonal"))
    with pytest.raises(QuantConfigError, match="parallel_config.prefill_opt: true is not supported with a W4A4"):
        _plan(w4a4, **SP_DEFAULT, prefill_opt=True)
    assert decide_paths(w4a4, ParallelConfig(**SP_DEFAULT, prefill_opt=False), W4A4).prefill == TP
