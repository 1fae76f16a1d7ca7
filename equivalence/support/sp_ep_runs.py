"""Sequence-parallel prefill helpers: prompt lengths that cover the padding cases, a rank's slice of the
tokens, and the token slots an expert-parallel exchange sends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from equivalence.support.strategies import (
    prompt_length,
)
from fixtures.tiny import tiny_config

CONFIG = tiny_config("tiny")

VOCAB, H, E, K = CONFIG.vocab_size, CONFIG.hidden_size, CONFIG.num_experts, CONFIG.num_experts_per_tok


@st.composite
def sp_prompt_lengths(draw, ranks: int, max_len: int = 40):
    """Prompt lengths whose total is rarely a multiple of P: S = kP + 1, 2-3 packed requests, S < P, 1 token.

    The first kind is what a one-example run draws (hypothesis starts from the simplest example): S = P + 1,
    so every rank holds 2 tokens and all but one pad.
    """
    kind = draw(st.sampled_from(("kp_plus_1", "packed", "below_p", "one_token")))
    if kind == "one_token":
        return [1]
    if kind == "below_p":
        return [draw(st.integers(1, max(1, ranks - 1)))]
    if kind == "kp_plus_1":
        return [draw(st.integers(1, (max_len - 1) // ranks)) * ranks + 1]
    return draw(st.lists(prompt_length(max_len), min_size=2, max_size=3))


def _mine(x: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank `rank`'s rows of the packed rows x (padded with zeros to a multiple of `ranks`)."""
    n = -(-x.shape[0] // ranks)
    return F.pad(x, (0, 0, 0, n * ranks - x.shape[0]))[rank * n : (rank + 1) * n]


def _slots(ids: torch.Tensor, ranks: int, rank: int) -> tuple[int, int]:
    """(slots of rank's tokens on other ranks' experts, slots of other ranks' tokens on rank's experts)."""
    n, local = ids.shape[0] // ranks, E // ranks
    owner_of_token = torch.arange(ids.shape[0])[:, None] // n
    owner_of_expert = ids.long() // local
    remote = owner_of_token != owner_of_expert
    return int((remote & (owner_of_token == rank)).sum()), int((remote & (owner_of_expert == rank)).sum())
