"""One table of environment variables (optimized/envs.py): no other module of `optimized` reads (or writes) the
environment, and each accessor parses its variable or refuses it with one message naming variable, value and what
is allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from optimized import envs
from optimized.errors import UsageError

PACKAGE = Path(envs.__file__).resolve().parent
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _env_uses(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES:
            uses.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in ENV_NAMES:
            uses.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.id}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENV_NAMES:
            uses.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from os import ...")
    return uses


def test_no_module_but_envs_touches_the_environment():
    uses = [use for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "envs.py" for use in _env_uses(path)]
    assert not uses, "read environment variables through optimized.envs (add them to its table):\n" + "\n".join(uses)


def test_the_scan_sees_reads():
    source = "import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\nc = environ['Z']\n"
    tree_file = PACKAGE.parent / "tests" / "_env_scan_probe.py"
    try:
        tree_file.write_text(source)
        PACKAGE_PARENT_USES = _env_uses(tree_file)
    finally:
        tree_file.unlink()
    assert len(PACKAGE_PARENT_USES) == 4


def test_every_table_entry_is_documented():
    for name, v in envs.READ.items():
        assert name == v.name and v.type and v.default and v.meaning and v.readers, name
    assert set(envs.WRITTEN) == {"TASK_QUEUE_ENABLE", "HCCL_OP_EXPANSION_MODE", "HCCL_BUFFSIZE"}


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="not in optimized.envs.READ"):
        envs._raw("SOME_OTHER_VARIABLE")
    with pytest.raises(KeyError, match="not in optimized.envs.WRITTEN"):
        envs.set_default("SOME_OTHER_VARIABLE", "1")


@pytest.fixture
def clean(monkeypatch):
    for name in envs.READ:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean):
    assert envs.world_size() is None and envs.rank() is None and envs.local_rank() is None
    assert envs.master_addr() is None and envs.master_port() is None and not envs.torchelastic_agent_store()
    assert envs.collective_timeout_s() is None and envs.platform_version() == "A3"
    assert not envs.force_portable() and envs.cpu_prepack()
    assert envs.strict_npu_limits() == "0" and envs.npu_golden_soc() == "a2a3"
    assert envs.preset_cache() == Path.home() / ".cache" / "qwen3-moe-npu" / "presets"
    assert envs.compile_cache_key() == Path.home() / ".config" / "qwen3-moe-npu" / "compile_cache.key"
    assert envs.case_name() is None and envs.latency_checkpoint() is None


@pytest.mark.parametrize(
    "name, value, accessor, expected",
    [
        ("WORLD_SIZE", "4", envs.world_size, 4),
        ("WORLD_SIZE", " 2 ", envs.world_size, 2),
        ("WORLD_SIZE", "", envs.world_size, None),  # empty counts as unset
        ("RANK", "0", envs.rank, 0),
        ("LOCAL_RANK", "3", envs.local_rank, 3),
        ("MASTER_PORT", "29500", envs.master_port, "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True", envs.torchelastic_agent_store, True),
        ("QWEN3_MOE_COLLECTIVE_TIMEOUT_S", "2.5", envs.collective_timeout_s, 2.5),
        ("PLATFORM_VERSION", "950", envs.platform_version, "950"),
        ("QWEN3_MOE_FORCE_PORTABLE", "1", envs.force_portable, True),
        ("QWEN3_MOE_CPU_PREPACK", "0", envs.cpu_prepack, False),
        ("QWEN3_MOE_STRICT_NPU_LIMITS", "route", envs.strict_npu_limits, "route"),
        ("NPU_GOLDEN_SOC", "950", envs.npu_golden_soc, "950"),
        ("QWEN3_MOE_PRESET_CACHE", "/tmp/presets", envs.preset_cache, Path("/tmp/presets")),
        ("CASE_NAME", "my-case_1.x", envs.case_name, "my-case_1.x"),
        ("QWEN3_MOE_LATENCY_CHECKPOINT", "/ckpt", envs.latency_checkpoint, "/ckpt"),
    ],
)
def test_values(clean, name, value, accessor, expected):
    clean.setenv(name, value)
    assert accessor() == expected


@pytest.mark.parametrize(
    "name, value, accessor, allowed",
    [
        ("TORCHELASTIC_USE_AGENT_STORE", "yes", envs.torchelastic_agent_store, "'True', 'False'"),
        ("QWEN3_MOE_COLLECTIVE_TIMEOUT_S", "0", envs.collective_timeout_s, "a positive number of seconds"),
        ("QWEN3_MOE_COLLECTIVE_TIMEOUT_S", "soon", envs.collective_timeout_s, "a positive number of seconds"),
        ("QWEN3_MOE_COLLECTIVE_TIMEOUT_S", "inf", envs.collective_timeout_s, "a positive number of seconds"),
        ("PLATFORM_VERSION", "A5", envs.platform_version, "'A2', 'A3', '950'"),
        ("QWEN3_MOE_FORCE_PORTABLE", "yes", envs.force_portable, "'0', '1'"),
        ("QWEN3_MOE_CPU_PREPACK", "off", envs.cpu_prepack, "'0', '1'"),
        ("QWEN3_MOE_STRICT_NPU_LIMITS", "yes", envs.strict_npu_limits, "'0', '1', 'route'"),
        ("NPU_GOLDEN_SOC", "910", envs.npu_golden_soc, "'a2a3', '950'"),
    ],
)
def test_bad_values_name_variable_value_and_what_is_allowed(clean, name, value, accessor, allowed):
    clean.setenv(name, value)
    with pytest.raises(envs.EnvError) as e:
        accessor()
    assert str(e.value) == f"environment variable {name}={value!r}; allowed: {allowed}" or str(e.value).startswith(
        f"environment variable {name}={value!r}; allowed: {allowed}"
    )
    assert isinstance(e.value, UsageError) and isinstance(e.value, ValueError)
    assert (e.value.name, e.value.value) == (name, value)


@pytest.mark.parametrize(
    "name, value, accessor, allowed",
    [
        ("WORLD_SIZE", "two", envs.world_size, "an integer >= 1"),
        ("WORLD_SIZE", "0", envs.world_size, "an integer >= 1"),
        ("RANK", "-1", envs.rank, "an integer >= 0"),
        ("LOCAL_RANK", "x", envs.local_rank, "an integer >= 0"),
    ],
)
def test_bad_launch_values_keep_the_launch_wording(clean, name, value, accessor, allowed):
    clean.setenv(name, value)
    with pytest.raises(envs.LaunchEnvError) as e:
        accessor()
    assert str(e.value) == f"environment variable {name} must be {allowed}, got {value!r} (torchrun sets it)"
    assert isinstance(e.value, UsageError) and isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)


def test_case_name_keeps_the_compile_cache_rule(clean):
    from optimized.config import InferenceConfig
    from optimized.executor.assembly import open_compile_cache

    cfg = InferenceConfig.from_dict({"model_config": {"exe_mode": "ge_graph", "enable_cache_compile": True}})
    clean.setenv("CASE_NAME", "../elsewhere")
    with pytest.raises(
        envs.EnvError,
        match=r"^environment variable CASE_NAME '\.\./elsewhere' must be a plain "
        r"directory name",
    ):
        open_compile_cache(cfg)


def test_world_size_is_one_rule_for_every_reader(clean):
    """The launch check, init_distributed and ParallelState refuse a bad WORLD_SIZE with the same message."""
    from optimized.config import ParallelConfig
    from optimized.distributed.parallel_state import ParallelState, init_distributed
    from optimized.executor.assembly import check_launch

    clean.setenv("WORLD_SIZE", "two")
    message = r"^environment variable WORLD_SIZE must be an integer >= 1, got 'two' \(torchrun sets it\)$"
    for call in (
        lambda: check_launch(1, "generate"),
        init_distributed,
        lambda: ParallelState.build(ParallelConfig(), 0),
    ):
        with pytest.raises(envs.EnvError, match=message):
            call()


def test_reads_happen_at_call_time(clean):
    from optimized.ops.validation import soc_variant, strict_npu_limits

    assert soc_variant() == "a2a3" and not strict_npu_limits()
    clean.setenv("NPU_GOLDEN_SOC", "950")
    clean.setenv("QWEN3_MOE_STRICT_NPU_LIMITS", "1")
    assert soc_variant() == "950" and strict_npu_limits("dims")
