"""`python -m optimized pd-router --prefill URL [URL ...] --decode URL [URL ...] [--host H] [--port N]`: the
OpenAI-compatible front of a prefill-decode deployment (optimized/pd/router.py; docs/serving.md).

At start the router reads every instance's /pd/v1/info and refuses, naming the instance, one whose role is not the
one it was given as, or whose served model, KV block size or KV cache dtype differs from the others', and a prefill
and a decode instance whose attention TP sizes do not divide one another. It serves until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import signal
import threading


def add_parser(sub) -> None:
    p = sub.add_parser("pd-router", help="the OpenAI-compatible router in front of prefill and decode instances")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (http://HOST:PORT)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0: any free port)")
    p.add_argument("--port-file", help="write the bound port to this file (one line) once the router serves")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the router waits for an instance's answer, or between two stream chunks (600)",
    )


def start(args):
    """(router server serving on its own thread, its port): the instances checked, the port bound and written."""
    from optimized.errors import UsageError
    from optimized.pd.router import Router, make_server, serve_in_thread
    from optimized.pd.router_instances import Pool
    from optimized.serving.listen import bind, bound_port, write_port_file

    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout={args.timeout} must be a number of seconds > 0")
    pool = Pool(args.prefill, args.decode)
    sock = bind(args.host, args.port)
    try:
        pool.connect(timeout=min(args.timeout, 30.0))
        server = make_server(Router(pool, args.timeout), sock)
    except BaseException:
        sock.close()
        raise
    serve_in_thread(server)
    port = bound_port(sock)
    if args.port_file:
        write_port_file(args.port_file, port)
    roles = ", ".join(f"{i.role} {i.url}" for i in pool.instances)
    print(f"pd-router: serving {pool.model_name} on http://{args.host}:{port} ({roles})", flush=True)
    return server, port


def wait_for_signal(stop: threading.Event | None = None, poll=None) -> None:
    """Blocks until SIGTERM, SIGINT (Ctrl-C), or `poll()` returning True (checked every 0.2 s)."""
    stop = stop or threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.2):
            if poll is not None and poll():
                break
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(args) -> int:
    server, _ = start(args)
    try:
        wait_for_signal()
    finally:
        server.shutdown()
        server.server_close()
    return 0
