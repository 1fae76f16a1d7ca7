"""`python -m optimized serve --config X.yaml [--host 127.0.0.1] [--port 8000]`: the OpenAI-compatible server.

The YAML is the same inference config as `generate`'s: model_config (model, dtype, exe_mode: eager or a graph
mode for the decode buckets), scheduler_config (batch_size: the most requests decoding together; block_size;
max_new_tokens: the default max_tokens; max_prefill_tokens: the prompt tokens one prefill step may pack, 0 no
budget), data_config.input_max_len (the longest prompt accepted: a longer one is refused with 413).
The KV pool holds `--kv-pool-blocks` blocks (default: batch_size requests of input_max_len + max_new_tokens).
Server-only settings are flags: --host, --port, --served-model-name, --kv-pool-blocks.
Multi-rank (TP / EP layouts): `torchrun --nproc-per-node N -m optimized serve ...`, one process per rank; rank 0
serves HTTP and sends each step's new requests and aborts to the others over a CPU gloo group
(optimized/serving/ranks.py). Attention DP (attn_dp: true) is refused: its lockstep dummy batches are not built.
"""
from __future__ import annotations

import os
from pathlib import Path

from optimized.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("--config", required=True, help="inference config YAML (see optimized/config.py)")
    p.add_argument("--model-path", help="overrides model_config.model_path")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", help="the model id clients name (default: the model path's last part)")
    p.add_argument("--kv-pool-blocks", type=int, help="paged KV pool size in blocks, the null block included")
    p.add_argument("--no-weight-check", action="store_true", help="skip the load-time finite-weight check")


def load_config(args):
    from optimized.config import ConfigError, InferenceConfig
    path = Path(args.config)
    if not path.is_file():
        raise UsageError(f"config file {args.config!r} not found" if not path.is_dir() else
                         f"config file {args.config!r} is a directory; give the inference config YAML file in it")
    try:
        cfg = InferenceConfig.from_yaml(path)
    except ConfigError as e:
        raise UsageError(f"invalid inference config {path}: " + "; ".join(f"{k}: {m}" for k, m in e.errors)) from None
    if args.model_path is not None:
        cfg.model_config.model_path = args.model_path
        if cfg.model_config.scheme[0] == "preset":
            cfg.model_config.with_ckpt = False
    return cfg


def build_engine(cfg, kv_pool_blocks: int | None, check_weights: bool = True, env=None):
    """(engine, tokenizer, stop ids, model dir) from an inference config, in this process (this rank: `env`)."""
    from optimized.config import ConfigError
    from optimized.distributed import ParallelState
    from optimized.executor.engine import Engine
    from optimized.executor.model_runner import ModelRunner
    from optimized.model_loader.build import load_model
    from optimized.model_loader.hf_config import ModelConfigError, load_hf_config
    from optimized.model_loader.model_path import resolve_model_path
    from optimized.model_loader.tokenizer import CheckpointTokenizer, eos_token_ids
    from optimized import platform

    m, p, s = cfg.model_config, cfg.parallel_config, cfg.scheduler_config
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if p.world_size != launched:
        raise UsageError(f"parallel_config.world_size is {p.world_size} but this job was launched with "
                         f"{launched} process(es); start it with `torchrun --nproc-per-node {p.world_size} -m "
                         f"optimized serve ...`" if p.world_size > 1 else
                         f"parallel_config.world_size is 1 but this job has {launched} processes")
    if p.attn_dp:
        raise UsageError("parallel_config.attn_dp: serving under attention DP is not implemented (its lockstep "
                         "dummy batches are not built); use a TP / EP layout")
    model_dir = resolve_model_path(m.model_path, *m.scheme)
    try:
        hf_config = load_hf_config(model_dir)
        cfg.validate_for_model(hf_config)
    except ModelConfigError as e:
        raise UsageError(str(e)) from None
    except ConfigError as e:
        raise UsageError("; ".join(f"{k}: {msg}" for k, msg in e.errors)) from None
    tokenizer = CheckpointTokenizer.load(model_dir)
    model = load_model(model_dir, parallel=ParallelState.build(p), dtype=m.torch_dtype, random_weights=not m.with_ckpt,
                       seed=cfg.data_config.seed, num_hidden_layers=m.num_hidden_layers, device=platform.device(env.local_rank if env else 0),
                       check_weights=check_weights, force_eplb=m.eplb)
    runner = ModelRunner(model, s.block_size, exe_mode=m.exe_mode, kv_cache_dtype=m.kv_cache_dtype)
    per_request = -(-(cfg.data_config.input_max_len + s.max_new_tokens) // s.block_size)
    blocks = kv_pool_blocks if kv_pool_blocks is not None else 1 + s.batch_size * per_request
    if blocks < 2:
        raise UsageError(f"--kv-pool-blocks={blocks} must be >= 2 (block 0 is the null block)")
    engine = Engine(runner, batch_size=s.batch_size, max_prefill_tokens=s.max_prefill_tokens, num_blocks=blocks)
    return engine, tokenizer, eos_token_ids(model_dir), model_dir


def make_server(cfg, engine, tokenizer, stop_ids, model_name: str, host: str, port: int, broadcast=None):
    """(uvicorn server, driver): the driver's fatal error stops the server."""
    import uvicorn
    from optimized.serving.app import build_app
    from optimized.serving.driver import Driver

    server_box = []
    driver = Driver(engine, on_fatal=lambda e: setattr(server_box[0], "should_exit", True), broadcast=broadcast)
    app = build_app(driver, tokenizer, model_name, stop_ids=stop_ids,
                    default_max_tokens=cfg.scheduler_config.max_new_tokens,
                    max_prompt_tokens=cfg.data_config.input_max_len)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    server_box.append(server)
    return server, driver


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"serve needs {e.name}: pip install 'qwen3-moe-npu[serve]'") from None
    cfg = load_config(args)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port={args.port} must be in 0..65535")
    if cfg.parallel_config.world_size == 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
        engine, tokenizer, stop_ids, model_dir = build_engine(cfg, args.kv_pool_blocks, not args.no_weight_check)
        return _serve(args, cfg, engine, tokenizer, stop_ids, model_dir, None)
    return _run_ranks(args, cfg)


def _run_ranks(args, cfg) -> int:
    """One process per rank: rank 0 serves, the others follow its broadcast; a failed rank is named."""
    import datetime
    import torch.distributed as dist
    from optimized.distributed import init_distributed
    from optimized.distributed.guard import (CollectiveTimeoutError, RankMismatchError, check_ranks_agree,
                                             collective_timeout_s, named_collective_errors, run_fingerprint)
    from optimized.serving.ranks import StepBroadcast, follow
    timeout_s = collective_timeout_s(cfg.parallel_config.collective_timeout_s)
    with named_collective_errors(timeout_s):
        env = init_distributed(timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with named_collective_errors(timeout_s):
            check_ranks_agree(run_fingerprint(cfg.to_dict(), cfg.model_config.model_path, [], serve=True))
            engine, tokenizer, stop_ids, model_dir = build_engine(cfg, args.kv_pool_blocks, not args.no_weight_check,
                                                                  env)
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            broadcast = StepBroadcast(group)
            if env.rank == 0:
                return _serve(args, cfg, engine, tokenizer, stop_ids, model_dir, broadcast)
            follow(engine, broadcast)
            return 0
    except (CollectiveTimeoutError, RankMismatchError) as e:
        raise UsageError(f"rank {env.rank}: {e}") from None
    except RuntimeError as e:    # gloo: a peer closed its connection (a rank died)
        raise UsageError(f"rank {env.rank}: a rank failed: {type(e).__name__}: {e}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(args, cfg, engine, tokenizer, stop_ids, model_dir, broadcast) -> int:
    name = args.served_model_name or Path(str(cfg.model_config.model_path).split(":")[-1]).name
    server, driver = make_server(cfg, engine, tokenizer, stop_ids, name, args.host, args.port, broadcast)
    driver.start()
    print(f"serving {name} ({model_dir}) on http://{args.host}:{args.port} : batch_size "
          f"{cfg.scheduler_config.batch_size}, KV pool {engine.cache.num_blocks} blocks of "
          f"{engine.cache.block_size}", flush=True)
    try:
        server.run()
    finally:
        driver.stop()
    if driver.error is not None:
        raise UsageError(f"the engine stopped: {type(driver.error).__name__}: {driver.error}")
    return 0
