"""`python -m optimized pd --prefill-config P.yaml --decode-config D.yaml --port N [--prefill-nproc K]
[--decode-nproc M]`: a prefill instance, a decode instance and the router on one machine (optimized/pd/launch.py;
docs/serving.md). Each instance is its own job (torchrun with its own rendezvous when its nproc > 1); the router
serves on --port once both instances answer /health. SIGTERM or Ctrl-C stops all three; an instance that exits is
named and the status is 1.
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("pd", help="prefill instance + decode instance + router on one machine")
    p.add_argument("--prefill-config", required=True, help="the prefill instance's inference config YAML")
    p.add_argument("--decode-config", required=True, help="the decode instance's inference config YAML")
    p.add_argument("--prefill-nproc", type=int, default=1, help="processes of the prefill instance (its world_size)")
    p.add_argument("--decode-nproc", type=int, default=1, help="processes of the decode instance (its world_size)")
    p.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default 8000; 0: any free port)")
    p.add_argument("--port-file", help="write the router's port to this file once it serves")
    p.add_argument("--instance-host", default="127.0.0.1", help="the instances' address (default 127.0.0.1)")
    p.add_argument("--served-model-name", help="the model id clients name, given to both instances")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        help="seconds each instance may take to load and answer /health (1800)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="the router's wait for an instance's answer (600)")


def run(args, command=None) -> int:
    """`python -m optimized pd` (optimized/cli/pd.py): status 0 after SIGTERM / Ctrl-C, 1 when an instance exited."""
    import argparse
    import signal
    import tempfile
    from pathlib import Path

    from optimized.cli.pd_router import start as start_router, wait_for_signal
    from optimized.errors import UsageError
    from optimized.pd.launch import Instance, Launcher, say, serve_command

    for flag, n in (("--prefill-nproc", args.prefill_nproc), ("--decode-nproc", args.decode_nproc)):
        if n < 1:
            raise UsageError(f"{flag}={n} must be >= 1")
    for flag, path in (("--prefill-config", args.prefill_config), ("--decode-config", args.decode_config)):
        if not Path(path).is_file():
            raise UsageError(f"{flag} {path!r} is not a file")
    extra = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    with tempfile.TemporaryDirectory(prefix="pd-ports-") as tmp:
        instances = [
            Instance("prefill", args.prefill_config, args.prefill_nproc, Path(tmp) / "prefill.port"),
            Instance("decode", args.decode_config, args.decode_nproc, Path(tmp) / "decode.port"),
        ]
        launcher = Launcher(instances, args.instance_host, command or serve_command, extra, args.startup_timeout)
        server = None
        stopped = []
        try:
            previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append(True) or _interrupt())
            try:
                launcher.start()
                router_args = argparse.Namespace(
                    prefill=[instances[0].url], decode=[instances[1].url], host=args.host, port=args.port,
                    port_file=args.port_file, timeout=args.timeout,
                )  # fmt: skip
                server, _ = start_router(router_args)
            finally:
                signal.signal(signal.SIGTERM, previous)
            wait_for_signal(poll=lambda: launcher.dead() is not None)
            dead = launcher.dead()
            if dead is not None:
                say(f"{dead.name} exited with status {dead.exited()}; stopping")
                return 1
            say("stopping")
            return 0
        except KeyboardInterrupt:
            say("interrupted while starting; stopping")
            return 0 if stopped else 130
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()
            launcher.stop()


def _interrupt():
    raise KeyboardInterrupt
