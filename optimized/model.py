"""The optimized Qwen3MoeForCausalLM: one decoder layer's data flow fits on one screen.

Tokens are packed (TND: all requests of a step concatenated). Every rank runs every token; the weights
are sharded over the process groups of `comm.ParallelState` (attention TP, MoE TP x EP, embedding TP,
lm_head TP). The residual stream is carried between layers by `npu_add_rms_norm`.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import is_sparse_layer
from .forward_metadata import ForwardMetadata
from .layers.attention import Qwen3MoeAttention, causal_mask_template
from .layers.embedding import ParallelLMHead, VocabParallelEmbedding
from .layers.moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock
from .layers.norm import RMSNorm

UNSUPPORTED = {
    "use_sliding_window": lambda c: bool(getattr(c, "use_sliding_window", False)),
    "attention_bias": lambda c: bool(getattr(c, "attention_bias", False)),
    "hidden_act": lambda c: getattr(c, "hidden_act", "silu") != "silu",
    "rope_parameters.rope_type": lambda c: (c.rope_parameters or {}).get("rope_type", "default") != "default",
    "tie_word_embeddings": lambda c: bool(getattr(c, "tie_word_embeddings", False)),
}


def check_supported(config) -> None:
    for key, unsupported in UNSUPPORTED.items():
        if unsupported(config):
            value = getattr(config, key.split(".")[0], None)
            raise NotImplementedError(f"config {key}={value!r} is not supported by the optimized model")


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, groups, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Qwen3MoeAttention(config, groups.attn_tp, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if is_sparse_layer(config, layer_idx):
            self.mlp = Qwen3MoeSparseMoeBlock(config, groups.moe_tp, groups.moe_ep, dtype)
        else:
            self.mlp = Qwen3MoeMLP(config, groups.moe_tp, dtype)

    def load(self, source, prefix: str) -> None:
        self.input_layernorm.load(source, f"{prefix}.input_layernorm.weight")
        self.self_attn.load(source, f"{prefix}.self_attn")
        self.post_attention_layernorm.load(source, f"{prefix}.post_attention_layernorm.weight")
        self.mlp.load(source, f"{prefix}.mlp")

    def forward(self, hidden, residual, cos, sin, meta: ForwardMetadata, kv_cache, atten_mask):
        if residual is None:            # first layer: nothing to add yet
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta, kv_cache, atten_mask)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, config, groups, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        check_supported(config)
        self.config, self.groups, self.dtype = config, groups, dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups.embed_tp, dtype)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i, groups, dtype)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, groups.lmhead_tp, dtype)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)
        self.register_buffer("atten_mask", causal_mask_template(), persistent=False)

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

    def forward(self, input_ids: torch.Tensor, meta: ForwardMetadata, kv_caches,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] packed -> logits [T, V] (or only at `logits_indices`)."""
        max_pos = self.config.max_position_embeddings
        # A host-side check (a device sync): graph mode checks the positions before the compiled step.
        if not torch.compiler.is_compiling() and meta.num_tokens and int(meta.positions.max()) >= max_pos:
            raise ValueError(f"position {int(meta.positions.max())} exceeds max_position_embeddings={max_pos}")
        cos, sin = self.rotary(meta.positions)
        hidden, residual = self.embed_tokens(input_ids), None                  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache, self.atten_mask)
        hidden, _ = self.norm(hidden, residual)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden)


def rope_cos_sin_cache(config) -> torch.Tensor:
    """[max_positions, 2*D] float32: cos | sin of the rotate_half RoPE with the config's rope_theta."""
    dim = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq   # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                                       # [P, D]
    return torch.cat((emb.cos(), emb.sin()), dim=-1)
