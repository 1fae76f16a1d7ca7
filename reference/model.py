"""Qwen3-MoE, plain and eager: the oracle the optimized model is compared to.

Mirrors the math of transformers' Qwen3MoeForCausalLM (read it top to bottom):
  embed -> N x [x + attn(rmsnorm(x)); x + moe_or_mlp(rmsnorm(x))] -> rmsnorm -> lm_head
  attention: q/k RMSNorm per head (over head_dim) before rotate-half RoPE, GQA, causal, softmax in fp32;
  MoE: softmax router in fp32, top-k, optional renormalization, per-expert SwiGLU, weighted sum, no
  shared experts; a dense SwiGLU MLP for layers in `mlp_only_layers` or off the `decoder_sparse_step`.
Module and parameter names equal the Hugging Face per-expert checkpoint names, so `state_dict()` keys are
the checkpoint's tensor names. Unsupported config features raise UnsupportedConfigError, never run wrong.
tie_word_embeddings=True is supported: lm_head shares the embedding's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3MoeConfig

ROUTER_DTYPES = ("activation", "float32")


class UnsupportedConfigError(ValueError):
    """A config feature this reference does not implement (the message names the key and its value)."""


def head_dim_of(config: Qwen3MoeConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_sparse_layer(config: Qwen3MoeConfig, layer_idx: int) -> bool:
    return layer_idx not in config.mlp_only_layers and (layer_idx + 1) % config.decoder_sparse_step == 0


def check_config(config: Qwen3MoeConfig) -> None:
    """Raise UnsupportedConfigError for anything the reference would otherwise compute wrongly."""

    def bad(key, value, why):
        raise UnsupportedConfigError(f"config {key}={value!r} is not supported by the reference: {why}")

    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ):
        if not isinstance(getattr(config, key), int) or getattr(config, key) < 1:
            bad(key, getattr(config, key), "it must be a positive integer")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        bad("rope_parameters['rope_type']", rope.get("rope_type"), "only 'default' RoPE is implemented")
    if "rope_theta" not in rope:
        bad("rope_parameters", rope, "it has no 'rope_theta'")
    if getattr(config, "use_sliding_window", False):
        bad("use_sliding_window", config.use_sliding_window, "sliding-window attention is not implemented")
    if config.attention_bias:
        bad("attention_bias", config.attention_bias, "q/k/v/o projections have no bias here")
    if config.hidden_act != "silu":
        bad("hidden_act", config.hidden_act, "only SwiGLU with 'silu' is implemented")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        bad(
            "num_key_value_heads",
            config.num_key_value_heads,
            f"num_attention_heads={config.num_attention_heads} is not a multiple of it",
        )
    if config.decoder_sparse_step < 1:
        bad("decoder_sparse_step", config.decoder_sparse_step, "it must be >= 1")
    sparse = [i for i in range(config.num_hidden_layers) if is_sparse_layer(config, i)]
    if sparse and config.num_experts < 1:
        bad(
            "num_experts",
            config.num_experts,
            f"layers {sparse} are sparse (mlp_only_layers="
            f"{config.mlp_only_layers}, decoder_sparse_step={config.decoder_sparse_step}) but have no experts",
        )
    if sparse and not 1 <= config.num_experts_per_tok <= config.num_experts:
        bad("num_experts_per_tok", config.num_experts_per_tok, f"it must be in [1, num_experts={config.num_experts}]")


# --- RoPE ------------------------------------------------------------------------------------------


def rope_cos_sin(config: Qwen3MoeConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., D] for integer positions [...]: computed in fp32, then cast to `dtype`."""
    dim = head_dim_of(config)
    base = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))  # [D/2]
    freqs = positions[..., None].float() * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, S, D]; cos/sin [S, D] or [B, S, D]."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [1 or B, 1, S, D]
    return (x * cos) + (rotate_half(x) * sin)


# --- building blocks -------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # fp32
        return self.weight * normed.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). One expert, or the dense MLP of a dense layer."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerCache:
    """K/V of one layer, appended along the sequence: k, v [B, KV, L, D]."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Append k, v [B, KV, S, D]; return all of them [B, KV, L + S, D]."""
        if self.k is not None and self.k.shape[0] != k.shape[0]:
            raise ValueError(f"KV cache holds batch {self.k.shape[0]} but the input has batch {k.shape[0]}")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    def __init__(self, num_layers: int):
        self.layers = [LayerCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Tokens already cached (the position of the next token)."""
        return self.layers[0].length


class Attention(nn.Module):
    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        H, N, KV, D = config.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(H, N * D, bias=False)
        self.k_proj = nn.Linear(H, KV * D, bias=False)
        self.v_proj = nn.Linear(H, KV * D, bias=False)
        self.o_proj = nn.Linear(N * D, H, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)  # per head, over head_dim
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: LayerCache | None = None
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.n_heads, self.head_dim)).transpose(1, 2)  # [B, N, S, D]
        k = self.k_norm(self.k_proj(x).view(B, S, self.n_kv_heads, self.head_dim)).transpose(1, 2)  # [B, KV, S, D]
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if layer_cache is not None:
            k, v = layer_cache.update(k, v)  # [B, KV, L, D], L = cached + S
        L = k.shape[2]
        k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # [B, N, L, D]; q head h uses kv head h // rep
        v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # [B, N, L, D]
        scores = (q @ k.transpose(-1, -2)) * self.scale  # [B, N, S, L]
        causal = torch.ones(S, L, dtype=torch.bool, device=x.device).tril(diagonal=L - S)  # query i is at L - S + i
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, N, S, L]
        out = (probs @ v).transpose(1, 2).reshape(B, S, -1)  # [B, S, N * D]
        return self.o_proj(out)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, router_dtype: str = "activation"):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.router_dtype = (
            config.num_experts_per_tok,
            config.norm_topk_prob,
            router_dtype,
        )
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def route(self, x: torch.Tensor, expert_ids: torch.Tensor | None = None):
        """x [T, H] -> (weights [T, K] in the logits dtype, expert ids [T, K], probs [T, E] fp32).

        expert_ids [T, K], if given, replaces the top-k choice (to replay another model's routing);
        the weights are still this router's probabilities of those experts.
        """
        if self.router_dtype == "float32":
            logits = F.linear(x.float(), self.gate.weight.float())  # [T, E] fp32
        else:
            logits = self.gate(x)  # [T, E] activation dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        if expert_ids is None:
            # Top-k as a stable descending sort: on exactly equal probabilities the lower expert id wins.
            expert_ids = probs.sort(dim=-1, descending=True, stable=True).indices[:, : self.top_k]  # [T, K]
        weights = probs.gather(-1, expert_ids)  # [T, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), expert_ids, probs

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; expert_ids [T, K] (T = x.numel() // H) forces the routing."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        weights, ids, _ = self.route(x, expert_ids)  # [T, K]
        out = torch.zeros_like(x)  # [T, H]
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)  # the tokens routed to expert e, and which of their K picks it is
            if token.numel() == 0:
                continue
            y = expert(x[token]) * weights[token, slot, None]  # [n, H]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, layer_idx: int, router_dtype: str = "activation"):
        super().__init__()
        self.self_attn = Attention(config)
        if is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config, router_dtype)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_cache)  # [B, S, H]
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, router_dtype: str = "activation"):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, router_dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, router_dtype: str = "activation"):
        super().__init__()
        check_config(config)
        if router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype={router_dtype!r}; expected one of {ROUTER_DTYPES}")
        self.config, self.router_dtype = config, router_dtype
        self.model = Qwen3MoeModel(config, router_dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, V] in the activation dtype; positions continue from the cache."""
        B, S = self._check_input(input_ids, cache)
        past = 0 if cache is None else cache.length
        positions = torch.arange(past, past + S, device=input_ids.device)  # [S]
        x = self.model.embed_tokens(input_ids)  # [B, S, H]
        cos, sin = rope_cos_sin(self.config, positions, x.dtype)  # [S, D]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if cache is None else cache.layers[i])
        return self.lm_head(self.model.norm(x))  # [B, S, V]

    def _check_input(self, input_ids: torch.Tensor, cache: KVCache | None):
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(
                f"input_ids must be an integer tensor [B, S]; got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        B, S = input_ids.shape
        if B == 0 or S == 0:
            raise ValueError(f"input_ids is empty: shape {(B, S)}")
        vocab = self.config.vocab_size
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
        if bad.numel():
            raise ValueError(
                f"token id {bad[0].item()} is outside the vocabulary [0, {vocab}) "
                f"(vocab_size={vocab}; {bad.numel()} bad ids)"
            )
        if cache is not None and len(cache.layers) != self.config.num_hidden_layers:
            raise ValueError(f"KV cache has {len(cache.layers)} layers; the model has {self.config.num_hidden_layers}")
        past = 0 if cache is None else cache.length
        limit = self.config.max_position_embeddings
        if past + S > limit:
            raise ValueError(
                f"total sequence length {past + S} (cached {past} + new {S}) exceeds max_position_embeddings={limit}"
            )
        return B, S
