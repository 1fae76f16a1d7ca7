"""Command line: `python -m optimized generate | serve | bench | latency | convert`, one module per subcommand.

    python -m optimized generate --config YAML [--model-path P] [--prompt TEXT ... | --prompt-ids 1,2,3 ...]
                                 [--chat] [--max-new-tokens N] [--dtype bfloat16|float32]
                                 [--temperature T] [--top-k K] [--top-p P] [--seed S] [--ignore-eos]
                                 [--save-logits FILE] [--no-weight-check]
    torchrun --nproc-per-node N -m optimized generate --config YAML ...   (N == parallel_config.world_size)
    python -m optimized bench [--preset qwen3_30b_a3b|qwen3_235b_a22b|tiny] [--layers 2] [--batch 1]
                              [--prompt-len 128] [--decode-steps 8] [--warmup 1] [--repeats 3]
                              [--dtype bfloat16|float32] [--skip-hf] [--json PATH]
    torchrun --nproc-per-node N -m optimized latency --budget NAME --json PATH [--model-path DIR]
                                                                          (N = the budget's world size)
    python -m optimized convert --quant w4a8 SRC DST [--no-progress]
    python -m optimized serve --config YAML [--host H] [--port P]    (OpenAI-compatible server)
    python -m optimized bench serve --url http://H:P [--request-rate R|inf] [--num-prompts N] ...

Errors a user can fix (bad config, bad prompt, world size mismatch or a launch without torchrun, missing or
broken checkpoint, a non-finite weight, an unsupported model config or quantization_config, a read-only
destination, an unsafe compile cache, ranks that disagree, a collective or rendezvous timeout, non-finite
logits, an NPU budget on other hardware) print one line `python -m optimized: error: ...` on stderr and exit
with status 2.
"""
from __future__ import annotations

from optimized.cli import bench, convert, generate, latency, serve
from optimized.cli.common import PROG, Parser, fail
from optimized.errors import UsageError

SUBCOMMANDS = {"generate": generate, "bench": bench, "latency": latency, "convert": convert, "serve": serve}


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
