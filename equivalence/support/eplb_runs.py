"""Expert load balancing helpers: drawn placements, and one MoE layer built with a placement on each gloo rank."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fixtures.checkpoints import checkpoint, w4a4_checkpoint, w4a8_checkpoint, w8a8_checkpoint
from fixtures.tiny import tiny_config

CONFIG = tiny_config("tiny")
E = CONFIG.num_experts
# W4A4: the experts are not rotated (only the attention linears are), so the unrotated conversion covers them.
# bfloat16: the float checkpoint served in bf16, whose CPU GEMMs read oneDNN packed copies of the expert weights.
CHECKPOINTS = {
    "float32": checkpoint,
    "bfloat16": checkpoint,
    "w8a8": w8a8_checkpoint,
    "w4a8": w4a8_checkpoint,
    "w4a4": w4a4_checkpoint,
}
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "w8a8": torch.bfloat16,
    "w4a8": torch.bfloat16,
    "w4a4": torch.bfloat16,
}


@st.composite
def placements(draw, ep: int, max_redundant: int = 8) -> tuple[int, ...]:
    """physical_to_logical of E + R slots (R a multiple that divides evenly over `ep` ranks, 0 included): every
    expert once in a drawn order, plus R drawn replicas (one expert may take several: uneven replica counts)."""
    r = draw(st.sampled_from([r for r in range(max_redundant + 1) if (E + r) % ep == 0]))
    extra = draw(st.lists(st.integers(0, E - 1), min_size=r, max_size=r))
    return tuple(draw(st.permutations(list(range(E)) + extra)))


def eplb_block(path: str, base, layer_idx: int, p2l: tuple[int, ...]):
    """Layer `layer_idx`'s MoE block of the checkpoint at `path`, built for this rank with placement `p2l` (read from
    the checkpoint, its runtime layouts made as the model's are), beside `base`, the rank's model without EPLB."""
    from optimized.layers.eplb.placement import ExpertPlacement
    from optimized.layers.moe import Qwen3MoeSparseMoeBlock
    from optimized.layers.quantization.lifecycle import process_weights_after_loading
    from optimized.model_loader.loader import CheckpointReader

    groups, device = base.groups, base.embed_tokens.weight.device
    placement = ExpertPlacement(p2l, base.config.num_experts, groups.moe_ep.size)
    prefix = f"model.layers.{layer_idx}.mlp"
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(
            base.config, groups.moe_tp, groups.moe_ep, base.dtype, False, base.quant_config, prefix, placement
        )
    with torch.no_grad():
        block.load(CheckpointReader(path), prefix)
    process_weights_after_loading(block, weight_nz=base.weight_nz)
    return block.eval()


def permuted_experts_source(path: str, perm: tuple[int, ...]):
    """The checkpoint at `path` as a StateDictSource whose expert e is the checkpoint's expert perm[e] (weights and
    scales): a checkpoint saved with its experts permuted."""
    from optimized.model_loader.loader import CheckpointReader, StateDictSource

    reader = CheckpointReader(path)
    out = {}
    for name in reader.names():
        head, sep, rest = name.partition(".mlp.experts.")
        if sep:
            expert, _, tail = rest.partition(".")
            src = f"{head}{sep}{perm[int(expert)]}.{tail}"
            out[name] = reader._tensor(src)[:]
        else:
            out[name] = reader._tensor(name)[:]
    return StateDictSource(out, label=f"{path} (experts permuted)")
