"""The optimized Qwen3MoeForCausalLM: one decoder layer's data flow fits on one screen.

Tokens are packed (TND: all requests of a step concatenated). The weights are sharded over the process
groups of `comm.ParallelState` (attention TP, MoE TP x EP, embedding TP, lm_head TP). The residual
stream is carried between layers by `npu_add_rms_norm`.

Decode (and prefill without `prefill_opt`): every rank runs every token. Prefill with `prefill_opt`
(sequence parallel, chosen once at build time): rank r of the attention TP group runs packed tokens
[r*n, (r+1)*n), n = ceil(T / P), through embedding, norms and MoE (EP scheme from
`prefill_plan.choose_ep_scheme`), attention gathering the whole sequence; the final-normed hidden states
are gathered for lm_head. The padding of the last slice is created and stripped in `sp_prefill_layers`
alone, and attention drops it before anything reaches the KV cache. A W4A8 checkpoint's SP prefill step
moves MXFP8 instead of bf16 (`layers/mx_prefill.py`, also chosen at build time).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimized.distributed import collectives as comm
from optimized.config import head_dim_of, is_sparse_layer
from optimized.forward_metadata import ForwardMetadata
from optimized.layers.attention import Qwen3MoeAttention, causal_mask_template
from optimized.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from optimized.layers.moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock
from optimized.layers.mx_prefill import MxSpPrefillStep, uses_mx_prefill
from optimized.layers.norm import RMSNorm
from optimized.distributed.prefill_plan import choose_ep_scheme

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
            return key, (value or {}).get(field) if field else value   # e.g. rope_parameters.rope_type
    return None


def check_supported(config) -> None:
    found = unsupported_feature(config)
    if found:
        raise NotImplementedError(f"config {found[0]}={found[1]!r} is not supported by the optimized model")


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, groups, dtype: torch.dtype, ep_scheme: str | None = None,
                 mx_prefill: bool = False):
        super().__init__()
        sp = ep_scheme is not None      # sequence-parallel prefill
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Qwen3MoeAttention(config, groups.attn_tp, dtype, sequence_parallel=sp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        sparse = is_sparse_layer(config, layer_idx)
        if sparse:
            self.mlp = Qwen3MoeSparseMoeBlock(config, groups.moe_tp, groups.moe_ep, dtype, ep_scheme)
        else:
            self.mlp = Qwen3MoeMLP(config, groups.moe_tp, dtype)
        # (attention, mlp) of a prefill step and of a decode step; decode always takes the TP path.
        self.steps = {True: (self.self_attn.forward_sp if sp else self.self_attn,
                             self.mlp.forward_ep if sp and sparse else self.mlp),
                      False: (self.self_attn, self.mlp)}
        # W4A8 under the SP prefill: the prefill step moves MXFP8 instead (optimized/layers/mx_prefill.py).
        self.mx_prefill = MxSpPrefillStep(sparse) if mx_prefill else None

    def load(self, source, prefix: str) -> None:
        self.input_layernorm.load(source, f"{prefix}.input_layernorm.weight")
        self.self_attn.load(source, f"{prefix}.self_attn")
        self.post_attention_layernorm.load(source, f"{prefix}.post_attention_layernorm.weight")
        self.mlp.load(source, f"{prefix}.mlp")

    def forward(self, hidden, residual, cos, sin, meta: ForwardMetadata, kv_cache, atten_mask):
        if meta.is_prefill and self.mx_prefill is not None:
            return self.mx_prefill(self, hidden, residual, cos, sin, meta, kv_cache, atten_mask)
        attn, mlp = self.steps[meta.is_prefill]
        if residual is None:            # first layer: nothing to add yet
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = attn(hidden, cos, sin, meta, kv_cache, atten_mask)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, config, groups, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        check_supported(config)
        self.config, self.groups, self.dtype = config, groups, dtype
        self.ep_scheme = (choose_ep_scheme(groups.parallel, config.num_experts_per_tok)
                          if groups.parallel.sp_prefill else None)
        self.mx_prefill = uses_mx_prefill(config, groups.parallel)     # W4A8 + SP prefill: MXFP8 on the wire
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups.embed_tp, dtype)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i, groups, dtype, self.ep_scheme, self.mx_prefill)
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
        # A prefill runs sequence parallel when the layout chose it at build time (self.ep_scheme).
        run = self.sp_prefill_layers if meta.is_prefill and self.ep_scheme else self.run_layers
        hidden = run(input_ids, cos, sin, meta, kv_caches)                    # [T, H], final-normed
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden)

    def run_layers(self, input_ids, cos, sin, meta: ForwardMetadata, kv_caches) -> torch.Tensor:
        """Every rank runs every token: ids [T] -> final-normed hidden states [T, H]."""
        hidden, residual = self.embed_tokens(input_ids), None                  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache, self.atten_mask)
        return self.norm(hidden, residual)[0]

    def sp_prefill_layers(self, input_ids, cos, sin, meta: ForwardMetadata, kv_caches) -> torch.Tensor:
        """Sequence-parallel prefill: this rank runs its n = ceil(T / P) tokens; ids [T] -> hidden [T, H]."""
        sp, tokens = self.groups.attn_tp, input_ids.shape[0]
        n = -(-tokens // sp.size)
        ids = F.pad(input_ids, (0, n * sp.size - tokens))                     # [P*n], padded with id 0
        mine = slice(sp.rank * n, (sp.rank + 1) * n)
        # A vocab-parallel lookup sums over its group, so every rank of that group looks up the same ids.
        hidden = self.embed_tokens(ids[mine]) if self.groups.embed_tp.size == 1 else self.embed_tokens(ids)[mine]
        residual = None                                                        # [n, H] from here on
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache, self.atten_mask)
        hidden, _ = self.norm(hidden, residual)
        return comm.all_gather(hidden, sp.group)[:tokens]                     # padding rows stripped


def rope_cos_sin_cache(config) -> torch.Tensor:
    """[max_positions, 2*D] float32: cos | sin of the rotate_half RoPE with the config's rope_theta."""
    dim = head_dim_of(config)
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq   # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                                       # [P, D]
    return torch.cat((emb.cos(), emb.sin()), dim=-1)
