"""Models for any tiny config: transformers, the reference and the optimized model on the same weights.

Used by the config-sensitivity tests and the drawn-config properties (equivalence/model/test_config_sensitivity.py):
- `config_of(**changes)`: the "tiny" fixture config with some keys changed (`rope_theta=` sets
  rope_parameters, `head_dim=None` removes head_dim so it falls back to hidden_size / num_attention_heads);
- `Trio.build(config, seed)`: transformers' model with the fixtures' seeded weight draw, its checkpoint-named
  state dict, and (built on first use) the reference and the optimized model (single process, fp32) on it;
- `Trio.logits(prompts, forced)`: per request, the logits at every prompt position and at each teacher-forced
  decode step, from all three models (the optimized model by one packed prefill, then paged decode steps).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from transformers import Qwen3MoeConfig

from equivalence.support.parallel_support import decode_metadata, paged_cache, runner_of
from fixtures.checkpoints import seeded_model
from fixtures.tiny import TINY_CONFIGS
from reference.checkpoint import model_from_state_dict, split_fused_experts


def config_of(base: str = "tiny", **changes) -> Qwen3MoeConfig:
    kwargs = copy.deepcopy(TINY_CONFIGS[base])
    if "rope_theta" in changes:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": float(changes.pop("rope_theta"))}
    for key, value in changes.items():
        if value is None:
            kwargs.pop(key, None)
        else:
            kwargs[key] = value
    return eager(Qwen3MoeConfig(**kwargs))


def eager(config: Qwen3MoeConfig) -> Qwen3MoeConfig:
    """transformers runs eager attention and the per-expert loop: the math the reference mirrors."""
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in state.items()}


@dataclass
class Trio:
    config: Qwen3MoeConfig
    hf: torch.nn.Module
    state: dict[str, torch.Tensor]  # checkpoint names (per-expert), fp32

    @staticmethod
    def build(
        config: Qwen3MoeConfig,
        seed: int,
        scales: dict[str, float] | None = None,
        share: dict[str, torch.Tensor] | None = None,
    ) -> "Trio":
        """share: a transformers state dict whose tensors replace the drawn ones of the same name and shape
        (so a model of a changed config keeps every weight the change leaves in place)."""
        hf = seeded_model(eager(config), seed, scales)
        if share:
            with torch.no_grad():
                for name, p in hf.state_dict().items():
                    if name in share and share[name].shape == p.shape:
                        p.copy_(share[name])
        return Trio(config, hf, split_fused_experts({k: v.detach().clone() for k, v in hf.state_dict().items()}))

    # Built on first use, so a failure of one model fails only the tests that use it.
    @functools.cached_property
    def ref(self) -> torch.nn.Module:
        return model_from_state_dict(self.config, self.state, torch.float32)

    @functools.cached_property
    def opt(self) -> torch.nn.Module:
        import optimized  # noqa: F401  (registers torch.ops.npu.*)
        from optimized.model_loader.build import model_from_source
        from optimized.model_loader.loader import StateDictSource

        return model_from_source(self.config, StateDictSource(self.state), dtype=torch.float32)

    @torch.no_grad()
    def hf_logits(self, prompts: list[list[int]], forced: list[list[int]] = ()) -> list[torch.Tensor]:
        return [self.hf(torch.tensor([seq])).logits[0] for seq in _sequences(prompts, forced)]

    @torch.no_grad()
    def ref_logits(self, prompts: list[list[int]], forced: list[list[int]] = ()) -> list[torch.Tensor]:
        return [self.ref(torch.tensor([seq]))[0] for seq in _sequences(prompts, forced)]

    @torch.no_grad()
    def opt_logits(self, prompts: list[list[int]], forced: list[list[int]] = ()) -> list[torch.Tensor]:
        return optimized_logits(self.opt, prompts, forced)


def _sequences(prompts, forced):
    return [p + [step[b] for step in forced] for b, p in enumerate(prompts)]


@torch.no_grad()
def optimized_logits(model, prompts: list[list[int]], forced: list[list[int]] = ()) -> list[torch.Tensor]:
    """Per request [len(prompt) + steps, V]: a packed prefill of all prompts, then one paged decode step per
    entry of `forced` (token ids [B] fed at the next position of each request)."""
    runner = runner_of(model)
    cache, table = paged_cache(model, [len(p) + len(forced) for p in prompts])
    ids, meta, _ = runner.prefill_inputs(prompts, table)
    prefill = model(ids, meta, cache.layers)  # [T, V]
    out, start = [], 0
    for p in prompts:
        out.append([prefill[start : start + len(p)]])
        start += len(p)
    lengths = [len(p) for p in prompts]
    for tokens in forced:
        step = model(torch.tensor(tokens), decode_metadata(lengths, table), cache.layers)  # [B, V]
        for b in range(len(prompts)):
            out[b].append(step[b : b + 1])
        lengths = [n + 1 for n in lengths]
    return [torch.cat(parts) for parts in out]


def prompts_for(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
