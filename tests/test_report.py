"""The equivalence report locates a planted bug at exactly its layer and checkpoint, and a clean run reports none.

Each planted bug changes the optimized model in ONE layer, through the same kind of instance wrapper a capture
uses (restored after the test): a wrong rotary (cos and sin swapped) shows first at that layer's qkv in the
prefill; one expert's output x1.5 at that layer's mlp (its router still agrees); the decode token's K/V written
one slot too early at that layer's kv_write in decode step 0, the prefill clean. fp32, world 1, the tiny
fixtures; the planted layer is drawn by hypothesis.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import strategies as st

from equivalence.report import divergence as R
from equivalence.support.checkpoints import KINDS
from equivalence.support.parallel_support import rank_model, reference_model, run_property
from equivalence.support.strategies import layout
from fixtures.checkpoints import checkpoint
from fixtures.tiny import tiny_config
from optimized.config import is_sparse_layer

PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [11, 2, 60]]


def models(name: str, dtype: str = "float32"):
    return (rank_model(str(checkpoint(name)), layout(1), getattr(torch, dtype), "cpu"), reference_model(name, dtype))


def first(report) -> tuple | None:
    c = report.first_divergence
    return None if c is None else (c.step, c.layer, c.kind)


def swapped_rotary(attn, monkeypatch):
    qkv = attn.qkv
    monkeypatch.setattr(attn, "qkv", lambda hidden, cos, sin: qkv(hidden, sin, cos), raising=False)


def scaled_expert(experts, monkeypatch, scale=1.5):
    """The first local expert that receives rows in a call has its output multiplied by `scale`."""
    forward = experts.forward

    def wrong(x, tokens_per_expert):
        out = forward(x, tokens_per_expert)
        counts = tokens_per_expert.long().tolist()
        e = next(i for i, n in enumerate(counts) if n)
        start = sum(counts[:e])
        out = out.clone()
        out[start : start + counts[e]] *= scale
        return out

    monkeypatch.setattr(experts, "forward", wrong)


def misplaced_decode_write(attn, monkeypatch):
    """Decode steps write the new token's K/V into the slot before its own."""
    update = attn.kv_cache_update

    def wrong(k, v, meta, kv_cache):
        if not meta.is_prefill:
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping - 1)
        return update(k, v, meta, kv_cache)

    monkeypatch.setattr(attn, "kv_cache_update", wrong, raising=False)


@pytest.mark.parametrize("name, dtype", [("tiny", "float32"), ("tiny-dense", "float32"), ("tiny", "bfloat16")])
def test_clean_run_reports_no_divergence(name, dtype, tmp_path):
    model, ref = models(name, dtype)
    report = R.build_report(model, ref, PROMPTS, 2)
    steps = {c.step for c in report.checkpoints}
    kinds = {c.kind for c in report.checkpoints}
    assert steps == {"prefill", "decode0", "decode1"}
    assert kinds == set(KINDS) | {"logits"}  # every kind captured (both fixtures have MoE layers)
    assert len(report.checkpoints) == 3 * (
        sum(9 if is_sparse_layer(model.config, i) else 8 for i in range(len(model.layers))) + 1
    )
    assert first(report) is None, report.summary()
    assert report.routing["tokens"] > 0 and report.routing["clear_flips"] == 0
    json_path, html_path = R.write_report(report, tmp_path)
    data = json.loads(json_path.read_text())
    assert data["first_divergence"] is None and len(data["checkpoints"]) == len(report.checkpoints)
    page = html_path.read_text()
    assert page.count("<svg") == len(KINDS) + 2 and "No divergence" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained


def test_planted_wrong_rotary_found_at_its_layer_qkv(monkeypatch):
    model, ref = models("tiny-dense")

    def check(layer):
        with monkeypatch.context() as m:
            swapped_rotary(model.layers[layer].self_attn, m)
            report = R.build_report(model, ref, PROMPTS, 1)
        assert first(report) == ("prefill", layer, "qkv"), report.summary()
        # what it computed on is the reference's (no earlier checkpoint of that layer was off)
        assert all(
            c.ok for c in report.checkpoints if c.step == "prefill" and c.layer == layer and c.kind == "input_norm"
        )

    run_property(check, 3, layer=st.integers(0, 3))


def test_planted_wrong_expert_scale_found_at_its_layer_mlp(monkeypatch):
    sparse = [
        (name, i)
        for name in ("tiny", "tiny-dense")
        for i in range(tiny_config(name).num_hidden_layers)
        if is_sparse_layer(tiny_config(name), i)
    ]

    def check(case):
        name, layer = case
        model, ref = models(name)
        with monkeypatch.context() as m:
            scaled_expert(model.layers[layer].mlp.experts, m)
            report = R.build_report(model, ref, PROMPTS, 1)
        assert first(report) == ("prefill", layer, "mlp"), report.summary()
        router = next(c for c in report.checkpoints if (c.step, c.layer, c.kind) == ("prefill", layer, "router"))
        assert router.ok, router

    run_property(check, 3, case=st.sampled_from(sparse))


def test_planted_wrong_decode_kv_write_found_at_its_layer_and_step(monkeypatch):
    model, ref = models("tiny")

    def check(layer):
        with monkeypatch.context() as m:
            misplaced_decode_write(model.layers[layer].self_attn, m)
            report = R.build_report(model, ref, PROMPTS, 2)
        assert first(report) == ("decode0", layer, "kv_write"), report.summary()
        assert report.first_divergence.metrics["cosine"] < 0.5  # the token's own slot holds nothing
        assert all(c.ok for c in report.checkpoints if c.step == "prefill")

    run_property(check, 2, layer=st.integers(0, 1))


def test_graph_decode_report_finds_planted_kv_write(monkeypatch):
    """Graph-mode decode (inductor here, torchair on NPU): the compiled step traces the planted write; the report
    still names its layer and step from the cache it read back."""
    model, ref = models("tiny")
    misplaced_decode_write(model.layers[1].self_attn, monkeypatch)
    report = R.build_report(model, ref, PROMPTS, 1, exe_mode="ge_graph")
    assert report.meta["graph_steps"] == ["decode0"]
    assert {c.kind for c in report.checkpoints if c.step == "decode0"} == {"kv_write", "logits"}
    assert first(report) == ("decode0", 1, "kv_write"), report.summary()


def test_cli_writes_report_and_names_bad_input(tmp_path, capsys):
    assert (
        R.main(
            [
                "--config",
                "fixtures/configs/tiny_single.yaml",
                "--prompt-ids",
                "1,2,3",
                "--decode-steps",
                "1",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "no divergence" in out and (tmp_path / "report.json").is_file() and (tmp_path / "report.html").is_file()
    assert R.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert R.main(["--config", "fixtures/configs/tiny_sp4_ep4.yaml"]) == 2
    assert "prefill_opt" in capsys.readouterr().err
    assert R.main(["--config", "fixtures/configs/tiny_single.yaml", "--prompt-ids", "1,100000"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_pytest_option_writes_report_on_equivalence_failure(tmp_path):
    """A failing equivalence test under `--equivalence-report DIR` leaves the report there and names it in the
    summary; a passing run writes nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "test_case.py").write_text(
        "import os, pytest\n@pytest.mark.equivalence\ndef test_equal():\n    assert os.environ.get('FAIL') != '1'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(root))

    def run(out, fail):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "equivalence.report.plugin",
                "-c",
                os.devnull,
                "--rootdir",
                str(tmp_path),
                "--equivalence-report",
                str(out),
                str(tmp_path / "test_case.py"),
            ],
            env=dict(env, FAIL=fail),
            capture_output=True,
            text=True,
            cwd=root,
            timeout=300,
        )

    passed = run(tmp_path / "clean", "0")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert not (tmp_path / "clean").exists()
    failed = run(tmp_path / "out", "1")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    data = json.loads((tmp_path / "out" / "tiny_single" / "report.json").read_text())
    assert data["first_divergence"] is None and data["checkpoints"]
    assert (tmp_path / "out" / "tiny_single" / "report.html").is_file()
    assert "equivalence report" in failed.stdout and "no divergence" in failed.stdout, failed.stdout


def _swap_rotary_on_rank1_layer1(model, rank):
    if rank == 1:
        attn = model.layers[1].self_attn
        qkv = attn.qkv
        attn.qkv = lambda hidden, cos, sin: qkv(hidden, sin, cos)


@pytest.mark.parametrize("plant", [None, _swap_rotary_on_rank1_layer1], ids=["clean", "rank1-layer1-rotary"])
def test_multi_rank_report_gathers_heads_and_finds_a_one_rank_bug(plant):
    """Attention TP 2 x MoE TP 2 x EP 2 on 4 gloo ranks (fixtures/configs/tiny_tp2_ep2.yaml): each rank's qkv and
    kv_write (its heads) gathered to full tensors; clean: no divergence; a wrong rotary on rank 1 only (its heads)
    in layer 1: found at layer 1 qkv of the prefill."""
    cfg = R.load_config("fixtures/configs/tiny_tp2_ep2.yaml")
    _, ref, model_dir = R.models_of_config(cfg)
    report = R.build_parallel_report(model_dir, cfg.parallel_config, ref, PROMPTS, 1, dtype=torch.float32, plant=plant)
    assert report.meta["world_size"] == 4
    qkv = next(c for c in report.checkpoints if c.kind == "qkv")
    assert qkv.metrics["cosine"] > 0.999  # gathered in head order (a mix-up is far off)
    assert first(report) == (None if plant is None else ("prefill", 1, "qkv")), report.summary()


def test_a_layout_is_judged_by_the_path_the_plan_takes_not_the_one_it_asks_for(tmp_path, capsys):
    """A W4A4 checkpoint on a layout that asks for the SP prefill by default runs the TP prefill (the recipe's
    prefill_opt excludes W4A4): the report refuses it as a quantized checkpoint, not as an SP layout."""
    import yaml

    from fixtures.checkpoints import w4a4_checkpoint
    from optimized.config import ParallelConfig
    from optimized.executor.assembly import WeightSource
    from optimized.path_plan import TP

    w4a4 = w4a4_checkpoint("tiny-h128")
    sp_by_default = ParallelConfig(world_size=2, attn_tp_size=2, moe_tp_size=1).validate()
    plan = R.layout_plan(WeightSource.from_checkpoint(w4a4), sp_by_default, torch.float32, 2)
    assert plan.paths.prefill == TP and plan.quant == "w4a4"
    R.check_layout(plan)  # the TP prefill: the layout itself is covered
    config = tmp_path / "w4a4_sp_default.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_config": {"model_path": str(w4a4), "dtype": "float32"},
                "parallel_config": {"world_size": 2, "attn_tp_size": 2, "moe_tp_size": 1},
                "scheduler_config": {"batch_size": 2, "block_size": 16},
            }
        )
    )
    assert R.main(["--config", str(config), "--quiet", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a quantized checkpoint (W4A4)" in err and "prefill_opt" not in err, err
