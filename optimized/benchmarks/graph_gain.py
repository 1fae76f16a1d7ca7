"""How much faster a compiled decode step can be than eager on a CPU host, measured: the graph's gain bound.

A compiled decode step calls most of its work as opaque operators, exactly as eager mode calls them: the prepacked
GEMMs (lm_head, QKV, O), the experts' grouped matmul, the attention and the KV write are the same portable kernels
in both modes (they read host data or hold oneDNN's packed weights, so the compiler cannot trace them). Only the
code the compiler generated (the fused norms, rotary, routing and SwiGLU) and its wrapper can make a graph step
faster than an eager one. `profile_compiled_code` profiles a graph runner's decode steps and returns that code's
own time per step (the median over the steps); `gain_bound` is eager decode over the graph step with that code
taking no time at all: no compiled graph of this model beats it on this host, whatever the compiler does.

CPU only: on an accelerator the profiler's host times are launch times, not kernel times, and there a graph removes
launch overhead, which this bound does not model. Tested by tests/test_graph_gain.py.
"""

from __future__ import annotations

import statistics

from torch.profiler import ProfilerActivity, profile

# Inductor's name for one call of a compiled graph in the profiler (its own record_function).
COMPILED_CALL = "## Call CompiledFxGraph"
# What the compiled wrapper itself does around the operators it calls: allocate and reinterpret its buffers.
WRAPPER_OPS = frozenset({"aten::empty", "aten::empty_strided", "aten::as_strided", "aten::resize_"})


def compiled_code_ms(events) -> list[float]:
    """The compiled code's own milliseconds in each compiled call among `events`: the call's self time (the
    generated kernels and the wrapper's Python) plus its buffer allocations; the operators it calls (and what they
    call) are not counted."""
    out = []
    for e in events:
        if e.name.startswith(COMPILED_CALL):
            opaque_us = sum(c.cpu_time_total for c in e.cpu_children if c.name not in WRAPPER_OPS)
            out.append((e.cpu_time_total - opaque_us) / 1000)
    return out


def profile_compiled_code(run) -> float:
    """The median over the compiled calls while `run()` runs (e.g. a generate whose decode is a graph) of the compiled
    code's own milliseconds (the median: one call slowed by background load does not move it)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    per_call = compiled_code_ms(prof.events())
    if not per_call:
        raise RuntimeError("no compiled graph ran: the gain bound needs a graph runner's decode steps")
    return statistics.median(per_call)


def gain_bound(eager_ms: float, graph_ms: float, compiled_ms: float) -> dict:
    """The bound and its parts, per decode step: the graph step with its compiled code at 0 ms is `graph_ms -
    compiled_ms`; eager over that is the most any graph can gain."""
    if not 0 <= compiled_ms < graph_ms:
        raise ValueError(f"compiled code {compiled_ms:.3f} ms must lie in [0, the graph step {graph_ms:.3f} ms)")
    rest = graph_ms - compiled_ms
    return {
        "compiled_code_ms_per_token": compiled_ms,
        "graph_without_compiled_code_ms_per_token": rest,
        "eager_over_graph_at_most": eager_ms / rest,
    }


def measure(graph_runner, ids: list[list[int]], decode_steps: int, eager_ms: float, graph_ms: float) -> dict | None:
    """The gain bound of `graph_runner` (a ModelRunner with a graph exe_mode), from one profiled generate of
    `decode_steps` decode steps and the unprofiled medians `eager_ms` / `graph_ms`; None off the CPU."""
    device = next(graph_runner.model.parameters()).device
    if device.type != "cpu":
        return None
    compiled = profile_compiled_code(lambda: graph_runner.generate(ids, decode_steps + 1))
    # Profiling slows the compiled code's Python a little: the bound errs towards the graph, never against it.
    return gain_bound(eager_ms, graph_ms, min(compiled, 0.999 * graph_ms))


def format_lines(g: dict) -> list[str]:
    return [
        f"  gain bound (CPU): the compiled code's own time is {g['compiled_code_ms_per_token']:.2f} ms of a graph "
        f"step; the rest ({g['graph_without_compiled_code_ms_per_token']:.2f} ms: the operators eager mode calls the "
        f"same way, and the engine around them) stays, so eager / graph decode is at most "
        f"{g['eager_over_graph_at_most']:.2f}x on this host"
    ]
