"""One assembly: every YAML key the run depends on is honoured the same way by `generate` and by `serve`.

Both commands go through `optimized.executor.assembly` (prepare -> start -> runner / engine). For each row of the
table a config is written, `generate` is run in-process (its started run captured at `Launch.start`) and `serve`'s
own start-up (`cli.serve.start`, what `serve` runs before opening its port) is called; the same check then runs on
both: the runner's exe_mode and graph buckets, the compile cache, the NZ weight cast, the KV cache dtype, the block
size, the scheduler's batch, prefill budget and prefix caching, the KV pool of the plan, mem_fraction_static (refused
alike), the profiler (a trace written alike). A key that one entry point dropped fails its row.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from optimized.__main__ import main as cli_main
from optimized.errors import UsageError
from optimized.executor import assembly

BASE = {
    "model_config": {"model_path": "fixture:tiny", "dtype": "float32"},
    "data_config": {"input_max_len": 32},
    "scheduler_config": {"batch_size": 2, "max_new_tokens": 2, "block_size": 16},
}


def _write(tmp_path, changes: dict):
    cfg = {k: dict(v) for k, v in BASE.items()}
    for key, value in changes.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _generate(path, monkeypatch):
    """generate in-process: (the started run, the runner's engine as generate built it)."""
    started, engines = [], []
    start = assembly.Launch.start

    def capture(self, **kw):
        run = start(self, **kw)
        started.append(copy.copy(run))  # the run as generate had it: its own close lets go of the model and runner
        return run

    monkeypatch.setattr(assembly.Launch, "start", capture)
    from optimized.executor import engine as engine_module

    init = engine_module.Engine.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        engines.append(self)

    monkeypatch.setattr(engine_module.Engine, "__init__", record)
    assert cli_main(["generate", "--config", str(path), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5"]) == 0
    return started[0], engines[0]


def _serve(path):
    from optimized.cli.serve import load_config, start
    from types import SimpleNamespace

    return start(load_config(SimpleNamespace(config=str(path), model_path=None)))


def _graph(run, engine, command):
    from optimized.executor.graph import GraphDecoder

    decoder = run.runner.decode_forward
    assert isinstance(decoder, GraphDecoder), type(decoder)
    assert run.plan.buckets == (1, 2) and decoder.buckets == run.plan.buckets  # the plan's sizes are captured
    if command == "serve":  # every bucket compiled before the port opens: no compile on the request path
        assert sorted(decoder.startup) == [1, 2], decoder.startup
    else:  # generate compiles what it runs: its batch of 2, then the batch of 1 left
        assert set(decoder.startup) <= {1, 2} and decoder.startup, decoder.startup


def _cache(run, engine, command):
    cache = run.runner.decode_forward.cache
    assert cache is not None and cache.root == run.launch.compile_cache.root
    assert any(cache.root.iterdir()), f"{command}: nothing written to the compile cache {cache.root}"


def _graph_and_cache(run, engine, command):
    _graph(run, engine, command)
    _cache(run, engine, command)


def _kv_fp8(run, engine, command):
    assert run.runner.kv_cache_dtype == torch.float8_e4m3fn
    assert engine.cache.layers[0][0].dtype == torch.float8_e4m3fn


def _scheduler(run, engine, command):
    assert run.runner.block_size == 32 and engine.cache.block_size == 32
    assert engine.scheduler.max_prefill_tokens == 24
    assert engine.scheduler.prefix_identity == ("float32", "none", "none")  # enable_prefix_caching
    if command == "serve":
        assert engine.scheduler.batch_size == 2
        assert run.plan.kv_pool_blocks == engine.cache.num_blocks == 1 + 2 * 2  # 2 requests of 32 + 2 tokens


def _chunked(run, engine, command):
    assert engine.scheduler.chunk_budget == 8 and engine.scheduler.max_prefill_tokens == 0
    assert run.runner.enable_chunked_prefill and run.runner.max_num_batched_tokens == 8


def _async(run, engine, command):
    assert run.runner.async_scheduling is True and engine.async_scheduling is True


def _nz_off(run, engine, command):
    layers = [m for m in run.model.modules() if getattr(m, "quant_method", None) is not None]
    assert layers and not any(m.weight_nz for m in layers), "model_config.enable_weight_nz: false was not honoured"


def _nz_on(run, engine, command):
    layers = [m for m in run.model.modules() if getattr(m, "quant_method", None) is not None]
    assert any(m.weight_nz for m in layers) and not any(m.weight_nz for m in layers if getattr(m, "router", False))


def _batch_invariant(run, engine, command):
    assert run.runner.batch_invariant is True and engine.runner is run.runner


ROWS = {
    "async_scheduling": ({"scheduler_config.async_scheduling": True}, _async),
    "batch_invariant": ({"model_config.batch_invariant": True}, _batch_invariant),
    "enable_weight_nz false": ({"model_config.enable_weight_nz": False}, _nz_off),
    "enable_weight_nz true": ({"model_config.enable_weight_nz": True}, _nz_on),
    # One row for both graph keys: each compile costs tens of seconds here, and the two checks are independent.
    "exe_mode, enable_cache_compile": (
        {"model_config.exe_mode": "ge_graph", "model_config.enable_cache_compile": True},
        _graph_and_cache,
    ),
    "kv_cache_dtype": ({"model_config.dtype": "bfloat16", "model_config.kv_cache_dtype": "float8"}, _kv_fp8),
    "scheduler": (
        {
            "scheduler_config.block_size": 32,
            "scheduler_config.max_prefill_tokens": 24,
            "scheduler_config.enable_prefix_caching": True,
        },
        _scheduler,
    ),
    "chunked prefill": (
        {"scheduler_config.enable_chunked_prefill": True, "scheduler_config.max_num_batched_tokens": 8},
        _chunked,
    ),
}


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_assembly_honours_each_key_for_generate_and_serve(row, command, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    monkeypatch.chdir(tmp_path)  # the compile cache lives under ./compile_cache
    monkeypatch.setenv("CASE_NAME", "keys-" + row.replace(", ", "-"))
    changes, check = ROWS[row]
    path = _write(tmp_path, changes)
    if command == "generate":
        run, engine = _generate(path, monkeypatch)
    else:
        run, engine = _serve(path)
    try:
        check(run, engine, command)
    finally:
        run.close()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_mem_fraction_static_refuses_alike(command, tmp_path, monkeypatch, capsys):
    path = _write(tmp_path, {"scheduler_config.mem_fraction_static": 1e-9})
    if command == "generate":
        with pytest.raises(SystemExit):
            cli_main(["generate", "--config", str(path), "--prompt-ids", "1,2,3"])
        err = capsys.readouterr().err
    else:
        with pytest.raises(UsageError) as e:
            _serve(path)
        err = str(e.value)
    assert "mem_fraction_static=1e-09" in err, err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_profiler_traces_generate_and_serve_alike(command, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    out = tmp_path / "traces"
    path = _write(tmp_path, {"model_config.enable_profiler": True, "model_config.output_path": str(out)})
    if command == "generate":
        assert cli_main(["generate", "--config", str(path), "--prompt-ids", "1,2,3"]) == 0
    else:
        from optimized.cli import serve

        monkeypatch.setattr(serve, "_serve", lambda *a: 0)  # the whole serving run, without a port
        assert cli_main(["serve", "--config", str(path)]) == 0
    traces = list((out / "profile").rglob("*"))
    assert any(p.is_file() for p in traces), f"{command}: no trace under {out}"
