"""`python -m optimized bench`: latency of reference vs optimized vs HF transformers beside the floors
(optimized/benchmarks/bench.py; `--world-size N` runs the parallel prefill bench).
`python -m optimized bench serve ...`: load a running server (optimized/benchmarks/serve_bench.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from optimized.benchmarks import bench, serve_bench

    p = sub.add_parser(
        "bench",
        help="latency: reference vs optimized vs transformers, beside the memory-bandwidth "
        "floor; `bench serve`: load a running server",
    )
    bench.add_arguments(p)
    modes = p.add_subparsers(dest="bench_mode", required=False, metavar="serve")
    serve_bench.add_arguments(
        modes.add_parser(
            "serve",
            help="TTFT / TPOT / ITL / throughput against `serve` (workloads: " + ", ".join(serve_bench.WORKLOADS) + ")",
        )
    )


def run(args) -> int:
    if getattr(args, "bench_mode", None) == "serve":
        from optimized.benchmarks import serve_bench

        return serve_bench.run(args)
    from optimized.benchmarks import bench

    return bench.run(args)
