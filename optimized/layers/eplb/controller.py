"""Expert load balancing while serving: routed-token counts over a window of steps, and a rebalance every
`eplb_step_interval` steps, between steps, in lockstep on every rank.

Each EPLB MoE block counts the rows it routes on the device (per logical expert and per physical slot,
`Qwen3MoeSparseMoeBlock.to_physical`); rows every rank holds are counted on one rank only, a rank's own rows on that
rank. The engine calls `between_steps()` before each step on every rank (the same number of times: the ranks step
together): the last step's counts go into a ring of `eplb_window_size` rows on the device (no host read); every
`eplb_step_interval` calls the window (and each slot's rows since the last rebalance) is summed over the world (one
all_reduce), read once on the host, the greedy policy places each layer anew (layers/eplb/policy.py) and the weights
move (layers/eplb/rearrange.py). The counts before the first step (the warm-up's dummy rows) are dropped. The
summaries `/metrics` shows are the host numbers of the last rebalance.
"""

from __future__ import annotations

import torch

from optimized.distributed import collectives as comm
from optimized.layers.eplb.policy import greedy_placement, rank_imbalance


class EplbController:
    def __init__(
        self, blocks: list, world_group, window_size: int, step_interval: int, layer_ids: list[int] | None = None
    ):
        """blocks: the model's MoE blocks built with a placement (parallel_config.enable_eplb); layer_ids: their
        decoder layers (the metrics' labels; default 0, 1, ...)."""
        self.blocks, self.world_group = blocks, world_group
        self.layer_ids = layer_ids or list(range(len(blocks)))
        self.window_size, self.step_interval = window_size, step_interval
        first = blocks[0].expert_load
        self.window = torch.zeros(window_size, len(blocks), first.shape[0], dtype=torch.int64, device=first.device)
        self.calls = self.position = 0
        self.rebalances = 0
        self.slots_moved = 0
        # Host summaries of the last rebalance, per layer: expert load max / mean, EP-rank rows max / mean.
        self.expert_imbalance: list[float] = []
        self.rank_imbalance: list[float] = []

    @classmethod
    def for_model(cls, model) -> "EplbController | None":
        p = getattr(getattr(model, "groups", None), "parallel", None)
        if p is None or not p.enable_eplb:
            return None
        ids = [i for i, layer in enumerate(model.layers) if getattr(layer.mlp, "eplb", False)]
        if not ids:
            return None
        blocks = [model.layers[i].mlp for i in ids]
        return cls(blocks, model.groups.world.group, p.eplb_window_size, p.eplb_step_interval, ids)

    @torch.no_grad()
    def between_steps(self) -> None:
        """Close the last step's counts into the window; rebalance every `step_interval` calls."""
        self.calls += 1
        if self.calls > 1:  # the first call's counts are the warm-up's (dummy rows): dropped
            self.window[self.position].copy_(torch.stack([b.expert_load for b in self.blocks]))
            self.position = (self.position + 1) % self.window_size
        for b in self.blocks:
            b.expert_load.zero_()
            if self.calls == 1:
                b.slot_load.zero_()
        if self.calls % self.step_interval == 0:
            self.rebalance()

    @torch.no_grad()
    def rebalance(self) -> None:
        """Every rank: the world's window counts -> a new placement per layer -> the weights moved."""
        experts = self.window.shape[2]
        counts = torch.cat([self.window.sum(0), torch.stack([b.slot_load for b in self.blocks])], dim=1)
        counts = comm.all_reduce(counts, self.world_group).tolist()  # [layers, E + slots]: the one host read
        load, slots = [row[:experts] for row in counts], [row[experts:] for row in counts]
        self.expert_imbalance = [max(x) / (sum(x) / len(x)) if sum(x) else 1.0 for x in load]
        self.rank_imbalance = [rank_imbalance(s, b.experts.moe_ep.size) for s, b in zip(slots, self.blocks)]
        for block, counts in zip(self.blocks, load):
            self.slots_moved += block.apply_placement(greedy_placement(counts, block.experts.placement))
            block.slot_load.zero_()
        self.rebalances += 1

    def metrics_lines(self) -> list[str]:
        """The Prometheus lines of /metrics (optimized/serving/metrics.py)."""
        rows = [
            "# HELP qwen3_moe_eplb_rebalances_total Expert placements recomputed and applied (parallel_config."
            "enable_eplb).",
            "# TYPE qwen3_moe_eplb_rebalances_total counter",
            f"qwen3_moe_eplb_rebalances_total {self.rebalances}",
            "# HELP qwen3_moe_expert_load_imbalance Per MoE layer: the most routed logical expert's tokens over the "
            "mean, over the window before the last rebalance.",
            "# TYPE qwen3_moe_expert_load_imbalance gauge",
            *(
                f'qwen3_moe_expert_load_imbalance{{layer="{i}"}} {v}'
                for i, v in zip(self.layer_ids, self.expert_imbalance)
            ),
            "# HELP qwen3_moe_expert_rank_imbalance Per MoE layer: the most loaded EP rank's routed tokens over the "
            "mean, between the last two rebalances.",
            "# TYPE qwen3_moe_expert_rank_imbalance gauge",
            *(
                f'qwen3_moe_expert_rank_imbalance{{layer="{i}"}} {v}'
                for i, v in zip(self.layer_ids, self.rank_imbalance)
            ),
        ]
        return rows
