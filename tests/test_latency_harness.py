"""The latency harness (optimized.benchmarks.latency, .budgets, .budget_run): statistics, the timing loop under a
deterministic fake clock, the budget table and its skip rules, the pooled random weights, and
`python -m optimized latency` on one CPU process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from optimized.benchmarks import budget_run as R
from optimized.benchmarks import budgets as B
from optimized.benchmarks import latency as L
from optimized.__main__ import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """Returns the next scripted time on each call, and logs the calls between syncs."""

    def __init__(self, times):
        self.times, self.log = list(times), []

    def __call__(self):
        self.log.append("clock")
        return self.times.pop(0)


# ----------------------------------------------------------------------------------------- statistics


def test_nearest_rank_percentiles_by_hand():
    samples = [float(x) for x in range(1, 11)]  # 1..10 (shuffled below)
    shuffled = samples[5:] + samples[:5]
    # rank ceil(q/100 * 10): p50 -> 5th = 5, p90 -> 9th = 9, p99 -> 10th = 10, p10 -> 1st = 1
    assert [L.percentile(shuffled, q) for q in (50, 90, 99, 10, 100)] == [5.0, 9.0, 10.0, 1.0, 10.0]
    assert L.percentile([7.0], 99) == 7.0
    # rank ceil(7 * 100 / 100) = 7, though 7 / 100 * 100 = 7.000000000000001 in floating point
    assert L.percentile([float(x) for x in range(1, 101)], 7) == 7.0
    with pytest.raises(ValueError, match="no samples"):
        L.percentile([], 50)
    with pytest.raises(ValueError, match=r"\(0, 100\]"):
        L.percentile([1.0], 0)


@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=200), st.floats(0, 100, exclude_min=True))
def test_percentile_is_the_nearest_rank(samples, q):
    # the smallest sample with at least q% of the samples at or below it
    p = L.percentile(samples, q)
    n = len(samples)
    assert p in samples
    assert 100 * sum(x <= p for x in samples) >= q * n
    assert 100 * sum(x < p for x in samples) < q * n


def test_summarize_reports_milliseconds():
    # 20 samples: 0.001 s x 18, 0.010 s, 0.100 s -> p50 1 ms, p90 (18th) 1 ms, p99 (20th) 100 ms
    s = L.summarize([0.001] * 18 + [0.010, 0.100])
    assert (s["p50"], s["p90"], s["p99"], s["min"], s["max"], s["n"]) == (1.0, 1.0, 100.0, 1.0, 100.0, 20)
    assert s["mean"] == pytest.approx((18 * 1 + 10 + 100) / 20)


def test_measure_warms_up_untimed_and_syncs_around_every_sample():
    clock = FakeClock([10.0, 10.5, 20.0, 20.25, 30.0, 31.0])
    calls = []
    samples = L.measure(
        lambda: calls.append("fn") or clock.log.append("fn"),
        warmup=2,
        repeats=3,
        sync=lambda: clock.log.append("sync"),
        clock=clock,
    )
    assert samples == [0.5, 0.25, 1.0]
    assert len(calls) == 5 and clock.times == []
    # warm-up: fn, sync (no clock); timed: sync, clock, fn, sync, clock
    assert clock.log == ["fn", "sync"] * 2 + ["sync", "clock", "fn", "sync", "clock"] * 3
    with pytest.raises(ValueError, match="repeats >= 1"):
        L.measure(lambda: None, warmup=0, repeats=0)


def test_interleave_runs_round_by_round_and_drops_warmup_rounds():
    order, counter = [], {"a": 0, "b": 0}

    def workload(name):
        def run():
            counter[name] += 1
            order.append(name)
            return {"prefill": [counter[name] * 1.0], "decode": [counter[name] * 0.1, counter[name] * 0.2]}

        return run

    out = L.interleave({"a": workload("a"), "b": workload("b")}, warmup=1, repeats=2)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert out["a"] == {"prefill": [2.0, 3.0], "decode": [0.2, 0.4, 0.30000000000000004, 0.6000000000000001]}
    assert out["b"]["prefill"] == [2.0, 3.0]


def test_runner_phase_timer_is_the_injected_clock():
    from fixtures.tiny import tiny_config
    from optimized import ModelRunner, model_from_source
    from optimized.benchmarks.budget_run import generation_samples

    runner = ModelRunner(model_from_source(tiny_config("tiny"), R.PooledRandomWeights(), dtype=torch.float32), 16)
    ticks = iter(range(100))
    runner.clock = lambda: float(next(ticks))  # every phase takes exactly one tick
    assert generation_samples(runner, [[1, 2, 3]], 3) == {"prefill": [1.0], "decode": [1.0, 1.0, 1.0]}


# -------------------------------------------------------------------------------------------- verdicts


def _budget(**kw):
    base = dict(name="b", kind="absolute", description="d", model={"fixture": "tiny"}, limits_ms={"decode": 20})
    base.update(kw)
    return B.Budget(**base)


def test_absolute_verdict_is_p50_against_the_limit_with_floor_ratio():
    b = _budget(repeats=1, decode_steps=3)  # one round of 3 decode steps: 3 samples
    at = B.phase_report(b, "decode", [0.019, 0.020, 0.030], floor_s=0.004)
    assert at["ms"]["p50"] == pytest.approx(20.0) and at["passed"] and at["p50_over_floor"] == pytest.approx(5.0)
    assert at["broken"] is None
    over = B.phase_report(b, "decode", [0.0201, 0.0201, 0.001], floor_s=0.004)
    assert not over["passed"] and over["broken"] is None


def test_a_p50_below_the_floor_or_too_few_samples_is_a_broken_measurement():
    b = _budget(repeats=1, decode_steps=3)
    # well within the 20 ms limit, but under the 4 ms floor: the timed work was not waited for
    fast = B.phase_report(b, "decode", [0.001, 0.0015, 0.030], floor_s=0.004)
    assert not fast["passed"] and "below the physical floor 4.000 ms" in fast["broken"]
    short = B.phase_report(b, "decode", [0.010, 0.010], floor_s=0.004)
    assert not short["passed"] and "has 2 samples, the budget's 1 rounds make 3" in short["broken"]
    one_per_round = _budget(repeats=2, limits_ms={"prefill": 20})
    assert B.phase_report(one_per_round, "prefill", [0.01, 0.01])["passed"]
    rel = _budget(kind="relative", limits_ms={}, max_ratio={"prefill": 10.0}, repeats=3)
    r = B.phase_report(rel, "prefill", [0.003] * 3, floor_s=0.002, reference_seconds=[0.001] * 3)
    assert not r["passed"] and "reference prefill p50 1.000 ms is below" in r["broken"]
    r = B.phase_report(rel, "prefill", [0.003] * 3, floor_s=0.0005, reference_seconds=[0.001] * 2)
    assert not r["passed"] and "reference prefill has 2 samples" in r["broken"]


def test_relative_verdict_is_the_ratio_of_p50s():
    b = _budget(kind="relative", limits_ms={}, max_ratio={"prefill": 1.5})
    r = B.phase_report(b, "prefill", [0.003, 0.003, 0.009], reference_seconds=[0.002, 0.002, 0.001])
    assert r["ratio_p50"] == pytest.approx(1.5) and r["passed"]
    r = B.phase_report(b, "prefill", [0.0031] * 3, reference_seconds=[0.002] * 3)
    assert not r["passed"]


def test_default_run_collects_no_latency_test():
    import sys
    from types import SimpleNamespace

    root_conftest = sys.modules.get("conftest") or __import__("conftest")  # the repository's conftest.py

    class Item:
        def __init__(self, name, marks):
            self.name, self.marks, self.keywords, self.added = name, marks, {}, []

        def get_closest_marker(self, mark):
            return mark if mark in self.marks else None

        def add_marker(self, mark):
            self.added.append(mark)

    def collect(markexpr):
        items = [Item("test_cpu_relative_budget", {"latency"}), Item("test_percentile", set())]
        deselected = []
        config = SimpleNamespace(
            getoption=lambda name, default=None: markexpr if name == "markexpr" else default,
            hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
        )
        root_conftest.pytest_collection_modifyitems(config, items)
        return [i.name for i in items], [i.name for i in deselected]

    # no timing assertion in the default run: deselected (and reported so), selected only by -m latency
    assert collect("") == (["test_percentile"], ["test_cpu_relative_budget"])
    assert collect("equivalence") == (["test_percentile"], ["test_cpu_relative_budget"])
    assert collect("latency")[0] == ["test_cpu_relative_budget", "test_percentile"]


# ---------------------------------------------------------------------------------------------- budgets


def test_seed_budgets_are_written_in():
    budgets = B.load_budgets()
    a3 = budgets["a3_235b_bf16_decode"]
    assert (a3.hardware.soc, a3.hardware.devices, a3.world_size) == ("Ascend910_93*", 16, 16)
    assert a3.limits_ms == {"decode": 20} and a3.prompt_len == 4096 and a3.batch == 1 and a3.routing == "skewed"
    assert a3.checkpoint is None
    p = a3.inference_config().parallel_config
    assert (p.attn_tp_size, p.moe_tp_size, p.embed_tp_size, p.lmhead_tp_size) == (16, 16, 16, 16)
    pr = budgets["atlas950pr_235b_w4a8"]
    assert (pr.hardware.soc, pr.hardware.devices, pr.world_size, pr.precision) == ("Ascend950*", 4, 4, "w4a8")
    assert pr.limits_ms == {"prefill": 280, "decode": 24} and pr.prompt_len == 4096 and pr.sp_prefill
    assert pr.checkpoint == "w4a8"
    p = pr.inference_config().parallel_config
    assert (p.attn_tp_size, p.moe_ep_size) == (4, 4)
    for b in (a3, pr):
        assert b.hf_config().num_hidden_layers == 94 and b.warmup >= 1 and b.repeats >= 3


def test_npu_budgets_skip_naming_hardware_and_fail_without_their_checkpoint():
    budgets = B.load_budgets()
    a3, pr = budgets["a3_235b_bf16_decode"], budgets["atlas950pr_235b_w4a8"]
    reason = a3.skip_reason("decode", B.Host("cpu", "", 0))
    assert "needs Atlas A3" in reason and "'Ascend910_93*'" in reason and "this host: backend cpu" in reason
    # the right hardware with too few devices, the wrong SoC
    assert "16 NPU devices" in a3.skip_reason("decode", B.Host("npu", "Ascend910_9392", 8))
    assert "needs Atlas A3" in a3.skip_reason("decode", B.Host("npu", "Ascend910B3", 16))
    a3_host = B.Host("npu", "Ascend910_9392", 16)
    assert (
        a3.skip_reason("decode", a3_host) is None and pr.skip_reason("prefill", B.Host("npu", "Ascend950PR", 4)) is None
    )
    assert budgets["cpu_tiny_relative"].skip_reason("decode", a3_host).startswith("a CPU relative budget")
    # on its hardware the W4A8 budget cannot be measured on random weights: a failure saying what to pass
    missing = pr.missing_checkpoint(None)
    assert "measures a w4a8 checkpoint: pass one with --latency-checkpoint DIR" in missing
    assert B.CHECKPOINT_ENV in missing and "convert --quant w4a8" in missing
    assert pr.missing_checkpoint("/ckpt") is None and a3.missing_checkpoint(None) is None


def test_random_weights_route_skewed_not_uniformly():
    from fixtures.tiny import tiny_config

    # a Qwen3-30B-A3B-shaped router (E 128, H 2048, top-8) over EP 4: the hot rank carries measurably more than
    # its share; unscaled random weights stay near balance (measured 1.5x vs 1.02x)
    name, shape = "model.layers.0.mlp.gate.weight", (128, 2048)
    skewed = R.routing_skew(R.PooledRandomWeights(seed=0).read(name, shape), 8, 4)
    uniform = R.routing_skew(R.RandomWeights(seed=0).read(name, shape), 8, 4)
    print(f"30B-shaped router load: skewed {skewed}, unscaled {uniform}")
    assert skewed["ep_rank_max_over_mean"] > 1.3 > 1.1 > uniform["ep_rank_max_over_mean"], (skewed, uniform)
    label = R.weights_label(None, tiny_config("tiny"), ep_size=2)
    assert label["weights"].startswith("random") and "skewed routing" in label["weights"]
    assert label["routing_skew"]["expert_max_over_mean"] > 1.0 and label["routing_skew"]["ep_size"] == 2
    assert R.weights_label("/ckpt", tiny_config("tiny")) == {"weights": "/ckpt"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"routing": "balanced"}, "routing: must be 'skewed'"),
        ({"limits_ms": {"decode_fast": 1}}, "limits_ms: must map phases"),
        ({"checkpoint": "fp4"}, "checkpoint: must be w4a8 or bf16"),
        ({"colour": "red"}, "unknown key(s) ['colour']"),
        ({"warmup": -1}, "warmup: must be a non-negative integer"),
        ({"limits_ms": {"decode": 0}}, "to positive numbers"),
        ({"dtype": "float16"}, "dtype: must be one of bfloat16, float32"),
        ({"precision": "int4"}, "precision: must be one of bf16, fp32, w4a8"),
        ({"max_ratio": {"decode": 2}}, "max_ratio: absolute budgets have limits_ms, not max_ratio"),
        ({"hardware": {"soc": "x", "devices": 1, "floor": "abacus", "name": "n"}}, "unknown 'abacus'"),
    ],
)
def test_bad_budget_files_name_the_budget_and_key(tmp_path, change, message):
    spec = {
        "kind": "absolute",
        "description": "d",
        "model": {"fixture": "tiny"},
        "limits_ms": {"decode": 1},
        "config": "fixtures/configs/tiny_single.yaml",
        "hardware": {"soc": "x", "devices": 1, "floor": "atlas_a3", "name": "n"},
    }
    spec.update(change)
    path = tmp_path / "budgets.yaml"
    path.write_text(json.dumps({"budgets": {"mine": spec}}))
    with pytest.raises(B.BudgetError, match="budgets.mine") as e:
        B.load_budgets(path)
    assert message in str(e.value)


# --------------------------------------------------------------------------------------- weights, CLI


def test_pooled_weights_read_the_same_values_whole_or_sliced():
    src = R.PooledRandomWeights(seed=3, pool=1001)  # tensors longer than the pool wrap around it
    whole = src.read("model.layers.0.mlp.experts.5.down_proj.weight", (64, 48))
    assert whole.shape == (64, 48) and whole.std() > 0
    rows = src.read("model.layers.0.mlp.experts.5.down_proj.weight", (64, 48), (slice(16, 32),))
    cols = src.read("model.layers.0.mlp.experts.5.down_proj.weight", (64, 48), (slice(None), slice(8, 24)))
    assert torch.equal(rows, whole[16:32]) and torch.equal(cols, whole[:, 8:24]) and cols.is_contiguous()
    assert not torch.equal(whole, src.read("model.layers.0.mlp.experts.6.down_proj.weight", (64, 48)))
    assert torch.equal(src.read("model.norm.weight", (64,)), torch.ones(64))


def test_reference_and_optimized_compute_the_same_tokens():
    from fixtures.tiny import tiny_config

    ref, runner = R.reference_and_optimized(tiny_config("tiny-dense"), torch.float32, seed=1)
    prompts = [[5, 6, 7, 8]]
    with torch.no_grad():
        ids, cache, ref_tokens = torch.tensor(prompts), ref.new_cache(), []
        for _ in range(5):
            ids = ref(ids, cache)[:, -1].argmax(-1, keepdim=True)
            ref_tokens.append(ids.item())
    assert runner.generate(prompts, 5).tokens == [ref_tokens]


def tiny_budget_file(tmp_path) -> Path:
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(
        json.dumps(
            {
                "budgets": {
                    "tiny_one_rank": {
                        "kind": "absolute",
                        "description": "tiny, one process",
                        "model": {"fixture": "tiny"},
                        "dtype": "float32",
                        "config": str(ROOT / "fixtures/configs/tiny_single.yaml"),
                        "prompt_len": 12,
                        "decode_steps": 3,
                        "warmup": 1,
                        "repeats": 2,
                        "limits_ms": {"prefill": 1e6, "decode": 1e6},
                        "hardware": {"soc": "*", "devices": 1, "floor": "atlas_a3", "name": "any"},
                    }
                }
            }
        )
    )
    return budgets


def test_cli_latency_measures_an_absolute_budget_on_one_process(tmp_path, capsys):
    budgets = tiny_budget_file(tmp_path)
    out = tmp_path / "raw.json"
    assert cli_main(["latency", "--budget", "tiny_one_rank", "--budgets", str(budgets), "--json", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["world_size"] == 1 and raw["model"] == "random weights" and raw["collective_latency_s"] is None
    assert raw["weights"].startswith("random") and raw["routing_skew"]["ep_size"] == 1
    assert len(raw["samples_s"]["prefill"]) == 2 and len(raw["samples_s"]["decode"]) == 2 * 3
    assert all(s > 0 for phase in raw["samples_s"].values() for s in phase)
    budget = B.load_budgets(budgets)["tiny_one_rank"]
    cmd = R.launch_command(budget, out, budgets, model_path="/ckpt")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    assert cmd[6:] == [
        "-m",
        "optimized",
        "latency",
        "--budget",
        "tiny_one_rank",
        "--budgets",
        str(budgets),
        "--json",
        str(out),
        "--model-path",
        "/ckpt",
    ]


def test_latency_weights_are_the_checkpoint_given_else_pooled_random_weights_of_the_budgets_shapes(tmp_path):
    from fixtures.checkpoints import checkpoint

    npu = B.load_budgets()["a3_235b_bf16_decode"]  # its NPU run builds through the same assembly call
    given, drawn = R.weight_source(npu, "/ckpt"), R.weight_source(npu, None)
    assert given.checkpoint == Path("/ckpt") and given.source is None
    assert drawn.checkpoint is None and isinstance(drawn.source, R.PooledRandomWeights)
    for w in (given, drawn):  # the MC2 window is sized for the budget's shapes either way
        assert w.hf_config.to_dict() == npu.hf_config().to_dict()
    # one process, a checkpoint given: loaded through the assembly and named in the raw file
    budgets, out, tiny = tiny_budget_file(tmp_path), tmp_path / "raw.json", str(checkpoint("tiny"))
    argv = ["latency", "--budget", "tiny_one_rank", "--budgets", str(budgets), "--json", str(out)]
    assert cli_main([*argv, "--model-path", tiny]) == 0
    raw = json.loads(out.read_text())
    assert raw["model"] == tiny and len(raw["samples_s"]["decode"]) == 2 * 3


def test_cli_latency_errors(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli_main(["latency", "--budget", "nope", "--json", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "no budget named 'nope'" in capsys.readouterr().err
    # W4A8 is measured on a converted checkpoint only, never on BF16 random weights
    monkeypatch.delenv(B.CHECKPOINT_ENV, raising=False)
    with pytest.raises(SystemExit):
        cli_main(["latency", "--budget", "atlas950pr_235b_w4a8", "--json", str(tmp_path / "x.json")])
    assert "measures a w4a8 checkpoint: pass one with" in capsys.readouterr().err


def test_latency_run_refuses_a_plan_that_does_not_run_what_the_budget_names():
    from fixtures.tiny import tiny_config
    from optimized.config import ParallelConfig
    from optimized.errors import UsageError
    from optimized.executor.plan import ExecutionPlan

    def plan(quant=None, **layout):
        parallel = ParallelConfig(**{"world_size": 1, **layout}).validate()
        return ExecutionPlan.for_layout(tiny_config("tiny"), parallel, quant=quant, batch=4, act_bytes=2)

    budgets = B.load_budgets()
    a3, pr = budgets["a3_235b_bf16_decode"], budgets["atlas950pr_235b_w4a8"]
    bf16_tp = plan()
    R.check_applied(a3, bf16_tp)  # bf16, TP prefill: what a3 names
    with pytest.raises(UsageError, match="is w4a8 but the model is not quantized"):
        R.check_applied(pr, bf16_tp)
    with pytest.raises(UsageError, match="is bf16 but the model is W8A8"):  # any scheme, not only W4A8
        R.check_applied(a3, plan("w8a8"))
    sp = plan(world_size=2, attn_tp_size=2, moe_tp_size=1, prefill_opt=True)
    with pytest.raises(UsageError, match="does not use the sequence-parallel prefill"):
        R.check_applied(a3, sp)


def test_a_checkpoints_plan_takes_its_own_scheme_whatever_shapes_size_the_window():
    """The harness passes a checkpoint with the budget's shapes (no quantization_config): the plan still
    decides on the checkpoint's own scheme, so a W4A8 checkpoint's SP prefill carries MXFP8 on the wire."""
    from fixtures.checkpoints import w4a8_checkpoint
    from fixtures.tiny import tiny_config
    from optimized.config import ParallelConfig
    from optimized.executor.assembly import WeightSource, plan_for
    from optimized.layers.quantization.schemes import MXFP8_WIRE
    from optimized.path_plan import SP

    shapes = tiny_config("tiny")  # no quantization_config: the shapes only
    weights = WeightSource.from_checkpoint(w4a8_checkpoint("tiny"), shapes)
    sp = ParallelConfig(world_size=2, attn_tp_size=2, moe_tp_size=1).validate()
    plan = plan_for(weights, sp, dtype=torch.bfloat16, batch=4)
    assert weights.quant == plan.quant == "w4a8"
    assert (plan.paths.prefill, plan.paths.wire) == (SP, MXFP8_WIRE)
    assert WeightSource.random_weights(shapes).quant is None
    assert plan_for(WeightSource.random_weights(shapes), sp, dtype=torch.bfloat16, batch=4).quant is None
