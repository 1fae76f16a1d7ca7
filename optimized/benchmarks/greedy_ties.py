"""Tie-aware judgement of generated tokens against a reference teacher-forced on them.

`judge_tokens(reference_logits [N, V], tokens [N], atol, rtol) -> TokenJudgement`: row j is the reference run on the
prompt and the candidate's own tokens before j (so one flip does not end the comparison), and each position is
- agree: the candidate's token is a reference argmax (exact ties agree);
- near-tie: not, but the reference's margin to it is within 2 atol + rtol (|x_top1| + |x_token|), what the logit
  noise of two runs can overturn;
- divergence: a larger margin.
One implementation for `bench` (optimized vs reference, atol / rtol from `LOGIT_NOISE`, which
tests/test_endpoint_judge.py pins to the tolerance table) and `equivalence.endpoint` (any server vs the reference,
atol / rtol from the table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# (atol, rtol) of one logit, optimized vs reference, by dtype: the tolerance table's model.float32 and
# model.parallel.bfloat16 (bench cannot import the test suite's table; a test holds these equal to it).
LOGIT_NOISE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (0.125, 2e-2),
}


@dataclass
class Position:
    position: int  # index among the generated tokens
    token: int  # the candidate's token
    reference_token: int  # the reference's argmax there
    margin: float  # reference logit of its argmax minus that of the candidate's token
    top2_margin: float  # reference's top-1 minus top-2 logit
    bound: float  # the margin the noise can overturn


@dataclass
class TokenJudgement:
    positions: int
    agree: int
    near_ties: list[Position] = field(default_factory=list)
    divergences: list[Position] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences

    @property
    def first_difference(self) -> Position | None:
        diffs = sorted(self.near_ties + self.divergences, key=lambda p: p.position)
        return diffs[0] if diffs else None

    def to_json(self) -> dict:
        return {
            "positions": self.positions,
            "agree": self.agree,
            "ok": self.ok,
            "near_ties": [asdict(p) for p in self.near_ties],
            "divergences": [asdict(p) for p in self.divergences],
        }

    def verdict(self) -> str:
        """One line: 'same', or the first difference (near-tie or divergence, with the reference's top-2 margin) and
        the agreement after teacher forcing."""
        first = self.first_difference
        if first is None:
            return f"same ({self.positions} tokens)"
        tie = first in self.near_ties
        return (
            f"{'near-tie' if tie else 'DIVERGENCE'} at token {first.position + 1} (reference top-2 margin "
            f"{first.top2_margin:.3g}, margin to the chosen token {first.margin:.3g} {'<=' if tie else '>'} "
            f"noise bound {first.bound:.3g}); after teacher forcing {self.agree} of {self.positions} agree, "
            f"{len(self.near_ties)} near-tie(s), {len(self.divergences)} divergence(s)"
        )


def judge_tokens(
    reference_logits: torch.Tensor, tokens: torch.Tensor, atol: float, rtol: float, offset: int = 0
) -> TokenJudgement:
    """reference_logits [N, V] (row j chose token j, teacher-forced), tokens [N] on the same device; one host read.
    offset: the position number of row 0 (for requests judged in parts)."""
    logits = reference_logits.float()  # [N, V]
    tokens = tokens.to(logits.device).long()
    top = torch.topk(logits, min(2, logits.shape[-1]), dim=-1)  # [N, 2]
    top1 = top.values[:, 0]
    top2 = top.values[:, -1]
    chosen = logits.gather(-1, tokens[:, None])[:, 0]  # [N]
    margin = top1 - chosen
    bound = 2 * atol + rtol * (top1.abs() + chosen.abs())
    differs = margin > 0  # a token whose logit equals the maximum is an argmax too (exact ties agree)
    rows = torch.stack(
        [differs.float(), margin, top1 - top2, bound, top.indices[:, 0].float(), tokens.float()], dim=-1
    ).tolist()  # the one host read
    out = TokenJudgement(positions=len(rows), agree=0)
    for j, (diff, m, m2, b, ref, tok) in enumerate(rows):
        if not diff:
            out.agree += 1
            continue
        p = Position(offset + j, int(tok), int(ref), m, m2, b)
        (out.near_ties if m <= b else out.divergences).append(p)
    return out


def merge(parts: list[TokenJudgement]) -> TokenJudgement:
    """Several requests' judgements as one (positions numbered within each request)."""
    out = TokenJudgement(positions=sum(p.positions for p in parts), agree=sum(p.agree for p in parts))
    for p in parts:
        out.near_ties += p.near_ties
        out.divergences += p.divergences
    return out
