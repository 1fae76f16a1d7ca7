"""What one forward step needs besides the token ids: positions, lengths, cache slots (TND layout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardMetadata:
    is_prefill: bool
    positions: torch.Tensor                    # [T] int64, position of each packed token in its request
    actual_seq_lengths_cu_q: list[int]         # [B] cumulative query lengths (TND)
    actual_seq_lengths_kv: list[int]           # [B] prefill: cumulative (== cu_q); decode: per-request KV length
    slot_mapping: torch.Tensor                 # [T] int64, cache slot of each token: block * block_size + offset
    block_table: torch.Tensor                  # [B, max_blocks] int32, padded with the null block 0
    block_size: int

    @property
    def max_position(self) -> int:
        """The largest position of the step, from the host lists (no device read): a prefill's longest prompt,
        a decode's longest KV length, minus one. -1 for an empty step."""
        if not self.actual_seq_lengths_kv:
            return -1
        if self.is_prefill:
            cu = self.actual_seq_lengths_cu_q
            return max(b - a for a, b in zip([0, *cu[:-1]], cu)) - 1
        return max(self.actual_seq_lengths_kv) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
