"""`python -m optimized bench`: latency of reference vs optimized vs HF transformers beside the floors
(optimized/benchmarks/bench.py; `--world-size N` runs the parallel prefill bench)."""
from __future__ import annotations


def add_parser(sub) -> None:
    from optimized.benchmarks import bench
    bench.add_arguments(sub.add_parser("bench", help="latency: reference vs optimized vs transformers, "
                                                     "beside the memory-bandwidth floor"))


def run(args) -> int:
    from optimized.benchmarks import bench
    return bench.run(args)
