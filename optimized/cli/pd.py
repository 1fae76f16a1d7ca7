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


def run(args) -> int:
    from optimized.pd.launch import run as launch

    return launch(args)
