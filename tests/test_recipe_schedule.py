"""scheduler_config.max_prefill_tokens and mem_fraction_static as the runner applies them, and the recipe keys the
config refuses (each naming why)."""

from __future__ import annotations

import pytest
import torch

from fixtures.checkpoints import checkpoint
from optimized.config import ConfigError, InferenceConfig
from optimized.executor.model_runner import ModelRunner
from optimized.model_loader.build import load_model

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3]]
POSITIONS = [[0, 2], [1], [0, 6], [0]]


@pytest.fixture(scope="module")
def model():
    return load_model(checkpoint("tiny"), dtype=torch.float32)


def test_prefill_in_groups_within_the_budget_equals_one_prefill(model):
    whole = ModelRunner(model, 16).generate(PROMPTS, 4, prompt_logits_positions=POSITIONS, return_logits=True)
    runner = ModelRunner(model, 16, max_prefill_tokens=8)
    packed, prefill_inputs = [], runner.prefill_inputs
    runner.prefill_inputs = lambda prompts, *a, **k: (packed.append(prompts), prefill_inputs(prompts, *a, **k))[1]
    split = runner.generate(PROMPTS, 4, prompt_logits_positions=POSITIONS, return_logits=True)
    assert packed == [PROMPTS[:2], PROMPTS[2:]]  # FIFO groups of at most 8 prompt tokens
    assert split.tokens == whole.tokens
    for a, b in zip(whole.prompt_logits + whole.logits, split.prompt_logits + split.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_prompt_beyond_the_prefill_budget_is_refused_naming_it(model):
    with pytest.raises(ValueError, match=r"prompt 2 has 7 tokens, more than max_prefill_tokens=6"):
        ModelRunner(model, 16, max_prefill_tokens=6).generate(PROMPTS, 2)


def test_memory_beyond_mem_fraction_static_is_refused_before_the_cache(model):
    with pytest.raises(ValueError, match=r"need more than mem_fraction_static=1e-09 of the device's"):
        ModelRunner(model, 16, mem_fraction_static=1e-9).generate(PROMPTS, 2)
    ModelRunner(model, 16, mem_fraction_static=0.85).generate(PROMPTS, 2)


@pytest.mark.parametrize(
    "section, key, value, why",
    [
        ("model_config", "force_eplb", "yes", "must be a boolean"),
        ("model_config", "perfect_eplb", 1, "must be a boolean"),
        ("model_config", "enable_static_kernel", True, "not implemented"),
        ("model_config", "next_n", 1, "speculative decoding (MTP) is not implemented"),
        ("model_config", "custom_params", {"enable_multi_streams": True}, "enable_multi_streams"),
        ("model_config", "enable_online_split_weight", False, "split offline"),
        ("model_config", "platform_version", "A9", "must be one of A2, A3, 950"),
        ("parallel_config", "cp_size", 2, "context-parallel prefill is not implemented"),
        ("parallel_config", "dense_tp_size", 2, "must equal moe_tp_size"),
        ("scheduler_config", "mem_fraction_static", 1.5, "(0, 1]"),
    ],
)
def test_recipe_key_refused_naming_it(section, key, value, why):
    with pytest.raises(ConfigError) as err:
        InferenceConfig.from_dict({section: {key: value}})
    assert any(k == f"{section}.{key}" and why in msg for k, msg in err.value.errors), err.value


def test_flat_layout_key_given_twice_is_an_error():
    with pytest.raises(ConfigError, match=r"model_config.model_path: given twice"):
        InferenceConfig.from_dict({"model_path": "a", "model_config": {"model_path": "b"}})
    cfg = InferenceConfig.from_dict(
        {"world_size": 2, "data_config": {"batch_size": 2, "max_new_tokens": 3}, "parallel_config": {"attn_tp_size": 2}}
    )
    assert (cfg.parallel_config.world_size, cfg.scheduler_config.batch_size) == (2, 2)
    assert cfg.parallel_config.moe_ep_size == 2 and cfg.parallel_config.attn_dp is False
