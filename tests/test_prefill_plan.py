"""Sequence-parallel prefill config keys, the recipe's rules, the plan's EP scheme choice and the volume formulas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optimized.config import ConfigError, InferenceConfig, ParallelConfig
from optimized.distributed.prefill_plan import alltoall_volume, allgather_volume, ep_comm_volumes
from optimized.path_plan import ALLGATHER, ALLTOALL, SP, TP, decide_paths

# Qwen3-30B-A3B's MoE shapes (fixtures.presets restates the released config).
QWEN3_30B = SimpleNamespace(hidden_size=2048, num_experts=128, num_experts_per_tok=8)


def _par(**p) -> ParallelConfig:
    return InferenceConfig.from_dict({"parallel_config": p}).parallel_config


def _errors(**p) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        InferenceConfig.from_dict({"parallel_config": p})
    return dict(e.value.errors)


@pytest.mark.parametrize(
    "p, on",
    [
        (dict(), False),  # one process: nothing to split
        (dict(world_size=4, attn_tp_size=4, moe_ep_size=4), True),  # sizes match: on by default
        (dict(world_size=4, attn_tp_size=4, moe_ep_size=4, prefill_opt=False), False),
        (
            dict(world_size=4, attn_tp_size=2, moe_tp_size=2, moe_ep_size=2, attn_dp=False),
            False,
        ),  # attention replicas: off
        (dict(world_size=4, attn_tp_size=4, moe_tp_size=4), False),
        (dict(world_size=2, attn_tp_size=2, moe_ep_size=2, prefill_opt=True), True),
    ],
)
def test_sp_prefill_default_and_switch(p, on):
    assert _par(**p).sp_prefill is on


@pytest.mark.parametrize(
    "p, key, fragments",
    [
        (
            dict(world_size=4, attn_tp_size=2, moe_tp_size=2, moe_ep_size=2, prefill_opt=True, attn_dp=False),
            "parallel_config.prefill_opt",
            ["moe_tp_size == 1"],
        ),
        (
            dict(world_size=4, attn_tp_size=2, moe_ep_size=4, prefill_opt=True, attn_dp=False),
            "parallel_config.prefill_opt",
            ["attn_tp_size == moe_ep_size (2 != 4)"],
        ),
        (
            dict(world_size=4, attn_tp_size=4, moe_ep_size=4, prefill_opt="yes"),
            "parallel_config.prefill_opt",
            ["must be a boolean"],
        ),
        (
            dict(world_size=4, attn_tp_size=4, moe_ep_size=4, moe_ep_scheme="mc2"),
            "parallel_config.moe_ep_scheme",
            ["one of auto, allgather, alltoall", "'mc2'"],
        ),
        (
            dict(world_size=4, attn_tp_size=4, moe_ep_size=4, prefill_opt=False, moe_ep_scheme="alltoall"),
            "parallel_config.moe_ep_scheme",
            ["sequence-parallel prefill", "off", "prefill_opt"],
        ),
        (
            dict(world_size=2, attn_tp_size=1, moe_ep_size=2, moe_ep_scheme="allgather"),
            "parallel_config.moe_ep_scheme",
            ["attn_tp_size 1", "moe_ep_size 2"],
        ),
    ],
)
def test_prefill_rule_error_names_key_and_rule(p, key, fragments):
    errors = _errors(**p)
    assert key in errors, errors
    for frag in fragments:
        assert frag in errors[key], (frag, errors[key])


def test_world_size_divisibility_still_named_with_prefill_opt():
    errors = _errors(world_size=4, attn_tp_size=3, moe_ep_size=4, prefill_opt=True)
    assert "world_size (4) must be divisible by attn_tp_size (3)" in errors["parallel_config.attn_tp_size"]


@pytest.mark.parametrize(
    "ep, top_k, scheme",
    [
        (2, 8, "allgather"),
        (4, 8, "allgather"),
        (8, 8, "allgather"),
        (16, 8, "alltoall"),
        (8, 4, "alltoall"),
        (4, 4, "allgather"),
    ],
)
def test_auto_scheme_follows_the_volume_rule(ep, top_k, scheme):
    par = _par(world_size=ep, attn_tp_size=ep, moe_ep_size=ep)
    model = SimpleNamespace(hidden_size=2048, num_experts=128, num_experts_per_tok=top_k)
    assert decide_paths(model, par).ep_scheme == scheme
    vol = ep_comm_volumes(model, par, 4096, 2)
    # The chosen scheme is the one moving fewer activation bytes (ties go to allgather, as in the recipe).
    cheaper = (
        "allgather" if vol["allgather"].total <= vol["alltoall"].total + 0.02 * vol["alltoall"].total else "alltoall"
    )
    assert cheaper == scheme, vol


def test_explicit_scheme_overrides_auto():
    par = _par(world_size=4, attn_tp_size=4, moe_ep_size=4, moe_ep_scheme="alltoall")
    paths = decide_paths(QWEN3_30B, par)  # top_k 8 >= 4: auto would pick allgather
    assert (paths.prefill, paths.ep_scheme, paths.why) == (SP, ALLTOALL, "moe_ep_scheme")


def test_volume_formulas_by_hand():
    # P=4 ranks, n=3 tokens each, H=10, top_k=2, E=8, bf16.
    ag = allgather_volume(3, 10, 2, 4, 2)
    assert ag.parts == {"all_gather": 3 * 3 * (10 * 2 + 2 * 8), "reduce_scatter": 3 * 3 * 10 * 2}
    a2a = alltoall_volume(3, 10, 2, 4, 8, 2, slots_out=5, slots_in=1)
    assert a2a.parts == {"all_to_all": 3 * 2 * 8 + (5 + 1) * 10 * 2}
    assert alltoall_volume(3, 10, 2, 4, 8, 2).total == round(3 * 2 * 8 + 2 * (3 * 2 * 3 / 4) * 10 * 2)


def test_qwen3_30b_volumes_ratio_is_ep_over_top_k():
    par = _par(world_size=4, attn_tp_size=4, moe_ep_size=4)
    vol = ep_comm_volumes(QWEN3_30B, par, 4096, 2)
    act = {s: v.total for s, v in vol.items()}
    # Activations dominate: allgather / alltoall ~ P / top_k = 0.5 (within the ids/weights/counts overhead).
    assert 0.5 <= act["allgather"] / act["alltoall"] <= 0.52
    paths = decide_paths(QWEN3_30B, par)
    assert (paths.prefill, paths.ep_scheme, paths.why) == (SP, ALLGATHER, "auto: top_k 8 >= moe_ep_size 4")
    assert decide_paths(QWEN3_30B, _par()).prefill == TP


def test_sp_example_config_fits_the_tiny_model_and_picks_allgather():
    from pathlib import Path

    from fixtures.tiny import tiny_config

    path = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "tiny_sp4_ep4.yaml"
    cfg = InferenceConfig.from_yaml(path).validate_for_model(tiny_config("tiny"))
    par = cfg.parallel_config
    assert par.sp_prefill and par.prefill_opt is True
    assert decide_paths(tiny_config("tiny"), par).ep_scheme == ALLGATHER  # top_k 4 >= ep 4
