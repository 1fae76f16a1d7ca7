"""Next-token choice: greedy (the default, and the tests' mode) or seeded sampling.

`SamplingParams(temperature, top_k, top_p, seed)`: temperature 0 is greedy (argmax, first index on ties,
exactly what the greedy path computes); otherwise the logits are divided by the temperature in float32,
restricted to the top_k largest (0: no limit; ties at the k-th value are kept) and to the smallest set of
most likely tokens whose probability reaches top_p (the most likely token always stays), and one token
is drawn from what is left.

Each request has its own generator, seeded from (seed, request index), so a request's tokens depend only
on its logits and the seed, not on which other requests are in the batch or have finished. Draws happen
on the host (CPU generators: the same stream on every backend). Every rank of a parallel run must draw the
same token: with a seed they do; without one the runner makes rank 0's random seed everyone's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0: no limit)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] logits -> [B, V] float32 probabilities after temperature, top-k and top-p."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs      # mass of the more likely tokens
        drop_sorted = before >= params.top_p                              # the first token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """Chooses one token per request from its logits row (see the module docstring)."""

    def __init__(self, params: SamplingParams, num_requests: int, seed: int | None = None):
        self.params = params
        self.generators = []
        if not params.greedy:
            base = params.seed if params.seed is not None else seed
            if base is None:
                raise ValueError("sampling without SamplingParams.seed needs a seed from the runner")
            self.generators = [torch.Generator().manual_seed(base * 1_000_003 + i) for i in range(num_requests)]

    def __call__(self, logits: torch.Tensor, requests: list[int]) -> torch.Tensor:
        """logits [len(requests), V] -> token ids [len(requests)] (int64, on the logits' device)."""
        if self.params.greedy:
            # On float32, the same index (the conversion is exact and ties keep the first index), and on a CPU
            # about twice as fast over a 152k vocabulary as argmax on 16-bit values.
            return logits.float().argmax(-1)
        probs = filtered_probs(logits, self.params).cpu()
        picks = [torch.multinomial(probs[i], 1, generator=self.generators[r]) for i, r in enumerate(requests)]
        return torch.cat(picks).to(logits.device)
