"""Command line: `python -m optimized generate | serve | bench | latency | convert | pd-router | pd`, one module per
subcommand.

`parser()` builds the whole parser from each subcommand module's `add_parser(sub)`; `main(argv)` parses, calls that
module's `run(args) -> exit status`, and turns a `UsageError` (a bad config, prompt, launch, checkpoint, quantization
config, destination, compile cache, rank disagreement, timeout, non-finite logits, or a budget on other hardware)
into one line `python -m optimized: error: ...` on stderr and exit status 2. Every option: `--help`, or
docs/config.md for the YAML they read.
"""

from __future__ import annotations

from optimized.cli import bench, convert, generate, latency, pd, pd_router, serve
from optimized.cli.common import PROG, Parser, fail
from optimized.errors import UsageError

SUBCOMMANDS = {
    "generate": generate,
    "bench": bench,
    "latency": latency,
    "convert": convert,
    "serve": serve,
    "pd-router": pd_router,
    "pd": pd,
}


def parser() -> Parser:
    top = Parser(prog=PROG, description="Qwen3-MoE optimized for Ascend NPUs (portable kernels elsewhere)")
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in SUBCOMMANDS.values():
        command.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args)
    except UsageError as e:
        fail(str(e))
