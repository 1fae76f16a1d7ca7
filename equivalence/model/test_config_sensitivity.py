"""Every config value the models read decides some test, so no fixture can hide a bug that ignores it.

A bug that ignores a config value computes the same thing whatever the value. So each field is set to two
(or three) values, the models of each value keeping every weight of the previous value's that the change
leaves in place (all of them unless the field changes the checkpoint layout):
- the values are far apart for transformers (ground truth): its logits move by more than FAR times the
  `model.float32` bounds; where the field changes the layout (tensor names or shapes), both the reference
  and the optimized loader must also reject one value's weights under the other value;
- at every value the reference equals transformers and the optimized model equals the reference (packed
  prefill + paged decode), within `model.float32`.
A model ignoring the field gives one answer for both values, so it fails at one of them at least (or cannot
load one layout). Fields: every Qwen3MoeConfig size, count, layer rule and constant the models compute
with, plus max_position_embeddings (the position limit: transformers' default RoPE never reads it),
vocab_size as the token-id limit and the router precision policy of the bf16 optimized MoE block (keys the
models only validate, and tie_word_embeddings, have their own tests). Configs drawn by hypothesis then
cover the combinations (head ratios 1-6, head_dim != hidden / heads, odd expert counts, top-k 1..E, dense
layers by each rule).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from equivalence.support.compare import assert_bitwise_equal, assert_close, describe, max_abs, rel_l2, tolerance
from equivalence.support.dist import get_pool
from equivalence.support.parallel_support import run_property, same_on_all_ranks
from equivalence.model.sensitivity import Trio, config_of, layout, optimized_logits, prompts_for
from equivalence.support.strategies import describe_layout, layouts, seeds, tiny_model_configs

SEED = 20250602
PROMPT_LENGTHS = [23, 9]  # two packed requests; the first crosses a 16-token cache block
FORCED = [[5, 6], [7, 8]]  # two teacher-forced decode steps (token per request)
FAR = 100  # "far beyond the tolerance": the logits must move by FAR x the table's bounds
TOL = "model.float32"

# With unit-scale activations every RMSNorm input has mean square ~1 and eps (<= 1e-3) moves logits by
# ~1e-5 relative, under the fp32 tolerance. These factors on the drawn weights (embedding 0.1: hidden
# states ~1e-2; q/k/v/o and down projections 0.03: q/k ~1e-2 and small residual updates) put the mean
# square of every norm's input at ~1e-4..2e-3, where eps 1e-3 vs 1e-6 is a large change (checked per norm
# in test_rms_norm_eps_decides_every_norm).
EPS_SCALES = {"embed_tokens": 0.1, "q_proj": 0.03, "k_proj": 0.03, "v_proj": 0.03, "o_proj": 0.03, "down_proj": 0.03}


@dataclasses.dataclass(frozen=True)
class FieldCase:
    field: str
    values: tuple
    bug: str  # what ignoring the field would look like
    base: dict = dataclasses.field(default_factory=dict)  # changes to the "tiny" config that make the field read
    scales: dict | None = None

    def config(self, value):
        return config_of(**{**self.base, self.field: value})


CASES = [
    FieldCase("hidden_size", (64, 48), "a hard-coded or fixture width: one layout cannot load"),
    FieldCase(
        "intermediate_size",
        (96, 80),
        "the dense MLP sized by moe_intermediate_size or a constant",
        base=dict(mlp_only_layers=[0]),
    ),
    FieldCase("moe_intermediate_size", (32, 40), "experts sized by intermediate_size or a constant"),
    FieldCase("num_attention_heads", (8, 12), "a fixed head count (12: 6 query heads per KV head)"),
    FieldCase("head_dim", (16, 24, None), "head_dim taken as hidden/heads (8), or required when absent"),
    FieldCase("num_key_value_heads", (2, 1), "KV heads = query heads, or a fixed GQA group"),
    FieldCase("num_experts", (16, 7), "a fixed expert count (7: odd)"),
    FieldCase("num_experts_per_tok", (4, 1), "a fixed top-k: same weights, other experts mixed"),
    FieldCase("norm_topk_prob", (True, False), "top-k weights always (or never) renormalized"),
    FieldCase("mlp_only_layers", ([0], [1]), "a listed layer built sparse (expects expert tensors)"),
    FieldCase("decoder_sparse_step", (1, 2, 3), "every layer sparse, or a fixed step", base=dict(num_hidden_layers=3)),
    FieldCase("num_hidden_layers", (2, 3), "a fixed depth"),
    FieldCase(
        "rms_norm_eps", (1e-6, 1e-3), "eps hard-coded (1e-6 is also the default); weights scaled", scales=EPS_SCALES
    ),
    FieldCase("rope_theta", (1e6, 1e4), "a fixed RoPE base (1e4 is transformers' default)"),
    FieldCase("vocab_size", (512, 389), "a fixed vocabulary (389: odd)"),
]


CASE = {c.field: c for c in CASES}
PROMPTS = prompts_for(min(CASE["vocab_size"].values), PROMPT_LENGTHS, SEED)  # valid ids for every case


@functools.lru_cache(maxsize=None)
def trio(field_name: str, index: int) -> Trio:
    """The models at the field's index-th value; they keep every weight of the previous value's models that
    the change leaves in place (same name and shape), so the logits move by the field's effect."""
    case = CASE[field_name]
    share = trio(field_name, index - 1).hf.state_dict() if index else None
    return Trio.build(case.config(case.values[index]), SEED, case.scales, share)


def all_logits(t: Trio, which: str) -> torch.Tensor:
    """transformers' ("hf"), the reference's ("ref") or the optimized ("opt") logits of PROMPTS + FORCED."""
    return torch.cat(getattr(t, f"{which}_logits")(PROMPTS, FORCED))


def assert_far_apart(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str:
    """`actual` differs from `expected` by more than FAR x the TOL bounds (elementwise somewhere, and rel_l2)."""
    tol = tolerance(TOL)
    beyond = ((actual - expected).abs() > FAR * (tol.atol + tol.rtol * expected.abs())).any()
    err = rel_l2(actual, expected)
    assert beyond and err > FAR * tol.max_rel_l2, (
        f"{what}: transformers' logits barely move ({describe(actual, expected)}); the fixture cannot tell a "
        f"model that ignores this change from one that follows it"
    )
    return f"rel_l2 {err:.3e}, max_abs {max_abs(actual, expected):.3e}"


def assert_both_loaders_reject(config, state, what: str) -> None:
    """Weights laid out for another value of the field do not load into a model built for `config`."""
    import optimized.model_loader.loader
    import reference.checkpoint
    from optimized.model_loader.build import model_from_source

    with pytest.raises(reference.checkpoint.CheckpointError):
        reference.checkpoint.model_from_state_dict(config, state)
    with pytest.raises(optimized.model_loader.loader.CheckpointError):
        model_from_source(config, optimized.model_loader.loader.StateDictSource(state, label=what), dtype=torch.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.field)
def test_field_decides_transformers_logits_and_both_models_follow(case: FieldCase):
    trios = [trio(case.field, i) for i in range(len(case.values))]
    for value, t in zip(case.values, trios):
        hf, ref, opt = (all_logits(t, w) for w in ("hf", "ref", "opt"))
        assert_close(ref, hf, TOL, f"{case.field}={value!r}: reference vs transformers")
        assert_close(opt, ref, TOL, f"{case.field}={value!r}: optimized vs reference")
    report = []
    for (va, a), (vb, b) in zip(zip(case.values, trios), zip(case.values[1:], trios[1:])):
        what = f"{case.field} {va!r} -> {vb!r} ({case.bug})"
        wa, wb = a.hf.state_dict(), b.hf.state_dict()  # transformers' names (fused expert tensors)
        shared = [n for n in wa if n in wb and wa[n].shape == wb[n].shape]
        for name in shared:
            assert_bitwise_equal(wb[name], wa[name], f"{what}: weight {name}")
        vocab = min(a.config.vocab_size, b.config.vocab_size)  # logits compared over the common vocabulary
        line = f"{va!r}->{vb!r}: " + assert_far_apart(
            all_logits(b, "hf")[:, :vocab], all_logits(a, "hf")[:, :vocab], what
        )
        if layout(a.state) != layout(b.state):
            # A model that ignored the field could not load one of the two layouts.
            assert_both_loaders_reject(a.config, b.state, f"{what}: weights for {vb!r}")
            assert_both_loaders_reject(b.config, a.state, f"{what}: weights for {va!r}")
            line += f"; layout differs, {len(shared)}/{len(wa)} tensors shared"
        report.append(line)
    print(f"{case.field}: " + "; ".join(report))


NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm")


def test_rms_norm_eps_decides_every_norm():
    """Each RMSNorm (per layer, per kind) is eps-sensitive on the eps fixture: a model that ignored eps in
    just one kind of norm would still move the logits far beyond the tolerance."""
    small, large = trio("rms_norm_eps", 0), trio("rms_norm_eps", 1)
    expected = all_logits(large, "hf")
    changes = []
    for kind in NORMS:
        modules = [m for n, m in large.hf.named_modules() if n.endswith(kind) and hasattr(m, "variance_epsilon")]
        assert modules, kind
        for m in modules:
            m.variance_epsilon = small.config.rms_norm_eps
        try:
            changes.append(f"{kind} " + assert_far_apart(all_logits(large, "hf"), expected, f"eps of {kind} only"))
        finally:
            for m in modules:
                m.variance_epsilon = large.config.rms_norm_eps
    print("rms_norm_eps 1e-3 -> 1e-6 in one kind of norm: " + "; ".join(changes))


@pytest.mark.parametrize("limit", [40, 300])
def test_max_position_embeddings_is_the_position_limit(limit):
    """transformers' default RoPE does not read max_position_embeddings; the models make it the limit: all
    of positions 0..limit-1 compute transformers' logits (the optimized RoPE cache covers them), position
    `limit` is an error naming the key. 40 and 300 lie on both sides of the fixtures' 256 and below the
    default 32768, so a cache or a check sized by any one constant fails one of them."""
    from optimized.executor.model_runner import ModelRunner

    t = Trio.build(config_of(max_position_embeddings=limit), SEED)
    prompts = prompts_for(t.config.vocab_size, [limit - 1, 5], SEED)
    forced = [[11, 12]]  # the first request's decode step is at position limit - 1
    hf, ref, opt = (torch.cat(getattr(t, f"{w}_logits")(prompts, forced)) for w in ("hf", "ref", "opt"))
    assert_close(ref, hf, TOL, f"max_position_embeddings={limit}: reference vs transformers")
    assert_close(opt, ref, TOL, f"max_position_embeddings={limit}: optimized vs reference")

    message = f"max_position_embeddings={limit}"
    with pytest.raises(ValueError, match=message):
        t.ref(torch.tensor([prompts[0] + [1, 2]]))
    with pytest.raises(ValueError, match=message):
        optimized_logits(t.opt, prompts, forced + [[13, 14]])
    runner = ModelRunner(t.opt, 16)
    assert len(runner.generate([prompts[0][:-1]], 2).tokens[0]) == 2
    with pytest.raises(ValueError, match=message):
        runner.generate([prompts[0]], 2)


@pytest.mark.parametrize("index", [0, 1], ids=["vocab512", "vocab389"])
def test_vocab_size_bounds_token_ids(index):
    """Token id vocab_size - 1 is read, vocab_size is an error naming the key, in the reference and in the
    optimized runner (the vocab-parallel embedding would silently embed an out-of-shard id as zeros)."""
    from optimized.executor.model_runner import ModelRunner

    t = trio("vocab_size", index)
    vocab = t.config.vocab_size
    runner = ModelRunner(t.opt, 16)
    assert len(runner.generate([[vocab - 1, 0]], 1).tokens[0]) == 1
    with torch.no_grad():
        assert t.ref(torch.tensor([[vocab - 1, 0]])).shape[-1] == vocab
    for call in (lambda: runner.generate([[vocab, 0]], 1), lambda: t.ref(torch.tensor([[vocab, 0]]))):
        with pytest.raises(ValueError, match=f"vocabulary \\[0, {vocab}\\)"):
            call()


# ------------------------------------------------------------------------------------------ router policy


class _Capture(TorchDispatchMode):
    """Records the inputs of every call of one operator."""

    def __init__(self, op_name: str):
        super().__init__()
        self.op_name, self.inputs = op_name, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().split("::")[-1].split(".")[0] == self.op_name:
            self.inputs.append(args[0].clone())
        return func(*args, **(kwargs or {}))


def test_bf16_router_logits_are_fp32_logits_of_bf16_hidden_states():
    """In a bf16 optimized model, the logits each MoE block hands to npu_moe_gating_top_k_softmax are
    float32 and bitwise F.linear(hidden.float(), gate weight in float32) of its bf16 input, as the recipe
    routes (checked on the logits themselves, so no top-k flip can hide a change). On these inputs the bf16
    logits differ from the fp32 ones by far more than fp32 rounding, so a bf16 router fails here."""
    from optimized.model_loader.build import model_from_source
    from optimized.layers.moe import Qwen3MoeSparseMoeBlock
    from optimized.model_loader.loader import StateDictSource

    t = trio("hidden_size", 0)  # the "tiny" config
    model = model_from_source(t.config, StateDictSource(t.state), dtype=torch.bfloat16)
    blocks = [(i, l.mlp) for i, l in enumerate(model.layers) if isinstance(l.mlp, Qwen3MoeSparseMoeBlock)]
    assert blocks
    seen: list[tuple[int, torch.Tensor]] = []
    hooks = [b.register_forward_pre_hook(lambda mod, args, i=i: seen.append((i, args[0].clone()))) for i, b in blocks]
    capture = _Capture("npu_moe_gating_top_k_softmax")
    try:
        with capture:
            optimized_logits(model, PROMPTS, FORCED)
    finally:
        for h in hooks:
            h.remove()
    assert len(capture.inputs) == len(seen) == len(blocks) * (1 + len(FORCED))
    op_tol = tolerance("op.float32")
    gaps = []
    for (layer, hidden), logits in zip(seen, capture.inputs):
        weight = t.state[f"model.layers.{layer}.mlp.gate.weight"]  # float32, as loaded
        assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32, (hidden.dtype, logits.dtype)
        expected = F.linear(hidden.float(), weight)  # [T, E]
        assert_bitwise_equal(logits, expected, f"layer {layer} router logits ({hidden.shape[0]} tokens)")
        in_bf16 = F.linear(hidden, weight.to(torch.bfloat16)).float()
        assert ((in_bf16 - expected).abs() > op_tol.atol + op_tol.rtol * expected.abs()).any(), (
            f"layer {layer}: bf16 router logits equal the fp32 ones within op.float32 on this input"
        )
        gaps.append(max_abs(in_bf16, expected))
    print(
        f"router dtype: bf16 vs fp32 router logits differ by max_abs {min(gaps):.3e} (smallest over "
        f"{len(gaps)} block calls); the optimized block's logits equal the fp32 ones bitwise"
    )


# ------------------------------------------------------------------------------------------ drawn configs


@functools.lru_cache(maxsize=8)
def drawn_trio(kwargs_key: str, seed: int) -> Trio:
    return Trio.build(config_of(**json.loads(kwargs_key)), seed)


def _trio_of(kwargs: dict, seed: int) -> Trio:
    """The drawn config's models, shared by the properties that draw the same config and seed."""
    return drawn_trio(json.dumps(kwargs, sort_keys=True), seed)


def prompt_sets(config):
    """1-3 prompts of 1-40 tokens that fit the config's vocabulary and position limit."""
    room = min(40, config.max_position_embeddings - 2)
    return st.lists(st.integers(1, room), min_size=1, max_size=3).flatmap(
        lambda lengths: st.integers(0, 2**31 - 1).map(lambda s: prompts_for(config.vocab_size, lengths, s))
    )


# Per drawn-config property: half the profile's examples (ci: 10; thorough: 500).
DRAWN = settings(max_examples=max(1, settings.default.max_examples // 2))


@DRAWN
@given(kwargs=tiny_model_configs(), seed=seeds, data=st.data())
def test_drawn_config_reference_equals_transformers_float32(kwargs, seed, data):
    t = _trio_of(kwargs, seed)
    prompts = data.draw(prompt_sets(t.config), label="prompts")
    for b, (ref, hf) in enumerate(zip(t.ref_logits(prompts), t.hf_logits(prompts))):
        assert_close(ref, hf, TOL, f"{kwargs} request {b}: reference vs transformers")


@DRAWN
@given(kwargs=tiny_model_configs(), seed=seeds, data=st.data())
def test_drawn_config_optimized_equals_reference_float32(kwargs, seed, data):
    t = _trio_of(kwargs, seed)
    prompts = data.draw(prompt_sets(t.config), label="prompts")
    steps = data.draw(st.integers(0, 2), label="decode steps")
    forced = prompts_for(t.config.vocab_size, [len(prompts)] * steps, seed)
    for b, (opt, ref) in enumerate(zip(t.opt_logits(prompts, forced), t.ref_logits(prompts, forced))):
        assert_close(opt, ref, TOL, f"{kwargs} request {b}: optimized (prefill + {steps} decode) vs reference")


@torch.no_grad()
def _drawn_logits_task(rank, world, kwargs, state, lay, prompts, forced):
    import optimized  # noqa: F401  (registers torch.ops.npu.*)
    from optimized.model_loader.build import model_from_source
    from optimized.distributed import ParallelState
    from optimized.model_loader.loader import StateDictSource

    model = model_from_source(
        config_of(**kwargs), StateDictSource(state), parallel=ParallelState.build(**lay), dtype=torch.float32
    )
    return optimized_logits(model, prompts, forced)


@pytest.mark.distributed
def test_drawn_config_optimized_on_2_ranks_equals_reference_float32():
    """A drawn structure sharded over 2 gloo ranks (a drawn valid layout: attention TP, MoE TP or EP, vocab)."""

    def check(kwargs, seed, data):
        t = _trio_of(kwargs, seed)
        lay = data.draw(layouts(2, t.config), label="layout")
        prompts = data.draw(prompt_sets(t.config), label="prompts")
        forced = prompts_for(t.config.vocab_size, [len(prompts)] * 2, seed)
        got = same_on_all_ranks(
            get_pool(2).run(_drawn_logits_task, kwargs, t.state, lay, prompts, forced, timeout=120),
            "drawn-config logits",
        )
        for b, (opt, ref) in enumerate(zip(got, t.ref_logits(prompts, forced))):
            assert_close(opt, ref, TOL, f"{describe_layout(lay)} {kwargs} request {b}: optimized vs reference")

    run_property(check, 4, kwargs=tiny_model_configs(), seed=seeds, data=st.data())
