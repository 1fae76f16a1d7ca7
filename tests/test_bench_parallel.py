"""`python -m optimized bench --world-size N`: TP vs SP prefill layouts over real processes in one run."""
from __future__ import annotations

import json

import pytest

from optimized.__main__ import main as cli_main


def test_bench_world_size_2_reports_tp_and_both_sp_schemes(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli_main(["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "9", "--warmup", "0",
                     "--repeats", "1", "--dtype", "float32", "--world-size", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for needle in ("prefill over 2 processes", "sp-allgather", "sp-alltoall", "vs tp (best)", "MoE layer 0"):
        assert needle in out, needle
    report = json.loads(out_json.read_text())
    layouts = report["layouts"]
    assert list(layouts) == ["tp", "sp-allgather", "sp-alltoall"]
    assert [v["scheme"] for v in layouts.values()] == [None, "allgather", "alltoall"]
    for name, v in layouts.items():
        assert len(v["prefill_ms"]) == 1 and v["prefill_ms"][0] > 0 and v["bytes_per_rank"] > 0, name
    for name in ("sp-allgather", "sp-alltoall"):
        (moe,) = layouts[name]["moe_rank0"]          # one layer, one MoE layer
        assert moe["measured"] == moe["formula"] > 0, (name, moe)


def test_bench_world_size_must_fit_the_model(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--preset", "tiny", "--world-size", "3"])
    assert "--world-size 3 must divide the model's num_attention_heads (8)" in capsys.readouterr().err
