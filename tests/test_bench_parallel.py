"""`python -m optimized bench --world-size N`: TP vs SP prefill layouts and TP vs MC2 vs attention-DP decode layouts
over real processes in one run, the bytes of each collective beside the formula."""

from __future__ import annotations

import json

import pytest

from optimized.__main__ import main as cli_main


def test_bench_world_size_2_reports_tp_and_both_sp_schemes_and_both_decode_layouts(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    # batch 3 over 2 EP ranks: n = 2 tokens each, the second rank's tail masked
    assert (
        cli_main(
            [
                "bench",
                "--preset",
                "tiny",
                "--layers",
                "1",
                "--prompt-len",
                "9",
                "--batch",
                "3",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--decode-steps",
                "2",
                "--dtype",
                "float32",
                "--world-size",
                "2",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for needle in (
        "prefill over 2 processes",
        "sp-allgather",
        "sp-alltoall",
        "vs tp (best)",
        "MoE layer 0",
        "decode over 2 processes",
        "npu_moe_distribute_dispatch_v2",
        "MC2 window 200 MB",
        "dp      skipped: needs an even --world-size >= 4",
    ):
        assert needle in out, needle
    assert out.count("every rank, every MoE layer: measured == formula: yes") == 2, out
    report = json.loads(out_json.read_text())
    layouts = report["layouts"]
    assert list(layouts) == ["tp", "sp-allgather", "sp-alltoall"]
    assert [v["scheme"] for v in layouts.values()] == [None, "allgather", "alltoall"]
    for name, v in layouts.items():
        assert len(v["prefill_ms"]) == 1 and v["prefill_ms"][0] > 0 and v["bytes_per_rank"] > 0, name
    for name in ("sp-allgather", "sp-alltoall"):
        (moe,) = layouts[name]["moe_rank0"]  # one layer, one MoE layer
        assert moe["measured"] == moe["formula"] > 0, (name, moe)

    decode = report["decode"]
    assert list(decode) == ["tp", "mc2"] and list(report["decode_skipped"]) == ["dp"]  # world 2: said, not run
    assert [v["exchange"] for v in decode.values()] == ["MoeInferTP", "MoeInferDispatchCombine"]
    assert decode["tp"]["sizes"] == dict(attn_tp_size=2, moe_tp_size=2, moe_ep_size=1)
    assert decode["mc2"]["sizes"] == dict(attn_tp_size=2, moe_tp_size=1, moe_ep_size=2)
    ops = {
        "tp": {"all_reduce"},
        "mc2": {"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "all_gather"},
    }
    for name, v in decode.items():
        assert len(v["decode_ms"]) == 2 and min(v["decode_ms"]) > 0, name  # 1 repeat x 2 steps
        assert len(v["moe"]) == len(v["step_bytes"]) == 2, name  # both ranks
        for rank, logs in enumerate(v["moe"]):
            (moe,) = logs  # one MoE layer, one decode step
            assert set(moe["formula"]) == ops[name], (name, moe)
            assert moe["measured"] == moe["formula"], (name, rank, moe)  # every collective, to the byte
            # the exchange's bytes are part of the step's, collective by collective
            for op, b in moe["measured"].items():
                assert v["step_bytes"][rank][op] >= b, (name, rank, op)
        assert moe["measured"]["all_reduce" if name == "tp" else "all_gather"] > 0, (name, moe)
    # tp: the [3, 64] fp32 partial sums all-reduced over 2 ranks, 2 * 1/2 of 768 B
    assert decode["tp"]["moe"][0][0]["measured"] == {"all_reduce": 768}
    # mc2: rank 0 sends 2 tokens' and rank 1 one token's slots; every rank's counts (L 8 + BS) to the other
    for rank, logs in enumerate(decode["mc2"]["moe"]):
        assert logs[0]["measured"]["npu_moe_distribute_dispatch_v2"] >= 9 * 8, (rank, logs)
        assert logs[0]["measured"]["all_gather"] == 2 * 64 * 4, (rank, logs)  # n = 2 rows of 64 fp32
    combined = sum(logs[0]["measured"]["npu_moe_distribute_combine_v2"] for logs in decode["mc2"]["moe"])
    dispatched = sum(logs[0]["measured"]["npu_moe_distribute_dispatch_v2"] - 9 * 8 for logs in decode["mc2"]["moe"])
    assert dispatched == combined // (64 * 4) * (64 * 4 + 8), (dispatched, combined)  # every row goes back
    formula = report["decode_formula"]
    assert formula["moe_layers"] == 2 and set(formula["layouts"]) == {"tp", "mc2"}  # the fixture's depth
    assert formula["layouts"]["tp"]["mc2_window_mb"] is None and formula["layouts"]["mc2"]["mc2_window_mb"] == 200


def test_bench_world_size_must_fit_the_model(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--preset", "tiny", "--world-size", "3"])
    assert "--world-size 3 must divide the model's num_attention_heads (8)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], "--world-size must be >= 1; got 0"),
        (["--world-size", "-2"], "--world-size must be >= 1; got -2"),
        (["--world-size", "32"], "--world-size 32 must divide the model's num_attention_heads (8)"),
        (["--formula-only"], "--formula-only needs --world-size > 1; got 1"),
    ],
)
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
    assert (
        cli_main(
            [
                "bench",
                "--preset",
                "qwen3_235b_a22b",
                "--world-size",
                "16",
                "--batch",
                "64",
                "--formula-only",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    config = bench_config("qwen3_235b_a22b", 94)
    mc2 = ParallelConfig(
        world_size=16, attn_tp_size=16, moe_tp_size=1, moe_ep_size=16, embed_tp_size=16, lmhead_tp_size=16
    )
    # EP 16, batch 64: n = 4, L = 8; uniform: 30 slots of 4096 bf16 (+ 8 B) out and in, 15 * 4 rows gathered
    layer = {decode_plan.DISPATCH: 15 * 9 * 8 + 30 * 8200, decode_plan.COMBINE: 30 * 8192, "all_gather": 15 * 4 * 8192}
    assert decode_plan.decode_volume(mc2, 64, 4096, 8, 128, 2).parts == layer
    assert decode_plan.step_volume(config, mc2, 64, 2).total == 94 * sum(layer.values())
    assert "94 MoE layers" in out, out
    assert (
        f"mc2    per layer: npu_moe_distribute_dispatch_v2 {layer[decode_plan.DISPATCH]:,d} B, "
        f"npu_moe_distribute_combine_v2 {layer[decode_plan.COMBINE]:,d} B, all_gather "
        f"{layer['all_gather']:,d} B = {sum(layer.values()):,d} B; per decode step: "
        f"{94 * sum(layer.values()):,d} B; MC2 window 200 MB (its own HCCL group)"
    ) in out, out
    # tp: [64, 4096] bf16 all-reduced over 16 ranks, 2 * 15/16 of 512 KiB per layer
    assert f"tp     per layer: all_reduce {2 * 15 * 64 * 4096 * 2 // 16:,d} B" in out, out
    assert "prefill over" not in out and "decode over" not in out
    saved = json.loads(out_json.read_text())["layouts"]["mc2"]
    assert saved["per_layer"] == layer and saved["mc2_window_mb"] == 200


def test_bench_formula_only_qwen3_235b_shows_the_recipes_attention_dp_layout(tmp_path, capsys):
    from optimized.distributed import decode_plan

    out_json = tmp_path / "formula.json"
    assert (
        cli_main(
            [
                "bench",
                "--preset",
                "qwen3_235b_a22b",
                "--world-size",
                "32",
                "--batch",
                "32",
                "--formula-only",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # attn4tp8dp_32ep, batch 32: 4 requests per DP group, n = 1 row per rank; EP 32, L = 4: uniform
    # 1 * 8 * 31 / 32 = 7.75 slots of 4096 bf16 (+ 8 B) out and in, nothing gathered
    dispatch, combine = 31 * 5 * 8 + round(7.75 * 8200), round(7.75 * 8192)
    assert (dispatch, combine) == (64_790, 63_488)
    attention = 3 * 1 * 4096 * 2  # each way, per layer, (T - 1) * n * H * 2 B
    lm_head = 3 * 1 * 4096 * 2  # n hidden rows to the 3 TP peers, once
    step = 94 * (dispatch + combine) + 94 * 2 * attention + lm_head
    assert step == 16_702_996
    assert (
        f"dp-tp4x8    1 row(s) per rank; MoE per layer: npu_moe_distribute_dispatch_v2 {dispatch:,d} B, "
        f"npu_moe_distribute_combine_v2 {combine:,d} B = {dispatch + combine:,d} B; attention per layer: "
        f"all_gather {attention:,d} B, reduce_scatter {attention:,d} B; per decode step: MoE "
        f"{94 * (dispatch + combine):,d} B + attention {94 * 2 * attention:,d} B + lm_head {lm_head:,d} B = "
        f"{step:,d} B; MC2 window 200 MB"
    ) in out, out
    for d in (2, 4, 16, 32):
        assert f"dp-tp{32 // d}x{d} " in out, d  # every split of 32 into DP groups
    saved = json.loads(out_json.read_text())["dp"]["dp-tp4x8"]
    assert saved["per_layer"] == {decode_plan.DISPATCH: dispatch, decode_plan.COMBINE: combine}
    assert saved["step_total"] == step and saved["rows"] == 1


def _bench_args(argv):
    import argparse

    from optimized.benchmarks import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_world_size_4_attention_dp_decode_bytes_equal_the_formulas():
    from optimized.benchmarks import bench_parallel

    # batch 6 over DP 2: 3 requests per group, 2 rows per rank, the second rank of each group 1 real + 1 padding row
    args = _bench_args(
        [
            "--preset",
            "tiny",
            "--layers",
            "1",
            "--prompt-len",
            "4",
            "--batch",
            "6",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--decode-steps",
            "1",
            "--dtype",
            "float32",
            "--world-size",
            "4",
        ]
    )
    args.prefill_layouts, args.decode_layouts = (), ("dp",)  # only the DP decode: the run stays short
    report = bench_parallel.run(args)
    out = bench_parallel.format_report(report)
    (dp,) = report["decode"].values()
    assert dp["exchange"] == "MoeInferDispatchCombine" and len(dp["decode_ms"]) == 1 and dp["decode_ms"][0] > 0
    assert dp["sizes"] == dict(
        attn_tp_size=2, moe_tp_size=1, moe_ep_size=4, embed_tp_size=1, lmhead_tp_size=1, attn_dp=True
    )
    row = 64 * 4  # one fp32 row of H 64
    counts = 3 * (16 // 4 + 1) * 8  # the counts of L 4 experts + BS to 3 peers
    for rank in range(4):
        (moe,) = dp["moe"][rank]
        assert set(moe["measured"]) == {"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"}, moe
        assert moe["measured"] == moe["formula"], (rank, moe)  # to the byte, no all_gather
        parts = dp["parts"][rank]
        # attention: 1 layer, (2 - 1) * 2 rows each way; lm_head: the same 2 hidden rows to the 1 TP peer, no logits
        assert parts["attention"] == dp["attention_formula"][rank] == {"all_gather": 2 * row, "reduce_scatter": 2 * row}
        assert parts["lm_head"] == {"all_gather": 2 * row}, (rank, parts)
        assert dp["step_bytes"][rank] == dp["step_formula"][rank], (rank, dp["step_bytes"][rank])
    sent = [dp["moe"][r][0]["measured"]["npu_moe_distribute_dispatch_v2"] - counts for r in range(4)]
    back = [dp["moe"][r][0]["measured"]["npu_moe_distribute_combine_v2"] for r in range(4)]
    assert sum(sent) == sum(back) // row * (row + 8) and min(sent) >= 0, (sent, back)  # every row comes back
    assert sum(back) // row <= 6 * 4  # only the 6 real tokens' 4 slots travel
    for needle in (
        "attn_tp 2 x dp 2, moe_tp 1, moe_ep 4",
        "dp     every rank, every MoE layer: measured == formula: yes",
        "dp     every rank: attention and whole step measured == formula: yes",
        "lm_head: all_gather 512 B",
        "attention: all_gather 512 B, reduce_scatter 512 B",
    ):
        assert needle in out, (needle, out)


def test_bench_dp_layout_is_skipped_with_its_reason_when_the_batch_breaks_the_dp_rule():
    from optimized.benchmarks import bench_parallel

    dp = bench_parallel.DECODE_BY_NAME["dp"]
    assert dp.skip(4, 6) is None and dp.skip(8, 2) is None
    assert dp.skip(4, 3) == (
        "--batch 3 is not a multiple of attn_dp_size 2 (the attention DP rule "
        "scheduler_config.batch_size % attn_dp_size == 0)"
    )
    assert dp.skip(2, 4).endswith(
        "at 2 attention TP would be 1, no attention collectives to compare (--formula-only shows it)"
    )
    assert dp.skip(5, 4).endswith("5 is odd")
    report = {
        "setup": dict(world_size=4, batch=3, prompt_len=4, decode_steps=1, warmup=0, repeats=1),
        "decode": {},
        "decode_skipped": {"dp": dp.skip(4, 3)},
        "decode_formula": {
            "preset": "tiny",
            "moe_layers": 1,
            "batch": 3,
            "dtype": "float32",
            "world_size": 4,
            "layouts": {},
        },
    }
    assert "dp      skipped: --batch 3 is not a multiple of attn_dp_size 2" in "\n".join(
        bench_parallel.format_decode(report)
    )


def test_bench_weights_are_the_checkpoint_given_else_random_weights_of_the_presets_shapes(tmp_path, capsys):
    import torch

    from fixtures.checkpoints import checkpoint
    from optimized.benchmarks import bench_parallel
    from optimized.config import ParallelConfig
    from optimized.model_loader.build import load_model

    tiny = str(checkpoint("tiny"))
    args = dict(seed=0, batch=2, block_size=16, model_path=tiny)
    one = ParallelConfig(world_size=1)
    config = bench_parallel.model_config("tiny", 1, tiny)
    model, _ = bench_parallel._build(config, one, args, torch.float32, "cpu")
    loaded = load_model(tiny, dtype=torch.float32, num_hidden_layers=1, device="cpu").state_dict()
    got = model.state_dict()
    assert len(model.layers) == 1 and got.keys() == loaded.keys()
    assert all(torch.equal(got[k], loaded[k]) for k in got)  # the checkpoint's first layer, through the assembly
    random, _ = bench_parallel._build(config, one, {**args, "model_path": None}, torch.float32, "cpu")
    assert not torch.equal(random.state_dict()["embed_tokens.weight"], got["embed_tokens.weight"])
    # on 2 ranks, named in the report
    argv = ["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "5", "--batch", "2", "--warmup", "0"]
    argv += ["--repeats", "1", "--decode-steps", "1", "--dtype", "float32", "--world-size", "2"]
    assert cli_main([*argv, "--model-path", tiny, "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["setup"]["weights"] == tiny
    with pytest.raises(SystemExit):
        cli_main(["bench", "--preset", "tiny", "--model-path", tiny])
    assert "--model-path is for the parallel bench's runs" in capsys.readouterr().err
