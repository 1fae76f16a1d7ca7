"""Qwen3-MoE attention on the fused operators, tensor-parallel over the attention TP group.

`Qwen3MoeAttention.forward(hidden [T, H], cos, sin, meta, kv_cache, atten_mask) -> [T, H]`:
merged_qkv_proj -> split -> q/k RMSNorm per head (npu_rms_norm) -> npu_apply_rotary_pos_emb (TND) ->
npu_fused_infer_attention_score_v2 (prefill: causal over the prompt; extend, a prefill over cached KV: the new tokens
written to the cache first, then causal over the row's cached + new keys read from it; decode: over the paged
cache) -> o_proj
(row-parallel, all_reduce; under attention DP the phase reduce-scatters its partial sums instead). New K/V go to
the paged cache through `meta`'s slot mapping with npu_scatter_nd_update_.

A layer's cache is (k, v), or (k, v, k_scale, v_scale) for the per-token FP8 cache: K and V quantized per token over
this rank's KV heads by npu_dynamic_quant at the write, decode reading them with key/value_quant_mode 4. Prefill
attends to its own 16-bit K/V, as the recipe does; only what later steps read passes through the cache. The SP
prefill's data movement around these pieces is the phase's (optimized/phases.py); W4A4's Hadamard rotation is inside
merged_qkv_proj's and o_proj's quant method.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from optimized.config import head_dim_of
from optimized.errors import UsageError
from optimized.forward_metadata import ForwardMetadata
from optimized.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from optimized.layers.quantization.config import QuantConfig
from optimized.layers.norm import RMSNorm

# sparse_mode 3 reads this 2048x2048 template (True = masked) whatever the sequence length.
CAUSAL_MASK_TEMPLATE_SIZE = 2048
FLOAT8_E4M3FN = 24  # torch ScalarType code of the FP8 KV cache (npu_dynamic_quant dst_type)
PER_TOKEN_PAGED = 4  # FIA key/value_quant_mode: one fp32 scale per token, stored per page


def causal_mask_template(device: torch.device | str | None = None) -> torch.Tensor:
    """None: the default device (under `with torch.device(d)`, d), never a host tensor by default."""
    size = CAUSAL_MASK_TEMPLATE_SIZE
    return ~torch.tril(torch.ones(size, size, dtype=torch.bool, device=device))


class Qwen3MoeAttention(nn.Module):
    def __init__(
        self,
        config,
        tp,
        dtype: torch.dtype,
        replicated_o_proj: bool = False,
        reduce_o_proj: bool = True,
        quant_config: QuantConfig | None = None,
        prefix: str = "self_attn",
    ):
        """reduce_o_proj=False: o_proj returns its partial sums (attention DP sums them with a reduce-scatter).
        quant_config: the model's (parsed once); prefix: this module's checkpoint prefix, for its linears' methods."""
        super().__init__()
        self.tp = tp
        self.head_dim = head_dim = head_dim_of(config)
        quant = quant_config or QuantConfig.from_hf_config(config)
        self.merged_qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            tp,
            dtype,
            quant.linear_method(f"{prefix}.q_proj"),
        )  # q, k, v: one method
        self.num_heads = self.merged_qkv_proj.q_heads  # per rank
        self.num_kv_heads = self.merged_qkv_proj.kv_heads  # per rank
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            tp,
            dtype,
            quant.linear_method(f"{prefix}.o_proj"),
            reduce_results=reduce_o_proj,
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)
        self.softmax_scale = head_dim**-0.5
        # A weight the SP prefill needs (phases.py asks for it): o_proj over this rank's tokens with every head,
        # the full weight on every rank; decode keeps the row-parallel o_proj.
        self.o_proj_replicated = (
            ReplicatedLinear(
                config.num_attention_heads * head_dim,
                config.hidden_size,
                dtype,
                quant.linear_method(f"{prefix}.o_proj"),
            )
            if replicated_o_proj
            else None
        )

    def load(self, source, prefix: str) -> None:
        self.merged_qkv_proj.load(
            source, f"{prefix}.q_proj.weight", f"{prefix}.k_proj.weight", f"{prefix}.v_proj.weight"
        )
        self.o_proj.load(source, f"{prefix}.o_proj.weight")
        if self.o_proj_replicated is not None:
            self.o_proj_replicated.load(source, f"{prefix}.o_proj.weight")
        self.q_norm.load(source, f"{prefix}.q_norm.weight")
        self.k_norm.load(source, f"{prefix}.k_norm.weight")

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: ForwardMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        atten_mask: torch.Tensor,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden, cos, sin)
        out = self.attend(q, k, v, meta, kv_cache, atten_mask)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def attend(self, q, k, v, meta: ForwardMetadata, kv_cache, atten_mask) -> torch.Tensor:
        """Attention of this step with its cache write: prefill attends to the fresh K/V, then writes them; decode
        writes the new token's K/V first, then reads the cache. -> [T, Nq_r, D]"""
        if meta.is_extend:  # the new K/V join the cache first: the rows read their whole context from it
            self.kv_cache_update(k, v, meta, kv_cache)
            out = self.attention_extend(q, meta, kv_cache, atten_mask)
        elif meta.is_prefill:
            out = self.attention_prefill(q, k, v, meta, atten_mask)
            self.kv_cache_update(k, v, meta, kv_cache)
        else:
            self.kv_cache_update(k, v, meta, kv_cache)
            out = self.attention_decode(q, meta, kv_cache, atten_mask)
        return out

    def qkv(self, hidden, cos: torch.Tensor, sin: torch.Tensor):
        """merged_qkv_proj (hidden: a tensor or MxRows), q/k RMSNorm per head, RoPE: q [T, Nq, D], k and v
        [T, Nkv, D] (this rank's heads)."""
        qkv = self.merged_qkv_proj(hidden)
        tokens = qkv.shape[0]
        q, k, v = qkv.split(self.merged_qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.view(tokens, self.num_heads, self.head_dim))  # [T, Nq, D]
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))  # [T, Nkv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)  # [T, Nkv, D]
        q, k = torch.ops.npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="TND")
        return q, k, v

    def attention_prefill(self, q, k, v, meta: ForwardMetadata, atten_mask):
        # A prompt attends only to itself, so q and kv lengths are the same prefix sums.
        if meta.is_extend:  # a caller that bypasses `attend` (the SP prefill) would silently drop the cached KV
            raise UsageError(
                "prefill over cached KV (cached_lens > 0) reached a prefill path that attends only to the new tokens "
                "(the sequence-parallel prefill, parallel_config.prefill_opt); use the tensor-parallel prefill"
            )
        return torch.ops.npu.npu_fused_infer_attention_score_v2(
            q, k, v, actual_seq_kvlen=meta.actual_seq_lengths_cu_q, **self._causal_tnd(meta, atten_mask)
        )[0]

    def _causal_tnd(self, meta: ForwardMetadata, atten_mask) -> dict:
        """FIA's arguments shared by prefill and extend: TND queries with cumulative lengths, causal from the
        bottom right (sparse_mode 3, the 2048 template)."""
        return dict(
            num_query_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            softmax_scale=self.softmax_scale,
            input_layout="TND",
            sparse_mode=3,
            atten_mask=atten_mask,
            actual_seq_qlen=meta.actual_seq_lengths_cu_q,
        )

    def attention_extend(self, q, meta: ForwardMetadata, kv_cache, atten_mask):
        """Prefill over cached KV: row b's Lq_b new queries (TND, cumulative q lengths) over its Lkv_b = cached + new
        keys, all in the cache already (written just before), causal with the diagonal shifted by the cached length.

        16-bit cache: FIA v2 as the NPU takes paged prefill, TND query over the BnBsH cache with the block table,
        per-row `actual_seq_kvlen`, sparse_mode 3 (right-down causal: query i sees key j <= i + Lkv_b - Lq_b) with
        the 2048 template. FP8 cache: the per-token de-quantization (key/value_quant_mode 4) is documented for one
        query token per row only, so the rows' context is gathered from the cache and de-quantized (E4M3 x its fp32
        scale, rounded to the activation dtype), then attended as a prefill over packed K/V (TND, cumulative q and
        kv lengths, sparse_mode 3). Every key, the new ones included, is then read quantized, as a decode step
        reads them. -> [T, Nq_r, D]"""
        k_cache, v_cache, *scales = kv_cache
        common = self._causal_tnd(meta, atten_mask)
        if scales:
            slots = meta.context_slots
            k = dequantize_rows(k_cache, scales[0], slots, q.dtype)
            v = dequantize_rows(v_cache, scales[1], slots, q.dtype)
            cu_kv = list(itertools.accumulate(meta.actual_seq_lengths_kv))
            return torch.ops.npu.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_kvlen=cu_kv, **common)[0]
        num_blocks, block_size = k_cache.shape[:2]
        return torch.ops.npu.npu_fused_infer_attention_score_v2(
            q,
            k_cache.view(num_blocks, block_size, -1),
            v_cache.view(num_blocks, block_size, -1),
            actual_seq_kvlen=meta.actual_seq_lengths_kv,  # per row: cached + new
            block_table=meta.block_table,
            block_size=meta.block_size,
            **common,
        )[0]

    def attention_decode(self, q, meta: ForwardMetadata, kv_cache, atten_mask):
        k_cache, v_cache, *scales = kv_cache
        num_blocks, block_size = k_cache.shape[:2]
        quant = {}
        if scales:  # FP8: sparse 0, no mask (§5.12)
            k_scale, v_scale = scales  # [blocks, block_size] fp32
            quant = dict(
                dequant_scale_key=k_scale,
                dequant_scale_value=v_scale,
                key_quant_mode=PER_TOKEN_PAGED,
                value_quant_mode=PER_TOKEN_PAGED,
            )
        # A static graph (ge_graph) calls torchair's operator with the lengths on the device, as the recipe's GE decode
        # does; eager mode and the captured graphs call torch_npu's with the host lists.
        device_lengths = meta.seq_lens_kv is not None
        fia = torch.ops.air if device_lengths else torch.ops.npu
        return fia.npu_fused_infer_attention_score_v2(
            q,
            k_cache.view(num_blocks, block_size, -1),
            v_cache.view(num_blocks, block_size, -1),
            num_query_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            softmax_scale=self.softmax_scale,
            input_layout="TND",
            sparse_mode=0 if scales else 3,
            atten_mask=None if scales else atten_mask,
            actual_seq_qlen=meta.seq_lens_cu_q if device_lengths else meta.actual_seq_lengths_cu_q,
            actual_seq_kvlen=meta.seq_lens_kv if device_lengths else meta.actual_seq_lengths_kv,
            block_table=meta.block_table,
            block_size=meta.block_size,
            **quant,
        )[0]

    def kv_cache_update(self, k, v, meta: ForwardMetadata, kv_cache) -> None:
        k_cache, v_cache, *scales = kv_cache  # [blocks, block_size, Nkv, D]
        tokens = k.shape[0]
        slots = meta.slot_mapping.view(-1, 1)
        if scales:
            k_scale, v_scale = scales  # [blocks, block_size] fp32
            k, ks = torch.ops.npu.npu_dynamic_quant(
                k.reshape(tokens, -1), dst_type=FLOAT8_E4M3FN, quant_mode="pertoken"
            )  # [T, Nkv*D] fp8, [T] fp32
            v, vs = torch.ops.npu.npu_dynamic_quant(
                v.reshape(tokens, -1), dst_type=FLOAT8_E4M3FN, quant_mode="pertoken"
            )
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            v = v.view(tokens, self.num_kv_heads, self.head_dim)
            torch.ops.npu.npu_scatter_nd_update_(k_scale.view(-1, 1, 1), slots, ks.view(tokens, 1, 1))
            torch.ops.npu.npu_scatter_nd_update_(v_scale.view(-1, 1, 1), slots, vs.view(tokens, 1, 1))
        torch.ops.npu.npu_scatter_nd_update_(k_cache.view(-1, self.num_kv_heads, self.head_dim), slots, k)
        torch.ops.npu.npu_scatter_nd_update_(v_cache.view(-1, self.num_kv_heads, self.head_dim), slots, v)


def dequantize_rows(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, Nkv, D] in `dtype`: the per-token FP8 cache's rows at `slots`, E4M3 x its fp32 scale (the same
    de-quantization the paged kernel applies with key/value_quant_mode 4); gathered on the uint8 bit view (float8
    indexing is missing from some torch builds)."""
    heads, dim = cache.shape[-2:]
    rows = cache.view(torch.uint8).view(-1, heads, dim)[slots].view(cache.dtype)
    return (rows.float() * scale.view(-1)[slots][:, None, None]).to(dtype)
