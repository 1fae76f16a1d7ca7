"""Per-platform settings (`optimized.platform.PlatformSettings`): the environment and the group options each
platform_version and exe_mode get, applied by `init_distributed` before the default group exists."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, strategies as st

from optimized import platform
from optimized.config import EXE_MODES, PLATFORM_VERSIONS
from optimized.platform import HCCL_OP_EXPANSION_AIV, PlatformSettings

VARS = ("TASK_QUEUE_ENABLE", "HCCL_OP_EXPANSION_MODE", "HCCL_BUFFSIZE")


@pytest.fixture
def npu_env(monkeypatch):
    """An NPU host's view, with none of the variables set."""
    monkeypatch.setattr(platform, "backend_name", lambda: "npu")
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(platform, "_APPLIED", None)
    return monkeypatch


# (platform, exe_mode) -> environment, default group hccl_config, hccl_buffer_size mirrored into HCCL_BUFFSIZE
EXPECTED = {
    ("A3", "eager"): ({"TASK_QUEUE_ENABLE": "2", "HCCL_OP_EXPANSION_MODE": "AIV"}, {}, False),
    ("A3", "ge_graph"): ({"TASK_QUEUE_ENABLE": "1", "HCCL_OP_EXPANSION_MODE": "AIV"}, {}, False),
    ("A2", "eager"): ({"TASK_QUEUE_ENABLE": "2", "HCCL_OP_EXPANSION_MODE": "AIV"}, {}, False),
    ("950", "eager"): ({"TASK_QUEUE_ENABLE": "2"}, {"hccl_op_expansion_mode": HCCL_OP_EXPANSION_AIV}, True),
    ("950", "npugraph_ex"): ({"TASK_QUEUE_ENABLE": "1"}, {"hccl_op_expansion_mode": HCCL_OP_EXPANSION_AIV}, True),
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: "-".join(k))
def test_each_platform_gets_its_environment_and_group_options(npu_env, key):
    env, group, mirror = EXPECTED[key]
    s = PlatformSettings(*key)
    assert s.apply() == env
    assert {name: os.environ[name] for name in VARS if name in os.environ} == env
    assert s.hccl_config(default_group=True) == group
    assert s.hccl_config(512) == {"hccl_buffer_size": 512}
    assert os.environ.get("HCCL_BUFFSIZE") == ("512" if mirror else None)
    assert platform.applied_settings() == s


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
        init_method="file:///dev/null", rank=0, world_size=2, settings=PlatformSettings("950", "ge_graph")
    )
    assert seen["env"] == {"TASK_QUEUE_ENABLE": "1", "HCCL_OP_EXPANSION_MODE": None, "HCCL_BUFFSIZE": None}
    assert platform.applied_settings() == PlatformSettings("950", "ge_graph")
    for name in VARS:
        npu_env.delenv(name, raising=False)
    npu_env.setenv("PLATFORM_VERSION", "A3")
    parallel_state.init_distributed(init_method="file:///dev/null", rank=0, world_size=2)
    assert seen["env"] == {"TASK_QUEUE_ENABLE": "2", "HCCL_OP_EXPANSION_MODE": "AIV", "HCCL_BUFFSIZE": None}
