"""`python -m optimized latency`: one latency budget (optimized/benchmarks/budgets.yaml) on this rank; under
torchrun, one process per rank (optimized/benchmarks/budget_run.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from optimized.benchmarks import budget_run

    budget_run.add_arguments(
        sub.add_parser(
            "latency",
            help="one latency budget (optimized/benchmarks/budgets.yaml) "
            "on this rank; under torchrun, one process per rank",
        )
    )


def run(args) -> int:
    from optimized.benchmarks import budget_run

    return budget_run.run(args)
