"""The graph's gain bound (optimized/benchmarks/graph_gain.py): what it counts as the compiled code's own time, its
arithmetic, and its place in `bench --exe-mode`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from optimized.benchmarks import graph_gain
from optimized.__main__ import main as cli_main


@dataclass
class Event:
    """The fields of a torch.profiler event the bound reads."""

    name: str
    cpu_time_total: float  # microseconds, children included
    cpu_children: list = field(default_factory=list)


def test_compiled_code_is_the_calls_own_time_and_its_buffers():
    matmul = Event("qwen3_moe_cpu::linear", 9000, [Event("mkldnn::_linear_pointwise", 8900)])
    attention = Event("air::npu_fused_infer_attention_score_v2", 2000)
    calls = [
        Event(f"{graph_gain.COMPILED_CALL} abc ##", 12000, [matmul, attention, Event("aten::empty", 100)]),
        Event(f"{graph_gain.COMPILED_CALL} abc ##", 11500, [matmul, attention]),
    ]
    outside = [Event("aten::argmax", 300), Event("npu::npu_grouped_matmul", 5000)]  # not inside a compiled call
    # 12000 - 9000 - 2000 and 11500 - 9000 - 2000: each call's own time, its allocation counted as its own
    assert graph_gain.compiled_code_ms(outside + calls) == pytest.approx([1.0, 0.5])


def test_no_compiled_call_is_an_error_not_a_zero():
    with pytest.raises(RuntimeError, match="no compiled graph ran"):
        graph_gain.profile_compiled_code(lambda: torch.ones(4).sum())


def test_gain_bound_arithmetic_and_its_refusals():
    g = graph_gain.gain_bound(eager_ms=43.0, graph_ms=40.0, compiled_ms=3.0)
    assert g["graph_without_compiled_code_ms_per_token"] == pytest.approx(37.0)
    assert g["eager_over_graph_at_most"] == pytest.approx(43.0 / 37.0)
    for bad in (-0.1, 40.0, 41.0):
        with pytest.raises(ValueError, match="compiled code"):
            graph_gain.gain_bound(eager_ms=43.0, graph_ms=40.0, compiled_ms=bad)


_lib = torch.library.Library("graph_gain_test", "DEF")
_lib.define("opaque(Tensor x) -> Tensor")
_lib.impl("opaque", lambda x: x @ x.T, "CPU")
torch.library.register_fake("graph_gain_test::opaque", lambda x: x.new_empty(x.shape[0], x.shape[0]), lib=_lib)


def test_this_torch_profiles_an_opaque_operator_inside_the_compiled_call():
    """The assumptions the bound rests on, checked against this torch: inductor names its call COMPILED_CALL and an
    operator it cannot trace runs as that call's child, so its time is subtracted."""
    step = torch.compile(lambda x: torch.ops.graph_gain_test.opaque(x.sin() * 2).cos(), fullgraph=True)
    x = torch.randn(64, 64)
    step(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step(x)
    calls = [e for e in prof.events() if e.name.startswith(graph_gain.COMPILED_CALL)]
    assert len(calls) == 3
    for call in calls:  # the fused sin / mul / cos are the call's own code; its children the operator and buffers
        children = {c.name for c in call.cpu_children}
        assert "graph_gain_test::opaque" in children
        assert children - {"graph_gain_test::opaque"} <= graph_gain.WRAPPER_OPS, children

    def opaque_us(call):
        return sum(c.cpu_time_total for c in call.cpu_children if c.name == "graph_gain_test::opaque")

    assert all(opaque_us(call) > 0 for call in calls)
    own = [(call.cpu_time_total - opaque_us(call)) / 1000 for call in calls]
    assert graph_gain.compiled_code_ms(prof.events()) == pytest.approx(own)


def test_bench_graph_mode_reports_the_gain_bound(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    argv = "bench --preset tiny --layers 1 --prompt-len 8 --decode-steps 2 --warmup 0 --repeats 1"
    argv += f" --dtype float32 --skip-hf --exe-mode ge_graph --json {out_json}"
    assert cli_main(argv.split()) == 0
    out = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    bound = report["graph"]["gain_bound"]
    graph_ms = report["results"]["graph"]["decode_ms_per_token"]["median"]
    eager_ms = report["results"]["optimized"]["decode_ms_per_token"]["median"]
    assert 0 < bound["compiled_code_ms_per_token"] < graph_ms
    assert bound["eager_over_graph_at_most"] == pytest.approx(
        eager_ms / (graph_ms - bound["compiled_code_ms_per_token"])
    )
    assert f"eager / graph decode is at most {bound['eager_over_graph_at_most']:.2f}x" in out
