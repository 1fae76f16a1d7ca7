"""InferenceConfig: every validation rule has an error test naming the dotted key and the rule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.support.plans import small_model_shapes
from optimized.config import ConfigError, InferenceConfig, ParallelConfig, dense_layers

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
EXAMPLES = sorted(CONFIGS.glob("*.yaml"))


def _err(d: dict) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        InferenceConfig.from_dict(d)
    return e.value


def _assert_names(err: ConfigError, key: str, *fragments: str) -> None:
    msg = str(err)
    lines = [line for line in msg.splitlines() if line.strip().startswith(key + ":")]
    assert lines, f"no error line for {key!r} in:\n{msg}"
    for frag in fragments:
        assert any(frag in line for line in lines), f"{frag!r} not in the {key} error:\n{msg}"


# ------------------------------------------------------------------------------------- defaults, files


def test_defaults_are_valid_single_process():
    cfg = InferenceConfig.from_dict({})
    assert cfg.parallel_config.world_size == 1
    assert cfg.model_config.model_path == "fixture:tiny"
    assert cfg == InferenceConfig()
    assert InferenceConfig.from_dict({"model_config": None}) == cfg  # empty section = defaults


def test_example_configs_exist():
    names = {p.name for p in EXAMPLES}
    assert {"tiny_single.yaml", "tiny_tp2.yaml", "tiny_tp4_ep.yaml", "qwen3_30b_a3b_bench.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_yaml_round_trips(path, tmp_path):
    cfg = InferenceConfig.from_yaml(path)
    again = InferenceConfig.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
    out = tmp_path / "again.yaml"
    out.write_text(cfg.to_yaml())
    assert InferenceConfig.from_yaml(out) == cfg
    # Every key the file sets is read as written (nothing silently dropped).
    raw = yaml.safe_load(path.read_text())
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_tiny_examples_fit_a_tiny_model_and_bench_fits_30b():
    tiny = SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=8,
        vocab_size=256,
        intermediate_size=64,
        num_hidden_layers=3,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    for name in ("tiny_single", "tiny_tp2", "tiny_tp4_ep", "tiny_tp2_ep2"):
        InferenceConfig.from_yaml(CONFIGS / f"{name}.yaml").validate_for_model(tiny)
    from transformers import Qwen3MoeConfig

    real = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
    )
    bench = InferenceConfig.from_yaml(CONFIGS / "qwen3_30b_a3b_bench.yaml").validate_for_model(real)
    assert bench.model_config.with_ckpt is False and bench.model_config.num_hidden_layers == 2
    assert bench.model_config.scheme == ("preset", "qwen3_30b_a3b")


def test_yaml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        InferenceConfig.from_yaml(bad)
    assert "bad.yaml" in str(e.value)


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("scheduler_config:\n  max_new_tokens: 4\n  block_size: 16\n  max_new_tokens: 64\n", "max_new_tokens", (2, 4)),
        ("model_config: {dtype: float32}\ndata_config: {}\nmodel_config: {dtype: bfloat16}\n", "model_config", (1, 3)),
        ("parallel_config: {world_size: 2, world_size: 4}\n", "world_size", (1, 1)),
    ],
)
def test_yaml_duplicate_key_is_refused_naming_the_key_and_both_lines(tmp_path, text, key, lines):
    """PyYAML keeps the last of repeated keys silently; the config refuses them."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"duplicate key {key!r} on line {lines[0]} and again on line {lines[1]}"):
        InferenceConfig.from_yaml(path)


def test_yaml_merge_key_may_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"  # `<<` then an explicit key: YAML's override, not a repeat
    path.write_text("scheduler_config:\n  <<: {max_new_tokens: 4, batch_size: 2}\n  max_new_tokens: 8\n")
    cfg = InferenceConfig.from_yaml(path)
    assert (cfg.scheduler_config.max_new_tokens, cfg.scheduler_config.batch_size) == (8, 2)


# ------------------------------------------------------------------------------------------ file rules


@pytest.mark.parametrize(
    "d, key, fragments",
    [
        # structure
        ({"model_cfg": {}}, "model_cfg", ["unknown section", "allowed sections: model_config, data_config"]),
        ({"model_config": {"path": "x"}}, "model_config.path", ["unknown key", "allowed keys: model_path, exe_mode"]),
        (
            {"parallel_config": {"tp_size": 2}},
            "parallel_config.tp_size",
            ["unknown key", "attn_tp_size", "moe_ep_size", "lmhead_tp_size"],
        ),
        ({"scheduler_config": {"blocksize": 2}}, "scheduler_config.blocksize", ["unknown key", "block_size"]),
        ({"data_config": {"promts": []}}, "data_config.promts", ["unknown key", "prompts"]),
        ({"parallel_config": [1, 2]}, "parallel_config", ["must be a mapping"]),
        # model_config
        ({"model_config": {"model_path": ""}}, "model_config.model_path", ["non-empty string"]),
        ({"model_config": {"model_path": 3}}, "model_config.model_path", ["non-empty string"]),
        ({"model_config": {"model_path": "fixture:"}}, "model_config.model_path", ["followed by a name"]),
        (
            {"model_config": {"exe_mode": "jit"}},
            "model_config.exe_mode",
            ["one of eager, ge_graph, acl_graph", "'jit'"],
        ),
        ({"model_config": {"dtype": "float16"}}, "model_config.dtype", ["one of bfloat16, float32"]),
        ({"model_config": {"tokenizer_mode": "raw"}}, "model_config.tokenizer_mode", ["one of default, chat", "'raw'"]),
        (
            {"parallel_config": {"collective_timeout_s": 0}},
            "parallel_config.collective_timeout_s",
            ["positive number of seconds"],
        ),
        ({"model_config": {"with_ckpt": 1}}, "model_config.with_ckpt", ["must be a boolean"]),
        ({"model_config": {"with_ckpt": "yes"}}, "model_config.with_ckpt", ["must be a boolean"]),
        ({"scheduler_config": {"async_scheduling": "on"}}, "scheduler_config.async_scheduling", ["must be a boolean"]),
        ({"model_config": {"enable_cache_compile": None}}, "model_config.enable_cache_compile", ["must be a boolean"]),
        (
            {"model_config": {"enable_cache_compile": True}},
            "model_config.enable_cache_compile",
            ["needs exe_mode: ge_graph or acl_graph"],
        ),
        ({"model_config": {"trust_compile_cache": "yes"}}, "model_config.trust_compile_cache", ["must be a boolean"]),
        (
            {"model_config": {"trust_compile_cache": True}},
            "model_config.trust_compile_cache",
            ["applies to the compile cache, which is off"],
        ),
        ({"model_config": {"num_hidden_layers": 0}}, "model_config.num_hidden_layers", ["positive integer or null"]),
        (
            {"model_config": {"model_path": "preset:qwen3_30b_a3b"}},
            "model_config.with_ckpt",
            ["must be false", "preset"],
        ),
        # data_config
        ({"data_config": {"dataset": "c4"}}, "data_config.dataset", ["one of prompts, random"]),
        ({"data_config": {"prompts": "hi"}}, "data_config.prompts", ["list of strings"]),
        ({"data_config": {"prompts": ["a", 1]}}, "data_config.prompts", ["list of strings"]),
        ({"data_config": {"prompts": []}}, "data_config.prompts", ["must not be empty"]),
        ({"data_config": {"input_max_len": -5}}, "data_config.input_max_len", ["positive integer", "-5"]),
        ({"data_config": {"seed": -1}}, "data_config.seed", ["non-negative integer"]),
        # parallel_config: types and positivity
        ({"parallel_config": {"world_size": 0}}, "parallel_config.world_size", ["positive integer", "0"]),
        ({"parallel_config": {"world_size": 2.0}}, "parallel_config.world_size", ["positive integer", "float"]),
        ({"parallel_config": {"world_size": True}}, "parallel_config.world_size", ["positive integer", "bool"]),
        ({"parallel_config": {"attn_tp_size": 0}}, "parallel_config.attn_tp_size", ["positive integer"]),
        ({"parallel_config": {"moe_tp_size": "2"}}, "parallel_config.moe_tp_size", ["positive integer", "str"]),
        ({"parallel_config": {"embed_tp_size": -2}}, "parallel_config.embed_tp_size", ["positive integer"]),
        ({"parallel_config": {"lmhead_tp_size": None}}, "parallel_config.lmhead_tp_size", ["positive integer"]),
        # parallel_config: divisibility and the MoE product
        (
            {"parallel_config": {"world_size": 4, "attn_tp_size": 3, "moe_ep_size": 4}},
            "parallel_config.attn_tp_size",
            ["world_size (4) must be divisible by attn_tp_size (3)"],
        ),
        (
            {"parallel_config": {"world_size": 4, "moe_tp_size": 8}},
            "parallel_config.moe_tp_size",
            ["world_size (4) must be divisible by moe_tp_size (8)"],
        ),
        (
            {"parallel_config": {"world_size": 6, "moe_ep_size": 4, "moe_tp_size": 1}},
            "parallel_config.moe_ep_size",
            ["world_size (6) must be divisible by moe_ep_size (4)"],
        ),
        (
            {"parallel_config": {"world_size": 4, "moe_ep_size": 4, "embed_tp_size": 3}},
            "parallel_config.embed_tp_size",
            ["world_size (4) must be divisible by embed_tp_size (3)"],
        ),
        (
            {"parallel_config": {"world_size": 4, "moe_ep_size": 4, "lmhead_tp_size": 8}},
            "parallel_config.lmhead_tp_size",
            ["world_size (4) must be divisible by lmhead_tp_size (8)"],
        ),
        (
            {"parallel_config": {"world_size": 4, "moe_tp_size": 2, "moe_ep_size": 1}},
            "parallel_config.moe_ep_size",
            ["moe_tp_size * moe_ep_size must equal world_size (2 * 1 != 4)"],
        ),
        (
            {"parallel_config": {"world_size": 8, "moe_tp_size": 2, "moe_ep_size": 2}},
            "parallel_config.moe_ep_size",
            ["(2 * 2 != 8)"],
        ),
        # scheduler_config
        ({"scheduler_config": {"batch_size": 0}}, "scheduler_config.batch_size", ["positive integer"]),
        ({"scheduler_config": {"max_new_tokens": 1.5}}, "scheduler_config.max_new_tokens", ["positive integer"]),
        ({"scheduler_config": {"block_size": -128}}, "scheduler_config.block_size", ["positive integer"]),
    ],
)
def test_file_rule_error_names_key_and_rule(d, key, fragments):
    _assert_names(_err(d), key, *fragments)


def test_all_errors_are_reported_together():
    e = _err({"model_config": {"dtype": "fp8", "bogus": 1}, "scheduler_config": {"batch_size": 0}})
    keys = [k for k, _ in e.errors]
    assert keys == ["model_config.bogus", "model_config.dtype", "scheduler_config.batch_size"]


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError, match="mapping of sections"):
        InferenceConfig.from_dict(["model_config"])


# ----------------------------------------------------------------------------------------- model rules


def _model(**over):
    return small_model_shapes(**over)


def _par(**p):
    """Replicated attention unless the test says otherwise (the default derives attention DP from attn_tp < world)."""
    return InferenceConfig.from_dict({"parallel_config": {"attn_dp": False, **p}})


def _model_err(cfg, model) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        cfg.validate_for_model(model)
    return e.value


@pytest.mark.parametrize(
    "par, model, key, fragments",
    [
        (
            dict(world_size=4, attn_tp_size=4, moe_ep_size=4),
            _model(num_attention_heads=6),
            "parallel_config.attn_tp_size",
            ["num_attention_heads (6) must be divisible by attn_tp_size (4)"],
        ),
        (
            dict(world_size=4, attn_tp_size=4, moe_ep_size=4),
            _model(num_key_value_heads=6, num_attention_heads=12),
            "parallel_config.attn_tp_size",
            ["num_key_value_heads (6)", "replicated"],
        ),
        (
            dict(world_size=4, moe_tp_size=4),
            _model(moe_intermediate_size=30),
            "parallel_config.moe_tp_size",
            ["moe_intermediate_size (30) must be divisible by moe_tp_size (4)"],
        ),
        (
            dict(world_size=4, moe_ep_size=4),
            _model(num_experts=6),
            "parallel_config.moe_ep_size",
            ["num_experts (6) must be divisible by moe_ep_size (4)"],
        ),
        (
            dict(world_size=4, moe_ep_size=4, embed_tp_size=4),
            _model(vocab_size=250),
            "parallel_config.embed_tp_size",
            ["vocab_size (250) must be divisible by embed_tp_size (4)", "padding"],
        ),
        (
            dict(world_size=4, moe_ep_size=4, lmhead_tp_size=4),
            _model(vocab_size=250),
            "parallel_config.lmhead_tp_size",
            ["vocab_size (250) must be divisible by lmhead_tp_size (4)", "padding"],
        ),
        (
            dict(world_size=4, moe_tp_size=4),
            _model(intermediate_size=50, mlp_only_layers=[1]),
            "parallel_config.moe_tp_size",
            ["intermediate_size (50) must be divisible by moe_tp_size (4)", "dense MLP"],
        ),
        (
            dict(world_size=4, moe_tp_size=4),
            _model(intermediate_size=50, decoder_sparse_step=2),
            "parallel_config.moe_tp_size",
            ["intermediate_size (50)"],
        ),
    ],
)
def test_model_rule_error_names_key_and_rule(par, model, key, fragments):
    _assert_names(_model_err(_par(**par), model), key, *fragments)


def test_dense_rule_only_applies_when_dense_layers_exist():
    cfg = _par(world_size=4, moe_tp_size=4)
    cfg.validate_for_model(_model(intermediate_size=50))  # all layers sparse: intermediate_size unused
    assert dense_layers(_model(mlp_only_layers=[1, 3])) == [1, 3]
    assert dense_layers(_model(decoder_sparse_step=2)) == [0, 2]
    # a dense layer beyond the num_hidden_layers override does not count
    trunc = InferenceConfig.from_dict(
        {
            "parallel_config": dict(world_size=4, moe_tp_size=4, attn_dp=False),
            "model_config": {"num_hidden_layers": 2, "with_ckpt": False},
        }
    )
    trunc.validate_for_model(_model(intermediate_size=50, mlp_only_layers=[3]))


def test_kv_heads_fewer_than_attn_tp_replicate():
    _par(world_size=8, attn_tp_size=8, moe_ep_size=8).validate_for_model(_model(num_key_value_heads=2))
    _par(world_size=2, attn_tp_size=2, moe_ep_size=2).validate_for_model(_model(num_key_value_heads=4))


def test_layer_override_cannot_exceed_checkpoint():
    cfg = InferenceConfig.from_dict({"model_config": {"num_hidden_layers": 9}})
    _assert_names(_model_err(cfg, _model()), "model_config.num_hidden_layers", "must not exceed", "(4)")
    # random weights: any depth
    InferenceConfig.from_dict({"model_config": {"num_hidden_layers": 9, "with_ckpt": False}}).validate_for_model(
        _model()
    )


# -------------------------------------------------------------------------------- random parallel layouts


def _valid(w, a, t, e, v, lm) -> bool:
    sizes = (a, t, e, v, lm)
    return w >= 1 and all(s >= 1 and w % s == 0 for s in sizes) and t * e == w


@settings(max_examples=60)
@given(
    w=st.integers(-1, 16),
    a=st.integers(0, 16),
    t=st.integers(0, 16),
    e=st.integers(0, 16),
    v=st.integers(0, 16),
    lm=st.integers(0, 16),
)
def test_random_parallel_layouts_accepted_iff_valid(w, a, t, e, v, lm):
    d = {
        "parallel_config": dict(
            world_size=w,
            attn_tp_size=a,
            moe_tp_size=t,
            moe_ep_size=e,
            embed_tp_size=v,
            lmhead_tp_size=lm,
            attn_dp=False,
        )
    }
    if _valid(w, a, t, e, v, lm):
        cfg = InferenceConfig.from_dict(d)
        assert cfg.parallel_config == ParallelConfig(w, a, t, e, v, lm, attn_dp=False)
    else:
        err = _err(d)
        assert err.errors and all(k.startswith("parallel_config.") for k, _ in err.errors)


@st.composite
def valid_layouts(draw):
    w = draw(st.sampled_from([1, 2, 4, 6, 8, 16]))
    divs = [d for d in range(1, w + 1) if w % d == 0]
    t = draw(st.sampled_from(divs))
    return dict(
        world_size=w,
        attn_tp_size=draw(st.sampled_from(divs)),
        moe_tp_size=t,
        moe_ep_size=w // t,
        embed_tp_size=draw(st.sampled_from(divs)),
        lmhead_tp_size=draw(st.sampled_from(divs)),
        attn_dp=False,
    )


@settings(max_examples=40)
@given(valid_layouts())
def test_valid_layouts_always_accepted(p):
    assert InferenceConfig.from_dict({"parallel_config": p}).parallel_config == ParallelConfig(**p)


def test_trust_compile_cache_with_the_cache_on():
    cfg = InferenceConfig.from_dict(
        {"model_config": {"exe_mode": "ge_graph", "enable_cache_compile": True, "trust_compile_cache": True}}
    )
    assert cfg.model_config.trust_compile_cache is True


# ------------------------------------------------------------------------------------ attention data parallel


def _dp(**over) -> dict:
    par = dict(world_size=4, attn_tp_size=2, moe_tp_size=1, moe_ep_size=4, attn_dp=True)
    par.update(over.pop("parallel", {}))
    return {"parallel_config": par, **over}


def test_attn_dp_layout_is_valid_and_sizes_its_groups():
    cfg = InferenceConfig.from_dict(_dp(scheduler_config={"batch_size": 4}))
    assert cfg.parallel_config.attn_dp_size == 2
    assert InferenceConfig.from_dict(_dp(parallel={"attn_dp": False})).parallel_config.attn_dp_size == 1
    for name, dp in (("tiny_attn2dp2_ep4", 2), ("tiny_attn4dp2_ep8", 2)):
        assert InferenceConfig.from_yaml(CONFIGS / f"{name}.yaml").parallel_config.attn_dp_size == dp


@pytest.mark.parametrize(
    "d, key, fragments",
    [
        (_dp(parallel={"attn_dp": "yes"}), "parallel_config.attn_dp", ["must be a boolean"]),
        (_dp(parallel={"attn_tp_size": 4}), "parallel_config.attn_dp", ["attn_tp_size < world_size", "4 / 4"]),
        (_dp(parallel={"moe_tp_size": 2, "moe_ep_size": 2}), "parallel_config.attn_dp", ["moe_tp_size 1", "got 2"]),
        (
            _dp(parallel={"embed_tp_size": 4}),
            "parallel_config.attn_dp",
            ["embed_tp_size (4) to divide attn_tp_size (2)"],
        ),
        (_dp(parallel={"prefill_opt": True}), "parallel_config.prefill_opt", ["cannot be combined with attn_dp"]),
        (
            _dp(scheduler_config={"batch_size": 3}),
            "scheduler_config.batch_size",
            ["(3) must be a multiple of attn_dp_size", "= 2"],
        ),
        (
            _dp(parallel={"world_size": 8, "moe_ep_size": 8}, scheduler_config={"batch_size": 6}),
            "scheduler_config.batch_size",
            ["(6) must be a multiple of attn_dp_size", "= 4"],
        ),
    ],
)
def test_attn_dp_rule_error_names_key_and_rule(d, key, fragments):
    _assert_names(_err(d), key, *fragments)


@pytest.mark.parametrize("exe_mode", ["ge_graph", "acl_graph"])
def test_attn_dp_runs_graph_mode_decode(exe_mode):
    """The recipe's 128ep / PD-decode layouts decode in graph mode under attention DP: accepted as they are."""
    cfg = InferenceConfig.from_dict(_dp(model_config={"exe_mode": exe_mode}, scheduler_config={"batch_size": 4}))
    assert (cfg.model_config.exe_mode, cfg.parallel_config.attn_dp_size) == (exe_mode, 2)


def test_batch_rule_only_applies_with_attn_dp():
    InferenceConfig.from_dict(_dp(parallel={"attn_dp": False}, scheduler_config={"batch_size": 3}))


# ------------------------------------------------------------------------------------- force_eplb


@pytest.mark.parametrize(
    "mc, on",
    [
        ({"force_eplb": True}, True),
        ({"perfect_eplb": True}, True),
        ({"force_eplb": True, "perfect_eplb": True}, True),
        ({"force_eplb": False, "perfect_eplb": False}, False),
        ({}, False),
    ],
)
def test_force_eplb_accepted_and_perfect_eplb_is_its_alias(mc, on):
    cfg = InferenceConfig.from_dict({"model_config": mc})
    assert cfg.model_config.eplb is on
    cfg.validate_for_model(_model(num_experts_per_tok=2))


def test_force_eplb_and_perfect_eplb_disagreeing_are_refused_naming_both():
    _assert_names(
        _err({"model_config": {"force_eplb": True, "perfect_eplb": False}}),
        "model_config.force_eplb",
        "(true) and perfect_eplb (false, its older name) disagree",
    )


@pytest.mark.parametrize("key, value", [("force_eplb", "yes"), ("perfect_eplb", 1), ("force_eplb", None)])
def test_force_eplb_must_be_a_boolean(key, value):
    d = {"model_config": {key: value}}
    if value is None:  # null: not given (false)
        assert InferenceConfig.from_dict(d).model_config.eplb is False
        return
    _assert_names(_err(d), f"model_config.{key}", "must be a boolean (true/false)")


@pytest.mark.parametrize(
    "mc, par, batch, model, key, fragments",
    [
        (
            {"force_eplb": True},
            {},
            1,
            _model(num_experts=8, num_experts_per_tok=9),
            "model_config.force_eplb",
            ["num_experts_per_tok (9) <= num_experts (8)"],
        ),
        (
            {"perfect_eplb": True},
            dict(world_size=2, moe_tp_size=2),
            5,
            _model(num_experts_per_tok=2),
            "model_config.perfect_eplb",
            ["B * num_experts_per_tok must be <= num_experts: B = 5", "batch_size"],
        ),
        (
            {"force_eplb": True, "exe_mode": "ge_graph"},
            dict(world_size=2, moe_tp_size=2),
            3,
            _model(num_experts=6, num_experts_per_tok=2),
            "model_config.force_eplb",
            ["B = 4", "graph bucket"],
        ),
    ],
)
def test_force_eplb_model_rule_error_names_key_and_rule(mc, par, batch, model, key, fragments):
    cfg = InferenceConfig.from_dict(
        {"model_config": mc, "parallel_config": {"attn_dp": False, **par}, "scheduler_config": {"batch_size": batch}}
    )
    _assert_names(_model_err(cfg, model), key, *fragments)


def test_force_eplb_moe_tp_batch_rule_only_with_moe_tp():
    for par in (dict(world_size=2, moe_tp_size=2), dict(world_size=2, moe_ep_size=2)):
        cfg = InferenceConfig.from_dict(
            {
                "model_config": {"force_eplb": True},
                "scheduler_config": {"batch_size": 4},
                "parallel_config": {"attn_dp": False, **par},
            }
        )
        if par.get("moe_tp_size") == 2:
            cfg.validate_for_model(_model(num_experts_per_tok=2))  # 4 * 2 <= 8
            _model_err(cfg, _model(num_experts_per_tok=3))  # 4 * 3 > 8
        else:
            cfg.validate_for_model(_model(num_experts_per_tok=3))  # EP: no such rule
