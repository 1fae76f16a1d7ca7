"""On an NPU: every recorded `torch.ops.npu` call (equivalence/spec/recorded_npu_calls.json) on torch_npu equals the
portable kernel, and the optimized model on the NPU computes what the reference computes on the CPU.

The replayed data are the seeded ones the model itself passes: the recording configurations run again on the CPU
(portable kernels, `NpuCallRecorder(capture=True)`), keeping each distinct call's arguments; each is then run by
torch_npu on the NPU and by the portable kernel on the CPU. Comparison (spec npu_ops_moe.md §0, mx_quant.md
§6): pure data movement and MX quantization of a given tensor bitwise; the fused MX norms and SwiGLU within one
element step of the decoded values (their pre-quantization tensor may differ by 1 bf16 ulp); other floats by the
tolerance table; regions the NPU leaves unwritten masked out. Skips only by what is known before any call: no
NPU (root conftest), a W4A8 call on a SoC other than Ascend 950 (the MX kernels' hardware), an MC2 collective
(dispatch / combine: replayed as a W-rank job by `test_recorded_mc2_on_torch_npu_equals_the_portable_kernels`,
equivalence/npu/mc2_replay.py), fewer NPUs than that job's ranks. A kernel error fails.
"""

from __future__ import annotations

import functools

import pytest
import torch

from equivalence.npu.record_npu_calls import (
    CONFIGURATIONS,
    MC2_OPS,
    REGENERATE,
    load_recording,
    mc2_configurations,
    record,
)
from equivalence.support.compare import assert_bitwise_equal, assert_close, op_tolerance, tolerance
from fixtures.tiny import tiny_config
from optimized.distributed.decode_plan import MC2_HIDDEN

pytestmark = pytest.mark.npu

RECORDED = sorted(load_recording().items(), key=lambda kv: (kv[1]["op"], kv[0]))
BITWISE = {
    "npu_moe_init_routing_v2",
    "npu_moe_re_routing",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "npu_dynamic_mx_quant",
    "npu_format_cast",
}  # the NZ cast keeps every value
MX_FUSED = {
    "npu_rms_norm_dynamic_mx_quant": (0, 1),
    "npu_add_rms_norm_dynamic_mx_quant": (0, 2),
    "npu_swiglu_mx_quant": (0, 1),
}  # (element output, scale output)
NORMS = {"npu_rms_norm", "npu_add_rms_norm", "npu_add_rms_norm_cast"}
W4A8_CONFIGS = {c.name for c in CONFIGURATIONS if c.w4a8}


def _host():
    from optimized.benchmarks.budgets import this_host

    return this_host()


def _is_950() -> bool:
    return "950" in _host().soc


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=None)
def _captured() -> dict:
    """key -> (op, args, kwargs): the first call of each signature, from every recording configuration."""
    out = {}
    for config in CONFIGURATIONS:
        for key, value in record(config, capture=True)[1].items():
            out.setdefault(key, value)
    return out


def _unwritten(op: str, kwargs: dict, outputs: list) -> dict[int, int | None]:
    """output index -> rows the NPU writes (None: the whole output is unspecified)."""
    if op == "npu_moe_init_routing_v2":
        valid = int(outputs[2].sum())
        return {0: valid, 3: valid if kwargs.get("scale") is not None else None}
    if op == "npu_moe_re_routing" and kwargs.get("per_token_scales") is None:
        return {1: None}
    if op == "npu_fused_infer_attention_score_v2" and not kwargs.get("return_softmax_lse"):
        return {1: None}
    if op.startswith("npu_grouped_matmul") and kwargs.get("group_list") is not None:
        groups = torch.as_tensor(kwargs["group_list"])
        return {0: int(groups.sum() if kwargs.get("group_list_type") == 1 else groups[-1])}
    if op in ("npu_rms_norm_dynamic_mx_quant", "npu_add_rms_norm_dynamic_mx_quant"):
        return {2 if op == "npu_rms_norm_dynamic_mx_quant" else 3: None}  # rstd: callers must not read it
    return {}


def _compare(op: str, kwargs: dict, got: list, want: list, what: str) -> None:
    from equivalence.ops.mx_oracle import fmt_name
    from equivalence.support.mx_decode import _decoded_close_within_one_step

    skip = _unwritten(op, kwargs, want)
    mx = MX_FUSED.get(op)
    if mx is not None:
        _decoded_close_within_one_step(
            got[mx[0]], got[mx[1]], want[mx[0]], want[mx[1]], fmt_name(kwargs.get("dst_type", 296))
        )
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if i in skip and skip[i] is None or (mx is not None and i in mx):
            continue
        rows = skip.get(i)
        a, b = (a, b) if rows is None else (a[:rows], b[:rows])
        name = f"{what} output {i}"
        if op in BITWISE or not b.dtype.is_floating_point or b.dtype.itemsize == 1:
            assert_bitwise_equal(a, b, name)
        elif op in NORMS or op in MX_FUSED:
            rstd = b.dtype == torch.float32 and b.dim() > 0 and b.shape[-1] == 1
            assert_close(a, b, tolerance("op.norm.rstd" if rstd else f"op.norm.{str(b.dtype)[6:]}"), name)
        else:
            assert_close(a, b, op_tolerance(b.dtype), name)


def test_the_recording_is_what_the_model_calls():
    captured = _captured()
    assert set(captured) == {key for key, _ in RECORDED}, f"the recording is stale: run `{REGENERATE}`"


@pytest.mark.parametrize("key, call", RECORDED, ids=[f"{c['op']}-{i}" for i, (_, c) in enumerate(RECORDED)])
def test_recorded_call_on_torch_npu_equals_the_portable_kernel(key, call, monkeypatch):
    from optimized.ops.registry import portable_kernel

    if call["op"] in MC2_OPS:  # a collective over ep_world_size ranks, with communicator names and opaque handles
        pytest.skip(
            f"{call['op']} is replayed as an ep_world_size-rank job on hccl by "
            "test_recorded_mc2_on_torch_npu_equals_the_portable_kernels (one process cannot run it)"
        )
    if set(call["configurations"]) <= W4A8_CONFIGS and not _is_950():
        pytest.skip(f"W4A8 call: the MX kernels run on Ascend 950; this host: {_host().describe()}")
    if _is_950():
        monkeypatch.setenv("NPU_GOLDEN_SOC", "950")
    op, args, kwargs = _captured()[key]
    name, _, overload = op.partition(".")
    npu_op = getattr(getattr(torch.ops.npu, name), overload or "default")
    want = portable_kernel(op)(*_map(args, torch.clone), **_map(kwargs, torch.clone))
    got = npu_op(*_map(args, lambda t: t.to("npu")), **_map(kwargs, lambda t: t.to("npu")))

    def as_list(out):
        return list(out) if isinstance(out, (list, tuple)) else [out]

    _compare(op, kwargs, _map(as_list(got), lambda t: t.cpu()), as_list(want), f"{op} ({call['configurations']})")


@pytest.mark.parametrize("config", mc2_configurations(), ids=lambda c: c.name)
def test_recorded_mc2_on_torch_npu_equals_the_portable_kernels(config):
    """Each rank's first MC2 dispatch and combine of a multi-rank recording, on W NPUs over hccl (a fresh group
    with the MC2 HCCL window, its HCCL communicator name in place of the recorded gloo name, the combine fed this
    job's own dispatch handles): expand_x[:n_recv] and expert_token_nums bitwise the portable kernel's, the
    combine within the op tolerance (equivalence/npu/mc2_replay.py)."""
    from equivalence.npu import mc2_replay

    world = config.layout()["moe_ep_size"]
    hidden = tiny_config(config.fixture).hidden_size
    if not MC2_HIDDEN[0] <= hidden <= MC2_HIDDEN[1]:
        pytest.skip(
            f"{config.name}: hidden_size {hidden} is outside the A3 MC2 kernels' {MC2_HIDDEN} (replayed on "
            f"the CPU only, tests/test_mc2_replay.py); the *-h1024 configurations replay here"
        )
    if torch.npu.device_count() < world:
        pytest.skip(
            f"{config.name}: the MC2 replay needs {world} NPUs (one per EP rank); {torch.npu.device_count()} visible"
        )
    captures = mc2_replay.capture(config)  # on the CPU: gloo ranks, portable kernels
    assert captures[0].world == world
    # Spawned, not forked: this process may hold an NPU context already, which a forked child cannot use.
    assert mc2_replay.run_on_spawned_ranks(world, mc2_replay.replay_task, captures, timeout=300) == ["ok"] * world


@pytest.mark.parametrize("fixture, w4a8", [("tiny", False), ("tiny", True)], ids=["bfloat16", "w4a8"])
def test_optimized_model_on_the_npu_equals_the_reference_on_the_cpu(fixture, w4a8):
    from equivalence.support.logits_runs import _logits_task, assert_bf16_logits_match_replayed_reference
    from equivalence.support.strategies import layout
    from equivalence.support.w4a8_reference import fake_quant_reference
    from fixtures.checkpoints import checkpoint, w4a8_checkpoint

    if w4a8 and not _is_950():
        pytest.skip(f"W4A8 runs on Ascend 950; this host: {_host().describe()}")
    prompts, forced = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]], [[7, 8], [2, 4]]
    path = (w4a8_checkpoint if w4a8 else checkpoint)(fixture)
    got = _map(_logits_task(0, 1, path, layout(1), "bfloat16", prompts, forced, device="npu"), lambda t: t.cpu())
    if w4a8:
        assert_bf16_logits_match_replayed_reference(
            got,
            fixture,
            prompts,
            forced,
            "W4A8 on the NPU",
            replayed_ref=fake_quant_reference(fixture),
            tol="model.w4a8.bfloat16",
            near_tie="router_tie.float32",
            ties_from_router_inputs=True,
        )
    else:
        assert_bf16_logits_match_replayed_reference(got, fixture, prompts, forced, "bf16 on the NPU")
