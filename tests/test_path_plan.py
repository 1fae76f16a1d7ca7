"""The plan decides, everyone reads: `path_plan.decide_paths` is the one rule of every phase's path, and no other
module decides again.

- The rule itself, over fixed and drawn layouts (hypothesis) and every scheme of the quantization table: attention
  DP, the SP prefill only where the layout asks for it and the scheme allows it, the EP scheme, the wire the scheme's
  row names, the MC2 decode.
- The guard, read from the source with `ast`: the old deciders (`sp_prefill()`, `uses_mx_prefill`, `choose_ep_scheme`,
  `mx_activation_bits`, `uses_mc2_decode`) and the MC2 window computed beside the plan (`mc2_window`) are gone;
  `decide_paths` is called only by the plan and by a model built without one; the layout's own facts
  (`ParallelConfig.sp_prefill`, `.mc2_decode`) are read only where the rule and the groups need them (the parallel
  bench, the latency harness and the first-divergence report read the plan); no product module compares a scheme
  name (it asks the table's row).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from optimized.config import ConfigError, InferenceConfig, ParallelConfig
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.schemes import MXFP8_WIRE, SCHEMES
from optimized.path_plan import ALLGATHER, ALLTOALL, DP, MC2, SP, TP, WIRE_16_BIT, decide_paths

ROOT = Path(__file__).resolve().parents[1]
MODEL = SimpleNamespace(num_experts_per_tok=4, num_attention_heads=64, head_dim=128, hidden_size=4096)

LAYOUTS = [
    dict(world_size=1),
    dict(world_size=2, attn_tp_size=2, moe_tp_size=2),  # TP, moe_infer_tp decode
    dict(world_size=2, attn_tp_size=2, moe_tp_size=1, prefill_opt=False),  # TP prefill, MC2 decode
    dict(world_size=2, attn_tp_size=2, moe_tp_size=1),  # SP by default, allgather (top_k 4 >= 2)
    dict(world_size=4, attn_tp_size=4, moe_tp_size=1),  # SP, allgather: top_k 4 == moe_ep_size 4 (the tie)
    dict(world_size=8, attn_tp_size=8, moe_tp_size=1),  # SP, alltoall: top_k 4 < 8
    dict(world_size=4, attn_tp_size=4, moe_tp_size=1, moe_ep_scheme="alltoall"),
    dict(world_size=4, attn_tp_size=2, moe_tp_size=1),  # attention DP
    dict(world_size=4, attn_tp_size=2, moe_tp_size=2, attn_dp=False),  # replicated attention, MoE TP 2 x EP 2
]


def _check_the_rule(parallel: ParallelConfig, scheme, model=MODEL) -> None:
    row = SCHEMES[scheme]
    if parallel.prefill_opt and not row.sp_prefill:
        with pytest.raises(QuantConfigError, match="parallel_config.prefill_opt"):
            decide_paths(model, parallel, scheme)
        return
    paths = decide_paths(model, parallel, scheme)
    assert paths == decide_paths(model, parallel, row)  # a name or its row: the same decision
    if parallel.attn_dp_size > 1:
        assert (paths.prefill, paths.ep_scheme, paths.wire, paths.decode) == (DP, ALLTOALL, WIRE_16_BIT, DP)
        return
    assert paths.decode == (MC2 if parallel.moe_tp_size == 1 and parallel.moe_ep_size > 1 else TP)
    if not (parallel.sp_prefill and row.sp_prefill):
        assert (paths.prefill, paths.ep_scheme, paths.wire) == (TP, None, None)
        return
    auto = ALLGATHER if model.num_experts_per_tok >= parallel.moe_ep_size else ALLTOALL
    assert paths.prefill == SP
    assert paths.ep_scheme == (auto if parallel.moe_ep_scheme == "auto" else parallel.moe_ep_scheme)
    assert paths.wire == (row.sp_wire or WIRE_16_BIT)


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=str)
def test_the_one_rule(sizes, scheme):
    cfg = {"parallel_config": sizes, "scheduler_config": {"batch_size": 4}}
    _check_the_rule(InferenceConfig.from_dict(cfg).parallel_config, scheme)


@st.composite
def _parallel_configs(draw) -> ParallelConfig:
    """Layouts the config accepts: sizes dividing the world, the options drawn as a file may set or leave them."""
    world = draw(st.sampled_from([1, 2, 4, 8]))
    divisors = [d for d in (1, 2, 4, 8) if world % d == 0]
    sizes = dict(
        world_size=world,
        attn_tp_size=draw(st.sampled_from(divisors)),
        moe_tp_size=draw(st.sampled_from(divisors)),
        moe_ep_scheme=draw(st.sampled_from(["auto", "allgather", "alltoall"])),
    )
    for key in ("prefill_opt", "attn_dp"):
        value = draw(st.sampled_from([None, True, False]))
        if value is not None:
            sizes[key] = value
    try:
        cfg = InferenceConfig.from_dict({"parallel_config": sizes, "scheduler_config": {"batch_size": 8}})
    except ConfigError:
        assume(False)  # a layout the config refuses never reaches the plan
    return cfg.parallel_config


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(parallel=_parallel_configs(), scheme=st.sampled_from(list(SCHEMES)), top_k=st.integers(1, 8))
def test_the_one_rule_over_drawn_layouts(parallel, scheme, top_k):
    model = SimpleNamespace(num_experts_per_tok=top_k, num_attention_heads=64, head_dim=128, hidden_size=4096)
    _check_the_rule(parallel, scheme, model)


def test_the_mxfp8_wire_comes_from_the_table_row():
    sp = ParallelConfig(world_size=2, attn_tp_size=2, moe_tp_size=1)
    wires = {name: decide_paths(MODEL, sp, name).wire for name, row in SCHEMES.items() if row.sp_prefill}
    assert wires == {name: SCHEMES[name].sp_wire or WIRE_16_BIT for name in wires}
    assert MXFP8_WIRE in wires.values()


# ------------------------------------------------------------------------------------------------- the guard

# The old deciders, and the window computed beside the plan: the rule and the plan's `mc2_window_mb` replaced them.
GONE = {"uses_mx_prefill", "choose_ep_scheme", "mx_activation_bits", "uses_mc2_decode", "mc2_window"}
# Who may call the rule: the plan, and a model built without one (tests, the benches' own builds).
DECIDES = {"optimized/path_plan.py", "optimized/executor/plan.py", "optimized/model.py"}
# The layout's own facts, read by the rule, by the config that defines them, and where the groups and the decode
# volume / window formulas need the layout itself (the MC2 group exists for an MC2 layout, whatever the plan).
READS_LAYOUT_FACT = {
    "sp_prefill": {"optimized/config.py", "optimized/path_plan.py"},
    "mc2_decode": {
        "optimized/config.py",
        "optimized/path_plan.py",
        "optimized/distributed/parallel_state.py",
        "optimized/distributed/decode_plan.py",
    },
}
SCHEME_NAMES = {"W4A4", "W4A8", "W8A8", "w4a4", "w4a8", "w8a8"}


def _sources(*tops: str):
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _names(tree) -> set[str]:
    """Every identifier used or imported (plain names, import aliases, function names)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.alias):
            found.add(node.name.rpartition(".")[2])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
    return found


def _attributes(tree) -> set[str]:
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def _calls(tree, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name for n in ast.walk(tree)
    )


def _calls_name(tree, name: str) -> bool:
    """A plain call `name(...)` (not a method of that name)."""
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == name for n in ast.walk(tree))


SOURCES = dict(_sources("optimized", "equivalence", "tests"))


def test_the_old_deciders_are_gone():
    users = {path: sorted(_names(tree) & GONE) for path, tree in SOURCES.items() if _names(tree) & GONE}
    assert not users, f"the plan's rule (optimized/path_plan.py) replaced these deciders: {users}"
    # sp_prefill survives only as the layout's property: no function of that name, no import or call of one
    for path, tree in SOURCES.items():
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.alias)} | {
            f.name for f in functions if not any(getattr(d, "id", None) == "property" for d in f.decorator_list)
        }
        assert "sp_prefill" not in defined and not _calls_name(tree, "sp_prefill"), (path, "sp_prefill()")


def test_only_the_plan_calls_the_rule():
    callers = {path for path, tree in SOURCES.items() if path.startswith("optimized/") and _calls(tree, "decide_paths")}
    assert callers <= DECIDES, f"{sorted(callers - DECIDES)} decide the phase paths again: read the plan's `paths`"


def test_the_layout_facts_are_read_only_where_allowed():
    readers = set()
    for path, tree in SOURCES.items():
        if path.startswith("tests/") or "/test_" in path or path.startswith("optimized/benchmarks/budget"):
            continue  # tests probe the facts; a latency budget has its own `sp_prefill` field (which it measures)
        for fact, allowed in READS_LAYOUT_FACT.items():
            if fact in _attributes(tree) and path not in allowed:
                readers.add((path, fact))
    assert not readers, f"read the plan's paths (ExecutionPlan.paths, model.paths) instead: {sorted(readers)}"


def test_no_product_module_compares_a_scheme_name():
    """Ask the quantization table's row (schemes.SCHEMES) instead of an if-chain naming W4A4 / W4A8 / W8A8."""
    found = []
    for path, tree in SOURCES.items():
        if not path.startswith("optimized/") or path.startswith("optimized/benchmarks/"):
            continue  # the benchmarks' precisions are the budgets' own names (budgets.yaml)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for op in operands:
                    elements = op.elts if isinstance(op, (ast.Tuple, ast.List, ast.Set)) else [op]
                    for e in elements:
                        if getattr(e, "id", None) in SCHEME_NAMES or getattr(e, "value", None) in SCHEME_NAMES:
                            found.append(f"{path}:{node.lineno}")
    assert not found, f"scheme names compared outside the table: {found}"


def test_the_guard_sees_a_planted_decision():
    planted = ast.parse(
        "from optimized.path_plan import decide_paths\n"
        "def f(p, row):\n"
        "    if row.name == W4A4 or p.mc2_decode:\n"
        "        return decide_paths(None, p)\n"
    )
    assert _calls(planted, "decide_paths") and "mc2_decode" in _attributes(planted)
    compares = [n for n in ast.walk(planted) if isinstance(n, ast.Compare)]
    assert any(getattr(n.comparators[0], "id", None) == "W4A4" for n in compares)
