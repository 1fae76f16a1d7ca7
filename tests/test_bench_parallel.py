"""`python -m optimized bench --world-size N`: TP vs SP prefill layouts and TP vs MC2 decode layouts over real
processes in one run, the bytes of each collective beside the formula."""
from __future__ import annotations

import json

import pytest

from optimized.__main__ import main as cli_main


def test_bench_world_size_2_reports_tp_and_both_sp_schemes_and_both_decode_layouts(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    # batch 3 over 2 EP ranks: n = 2 tokens each, the second rank's tail masked
    assert cli_main(["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "9", "--batch", "3", "--warmup",
                     "0", "--repeats", "1", "--decode-steps", "2", "--dtype", "float32", "--world-size", "2",
                     "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for needle in ("prefill over 2 processes", "sp-allgather", "sp-alltoall", "vs tp (best)", "MoE layer 0",
                   "decode over 2 processes", "npu_moe_distribute_dispatch_v2", "HCCL buffer >= 3 MB"):
        assert needle in out, needle
    assert out.count("every rank, every MoE layer: measured == formula: yes") == 2, out
    report = json.loads(out_json.read_text())
    layouts = report["layouts"]
    assert list(layouts) == ["tp", "sp-allgather", "sp-alltoall"]
    assert [v["scheme"] for v in layouts.values()] == [None, "allgather", "alltoall"]
    for name, v in layouts.items():
        assert len(v["prefill_ms"]) == 1 and v["prefill_ms"][0] > 0 and v["bytes_per_rank"] > 0, name
    for name in ("sp-allgather", "sp-alltoall"):
        (moe,) = layouts[name]["moe_rank0"]          # one layer, one MoE layer
        assert moe["measured"] == moe["formula"] > 0, (name, moe)

    decode = report["decode"]
    assert list(decode) == ["tp", "mc2"]
    assert [v["exchange"] for v in decode.values()] == ["MoeInferTP", "MoeInferDispatchCombine"]
    assert decode["tp"]["sizes"] == dict(attn_tp_size=2, moe_tp_size=2, moe_ep_size=1)
    assert decode["mc2"]["sizes"] == dict(attn_tp_size=2, moe_tp_size=1, moe_ep_size=2)
    ops = {"tp": {"all_reduce"},
           "mc2": {"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "all_gather"}}
    for name, v in decode.items():
        assert len(v["decode_ms"]) == 2 and min(v["decode_ms"]) > 0, name      # 1 repeat x 2 steps
        assert len(v["moe"]) == len(v["step_bytes"]) == 2, name                # both ranks
        for rank, logs in enumerate(v["moe"]):
            (moe,) = logs                                                      # one MoE layer, one decode step
            assert set(moe["formula"]) == ops[name], (name, moe)
            assert moe["measured"] == moe["formula"], (name, rank, moe)       # every collective, to the byte
            # the exchange's bytes are part of the step's, collective by collective
            for op, b in moe["measured"].items():
                assert v["step_bytes"][rank][op] >= b, (name, rank, op)
        assert moe["measured"]["all_reduce" if name == "tp" else "all_gather"] > 0, (name, moe)
    # tp: the [3, 64] fp32 partial sums all-reduced over 2 ranks, 2 * 1/2 of 768 B
    assert decode["tp"]["moe"][0][0]["measured"] == {"all_reduce": 768}
    # mc2: rank 0 sends 2 tokens' and rank 1 one token's slots; every rank's counts (L 8 + BS) to the other
    for rank, logs in enumerate(decode["mc2"]["moe"]):
        assert logs[0]["measured"]["npu_moe_distribute_dispatch_v2"] >= 9 * 8, (rank, logs)
        assert logs[0]["measured"]["all_gather"] == 2 * 64 * 4, (rank, logs)   # n = 2 rows of 64 fp32
    combined = sum(logs[0]["measured"]["npu_moe_distribute_combine_v2"] for logs in decode["mc2"]["moe"])
    dispatched = sum(logs[0]["measured"]["npu_moe_distribute_dispatch_v2"] - 9 * 8 for logs in decode["mc2"]["moe"])
    assert dispatched == combined // (64 * 4) * (64 * 4 + 8), (dispatched, combined)  # every row goes back
    formula = report["decode_formula"]
    assert formula["moe_layers"] == 2 and set(formula["layouts"]) == {"tp", "mc2"}      # the fixture's depth
    assert formula["layouts"]["tp"]["hccl_buffer_mb"] is None and formula["layouts"]["mc2"]["hccl_buffer_mb"] == 3


def test_bench_world_size_must_fit_the_model(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--preset", "tiny", "--world-size", "3"])
    assert "--world-size 3 must divide the model's num_attention_heads (8)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size must be >= 1; got 0"),
    (["--world-size", "-2"], "--world-size must be >= 1; got -2"),
    (["--world-size", "32"], "--world-size 32 must divide the model's num_attention_heads (8)"),
    (["--formula-only"], "--formula-only needs --world-size > 1; got 1"),
])
def test_bench_bad_world_size_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--preset", "tiny", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_formula_only_qwen3_235b_runs_nothing(tmp_path, capsys):
    from optimized.benchmarks.common import bench_config
    from optimized.config import ParallelConfig
    from optimized.distributed import decode_plan

    out_json = tmp_path / "formula.json"
    assert cli_main(["bench", "--preset", "qwen3_235b_a22b", "--world-size", "16", "--batch", "64",
                     "--formula-only", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    config = bench_config("qwen3_235b_a22b", 94)
    mc2 = ParallelConfig(world_size=16, attn_tp_size=16, moe_tp_size=1, moe_ep_size=16, embed_tp_size=16,
                         lmhead_tp_size=16)
    # EP 16, batch 64: n = 4, L = 8; uniform: 30 slots of 4096 bf16 (+ 8 B) out and in, 15 * 4 rows gathered
    layer = {decode_plan.DISPATCH: 15 * 9 * 8 + 30 * 8200, decode_plan.COMBINE: 30 * 8192, "all_gather": 15 * 4 * 8192}
    assert decode_plan.decode_volume(mc2, 64, 4096, 8, 128, 2).parts == layer
    assert decode_plan.step_volume(config, mc2, 64, 2).total == 94 * sum(layer.values())
    assert "94 MoE layers" in out, out
    assert (f"mc2    per layer: npu_moe_distribute_dispatch_v2 {layer[decode_plan.DISPATCH]:,d} B, "
            f"npu_moe_distribute_combine_v2 {layer[decode_plan.COMBINE]:,d} B, all_gather "
            f"{layer['all_gather']:,d} B = {sum(layer.values()):,d} B; per decode step: "
            f"{94 * sum(layer.values()):,d} B; HCCL buffer >= 11 MB (HCCL_BUFFSIZE)") in out, out
    # tp: [64, 4096] bf16 all-reduced over 16 ranks, 2 * 15/16 of 512 KiB per layer
    assert f"tp     per layer: all_reduce {2 * 15 * 64 * 4096 * 2 // 16:,d} B" in out, out
    assert "prefill over" not in out and "decode over" not in out
    saved = json.loads(out_json.read_text())["layouts"]["mc2"]
    assert saved["per_layer"] == layer and saved["hccl_buffer_mb"] == 11
