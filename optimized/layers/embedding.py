"""Vocabulary-parallel embedding and the column-parallel LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimized.distributed import collectives as comm
from optimized.layers.linear import ColumnParallelLinear, _split


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*V/tp, (r+1)*V/tp); each looks up the ids it owns, zeros elsewhere, all_reduce sums.

    The sum adds exact zeros to one real row, so it is bit-exact in every dtype.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp, dtype: torch.dtype):
        super().__init__()
        self.tp, self.vocab_size, self.hidden_size = tp, vocab_size, hidden_size
        self.rows_per_rank = _split(vocab_size, tp.size, "vocab_size")
        self.start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype), requires_grad=False)

    def load(self, source, name: str) -> None:
        rows = slice(self.start, self.start + self.rows_per_rank)
        self.weight.copy_(source.read(name, (self.vocab_size, self.hidden_size), (rows,)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        owned = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        out = out.masked_fill(~owned.unsqueeze(-1), 0)
        return comm.all_reduce(out, self.tp.group)


class ParallelLMHead(ColumnParallelLinear):
    """lm_head split by vocabulary rows across `tp`; the logits slices are all-gathered."""

    def __init__(self, hidden_size: int, vocab_size: int, tp, dtype: torch.dtype):
        super().__init__(hidden_size, vocab_size, tp, dtype, gather_output=True)
