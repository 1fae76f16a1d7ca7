"""The optimized model makes only the `torch.ops.npu` calls that equivalence/spec/recorded_npu_calls.json lists.

The NPU replay tests (equivalence/npu/test_npu_replay.py) prove exactly the listed calls on torch_npu, so a call the
file lacks is a call no NPU test has seen: re-recording the single-process configurations (fp32, bf16, W4A8, W8A8)
must give a subset of the file. The multi-rank configurations are recorded by the regeneration command only.
"""

from __future__ import annotations

import pytest
import torch

from equivalence.npu.record_npu_calls import (
    COMMUNICATOR,
    CONFIGURATIONS,
    MC2_OPS,
    REGENERATE,
    SINGLE_PROCESS,
    NpuCallRecorder,
    call_key,
    load_recording,
    record,
    signature,
)


@pytest.mark.parametrize("config", SINGLE_PROCESS, ids=lambda c: c.name)
def test_model_makes_only_recorded_npu_calls(config):
    listed = load_recording()
    calls, _ = record(config)
    assert calls, f"{config.name}: no torch.ops.npu call was recorded (is the recorder seeing the model?)"
    missing = [call for key, call in calls.items() if key not in listed]
    assert not missing, (
        f"{config.name}: {len(missing)} torch.ops.npu call(s) not in the recording (no NPU test "
        f"replays them); regenerate with `{REGENERATE}` and review the diff:\n"
        + "\n".join(call_key(c) for c in missing[:5])
    )
    mine = [c for c in listed.values() if config.name in c["configurations"]]
    assert {call_key(c) for c in mine} == set(calls), f"{config.name}: the recording is stale; run `{REGENERATE}`"


def test_recording_lists_every_configuration_and_the_sp_exchanges():
    listed = load_recording().values()
    seen = {name for call in listed for name in call["configurations"]}
    assert seen == {c.name for c in CONFIGURATIONS}
    re_routing = [c["args"] for c in listed if c["op"] == "npu_moe_re_routing"]
    assert re_routing and all(a["tokens"]["dtype"] in ("bfloat16", "float16", "int8") for a in re_routing), (
        "the double-routing exchange must hand npu_moe_re_routing only dtypes the NPU kernel takes"
    )
    mc2 = [c for c in listed if c["op"] in MC2_OPS]
    assert {c["args"]["ep_world_size"] for c in mc2} == {2, 4}, "MC2 decode over SP (2 ranks) and attention DP (4)"
    assert all(c["args"][g] == COMMUNICATOR for c in mc2 for g in ("group_ep", "group_tp")), (
        "a job's communicator name in the recording makes it depend on which groups its workers made before"
    )
    fp8_kv = {name for c in listed if c["op"] == "npu_dynamic_quant" for name in c["configurations"]}
    assert fp8_kv == {c.name for c in CONFIGURATIONS if c.kv_cache == "fp8"}, "only the FP8 KV cache quantizes K/V"


def test_signature_names_positional_and_keyword_arguments_alike():
    x, gamma = torch.ones(3, 8), torch.ones(8)
    with NpuCallRecorder() as by_position:
        torch.ops.npu.npu_rms_norm(x, gamma, 1e-6)
    with NpuCallRecorder() as by_keyword:
        torch.ops.npu.npu_rms_norm(x, gamma=gamma, epsilon=1e-6)
    with NpuCallRecorder() as by_default:
        torch.ops.npu.npu_rms_norm(x, gamma)
    assert list(by_position.calls) == list(by_keyword.calls) == list(by_default.calls)
    (call,) = by_position.calls.values()
    assert call == signature(torch.ops.npu.npu_rms_norm.default, (x, gamma), {"epsilon": 1e-6})
    assert call["args"]["self"] == {"dtype": "float32", "shape": [3, 8], "stride": [8, 1]}
    assert call["args"]["epsilon"] == 1e-6


@pytest.mark.parametrize("config", CONFIGURATIONS, ids=lambda c: c.name)
def test_build_time_operator_check_requires_exactly_the_recorded_operators(config):
    """The operators the build checks (plus the FP8 KV cache's, which the runner checks) are exactly those the
    configuration is recorded calling."""
    from fixtures.tiny import tiny_config
    from optimized.layers.quantization.schemes import scheme_row
    from optimized.model_loader.build import operators_for
    from optimized.ops.required import FP8_KV_CACHE

    recorded = {c["op"] for c in load_recording().values() if config.name in c["configurations"]}
    paths = config.paths()
    assert paths.ep_scheme == (config.scheme or ("alltoall" if config.attn_dp else None)), paths
    checked = operators_for(paths, scheme_row(config.quant), tiny_config(config.fixture)) | (
        FP8_KV_CACHE if config.kv_cache == "fp8" else frozenset()
    )
    assert checked == recorded, (
        f"checked, not called: {sorted(checked - recorded)}; called, not checked: {sorted(recorded - checked)}"
    )


def test_an_npu_can_replay_sp_and_dp_mc2_calls_within_the_kernels_hidden_size():
    """The tiny fixtures' hidden 64 is below the A3 MC2 kernels' 1024: an SP and a DP recording on a fixture within
    the limit (`tiny-h1024`) give the NPU MC2 replay calls the real kernels take."""
    from equivalence.npu.record_npu_calls import mc2_configurations
    from fixtures.tiny import tiny_config
    from optimized.distributed.decode_plan import MC2_HIDDEN

    within = [c for c in mc2_configurations() if MC2_HIDDEN[0] <= tiny_config(c.fixture).hidden_size <= MC2_HIDDEN[1]]
    assert {("dp" if c.attn_dp else "sp") for c in within} == {"sp", "dp"}, [c.name for c in within]
    listed = load_recording().values()
    for c in within:
        shapes = {
            tuple(call["args"]["x"]["shape"])
            for call in listed
            if call["op"] == "npu_moe_distribute_dispatch_v2" and c.name in call["configurations"]
        }
        assert shapes and all(s[1] == tiny_config(c.fixture).hidden_size for s in shapes), (c.name, shapes)
