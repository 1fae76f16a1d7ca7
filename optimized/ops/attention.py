"""Fused inference attention: `npu_fused_infer_attention_score_v2` (+`.out`) and the v1 wrapper
`npu_fused_infer_attention_score` (+`.out`). Contract: spec npu_ops_attention_norm.md §5 (v2) and §6 (v1).

Numerics (§5.8): Q, K, V (de-quantized) → fp32; scores and softmax in fp32; P rounded to the value compute
dtype before P @ V (fp32 accumulation); output rounded once to the query dtype; lse stays fp32. Rows with no
visible key give out 0 / lse +inf; query rows owned by no batch give out 0 / lse 0.

The loop runs over requests only, requests of equal lengths batched together (eager); inside, everything is batched
over heads and tokens.
"""

# Masking rule (δ_b = Lkv_b − Lq_b; i, j in-batch query/key rows; atten_mask True/1 = masked): mode 0 all (with mask:
# mask==0 and −pre ≤ j−i ≤ next), 1 mask==0, 2 j ≤ i, 3 j ≤ i+δ_b, 4 δ_b−pre ≤ j−i ≤ δ_b+next; Q_S=1 non-TND ignores
# modes 2-4.
# Length rule: TND actual_seq_qlen cumulative, actual_seq_kvlen cumulative without block_table and per-batch with it;
# other layouts per-batch (None → S, len 1 → broadcast, len ≥ B → first B; Q_S=1 → Lq=1).
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .registry import register
from .validation import DIMS, FP32, check, check_dim, check_dtype, check_npu_limit, dtype_from_code, fail, unsupported

OP_V2 = "npu_fused_infer_attention_score_v2"
OP_V1 = "npu_fused_infer_attention_score"
INT_MAX = 2147483647

# input_layout -> query rank. Other op-plugin layouts are known but not implemented here (§5.2).
_LAYOUT_RANK = {"TND": 3, "BSH": 3, "BSND": 4, "BNSD": 4}
_LAYOUTS_NOT_IMPLEMENTED = (
    "NTD",
    "NSD",
    "BNSD_BSND",
    "BSH_BNSD",
    "BSND_BNSD",
    "NTD_TND",
    "BSH_NBSD",
    "BSND_NBSD",
    "BNSD_NBSD",
    "TND_NTD",
)
_FLOAT_QUERY = (torch.float16, torch.bfloat16, torch.float32)  # fp32: portable extension (strict mode rejects)
_QUANT_KV = (torch.int8, torch.float8_e4m3fn)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_TEMPLATE = 2048
_template_checked: dict[tuple, bool] = {}


class _Names:
    """Argument names as the caller's schema spells them (v1 renames several v2 arguments, §6)."""

    def __init__(self, op: str, renames: dict[str, str] | None = None):
        self.op, self._renames = op, renames or {}

    def __call__(self, v2_name: str) -> str:
        return self._renames.get(v2_name, v2_name)


@dataclass
class _Plan:
    """Shape-level facts shared by the kernel and the fake kernel."""

    layout: str
    nq: int
    nkv: int
    d: int
    dv: int
    paged: bool
    cache: str | None  # "BnBsH" / "BnNBsD" when paged
    out_shape: tuple
    lse_shape: tuple
    out_dtype: torch.dtype
    p_dtype: torch.dtype  # dtype P is rounded to before P @ V


def _int_list(value: Any) -> list[int] | None:
    """SymInt[]? arrives as a list of ints; a 1-D tensor (direct portable-kernel calls) is accepted too."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(x) for x in value.reshape(-1).tolist()]
    return [x if isinstance(x, torch.SymInt) else int(x) for x in value]  # traced: symbols stay symbols


def _plan(
    n: _Names,
    query,
    key,
    value,
    *,
    atten_mask,
    block_table,
    num_query_heads,
    num_key_value_heads,
    input_layout,
    sparse_mode,
    block_size,
    key_quant_mode,
    value_quant_mode,
    return_softmax_lse,
    inner_precise,
    dequant_scale_key,
    dequant_scale_value,
    out_dtype,
) -> _Plan:
    op = n.op
    # --- layout and ranks (§5.2)
    if input_layout in _LAYOUTS_NOT_IMPLEMENTED:
        unsupported(op, f"{n('input_layout')}={input_layout!r}")
    check(
        input_layout in _LAYOUT_RANK,
        op,
        f"{n('input_layout')}={input_layout!r} is unknown; layout only support "
        f"{sorted(_LAYOUT_RANK) + list(_LAYOUTS_NOT_IMPLEMENTED)}",
    )
    layout = input_layout
    check_dim(op, "query", query, (_LAYOUT_RANK[layout],))
    if query.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        unsupported(op, f"quantized query (dtype {query.dtype})")
    check_dtype(op, "query", query, _FLOAT_QUERY)
    check_npu_limit(
        query.dtype in (torch.float16, torch.bfloat16),
        op,
        f"query dtype must be float16/bfloat16; got {query.dtype}",
        FP32,
    )
    # --- heads (§5.5)
    nq = num_query_heads
    nkv = num_key_value_heads if num_key_value_heads != 0 else nq
    check(nq > 0, op, f"{n('num_query_heads')} must be > 0; got {nq}")
    check(nkv > 0, op, f"{n('num_key_value_heads')} must be >= 0; got {num_key_value_heads}")
    check(nq % nkv == 0, op, f"{n('num_query_heads')}={nq} must be divisible by {n('num_key_value_heads')}={nkv}")
    check_npu_limit(
        nq // nkv <= 64 and nq <= 256 and nkv <= 256,
        op,
        f"num_query_heads/num_key_value_heads <= 64, both <= 256; got {nq}/{nkv}",
        DIMS,
    )
    if layout == "BSH":
        check(
            query.shape[2] % nq == 0,
            op,
            f"query hidden size {query.shape[2]} must be divisible by {n('num_query_heads')}={nq}",
        )
        d = query.shape[2] // nq
    else:
        n_axis = 1 if layout in ("TND", "BNSD") else 2
        check(
            query.shape[n_axis] == nq,
            op,
            f"{n('num_query_heads')}={nq} must equal the query head axis; "
            f"got query shape {tuple(query.shape)} ({layout})",
        )
        d = query.shape[-1]
    # --- key / value (§5.2, §5.6)
    check(
        key.dim() == value.dim() and key.shape[:-1] == value.shape[:-1],
        op,
        f"key and value shapes must agree except the last axis; got key {tuple(key.shape)}, value {tuple(value.shape)}",
    )
    paged = block_table is not None
    cache = None
    if paged:
        check(block_size > 0, op, f"{n('block_table')} is given, so {n('block_size')} must be > 0; got {block_size}")
        check_dtype(op, n("block_table"), block_table, (torch.int32,))
        check_dim(op, n("block_table"), block_table, (2,))
        if key.dim() == 5:
            unsupported(op, "5-D NZ paged KV cache")
        check_dim(op, "key", key, (3, 4))
        cache = "BnBsH" if key.dim() == 3 else "BnNBsD"
        check(
            cache == "BnBsH" or layout in ("TND", "BNSD"),
            op,
            f"paged key layout (num_blocks, Nkv, block_size, D) needs input_layout TND or BNSD; got {layout}",
        )
        bs_axis = 1 if cache == "BnBsH" else 2
        check(
            key.shape[bs_axis] == block_size,
            op,
            f"{n('block_size')}={block_size} must equal the key cache block axis; got key shape {tuple(key.shape)}",
        )
        check(
            0 < block_size <= 1024 and block_size % 16 == 0,
            op,
            f"{n('block_size')} must be a multiple of 16 in (0, 1024]; got {block_size}",
        )
        if layout != "TND":
            q_s = query.shape[1] if layout in ("BSH", "BSND") else query.shape[2]
            ok = (block_size % 128 == 0 and block_size <= 512) if q_s > 1 else block_size <= 512
            if not ok:
                warnings.warn(
                    f"{op}: {n('block_size')}={block_size} is outside the documented NPU range for "
                    f"this layout (multiple of 128 in [128, 512] for Q_S > 1, <= 512 for Q_S = 1)"
                )
        if cache == "BnBsH":
            check_npu_limit(
                key.shape[2] <= 65535,
                op,
                f"paged key cache (num_blocks, block_size, H) needs H = Nkv*D <= 65535; got {key.shape[2]} (spec §5.6)",
                DIMS,
            )
            check(
                key.shape[2] == nkv * d,
                op,
                f"key cache hidden size {key.shape[2]} must equal {n('num_key_value_heads')}*D = {nkv}*{d}",
            )
            check(
                value.shape[2] % nkv == 0,
                op,
                f"value cache hidden size {value.shape[2]} must be divisible by {n('num_key_value_heads')}={nkv}",
            )
            dv = value.shape[2] // nkv
        else:
            check(
                key.shape[1] == nkv and key.shape[3] == d,
                op,
                f"key cache must be (num_blocks, {nkv}, block_size, {d}); got {tuple(key.shape)}",
            )
            dv = value.shape[3]
    else:
        check(
            key.dim() == query.dim(),
            op,
            f"key must have {query.dim()} dims like query ({layout}); got key shape {tuple(key.shape)}",
        )
        if layout == "BSH":
            check(key.shape[0] == query.shape[0], op, f"key batch {key.shape[0]} != query batch {query.shape[0]}")
            check(
                key.shape[2] == nkv * d,
                op,
                f"key hidden size {key.shape[2]} must equal {n('num_key_value_heads')}*D = {nkv}*{d}",
            )
            check(
                value.shape[2] % nkv == 0,
                op,
                f"value hidden size {value.shape[2]} must be divisible by {n('num_key_value_heads')}={nkv}",
            )
            dv = value.shape[2] // nkv
        else:
            n_axis = 1 if layout in ("TND", "BNSD") else 2
            check(
                key.shape[n_axis] == nkv,
                op,
                f"{n('num_key_value_heads')}={nkv} must equal the key head "
                f"axis; got key shape {tuple(key.shape)} ({layout})",
            )
            check(key.shape[-1] == d, op, f"key head dim {key.shape[-1]} != query head dim {d}")
            if layout != "TND":
                check(key.shape[0] == query.shape[0], op, f"key batch {key.shape[0]} != query batch {query.shape[0]}")
            dv = value.shape[-1]
    check_npu_limit(
        d <= 512 and d % 16 == 0 and dv <= 512 and dv % 16 == 0,
        op,
        f"head dims must be multiples of 16 and <= 512; got D={d}, Dv={dv}",
        DIMS,
    )
    if layout == "TND":
        check_npu_limit(
            (d, dv) in ((128, 128), (192, 128), (192, 192)) or (nq == nkv and d == dv == 64),
            op,
            f"TND supports D = Dv = 128, D = 192 with Dv in (128, 192), or 64 for MHA; got D={d}, Dv={dv}",
            DIMS,
        )
        check_npu_limit(
            dv != 192 or (nq == nkv and not paged),
            op,
            f"TND with Dv = 192 takes neither GQA nor a paged cache (spec §5.11); "
            f"got Nq={nq}, Nkv={nkv}, paged={paged}",
            DIMS,
        )
    # --- de-quantization (§5.7)
    quantized = False
    for which, tensor, mode, scale in (
        ("key", key, key_quant_mode, dequant_scale_key),
        ("value", value, value_quant_mode, dequant_scale_value),
    ):
        mode_arg = n(f"{which}_quant_mode")
        if mode == 4:
            check(paged, op, f"{mode_arg}=4 (per-token scale per page) needs {n('block_table')}")
            check_dtype(op, which, tensor, _QUANT_KV)
            check(scale is not None, op, f"{mode_arg}=4 needs {n(f'dequant_scale_{which}')}")
            check_dtype(op, n(f"dequant_scale_{which}"), scale, (torch.float32,))
            check(
                tuple(scale.shape) == (key.shape[0], block_size),
                op,
                f"{n(f'dequant_scale_{which}')} has shape {tuple(scale.shape)}; expected "
                f"(num_blocks, block_size) = ({key.shape[0]}, {block_size})",
            )
            quantized = True
        elif mode == 0:
            if tensor.dtype in _QUANT_KV:
                fail(op, f"{which} dtype {tensor.dtype} needs {mode_arg}=4 (per-token de-quantization)")
            check(
                tensor.dtype == query.dtype,
                op,
                f"{which} has dtype {tensor.dtype}; expected the query dtype {query.dtype}",
            )
            if scale is not None:
                unsupported(op, f"{n(f'dequant_scale_{which}')} with {mode_arg}=0 (per-channel de-quantization)")
        else:
            unsupported(op, f"{mode_arg}={mode}")
    # --- masks (§5.4)
    check(
        sparse_mode in (0, 1, 2, 3, 4), op, f"{n('sparse_mode')}={sparse_mode} is not supported; allowed: 0, 1, 2, 3, 4"
    )
    if layout == "TND":
        check(sparse_mode in (0, 3, 4), op, f"TND allows {n('sparse_mode')} 0 (no mask), 3, 4; got {sparse_mode}")
        check(sparse_mode != 0 or atten_mask is None, op, f"TND with {n('sparse_mode')}=0 takes no {n('atten_mask')}")
    if atten_mask is not None:
        check_dtype(op, n("atten_mask"), atten_mask, _MASK_DTYPES)
    if sparse_mode in (2, 3, 4):
        check(
            atten_mask is not None,
            op,
            f"{n('sparse_mode')}={sparse_mode} needs the 2048x2048 {n('atten_mask')} template triu(ones, 1)",
        )
        check(
            tuple(atten_mask.shape) in ((_TEMPLATE,) * 2, (1,) + (_TEMPLATE,) * 2, (1, 1) + (_TEMPLATE,) * 2),
            op,
            f"{n('atten_mask')} for {n('sparse_mode')}={sparse_mode} must be (2048, 2048), (1, 2048, 2048) "
            f"or (1, 1, 2048, 2048); got {tuple(atten_mask.shape)}",
        )
    if sparse_mode == 1:
        check(atten_mask is not None, op, f"{n('sparse_mode')}=1 needs a full {n('atten_mask')}")
    if sparse_mode in (0, 1) and atten_mask is not None:
        check_dim(op, n("atten_mask"), atten_mask, (2, 3, 4))
    # --- misc
    check(inner_precise in (0, 1, 2, 3), op, f"{n('inner_precise')} must be in 0..3; got {inner_precise}")
    out_dt = query.dtype
    if out_dtype is not None and dtype_from_code(op, n("out_dtype"), out_dtype) != query.dtype:
        unsupported(op, f"{n('out_dtype')}={dtype_from_code(op, n('out_dtype'), out_dtype)} (quantized output)")
    # --- output shapes (§5.2, §5.9)
    if layout == "TND":
        out_shape = (query.shape[0], nq, dv)
        lse_shape = (query.shape[0], nq, 1)
    elif layout == "BSH":
        out_shape = (query.shape[0], query.shape[1], nq * dv)
        lse_shape = (query.shape[0], nq, query.shape[1], 1)
    elif layout == "BSND":
        out_shape = (query.shape[0], query.shape[1], nq, dv)
        lse_shape = (query.shape[0], nq, query.shape[1], 1)
    else:  # BNSD
        out_shape = (query.shape[0], nq, query.shape[2], dv)
        lse_shape = (query.shape[0], nq, query.shape[2], 1)
    if not return_softmax_lse:
        lse_shape = (0,)
    p_dtype = query.dtype if quantized else value.dtype
    return _Plan(layout, nq, nkv, d, dv, paged, cache, out_shape, lse_shape, out_dt, p_dtype)


def _reject_unsupported(n: _Names, **kwargs) -> None:
    """§5.10: optional inputs the portable kernel does not implement must not be silently ignored."""
    for name, value in kwargs.items():
        if value is not None:
            unsupported(n.op, n(name))


def _per_batch(n: _Names, arg: str, lengths: list[int] | None, batch: int, default: int) -> list[int]:
    if lengths is None:
        return [default] * batch
    if len(lengths) == 1:
        return lengths * batch
    check(len(lengths) >= batch, n.op, f"{n(arg)} has {len(lengths)} entries; expected 1 or >= batch {batch}")
    return lengths[:batch]


def _check_template(n: _Names, mask: torch.Tensor) -> None:
    """Modes 2/3/4: the mask is a tile template; its content must be triu(ones(2048, 2048), 1)."""
    key = (mask.data_ptr(), mask._version, mask.device, mask.dtype, tuple(mask.stride()))
    if key in _template_checked:
        return
    template = torch.triu(torch.ones(_TEMPLATE, _TEMPLATE, dtype=torch.bool, device=mask.device), 1)
    check(
        torch.equal(mask.reshape(_TEMPLATE, _TEMPLATE) != 0, template),
        n.op,
        f"{n('atten_mask')} must be the template triu(ones(2048, 2048), 1) (True above the diagonal = masked)",
    )
    if len(_template_checked) > 64:
        _template_checked.clear()
    _template_checked[key] = True


def _visible(
    mode: int, lq: int, lkv: int, mask_b: torch.Tensor | None, pre: int, nxt: int, q_s_one: bool, device
) -> torch.Tensor | None:
    """(Lq, Lkv) bool visibility of §5.4 with in-batch indices; None where every key is visible (a decode row:
    Q_S = 1, or mode 3 with one query row), so the scores need no mask."""
    if (mode in (0, 1) and mask_b is None) or (mode not in (0, 1) and (q_s_one or (mode == 3 and lq == 1))):
        return None
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lkv, device=device)[None, :]
    rel, delta = j - i, lkv - lq
    everything = torch.ones(lq, lkv, dtype=torch.bool, device=device)
    if mode in (0, 1):
        if mask_b is None:
            return everything
        vis = mask_b[:lq, :lkv] == 0
        return vis & (rel >= -pre) & (rel <= nxt) if mode == 0 else vis
    if q_s_one:  # Q_S = 1 with BSH/BSND/BNSD ignores sparse_mode: attend to all Lkv_b keys
        return everything
    if mode == 2:
        return (rel <= 0) & everything
    if mode == 3:
        return (rel <= delta) & everything
    return (rel >= delta - pre) & (rel <= delta + nxt)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm into an output whose every matrix starts 64-byte aligned, as a lone request's output does. The CPU
    GEMM rounds a product differently when its output matrix starts unaligned: in a contiguous batch, matrix i of
    (2, 17) fp32 starts 136 bytes after matrix i - 1, and a request batched with others got scores one bit away from
    its scores alone (bmm's matrix 0, and every matrix of an aligned output, equal torch.mm's)."""
    # Only for plain tensors run eagerly, checked before any size is read: traced (the compiler inlines this kernel),
    # its tensors take no out= and a size comparison would specialize the graph on the batch; the compiler picks
    # its own GEMM anyway.
    if type(a) is not torch.Tensor or torch.compiler.is_compiling():
        return torch.bmm(a, b)
    batch, rows, cols = a.shape[0], a.shape[1], b.shape[2]
    per_align = max(1, 64 // a.element_size())
    per = -(-(rows * cols) // per_align) * per_align
    if batch == 1 or per == rows * cols:
        return torch.bmm(a, b)
    out = a.new_empty(batch * per).as_strided((batch, rows, cols), (per, cols, 1))
    return torch.bmm(a, b, out=out)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vis: torch.Tensor | None,
    scale: float,
    p_dtype: torch.dtype,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (R, Lq, Nq, D), k (R, Lkv, Nkv, D), v (R, Lkv, Nkv, Dv) fp32 for R requests of the same lengths; vis
    (Lq, Lkv) or None (all visible). -> out (R, Lq, Nq, Dv), lse (R, Nq, Lq). Each request's arithmetic is its own
    (batched matmuls and row reductions): the same bits as alone. inplace: the softmax's elementwise steps write
    into the scores tensor (eager only: a traced body may not mutate its temporaries); the same values either way.

    GQA: query head h = g*G + r reads KV head g (contiguous groups, same as repeat_interleave(G) on K/V)."""
    reqs, lq, nq, _ = q.shape
    lkv, nkv, dv = v.shape[1:]
    group = nq // nkv
    if lkv == 0 or lq == 0:
        return q.new_zeros(reqs, lq, nq, dv), torch.full((reqs, nq, lq), math.inf, device=q.device)
    # Batched matmuls over contiguous operands of fixed per-request shapes, (G*Lq, D) @ (D, Lkv) per (request, KV
    # head): an einsum, or a strided operand, lets the GEMM path depend on how many requests share the call, and a
    # request batched with others would round differently from the same request alone.
    # torch.bmm on 3-D operands (`_bmm`): torch.matmul folds a batch of one into a plain mm, another GEMM path.
    qg = q.reshape(reqs, lq, nkv, group, q.shape[-1]).permute(0, 2, 3, 1, 4).reshape(reqs * nkv, group * lq, -1)
    kt = k.permute(0, 2, 3, 1).reshape(reqs * nkv, -1, lkv)  # (R*Nkv, D, Lkv)
    s = _bmm(qg.contiguous(), kt.contiguous()).reshape(reqs, nkv, group, lq, lkv)  # (R, Nkv, G, Lq, Lkv)
    if inplace:  # eager: the same elementwise operations, written into the scores (no temporary per step)
        s = s.contiguous()  # a dense copy where `_bmm` padded its matrices, as `s * scale` made one
        s.mul_(scale)
        if vis is not None:
            s.masked_fill_(~vis, -math.inf)
    else:
        s = s * scale
        if vis is not None:
            s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    valid = torch.isfinite(m)
    shift = torch.where(valid, m, torch.zeros_like(m))
    p = s.sub_(shift).exp_() if inplace else torch.exp(s - shift)
    l = p.sum(-1, keepdim=True)
    norm = torch.where(valid, l, torch.ones_like(l))
    probs = (p.div_(norm) if inplace else p / norm).to(p_dtype).float()
    out = _bmm(
        probs.reshape(reqs * nkv, group * lq, lkv).contiguous(),
        v.permute(0, 2, 1, 3).reshape(reqs * nkv, lkv, dv).contiguous(),
    )  # (R*Nkv, G*Lq, Dv)
    out = out.reshape(reqs, nkv, group, lq, dv).permute(0, 3, 1, 2, 4).reshape(reqs, lq, nq, dv)
    lse = torch.where(valid, m + torch.log(l), torch.full_like(m, math.inf)).reshape(reqs, nq, lq)
    return out, lse


def _gather_pages(
    cache: torch.Tensor, layout: str, blk: torch.Tensor, off: torch.Tensor, nkv: int, dim: int
) -> torch.Tensor:
    """K[..., s] = cache[blk[..., s], off[..., s]] as (..., Lkv, Nkv, D) fp32; float8 is gathered on its uint8 bit
    view."""
    bits = cache.view(torch.uint8) if cache.dtype.is_floating_point and cache.element_size() == 1 else cache
    rows = bits[blk, off] if layout == "BnBsH" else bits[blk, :, off, :]
    rows = rows.view(cache.dtype) if bits is not cache else rows
    return rows.float().reshape(*blk.shape, nkv, dim)


def _length_groups(lq: list, lkv: list, together: bool) -> list[list[int]]:
    """Request indices grouped by equal (query, key) lengths, in first-seen order; one group per request unless
    `together` (the same visibility for equal lengths, and lengths that are ints to compare)."""
    if not together:
        return [[b] for b in range(len(lq))]
    groups: dict[tuple, list[int]] = {}
    for b, key in enumerate(zip(lq, lkv)):
        groups.setdefault(key, []).append(b)
    return list(groups.values())


def _select(t: torch.Tensor, members: list[int]) -> torch.Tensor:
    """t[members] along dim 0: a slice (a view) when the members are consecutive, as they usually are."""
    if members == list(range(members[0], members[0] + len(members))):
        return t[members[0] : members[0] + len(members)]
    return t[members]


def _stack(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0][None] if len(pieces) == 1 else torch.stack(pieces)


def _fia(
    n: _Names,
    query,
    key,
    value,
    *,
    atten_mask,
    actual_seq_qlen,
    actual_seq_kvlen,
    block_table,
    dequant_scale_key,
    dequant_scale_value,
    num_query_heads,
    num_key_value_heads,
    softmax_scale,
    pre_tokens,
    next_tokens,
    input_layout,
    sparse_mode,
    block_size,
    key_quant_mode,
    value_quant_mode,
    inner_precise,
    return_softmax_lse,
    out_dtype,
    read_data: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """read_data False: skip the checks that read tensor data on the host (block ids within the pool, the mask
    template's content) and write the output rows with functional ops, for the traced body a compiled graph inlines;
    everything else is the same code."""
    op = n.op
    plan = _plan(
        n,
        query,
        key,
        value,
        atten_mask=atten_mask,
        block_table=block_table,
        num_query_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads,
        input_layout=input_layout,
        sparse_mode=sparse_mode,
        block_size=block_size,
        key_quant_mode=key_quant_mode,
        value_quant_mode=value_quant_mode,
        return_softmax_lse=return_softmax_lse,
        inner_precise=inner_precise,
        dequant_scale_key=dequant_scale_key,
        dequant_scale_value=dequant_scale_value,
        out_dtype=out_dtype,
    )
    qlen, kvlen = _int_list(actual_seq_qlen), _int_list(actual_seq_kvlen)
    layout, nq, nkv, d, dv = plan.layout, plan.nq, plan.nkv, plan.d, plan.dv
    device = query.device

    # 1. query rows per batch (Lq_b) and a (B or T, ...) view of the query
    if layout == "TND":
        check(qlen is not None, op, f"input_layout TND needs {n('actual_seq_qlen')} (cumulative)")
        check(kvlen is not None, op, f"input_layout TND needs {n('actual_seq_kvlen')}")
        batch = len(qlen)
        check(
            len(kvlen) == batch,
            op,
            f"{n('actual_seq_kvlen')} has {len(kvlen)} entries; expected len({n('actual_seq_qlen')}) = {batch}",
        )
        check(batch > 0, op, f"{n('actual_seq_qlen')} must not be empty")
        check_npu_limit(batch <= 4096, op, f"TND batch <= 4096; got {batch}")
        check(
            all(x >= 0 for x in qlen) and all(b >= a for a, b in zip(qlen, qlen[1:])),
            op,
            f"{n('actual_seq_qlen')} must be cumulative (non-negative, non-decreasing); got {qlen}",
        )
        check(
            qlen[-1] <= query.shape[0],
            op,
            f"{n('actual_seq_qlen')}[-1]={qlen[-1]} exceeds the query token count T={query.shape[0]}",
        )
        q_start = [0] + qlen[:-1]
        lq = [qlen[b] - q_start[b] for b in range(batch)]
        q_s_one = False
    else:
        q4 = query.reshape(query.shape[0], query.shape[1], nq, d) if layout == "BSH" else query
        q4 = q4.transpose(1, 2) if layout == "BNSD" else q4  # (B, S, Nq, D)
        batch, seq = q4.shape[:2]
        check_npu_limit(batch <= 65536, op, f"batch <= 65536; got {batch}")
        q_s_one = seq == 1
        lq = [1] * batch if q_s_one else _per_batch(n, "actual_seq_qlen", qlen, batch, seq)
        check(all(0 <= x <= seq for x in lq), op, f"{n('actual_seq_qlen')} entries must be in [0, S={seq}]; got {lq}")

    # Per-token-per-page KV de-quantization (key/value_quant_mode 4) is documented for one query row per batch only
    # (spec §5.7): the decode step's call. A route cap: the caller decides which step reads a quantized cache.
    check_npu_limit(
        key_quant_mode != 4 or all(x <= 1 for x in lq),
        op,
        f"{n('key_quant_mode')}=4 takes one query row per batch (decode); got query lengths {lq}",
    )

    # 2. key/value rows per batch
    if plan.paged:
        check(kvlen is not None, op, f"{n('block_table')} (paged KV) needs per-batch {n('actual_seq_kvlen')}")
        lkv = kvlen if layout == "TND" else _per_batch(n, "actual_seq_kvlen", kvlen, batch, 0)
        check(
            block_table.shape[0] == batch,
            op,
            f"{n('block_table')} has {block_table.shape[0]} rows; expected the batch count {batch}",
        )
        capacity = block_table.shape[1] * block_size
        check(
            all(0 <= x <= capacity for x in lkv),
            op,
            f"paged {n('actual_seq_kvlen')} entries must be in [0, max_blocks*block_size = {capacity}]; got {lkv}",
        )
        if read_data:
            used = (
                torch.arange(block_table.shape[1], device=block_table.device)[None, :]
                < torch.tensor([-(-x // block_size) for x in lkv], device=block_table.device)[:, None]
            )
            ids = block_table[used]
            bad = (ids < 0) | (ids >= key.shape[0])
            if bool(bad.any()):
                fail(op, f"{n('block_table')} holds block id {int(ids[bad][0])} outside [0, num_blocks={key.shape[0]})")
        kv_start = None
    elif layout == "TND":
        check(
            all(x >= 0 for x in kvlen) and all(b >= a for a, b in zip(kvlen, kvlen[1:])),
            op,
            f"{n('actual_seq_kvlen')} must be cumulative without block_table (non-negative, non-decreasing); "
            f"got {kvlen}",
        )
        check(
            kvlen[-1] <= key.shape[0],
            op,
            f"{n('actual_seq_kvlen')}[-1]={kvlen[-1]} exceeds the key token count T_kv={key.shape[0]}",
        )
        kv_start = [0] + kvlen[:-1]
        lkv = [kvlen[b] - kv_start[b] for b in range(batch)]
    else:

        def to_bsnd(t, dim):
            if layout == "BSH":
                return t.reshape(t.shape[0], t.shape[1], nkv, dim)
            return t.transpose(1, 2) if layout == "BNSD" else t

        k4, v4 = to_bsnd(key, d), to_bsnd(value, dv)
        s_kv = k4.shape[1]
        lkv = _per_batch(n, "actual_seq_kvlen", kvlen, batch, s_kv)
        check(
            all(0 <= x <= s_kv for x in lkv),
            op,
            f"{n('actual_seq_kvlen')} entries must be in [0, S_kv={s_kv}]; got {lkv}",
        )

    # 3. mask: template content (modes 2/3/4) or full mask as (Bm, Qm, Km) (modes 0/1)
    mask3 = None
    if atten_mask is not None and sparse_mode in (2, 3, 4):
        if read_data:
            _check_template(n, atten_mask)
    elif atten_mask is not None:
        if atten_mask.dim() == 2 and layout != "TND" and q_s_one and atten_mask.shape[0] == batch and batch > 1:
            mask3 = atten_mask[:, None, :]  # (B, KV_S) for Q_S = 1
        elif atten_mask.dim() == 4:
            check(
                atten_mask.shape[1] == 1 and atten_mask.shape[0] in (1, batch),
                n.op,
                f"{n('atten_mask')} 4-D must be (B, 1, Q_S, KV_S) or (1, 1, Q_S, KV_S); got {tuple(atten_mask.shape)}",
            )
            mask3 = atten_mask[:, 0]
        else:
            mask3 = atten_mask if atten_mask.dim() == 3 else atten_mask[None]
            check(
                mask3.shape[0] == 1, op, f"{n('atten_mask')} 3-D must be (1, Q_S, KV_S); got {tuple(atten_mask.shape)}"
            )
        need_q, need_kv = max(lq, default=0), max(lkv, default=0)
        check(
            mask3.shape[1] >= need_q and mask3.shape[2] >= need_kv,
            op,
            f"{n('atten_mask')} covers ({mask3.shape[1]}, {mask3.shape[2]}) query x key positions; the batch "
            f"needs ({need_q}, {need_kv})",
        )

    # 4. attention per request, requests of the same lengths together where their visibility is the same (no
    # per-request mask) and the lengths are known (eager; traced, lengths are symbols and stay one per request)
    scale = float(softmax_scale)
    rows = query.shape[0] if layout == "TND" else batch * seq
    out = torch.zeros(rows, nq, dv, dtype=plan.out_dtype, device=device)
    lse = torch.zeros(rows, nq, dtype=torch.float32, device=device)
    same_visibility = read_data and (mask3 is None or mask3.shape[0] == 1)
    for members in _length_groups(lq, lkv, same_visibility):
        b0, reqs = members[0], len(members)
        if plan.paged:
            pos = torch.arange(lkv[b0], device=block_table.device)
            blk = _select(block_table, members)[:, pos // block_size].long()  # (R, Lkv)
            off = (pos % block_size).expand(reqs, -1)
            k_g = _gather_pages(key, plan.cache, blk, off, nkv, d)
            v_g = _gather_pages(value, plan.cache, blk, off, nkv, dv)
            if key_quant_mode == 4:
                k_g = k_g * dequant_scale_key[blk, off][..., None, None]
            if value_quant_mode == 4:
                v_g = v_g * dequant_scale_value[blk, off][..., None, None]
        elif layout == "TND":
            k_g = _stack([key[kv_start[b] : kvlen[b]] for b in members]).float()
            v_g = _stack([value[kv_start[b] : kvlen[b]] for b in members]).float()
        else:
            k_g, v_g = _select(k4, members)[:, : lkv[b0]].float(), _select(v4, members)[:, : lkv[b0]].float()
        q_g = (
            _stack([query[q_start[b] : qlen[b]] for b in members])
            if layout == "TND"
            else _select(q4, members)[:, : lq[b0]]
        )
        mask_b = None if mask3 is None else mask3[b0 if mask3.shape[0] > 1 else 0]
        vis = _visible(sparse_mode, lq[b0], lkv[b0], mask_b, pre_tokens, next_tokens, q_s_one, device)
        o_g, lse_g = _attend(q_g.float(), k_g, v_g, vis, scale, plan.p_dtype, inplace=read_data)
        o_g, lse_g = o_g.to(plan.out_dtype), lse_g.transpose(1, 2)  # (R, Lq, Nq, Dv), (R, Lq, Nq)
        for i, b in enumerate(members):
            first = q_start[b] if layout == "TND" else b * seq
            if read_data:
                out[first : first + lq[b]] = o_g[i]
                lse[first : first + lq[b]] = lse_g[i]
            else:  # traced: the same writes as functional ops (a graph's decomposition may not mutate temporaries)
                out = out.slice_scatter(o_g[i], 0, first, first + lq[b])
                lse = lse.slice_scatter(lse_g[i], 0, first, first + lq[b])

    # 5. output layout
    if layout == "TND":
        out_final = out
        lse_final = lse[..., None]
    else:
        out4 = out.reshape(batch, seq, nq, dv)
        out_final = {
            "BSH": lambda: out4.reshape(batch, seq, nq * dv),
            "BSND": lambda: out4,
            "BNSD": lambda: out4.transpose(1, 2).contiguous(),
        }[layout]()
        lse_final = lse.reshape(batch, seq, nq).transpose(1, 2)[..., None].contiguous()
    if not return_softmax_lse:
        lse_final = torch.empty(0, dtype=torch.float32, device=device)
    return out_final, lse_final


# ---------------------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, ...) -> (Tensor, Tensor)


def _v2_unsupported(
    n: _Names,
    query_rope,
    key_rope,
    pse_shift,
    dequant_scale_query,
    dequant_offset_key,
    dequant_offset_value,
    dequant_scale_key_rope,
    quant_scale_out,
    quant_offset_out,
    quant_scale_p,
    learnable_sink,
    query_quant_mode,
    query_dtype,
    key_dtype,
    value_dtype,
    query_rope_dtype,
    key_rope_dtype,
    key_shared_prefix_dtype,
    value_shared_prefix_dtype,
    dequant_scale_query_dtype,
    dequant_scale_key_dtype,
    dequant_scale_value_dtype,
    dequant_scale_key_rope_dtype,
) -> None:
    _reject_unsupported(
        n,
        query_rope=query_rope,
        key_rope=key_rope,
        pse_shift=pse_shift,
        dequant_scale_query=dequant_scale_query,
        dequant_offset_key=dequant_offset_key,
        dequant_offset_value=dequant_offset_value,
        dequant_scale_key_rope=dequant_scale_key_rope,
        quant_scale_out=quant_scale_out,
        quant_offset_out=quant_offset_out,
        quant_scale_p=quant_scale_p,
        learnable_sink=learnable_sink,
        query_dtype=query_dtype,
        key_dtype=key_dtype,
        value_dtype=value_dtype,
        query_rope_dtype=query_rope_dtype,
        key_rope_dtype=key_rope_dtype,
        key_shared_prefix_dtype=key_shared_prefix_dtype,
        value_shared_prefix_dtype=value_shared_prefix_dtype,
        dequant_scale_query_dtype=dequant_scale_query_dtype,
        dequant_scale_key_dtype=dequant_scale_key_dtype,
        dequant_scale_value_dtype=dequant_scale_value_dtype,
        dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype,
    )
    if query_quant_mode != 0:
        unsupported(n.op, f"{n('query_quant_mode')}={query_quant_mode}")


def _v2(
    op: str,
    fake: bool,
    query,
    key,
    value,
    *,
    query_rope=None,
    key_rope=None,
    pse_shift=None,
    atten_mask=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    block_table=None,
    dequant_scale_query=None,
    dequant_scale_key=None,
    dequant_offset_key=None,
    dequant_scale_value=None,
    dequant_offset_value=None,
    dequant_scale_key_rope=None,
    quant_scale_out=None,
    quant_offset_out=None,
    quant_scale_p=None,
    learnable_sink=None,
    num_query_heads=1,
    num_key_value_heads=0,
    softmax_scale=1.0,
    pre_tokens=INT_MAX,
    next_tokens=INT_MAX,
    input_layout="BSH",
    sparse_mode=0,
    block_size=0,
    query_quant_mode=0,
    key_quant_mode=0,
    value_quant_mode=0,
    inner_precise=0,
    return_softmax_lse=False,
    query_dtype=None,
    key_dtype=None,
    value_dtype=None,
    query_rope_dtype=None,
    key_rope_dtype=None,
    key_shared_prefix_dtype=None,
    value_shared_prefix_dtype=None,
    dequant_scale_query_dtype=None,
    dequant_scale_key_dtype=None,
    dequant_scale_value_dtype=None,
    dequant_scale_key_rope_dtype=None,
    out_dtype=None,
    renames=None,
    read_data=True,
):
    n = _Names(op, renames)
    _v2_unsupported(
        n,
        query_rope,
        key_rope,
        pse_shift,
        dequant_scale_query,
        dequant_offset_key,
        dequant_offset_value,
        dequant_scale_key_rope,
        quant_scale_out,
        quant_offset_out,
        quant_scale_p,
        learnable_sink,
        query_quant_mode,
        query_dtype,
        key_dtype,
        value_dtype,
        query_rope_dtype,
        key_rope_dtype,
        key_shared_prefix_dtype,
        value_shared_prefix_dtype,
        dequant_scale_query_dtype,
        dequant_scale_key_dtype,
        dequant_scale_value_dtype,
        dequant_scale_key_rope_dtype,
    )
    common = dict(
        atten_mask=atten_mask,
        block_table=block_table,
        num_query_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads,
        input_layout=input_layout,
        sparse_mode=sparse_mode,
        block_size=block_size,
        key_quant_mode=key_quant_mode,
        value_quant_mode=value_quant_mode,
        return_softmax_lse=return_softmax_lse,
        inner_precise=inner_precise,
        dequant_scale_key=dequant_scale_key,
        dequant_scale_value=dequant_scale_value,
        out_dtype=out_dtype,
    )
    if fake:  # shape-level checks only: lengths may be SymInts / unknown while tracing
        if block_table is not None or input_layout == "TND":
            check(actual_seq_kvlen is not None, op, f"{n('actual_seq_kvlen')} is required for TND / paged KV")
        if input_layout == "TND":
            check(actual_seq_qlen is not None, op, f"input_layout TND needs {n('actual_seq_qlen')} (cumulative)")
        plan = _plan(n, query, key, value, **common)
        return (
            query.new_empty(plan.out_shape, dtype=plan.out_dtype),
            query.new_empty(plan.lse_shape, dtype=torch.float32),
        )
    return _fia(
        n,
        query,
        key,
        value,
        actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen,
        softmax_scale=softmax_scale,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        read_data=read_data,
        **common,
    )


def _write_out(op: str, arg: str, out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    check(out.dtype == result.dtype, op, f"{arg} has dtype {out.dtype}; expected {result.dtype}")
    if out.shape != result.shape:
        out.resize_(result.shape)
    out.copy_(result)
    return out


# The kernel and fake kernel are `_v2` with the op name bound: signature = the schema's arguments and defaults.
fia_v2 = functools.partial(_v2, OP_V2, False)
fia_v2_fake = functools.partial(_v2, OP_V2, True)


def fia_v2_traced(query, key, value, **kwargs):
    """The kernel as a compiled graph inlines it (`_fia` with read_data False): without the host reads of the block
    ids and the mask template (a graph cannot raise on data; the runner builds the block table from its own
    allocator), output rows written functionally."""
    return _v2(OP_V2, False, query, key, value, read_data=False, **kwargs)


def _out_overload(op: str, functional):
    """Kernel and fake kernel of an `.out` overload (`..., Tensor? workspace=None, Tensor(a!) attention_out,
    Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))`): compute with `functional`, write into the outputs."""

    def variant(fake: bool):
        def kernel(query, key, value, *, attention_out, softmax_lse, workspace=None, **kwargs):
            out, lse = functional(op, fake, query, key, value, **kwargs)
            return (
                _write_out(op, "attention_out", attention_out, out),
                _write_out(op, "softmax_lse", softmax_lse, lse),
            )

        return kernel

    return variant(False), variant(True)


fia_v2_out, fia_v2_out_fake = _out_overload(OP_V2 + ".out", _v2)


# ---------------------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, ...) -> (Tensor, Tensor)
# v1 = argument-renaming wrapper around v2 (§6).

_V1_RENAMES = {  # v2 name -> v1 name (for error messages)
    "actual_seq_qlen": "actual_seq_lengths",
    "actual_seq_kvlen": "actual_seq_lengths_kv",
    "num_query_heads": "num_heads",
    "softmax_scale": "scale",
    "return_softmax_lse": "softmax_lse_flag",
    "dequant_scale_key": "key_antiquant_scale",
    "dequant_offset_key": "key_antiquant_offset",
    "dequant_scale_value": "value_antiquant_scale",
    "dequant_offset_value": "value_antiquant_offset",
    "key_quant_mode": "key_antiquant_mode",
    "value_quant_mode": "value_antiquant_mode",
    "quant_scale_out": "quant_scale2",
    "quant_offset_out": "quant_offset2",
}


def _v1(
    op: str,
    fake: bool,
    query,
    key,
    value,
    *,
    pse_shift=None,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    dequant_scale1=None,
    quant_scale1=None,
    dequant_scale2=None,
    quant_scale2=None,
    quant_offset2=None,
    antiquant_scale=None,
    antiquant_offset=None,
    key_antiquant_scale=None,
    key_antiquant_offset=None,
    value_antiquant_scale=None,
    value_antiquant_offset=None,
    block_table=None,
    query_padding_size=None,
    kv_padding_size=None,
    key_shared_prefix=None,
    value_shared_prefix=None,
    actual_shared_prefix_len=None,
    query_rope=None,
    key_rope=None,
    key_rope_antiquant_scale=None,
    num_heads=1,
    scale=1.0,
    pre_tokens=INT_MAX,
    next_tokens=INT_MAX,
    input_layout="BSH",
    num_key_value_heads=0,
    sparse_mode=0,
    inner_precise=0,
    block_size=0,
    antiquant_mode=0,
    key_antiquant_mode=0,
    value_antiquant_mode=0,
    softmax_lse_flag=False,
):
    n = _Names(op)
    _reject_unsupported(
        n,
        antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset,
        dequant_scale1=dequant_scale1,
        quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2,
        query_padding_size=query_padding_size,
        kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix,
        value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len,
        key_rope_antiquant_scale=key_rope_antiquant_scale,
    )
    if antiquant_mode != 0:
        unsupported(op, f"antiquant_mode={antiquant_mode}")
    return _v2(
        op,
        fake,
        query,
        key,
        value,
        query_rope=query_rope,
        key_rope=key_rope,
        pse_shift=pse_shift,
        atten_mask=atten_mask,
        actual_seq_qlen=actual_seq_lengths,
        actual_seq_kvlen=actual_seq_lengths_kv,
        block_table=block_table,
        dequant_scale_key=key_antiquant_scale,
        dequant_offset_key=key_antiquant_offset,
        dequant_scale_value=value_antiquant_scale,
        dequant_offset_value=value_antiquant_offset,
        quant_scale_out=quant_scale2,
        quant_offset_out=quant_offset2,
        num_query_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        softmax_scale=scale,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        input_layout=input_layout,
        sparse_mode=sparse_mode,
        block_size=block_size,
        key_quant_mode=key_antiquant_mode,
        value_quant_mode=value_antiquant_mode,
        inner_precise=inner_precise,
        return_softmax_lse=softmax_lse_flag,
        renames=_V1_RENAMES,
    )


fia_v1 = functools.partial(_v1, OP_V1, False)
fia_v1_fake = functools.partial(_v1, OP_V1, True)


fia_v1_out, fia_v1_out_fake = _out_overload(OP_V1 + ".out", _v1)


register(OP_V2, fia_v2, fia_v2_fake, traceable=fia_v2_traced)
register(OP_V2 + ".out", fia_v2_out, fia_v2_out_fake)
register(OP_V1, fia_v1, fia_v1_fake)
register(OP_V1 + ".out", fia_v1_out, fia_v1_out_fake)
