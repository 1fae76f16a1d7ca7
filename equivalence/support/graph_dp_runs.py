"""Graph-mode decode under attention data parallelism against eager, on pool ranks."""

from __future__ import annotations

import torch

from equivalence.support.strategies import BLOCK_SIZE

NEW_TOKENS = 4


def _compile_fn(compiler: str):
    """GraphDecoder's compiler: None (the platform's: the torchair stand-in, inductor here) or dynamo + AOTAutograd
    without codegen, static and run as a GE graph (torchair's decode attention runs only in one), as ge_graph is."""
    if compiler != "aot_eager":
        return None
    from optimized.torchair_standin import running_ge_graph

    def compile_step(step):
        compiled = torch.compile(step, backend="aot_eager", dynamic=False, fullgraph=True)

        def run(*args):
            with running_ge_graph():
                return compiled(*args)

        return run

    return compile_step


DP_PROMPTS = [
    [5, 6, 7],
    list(range(1, 18)),
    [9, 4],
    list(range(40, 71)),
    [3] * 6,
]  # DP 2: groups of 3 and 2 (+ a dummy)


@torch.no_grad()
def _graph_dp_vs_eager_task(rank, world, path, lay, compiler, prompts, n, dtype=torch.float32):
    from torch._dynamo.utils import counters

    from optimized.distributed import ParallelState
    from optimized.executor.graph import GraphDecoder
    from optimized.executor.model_runner import ModelRunner
    from optimized.model_loader.build import load_model

    model = load_model(path, parallel=ParallelState.build(**lay), dtype=dtype, num_hidden_layers=1)
    runner = ModelRunner(model, BLOCK_SIZE)
    eager = runner.generate(prompts, n, return_logits=True)
    torch._dynamo.reset()
    runner.decode_forward = GraphDecoder(model, "ge_graph", compiler=_compile_fn(compiler))
    graphs = counters["stats"]["unique_graphs"]
    graph = runner.generate(prompts, n, return_logits=True)
    return {
        "eager": (eager.tokens, [t.clone() for t in eager.logits]),
        "graph": (graph.tokens, [t.clone() for t in graph.logits]),
        "captured": {
            "graphs": counters["stats"]["unique_graphs"] - graphs,
            "breaks": sum(counters["graph_break"].values()),
            "padding": dict(runner.decode_forward.padding),
        },
    }
