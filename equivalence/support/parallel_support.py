"""Shared machinery of the multi-rank equivalence tests (test_layers_parallel, test_e2e_parallel,
test_loader_parallel): worker-side model building, the parent-side reference, routing-flip accounting.

Worker side (runs inside `equivalence.support.dist` ranks): `rank_model(path, layout, dtype)` builds this rank's
optimized model for a layout (`ParallelState.build(**layout)`, same calls in the same order on every rank)
and keeps the last few in a small cache, so the hypothesis examples of one layout share one build.
`paged_cache` / `runner_of` give a paged KV cache and the runner's metadata builders.

Parent side: `reference_model(name, dtype)` (the independent oracle, cached), `same_on_all_ranks` (every
rank processes the same tokens, so every rank must return bitwise the same activations), `routing_check`
(routing-flip-aware comparison: which tokens picked other experts than the reference, and whether each
such token was a near-tie for the reference; `input_tie_margins` derives each token's near-tie bound from
how far the optimized router's input is from the reference's), `run_property` (a hypothesis property run with a per-call
example budget, capped by the active profile).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from hypothesis import given, settings

from equivalence.support.compare import assert_bitwise_equal
from equivalence.support.strategies import BLOCK_SIZE

# Where the worker side builds the optimized model: the CPU unless QWEN3_MOE_TEST_DEVICE names another device
# (ci/device_check.sh sets it to cuda: optimized on the GPU, the reference on the CPU, the same comparisons).
TEST_DEVICE_ENV = "QWEN3_MOE_TEST_DEVICE"

_MODEL_CACHE: OrderedDict = OrderedDict()
_MODEL_CACHE_SIZE = 4


# ------------------------------------------------------------------------------------------ worker side


def test_device() -> torch.device:
    """The optimized model's device in the model tests ($QWEN3_MOE_TEST_DEVICE, default the CPU)."""
    name = os.environ.get(TEST_DEVICE_ENV, "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{TEST_DEVICE_ENV}={name!r} is not a device ({e})") from None


def to_device(tree, device):
    """`tree` (nested lists, tuples, dicts) with every tensor moved to `device`."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def on_host(tree):
    """A worker's result with every tensor on the CPU (what the parent compares, and pipes can carry)."""
    return to_device(tree, "cpu")


def rank_model(path: str, layout: dict, dtype: torch.dtype, device: str | None = None):
    """This rank's optimized model (cached per checkpoint, layout, dtype and device; default `test_device()`)."""
    device = str(device or test_device())
    import optimized  # noqa: F401  (registers torch.ops.npu.*)
    from optimized.model_loader.build import load_model
    from optimized.distributed import ParallelState
    from optimized.distributed.parallel_state import groups_generation

    # The groups' generation is part of the key: a task that closed its model (destroy_groups, e.g. the equivalence
    # report's) destroyed the groups every cached model of this rank holds.
    key = (str(path), tuple(sorted(layout.items())), dtype, device, groups_generation())
    if key in _MODEL_CACHE:
        _MODEL_CACHE.move_to_end(key)
        return _MODEL_CACHE[key]
    state = ParallelState.build(**layout)
    model = load_model(path, parallel=state, dtype=dtype, device=device)
    _MODEL_CACHE[key] = model
    while len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return model


def runner_of(model):
    from optimized.executor.model_runner import ModelRunner

    return ModelRunner(model, BLOCK_SIZE)


@contextlib.contextmanager
def generation_with_phase_log(model, on_step):
    """`model` with `on_step(meta, input_ids)` called before each prefill / decode phase run; restored on exit (the
    model may be cached per worker)."""
    phases = list({id(p): p for p in (model.prefill, model.decode)}.values())
    for phase in phases:

        def run(m, input_ids, cos, sin, meta, kv_caches, _run=phase.run):
            on_step(meta, input_ids)
            return _run(m, input_ids, cos, sin, meta, kv_caches)

        phase.run = run
    try:
        yield model
    finally:
        for phase in phases:
            del phase.run


def paged_cache(model, budgets: list[int], num_layers: int | None = None, dtype: torch.dtype | None = None):
    """A paged cache with room for requests of `budgets` tokens, and their block table (dtype: the cache's,
    default the model's activation dtype; float8_e4m3fn: the per-token FP8 cache with its scale caches).

    Blocks are handed out interleaved across requests (request 0 gets blocks 1, 1+B, ...), so a request's
    blocks are not contiguous and every lookup goes through the block table.
    """
    from optimized.executor.kv_cache import PagedKVCache, block_table

    attn = model.layers[0].self_attn
    needs = [-(-n // BLOCK_SIZE) for n in budgets]
    cache = PagedKVCache(
        num_layers or len(model.layers),
        1 + sum(needs),
        BLOCK_SIZE,
        attn.num_kv_heads,
        attn.head_dim,
        dtype or model.dtype,
        model.atten_mask.device,
    )
    blocks: list[list[int]] = [[] for _ in budgets]
    for step in range(max(needs)):
        for r, need in enumerate(needs):
            if step < need:
                blocks[r] += cache.allocate(1)
    return cache, block_table(blocks, model.atten_mask.device)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


# ------------------------------------------------------------------------------------------ parent side


@functools.lru_cache(maxsize=None)
def reference_model(name: str, dtype_name: str = "float32"):
    """The reference model of fixture `name` (fp32 router, as the optimized model routes in fp32)."""
    from fixtures.checkpoints import checkpoint
    from reference.checkpoint import load_model

    return load_model(checkpoint(name), dtype_of(dtype_name), router_dtype="float32")


def same_on_all_ranks(results: list, what: str):
    """Every rank computed the same tokens: their outputs must be bitwise equal. Returns rank 0's."""
    first = results[0]
    for r, other in enumerate(results[1:], start=1):
        _bitwise_tree(other, first, f"{what}: rank {r} vs rank 0")
    return first


def _bitwise_tree(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert_bitwise_equal(a, b, what)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _bitwise_tree(a[k], b[k], f"{what} [{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _bitwise_tree(x, y, f"{what} [{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


@dataclass
class RoutingStats:
    """Routing of `tokens` tokens by the optimized model vs the reference router on the same input."""

    tokens: int = 0
    flips: int = 0  # tokens whose expert set differs from the reference's own top-k
    clear_flips: int = 0  # ... of which the reference margin was NOT a near-tie (a bug)
    worst_margin: float = 0.0  # the largest relative reference margin among flipped tokens

    def __add__(self, other: "RoutingStats") -> "RoutingStats":
        return RoutingStats(
            self.tokens + other.tokens,
            self.flips + other.flips,
            self.clear_flips + other.clear_flips,
            max(self.worst_margin, other.worst_margin),
        )

    @property
    def flip_rate(self) -> float:
        return self.flips / self.tokens if self.tokens else 0.0

    def __str__(self) -> str:
        return (
            f"routing flips {self.flips}/{self.tokens} tokens ({100 * self.flip_rate:.2f}%), "
            f"{self.clear_flips} not near-ties, worst flipped relative margin {self.worst_margin:.2e}"
        )


def input_tie_margins(
    router_weight: torch.Tensor, reference_in: torch.Tensor, optimized_in: torch.Tensor, slack: float
) -> torch.Tensor:
    """Per token [T]: the largest relative top-k margin a router input difference can overturn.

    The router logits of the two inputs differ by d = W (x_ref - x_opt) [T, E]. Expert b can displace a
    from the top-k only if the reference gap l_a - l_b is at most d_a - d_b <= max(d) - min(d) = s, so the
    reference margin (p_k - p_(k+1)) / p_k = 1 - exp(-(l_k - l_(k+1))) of a token that flips is at most
    1 - exp(-s); `slack` adds the fp32 router's own rounding (`router_tie.float32`).
    """
    d = (reference_in.double() - optimized_in.double()) @ router_weight.double().t()  # [T, E]
    spread = d.max(-1).values - d.min(-1).values
    return (1 - torch.exp(-spread)).float() + slack


def routing_check(
    probs: torch.Tensor, top_k: int, optimized_ids: torch.Tensor, near_tie: float | torch.Tensor
) -> RoutingStats:
    """Compare the optimized expert ids [T, K] with the reference router's probabilities [T, E].

    The reference's relative top-k margin of a token is (p_k - p_(k+1)) / p_k over its sorted
    probabilities; a token may pick another expert set only if that margin is below `near_tie` (one bound,
    or one per token [T], e.g. `input_tie_margins`).
    """
    ordered = probs.float().sort(dim=-1, descending=True, stable=True)
    own = ordered.indices[:, :top_k].sort(-1).values
    theirs = optimized_ids.long().sort(-1).values
    flipped = (own != theirs).any(-1)  # [T]
    if top_k < probs.shape[-1]:
        pk, pk1 = ordered.values[:, top_k - 1], ordered.values[:, top_k]
        margin = (pk - pk1) / pk.clamp_min(torch.finfo(torch.float32).tiny)  # [T]
    else:
        margin = torch.zeros(probs.shape[0])
    flipped_margins = margin[flipped]
    bound = near_tie[flipped] if isinstance(near_tie, torch.Tensor) else near_tie
    return RoutingStats(
        tokens=int(probs.shape[0]),
        flips=int(flipped.sum()),
        clear_flips=int((flipped_margins >= bound).sum()),
        worst_margin=float(flipped_margins.max()) if flipped_margins.numel() else 0.0,
    )


def run_property(check, max_examples: int, **strategies) -> None:
    """Run `check(**drawn)` as a hypothesis property with `max_examples` examples under the `ci` profile
    (max_examples 20); profiles with a larger budget scale it (dev 2x, thorough 50x), always capped by it."""
    cap = settings.default.max_examples
    n = max_examples * max(1, cap // 20)
    settings(max_examples=max(1, min(n, cap)))(given(**strategies)(check))()


def decode_metadata(lengths: list[int], table: torch.Tensor, block_size: int = BLOCK_SIZE):
    """One decode step's metadata for requests holding `lengths` tokens (each new token at position lengths[b]),
    built by the engine's own metadata path (`optimized.executor.engine.decode_metadata`) from device positions."""
    from optimized.executor.engine import decode_metadata as engine_decode_metadata

    positions = torch.tensor(lengths, dtype=torch.int64, device=table.device)
    return engine_decode_metadata(positions, [n + 1 for n in lengths], table, block_size)
