"""The optimized Qwen3MoeForCausalLM: one decoder layer's data flow fits on one screen.

Tokens are packed (TND: all requests of a step concatenated). The weights are sharded over the process groups of
`distributed.ParallelState` (attention TP, MoE TP x EP, embedding TP, lm_head TP). The residual stream is carried
between layers by `npu_add_rms_norm`. How each phase moves activations between ranks (tensor parallel, the
sequence-parallel prefill in bf16 or with MXFP8 on the wire) is decided once by the plan (optimized/path_plan.py)
and built as a strategy (optimized/phases.py): the phase owns the layer loop and hands each layer its step. The
checkpoint's quantization is parsed once (`QuantConfig`, optimized/layers/quantization/config.py), which gives each
linear and the experts their quant method by checkpoint prefix when the layers are built.
"""

from __future__ import annotations

import torch
from torch import nn

from optimized.config import head_dim_of, is_sparse_layer
from optimized.forward_metadata import ForwardMetadata
from optimized.layers.attention import Qwen3MoeAttention, causal_mask_template
from optimized.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from optimized.layers.eplb.placement import eplb_placement
from optimized.layers.moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock
from optimized.layers.norm import RMSNorm
from optimized.layers.quantization.config import QuantConfig
from optimized.path_plan import SP, PhasePaths, decide_paths
from optimized.phases import build_phases

UNSUPPORTED = {
    "use_sliding_window": lambda c: bool(getattr(c, "use_sliding_window", False)),
    "attention_bias": lambda c: bool(getattr(c, "attention_bias", False)),
    "hidden_act": lambda c: getattr(c, "hidden_act", "silu") != "silu",
    "rope_parameters.rope_type": lambda c: (c.rope_parameters or {}).get("rope_type", "default") != "default",
    "tie_word_embeddings": lambda c: bool(getattr(c, "tie_word_embeddings", False)),
}


def unsupported_feature(config) -> tuple[str, object] | None:
    """(key, value) of the first config feature the optimized model does not implement, or None."""
    for key, unsupported in UNSUPPORTED.items():
        if unsupported(config):
            head, _, field = key.partition(".")
            value = getattr(config, head, None)
            return key, (value or {}).get(field) if field else value  # e.g. rope_parameters.rope_type
    return None


def check_supported(config) -> None:
    found = unsupported_feature(config)
    if found:
        raise NotImplementedError(f"config {found[0]}={found[1]!r} is not supported by the optimized model")


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        groups,
        dtype: torch.dtype,
        replicated_o_proj: bool = False,
        force_eplb: bool = False,
        reduce_o_proj: bool = True,
        quant_config: QuantConfig | None = None,
    ):
        """replicated_o_proj / reduce_o_proj: what the phases need of o_proj (optimized/phases.py); quant_config: the
        model's, parsed once (default: from `config`)."""
        super().__init__()
        quant, prefix = quant_config or QuantConfig.from_hf_config(config), f"model.layers.{layer_idx}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Qwen3MoeAttention(
            config, groups.attn_tp, dtype, replicated_o_proj, reduce_o_proj, quant, f"{prefix}.self_attn"
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if is_sparse_layer(config, layer_idx):
            self.mlp = Qwen3MoeSparseMoeBlock(
                config,
                groups.moe_tp,
                groups.moe_ep,
                dtype,
                force_eplb,
                quant,
                f"{prefix}.mlp",
                eplb_placement(config, groups),
            )
        else:
            self.mlp = Qwen3MoeMLP(config, groups.moe_tp, dtype, quant, f"{prefix}.mlp")

    def load(self, source, prefix: str) -> None:
        self.input_layernorm.load(source, f"{prefix}.input_layernorm.weight")
        self.self_attn.load(source, f"{prefix}.self_attn")
        self.post_attention_layernorm.load(source, f"{prefix}.post_attention_layernorm.weight")
        self.mlp.load(source, f"{prefix}.mlp")

    def forward(self, hidden, residual, cos, sin, meta: ForwardMetadata, kv_cache, atten_mask, step):
        """`step`: how the phase moves activations between ranks (optimized/phases.py), chosen at build time."""
        hidden, residual = step.input_norm(self.input_layernorm, hidden, residual)
        hidden = step.attention(self.self_attn, hidden, cos, sin, meta, kv_cache, atten_mask)
        router_in, hidden, residual = step.post_attention_norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp.forward_step(step, router_in, hidden), residual  # step.moe or step.dense_mlp


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(
        self,
        config,
        groups,
        dtype: torch.dtype = torch.bfloat16,
        force_eplb: bool = False,
        quant_config: QuantConfig | None = None,
        paths: PhasePaths | None = None,
    ):
        """force_eplb: model_config.force_eplb, the recipe's balanced expert ids in every MoE layer
        (optimized/layers/force_eplb.py). quant_config: the checkpoint's quantization (the build passes one that
        knows the checkpoint's 16-bit dense projections; default: parsed from `config`). paths: the execution plan's
        phase paths (default: decided here by the plan's one rule, `path_plan.decide_paths`)."""
        super().__init__()
        check_supported(config)
        self.config, self.groups, self.dtype, self.force_eplb = config, groups, dtype, force_eplb
        self.quant_config = quant = quant_config or QuantConfig.from_hf_config(config)  # parsed once
        self.paths = paths or decide_paths(config, groups.parallel, quant.row)
        self.prefill, self.decode = build_phases(config, groups, self.paths)  # the plan's strategies, built once
        if self.prefill.reduces_o_proj != self.decode.reduces_o_proj:  # one o_proj serves both phases
            raise ValueError("the prefill and decode phases disagree on whether o_proj reduces its partial sums")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups.embed_tp, dtype)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(
                config, i, groups, dtype, self.prefill.replicated_o_proj, force_eplb, self.decode.reduces_o_proj, quant
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, groups.lmhead_tp, dtype)
        # Created on the default device (a `with torch.device(...)` build puts them on the model's device).
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)
        self.register_buffer("atten_mask", causal_mask_template(), persistent=False)

    @property
    def ep_scheme(self) -> str | None:
        """The SP prefill's MoE EP scheme ('allgather' / 'alltoall'), None without the SP prefill (the plan's)."""
        return self.paths.ep_scheme if self.paths.prefill == SP else None

    def close(self) -> None:
        """Destroy this model's process subgroups (all ranks together), before the default group goes."""
        self.groups.close()

    def load_weights(self, source) -> None:
        with torch.no_grad():
            self.embed_tokens.load(source, "model.embed_tokens.weight")
            for i, layer in enumerate(self.layers):
                layer.load(source, f"model.layers.{i}")
            self.norm.load(source, "model.norm.weight")
            self.lm_head.load(source, "lm_head.weight")
        source.check_all_used()

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in the activation dtype (computed in float32, as the reference does)."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def forward(
        self, input_ids: torch.Tensor, meta: ForwardMetadata, kv_caches, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [T] packed -> logits [T, V] (or only at `logits_indices`). Under attention DP: this rank's DP
        group's tokens in, that group's logits out (`phases.DataParallelPhase.logits`)."""
        max_pos, vocab = self.config.max_position_embeddings, self.config.vocab_size
        # Checked without reading the device (eager launches never wait on it): the positions on the host lists the
        # step carries, the ids' dtype on the tensor's metadata, their values only where they already are host data
        # (a model on the CPU); on an accelerator the runner checked the prompts and the sampler draws inside the
        # vocabulary. Graph mode checks the same host lists before its compiled step.
        if not torch.compiler.is_compiling():
            if meta.max_position >= max_pos:
                raise ValueError(f"position {meta.max_position} exceeds max_position_embeddings={max_pos}")
            if input_ids.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"input_ids must hold integer token ids (int64 / int32), got dtype {input_ids.dtype}")
            if input_ids.device.type == "cpu" and input_ids.numel():
                low, high = (int(v) for v in torch.aminmax(input_ids))
                if low < 0 or high >= vocab:
                    raise ValueError(
                        f"input_ids holds token id {low if low < 0 else high}, outside the vocabulary [0, {vocab})"
                    )
        cos, sin = self.rotary(meta.positions)
        phase = self.prefill if meta.is_prefill else self.decode
        hidden = phase.run(self, input_ids, cos, sin, meta, kv_caches)  # [T, H], final-normed
        return phase.logits(self, hidden, logits_indices, meta)  # lm_head (attention DP: the DP group's)


def rope_cos_sin_cache(config) -> torch.Tensor:
    """[max_positions, 2*D] float32: cos | sin of the rotate_half RoPE with the config's rope_theta."""
    dim = head_dim_of(config)
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return torch.cat((emb.cos(), emb.sin()), dim=-1)
