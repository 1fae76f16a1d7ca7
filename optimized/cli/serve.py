"""`python -m optimized serve --config X.yaml [--host 127.0.0.1] [--port 8000]`: the OpenAI-compatible server.

The YAML is `generate`'s inference config, assembled the same way (optimized/executor/assembly.py: the plan printed,
the MC2 window sized for batch_size, the compile cache, mem_fraction_static, the profiler over the whole run);
server-only settings are flags (--host, --port, --served-model-name, --kv-pool-blocks: by default the pool is sized by
memory, what mem_fraction_static of the device leaves after the weights and a measured activation peak, capped at
batch_size requests of input_max_len + max_new_tokens within max_position_embeddings, per DP group under attention
DP: optimized/executor/kv_pool.py; the plan prints it). In graph mode every decode bucket is compiled or loaded
before the port opens. Under torchrun rank 0 serves HTTP and the other ranks follow
its engine steps (optimized/serving/ranks.py). docs/serving.md.
"""

from __future__ import annotations

from pathlib import Path

from optimized.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("--config", required=True, help="inference config YAML (see optimized/config.py)")
    p.add_argument("--model-path", help="overrides model_config.model_path")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0: any free port)")
    p.add_argument(
        "--port-file",
        help="write the bound port to this file (one line) as soon as it is bound, before the model loads",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers (from its first byte); slower: dropped (30)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a client may take to send a request's body after its headers; slower: 408 and dropped (60)",
    )
    p.add_argument("--served-model-name", help="the model id clients name (default: the model path's last part)")
    p.add_argument(
        "--kv-pool-blocks",
        type=int,
        help="paged KV pool size in blocks per DP group, the null block included (default: sized by memory from "
        "scheduler_config.mem_fraction_static, capped at what batch_size requests can use)",
    )
    p.add_argument("--no-weight-check", action="store_true", help="skip the load-time finite-weight check")
    p.add_argument(
        "--pd-role",
        choices=("prefill", "decode"),
        help="prefill-decode disaggregation: this instance's role (docs/serving.md); default: colocated",
    )
    p.add_argument(
        "--pd-hold-timeout",
        type=float,
        default=120.0,
        help="prefill: seconds a request's KV stays held for a decode instance that does not claim it (120)",
    )
    p.add_argument(
        "--pd-transfer-host",
        default="127.0.0.1",
        help="the address this instance's ranks give the KV transfer engine (one other machines reach; 127.0.0.1)",
    )
    p.add_argument(
        "--pd-transfer-protocol",
        choices=("tcp", "ascend"),
        default="tcp",
        help="the Mooncake transfer protocol: tcp (CPU), ascend (NPU, the mooncake-transfer-engine-npu build)",
    )


def load_config(args):
    from optimized.executor.assembly import load_config as load

    return load(args.config, model_path=args.model_path)


def start(cfg, kv_pool_blocks: int | None = None, check_weights: bool = True):
    """The assembly for serving: (started run, engine with every graph bucket ready)."""
    from optimized.executor.assembly import prepare

    if kv_pool_blocks is not None and kv_pool_blocks < 2:
        raise UsageError(f"--kv-pool-blocks={kv_pool_blocks} must be >= 2 (block 0 is the null block)")
    launch = prepare(cfg, "serve", check_weights=check_weights)
    s = cfg.scheduler_config
    run = launch.start(
        batch=s.batch_size,
        prefill_tokens=s.batch_size * cfg.data_config.input_max_len,
        kv_pool_blocks=kv_pool_blocks,
        agree=dict(serve=True),
    )
    try:
        return run, run.engine(warm_up=True)
    except BaseException:
        run.close()
        raise


def build_engine(cfg, kv_pool_blocks: int | None, check_weights: bool = True):
    """(engine, tokenizer, stop ids, model dir) in this single process (library and tests)."""
    from optimized.model_loader.tokenizer import eos_token_ids

    run, engine = start(cfg, kv_pool_blocks, check_weights)
    return engine, run.launch.tokenizer, eos_token_ids(run.launch.model_dir), run.launch.model_dir


def make_server(
    cfg, engine, tokenizer, stop_ids, model_name: str, sock, broadcast=None, timeouts=(30.0, 60.0), pd=None
):
    """(uvicorn server on the bound socket `sock`, driver): the driver's fatal error stops the server. timeouts:
    (header, body) read bounds in seconds. pd: the instance's `PdInstance` under prefill-decode disaggregation."""
    from optimized.serving.app import build_app
    from optimized.serving.driver import Driver
    from optimized.serving.http_server import Server

    server_box = []
    driver = Driver(engine, on_fatal=lambda e: setattr(server_box[0], "should_exit", True), broadcast=broadcast, pd=pd)
    app = build_app(
        driver,
        tokenizer,
        model_name,
        stop_ids=stop_ids,
        default_max_tokens=cfg.scheduler_config.max_new_tokens,
        max_prompt_tokens=cfg.data_config.input_max_len,
        body_timeout_s=timeouts[1],
    )
    server = Server(app, sock, header_timeout_s=timeouts[0])
    server_box.append(server)
    return server, driver


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"serve needs {e.name}: pip install 'qwen3-moe-npu[serve]'") from None
    cfg = load_config(args)
    timeouts = [("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)]
    for flag, value in timeouts + [("--pd-hold-timeout", getattr(args, "pd_hold_timeout", 120.0))]:
        if not 0 < value < float("inf"):
            raise UsageError(f"{flag}={value} must be a number of seconds > 0")
    sock = listen(args)
    try:
        run_, engine = start(cfg, args.kv_pool_blocks, not args.no_weight_check)
        try:
            with run_.named_errors(), run_.profiled(args.config):
                if run_.env.world_size == 1:
                    return _serve(args, cfg, run_, engine, None, sock, pd_instance(args, engine))
                return _serve_ranks(args, cfg, run_, engine, sock)
        finally:
            run_.close()
    finally:
        if sock is not None:
            sock.close()


def listen(args):
    """The HTTP socket, bound before the model loads (a taken port fails in a second, not after the load), on the rank
    that serves (rank 0; None on the others); with --port 0 the port the kernel gave is printed and written to
    --port-file."""
    from optimized import envs
    from optimized.serving.listen import bind, bound_port, write_port_file

    if envs.rank() not in (None, 0):
        return None
    sock = bind(args.host, args.port)
    port = bound_port(sock)
    if args.port_file:
        try:
            write_port_file(args.port_file, port)
        except UsageError:
            sock.close()
            raise
    print(f"bound http://{args.host}:{port} (the model loads next)", flush=True)
    return sock


def _serve_ranks(args, cfg, run_, engine, sock) -> int:
    """One process per rank: rank 0 serves, the others follow its broadcast; a failed rank is named."""
    import datetime
    import torch.distributed as dist
    from optimized.serving.ranks import StepBroadcast, follow

    rank = run_.env.rank
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=run_.timeout_s))
        broadcast = StepBroadcast(group)
        pd = pd_instance(args, engine, group)  # every rank: its transfer engine, named to rank 0
        if rank == 0:
            return _serve(args, cfg, run_, engine, broadcast, sock, pd)
        follow(engine, broadcast, pd)
        return 0
    except RuntimeError as e:  # gloo: a peer closed its connection (a rank died)
        raise UsageError(f"rank {rank}: a rank failed: {type(e).__name__}: {e}") from None


def pd_instance(args, engine, group=None):
    """The instance's side of prefill-decode disaggregation (None without --pd-role): this rank's Mooncake transfer
    engine over its KV cache."""
    if not getattr(args, "pd_role", None):
        return None
    from optimized.pd.instance import PdInstance
    from optimized.pd.transfer_engine import HANDSHAKE, MooncakeTransferEngine

    transfer = MooncakeTransferEngine()
    transfer.initialize(args.pd_transfer_host, HANDSHAKE, args.pd_transfer_protocol, "")
    return PdInstance(args.pd_role, engine, transfer, group, args.pd_hold_timeout)


def _serve(args, cfg, run_, engine, broadcast, sock, pd=None) -> int:
    from optimized.model_loader.tokenizer import eos_token_ids
    from optimized.serving.listen import bound_port

    launch = run_.launch
    name = args.served_model_name or Path(str(cfg.model_config.model_path).split(":")[-1]).name
    timeouts = (args.header_timeout, args.body_timeout)
    stop_ids = eos_token_ids(launch.model_dir)
    server, driver = make_server(cfg, engine, launch.tokenizer, stop_ids, name, sock, broadcast, timeouts, pd)
    driver.start()
    print(
        f"serving {name} ({launch.model_dir}) on http://{args.host}:{bound_port(sock)} : batch_size "
        f"{cfg.scheduler_config.batch_size}, KV pool {engine.cache.num_blocks} blocks of "
        f"{engine.cache.block_size}{' per DP group' if engine.dp_size > 1 else ''}"
        f"{f', prefill-decode role {pd.role}' if pd is not None else ''}",
        flush=True,
    )
    try:
        server.run()
    finally:
        driver.stop()
    if driver.error is not None:
        raise UsageError(f"the engine stopped: {type(driver.error).__name__}: {driver.error}")
    return 0
