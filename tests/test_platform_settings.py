"""Per-platform settings (`optimized.platform.PlatformSettings`): the environment and the group options each
platform_version and exe_mode get, applied by `init_distributed` before the default group exists."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, strategies as st

from optimized import platform
from optimized.config import EXE_MODES, PLATFORM_VERSIONS
from optimized.platform import PlatformSettings

VARS = ("TASK_QUEUE_ENABLE", "HCCL_OP_EXPANSION_MODE", "HCCL_BUFFSIZE")


@pytest.fixture
def npu_env(monkeypatch):
    """An NPU host's view, with none of the variables set."""
    monkeypatch.setattr(platform, "backend_name", lambda: "npu")
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(platform, "_APPLIED", None)
    return monkeypatch


# The recipe (hicann/cann-recipes-infer at fbc225d) sets, per (platform_version, exe_mode, device name):
#   TQ   executor/core/config/inference_config.py L223-226 (ModelConfig._validate): TASK_QUEUE_ENABLE=1 for
#        npugraph_ex or any 950, else 2 (acl_graph, the same captured-graph mode here, follows npugraph_ex);
#   AIV  executor/scripts/function.sh L218-226 (set_hccl): HCCL_OP_EXPANSION_MODE=AIV unless platform_version is 950;
#   CCU  executor/core/engine/execution_engine.py L108-115 (_init_device): on 950 the default group's hccl_config
#        hccl_op_expansion_mode 5 when the upper-cased device name holds 950DT, 6 for 950PR, else no options;
#   BUF  executor/utils/hccl_utils.py L99-100 (init_comm_group_by_ranks): on 950 a group's hccl_buffer_size is also
#        exported as HCCL_BUFFSIZE.
# row -> (environment, default group hccl_config, hccl_buffer_size mirrored into HCCL_BUFFSIZE)
A23 = {"HCCL_OP_EXPANSION_MODE": "AIV"}  # AIV
EXPECTED = {
    ("A3", "eager", "Ascend910_9391"): ({"TASK_QUEUE_ENABLE": "2", **A23}, {}, False),  # TQ else-branch, AIV
    ("A3", "ge_graph", "Ascend910_9391"): ({"TASK_QUEUE_ENABLE": "2", **A23}, {}, False),  # TQ: ge_graph is not 1
    ("A3", "npugraph_ex", "Ascend910_9391"): ({"TASK_QUEUE_ENABLE": "1", **A23}, {}, False),  # TQ npugraph_ex
    ("A3", "acl_graph", "Ascend910_9391"): ({"TASK_QUEUE_ENABLE": "1", **A23}, {}, False),  # TQ as npugraph_ex
    ("A2", "eager", "Ascend910B3"): ({"TASK_QUEUE_ENABLE": "2", **A23}, {}, False),  # TQ, AIV
    ("A2", "ge_graph", "Ascend910B3"): ({"TASK_QUEUE_ENABLE": "2", **A23}, {}, False),  # TQ, AIV
    ("A2", "npugraph_ex", "Ascend910B3"): ({"TASK_QUEUE_ENABLE": "1", **A23}, {}, False),  # TQ, AIV
    ("950", "eager", "Ascend950DT"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": 5}, True),  # TQ, CCU, BUF
    ("950", "ge_graph", "Ascend950DT"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": 5}, True),
    ("950", "npugraph_ex", "Ascend950DT"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": 5}, True),
    ("950", "eager", "Ascend950PR"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": 6}, True),  # CCU 950PR
    ("950", "ge_graph", "Ascend950PR"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": 6}, True),
    ("950", "npugraph_ex", "ascend950pr"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": 6}, True),  # upper
    ("950", "eager", "Ascend950"): ({"TASK_QUEUE_ENABLE": "1"}, {}, True),  # CCU: neither name, no options
    ("950", "eager", ""): ({"TASK_QUEUE_ENABLE": "1"}, {}, True),  # the name unreadable: as the recipe, no options
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: "-".join(k) or "unnamed")
def test_each_platform_mode_and_device_gets_the_recipes_environment_and_group_options(npu_env, key):
    env, group, mirror = EXPECTED[key]
    s = PlatformSettings(*key)
    assert s.apply() == env
    assert {name: os.environ[name] for name in VARS if name in os.environ} == env
    assert s.hccl_config(default_group=True) == group
    assert s.hccl_config(512) == {"hccl_buffer_size": 512}
    assert os.environ.get("HCCL_BUFFSIZE") == ("512" if mirror else None)
    assert platform.applied_settings() == s


def test_every_platform_and_recipe_mode_has_a_row():
    recipe_modes = ("eager", "ge_graph", "npugraph_ex")  # inference_config.py L216 (acl_graph: this project's name)
    assert {(v, m) for v, m, _ in EXPECTED} >= {(v, m) for v in PLATFORM_VERSIONS for m in recipe_modes}


def test_the_device_name_is_read_from_the_npu_only_for_a_950(npu_env):
    """Without a name given, a 950 asks torch_npu (`platform.npu_device_name`); A2 / A3 need none."""
    asked = []
    npu_env.setattr(platform, "npu_device_name", lambda: asked.append(1) or "Ascend950PR")
    assert PlatformSettings("950", "eager").hccl_config(default_group=True) == {"hccl_op_expansion_mode": 6}
    assert PlatformSettings("A3", "eager").device_name == "" and len(asked) == 1
    assert "platform 950 (Ascend950PR), eager: TASK_QUEUE_ENABLE=1" in PlatformSettings("950", "eager").describe()


def test_off_the_npu_the_device_name_is_empty(monkeypatch):
    monkeypatch.setattr(platform, "backend_name", lambda: "cpu")
    assert platform.npu_device_name() == ""
    assert PlatformSettings("950", "eager").default_group_hccl_config == {}


@given(version=st.sampled_from(PLATFORM_VERSIONS), mode=st.sampled_from(EXE_MODES))
def test_a_variable_the_user_set_wins_and_nothing_is_set_off_the_npu(version, mode):
    saved = {name: os.environ.pop(name, None) for name in VARS}
    try:
        s = PlatformSettings(version, mode)
        assert s.apply("cpu") == {} and not any(name in os.environ for name in VARS)
        os.environ["TASK_QUEUE_ENABLE"] = "0"
        assert s.apply("npu")["TASK_QUEUE_ENABLE"] == "0"
        assert s.describe().startswith(f"platform {version}, {mode}: TASK_QUEUE_ENABLE=")
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def test_unknown_platform_or_mode_is_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match="platform_version 'A9' is not one of A2, A3, 950"):
        PlatformSettings("A9", "eager")
    with pytest.raises(ValueError, match="exe_mode 'fast' is not one of eager, ge_graph"):
        PlatformSettings("A3", "fast")


def test_init_distributed_applies_the_settings_before_the_group(npu_env):
    """init_distributed applies the settings it is given (950: no HCCL_OP_EXPANSION_MODE in the environment) and
    hands the default group its options; without settings, $PLATFORM_VERSION's."""
    from optimized.distributed import parallel_state

    seen = {}
    npu_env.setattr(platform, "set_device", lambda r: None)
    npu_env.setattr(platform, "dist_backend", lambda: "gloo")
    npu_env.setattr(parallel_state, "_join_store", lambda *a: None)
    npu_env.setattr(
        parallel_state.dist,
        "init_process_group",
        lambda *a, **kw: seen.update(env={n: os.environ.get(n) for n in VARS}, options=kw["pg_options"]),
    )
    npu_env.setattr(parallel_state.dist, "is_initialized", lambda: False)
    parallel_state.init_distributed(
        init_method="file:///dev/null",
        rank=0,
        world_size=2,
        settings=PlatformSettings("950", "ge_graph", "Ascend950DT"),
    )
    assert seen["env"] == {"TASK_QUEUE_ENABLE": "1", "HCCL_OP_EXPANSION_MODE": None, "HCCL_BUFFSIZE": None}
    assert platform.applied_settings() == PlatformSettings("950", "ge_graph", "Ascend950DT")
    for name in VARS:
        npu_env.delenv(name, raising=False)
    npu_env.setenv("PLATFORM_VERSION", "A3")
    parallel_state.init_distributed(init_method="file:///dev/null", rank=0, world_size=2)
    assert seen["env"] == {"TASK_QUEUE_ENABLE": "2", "HCCL_OP_EXPANSION_MODE": "AIV", "HCCL_BUFFSIZE": None}
