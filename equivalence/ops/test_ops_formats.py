"""npu_format_cast's FRACTAL_NZ layout (docs/nz_format.md) and the NZ rules its consumers read by.

The cast keeps every value and records the layout; `nz_fractals` is the arrangement the NPU stores (fractals of 16
rows x C0 elements, C0 = 32 bytes of the element type the cast is told), read back bit for bit; a grouped or quant
matmul refuses an NZ operand the NPU would misread: W4A8's FP4 experts cast in the orientation the NPU cannot read.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import optimized.ops  # noqa: F401  (registers torch.ops.npu.*)
from equivalence.support.compare import assert_bitwise_equal
from optimized.ops import cpu_gemm, formats, mx_format as mxf

pytestmark = pytest.mark.equivalence

CAST = torch.ops.npu.npu_format_cast
GMM = torch.ops.npu.npu_grouped_matmul
QMM = torch.ops.npu.npu_quant_matmul
FP8 = torch.float8_e4m3fn
FP4 = mxf.float4_e2m1fn_x2
E8M0 = mxf.float8_e8m0fnu

# storage dtype, cast kwargs -> (what the fractals hold, C0 in elements): C0 * element bits == 32 bytes; 4-byte types
# tile as float16 unless told; packed FP4 told float8_e4m3fn tiles 32 codes (16 bytes) a fractal row.
BLOCKS = [
    (torch.float16, {}, "float16", 16),
    (torch.bfloat16, {}, "bfloat16", 16),
    (torch.float32, {}, "float32", 16),
    (torch.int8, {}, "int8", 32),
    (FP8, {}, "float8_e4m3fn", 32),
    (torch.uint8, {}, "uint8", 32),
    (torch.uint8, {"customize_dtype": FP8, "input_dtype": FP4}, "float4_e2m1fn_x2", 32),
    (torch.uint8, {"input_dtype": FP4}, "float4_e2m1fn_x2", 64),
]


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.int8):
        return torch.randint(0, 255, shape, generator=g).to(torch.uint8).view(dtype)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@given(
    case=st.sampled_from(BLOCKS),
    shape=st.lists(st.integers(1, 40), min_size=2, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_nz_fractals_hold_each_element_at_its_block_place_and_read_back(case, shape, seed):
    dtype, kwargs, element, c0 = case
    x = _values(shape, dtype, seed)
    y = CAST(x, 29, **kwargs)
    layout = formats.nz_layout(y)
    assert layout is not None and (layout.element, layout.c0) == (element, c0), layout
    assert_bitwise_equal(_bits(y), _bits(x), "the cast keeps every value")
    fractals = formats.nz_fractals(y, layout)
    *lead, rows, cols = shape
    c0s = c0 // 2 if element == "float4_e2m1fn_x2" else c0
    assert tuple(fractals.shape) == (*lead, -(-cols // c0s), -(-rows // 16) * 16, c0s) == layout.fractal_shape
    # element (r, c) sits in fractal column block c // C0, row r, place c % C0 (storage units: bytes for FP4)
    r = torch.arange(rows).view(-1, 1).expand(rows, cols)
    c = torch.arange(cols).view(1, -1).expand(rows, cols)
    placed = fractals[..., c // c0s, r, c % c0s]
    assert_bitwise_equal(_bits(placed), _bits(y), "element (r, c) at [c // C0, r, c % C0]")
    assert_bitwise_equal(_bits(formats.from_nz_fractals(fractals, layout)), _bits(y), "NZ -> ND round trip")
    pad = fractals.clone()
    pad[..., c // c0s, r, c % c0s] = torch.zeros((), dtype=dtype)
    assert not _bits(pad).any(), "the padding of the fractals is zero"


def test_nd_cast_records_no_layout_and_nz_survives_a_parameter_and_a_transpose():
    x = torch.randn(3, 5, 7)
    assert formats.nz_layout(CAST(x, 2)) is None
    p = torch.nn.Parameter(CAST(x, 29), requires_grad=False)
    assert formats.nz_operand("op", "w", p) == formats.NzOperand(formats.nz_layout(p), transposed=False)
    assert formats.nz_operand("op", "w", p.transpose(1, 2)).transposed
    with pytest.raises(ValueError, match=r"op: w \(shape \(5, 7\).*view of a FRACTAL_NZ tensor.*reads an NZ operand"):
        formats.nz_operand("op", "w", p[0])


def test_the_cast_refuses_dtype_arguments_it_cannot_honour():
    with pytest.raises(ValueError, match=r"input_dtype=24; allowed: None or 296"):
        CAST(torch.zeros(4, 4, dtype=torch.uint8), 29, input_dtype=FP8)
    with pytest.raises(ValueError, match=r"input_dtype=296 \(packed FP4\) needs uint8 / int8 storage"):
        CAST(torch.zeros(4, 4), 29, input_dtype=FP4)
    with pytest.raises(ValueError, match=r"customize_dtype / input_dtype describe a FRACTAL_NZ cast"):
        CAST(torch.zeros(4, 4, dtype=torch.uint8), 2, input_dtype=FP4)
    with pytest.raises(ValueError, match=r"FRACTAL_NZ \(29\) takes 2 to 6 dims"):
        CAST(torch.zeros((1,) * 7), 29)


# --- W4A8's FP4 expert weights: the orientation the NPU reads ------------------------------------------------------

E, K, N, M = 2, 128, 32, 6


def _w4a8_operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (E, N, K // 2), generator=g).to(torch.uint8)  # checkpoint order, packed along K
    ws = torch.randint(120, 130, (E, K // 64, N, 2), generator=g).to(torch.uint8)
    x = (torch.randn(M, K, generator=g) * 2).to(FP8)
    xs = torch.randint(124, 130, (M, K // 64, 2), generator=g).to(torch.uint8)
    return w, ws, x, xs


def _w4a8_gmm(weight, ws, x, xs):
    return GMM(
        [x],
        [weight],
        antiquant_scale=[ws],
        per_token_scale=[xs],
        group_list=torch.tensor([4, 2]),
        group_type=0,
        group_list_type=1,
        split_item=3,
        tuning_config=[0],
        output_dtype=15,
        weight_dtype=FP4,
        per_token_scale_dtype=E8M0,
    )[0]


def test_w4a8_fp4_weight_cast_as_the_recipe_casts_it_reads_the_nd_numbers():
    w, ws, x, xs = _w4a8_operands()
    nz = CAST(w.contiguous(), 29, customize_dtype=FP8, input_dtype=FP4)
    assert_bitwise_equal(_w4a8_gmm(nz.transpose(1, 2), ws, x, xs), _w4a8_gmm(w.transpose(1, 2), ws, x, xs), "W4A8")


def test_w4a8_fp4_weight_cast_transposed_is_refused_as_the_npu_would_misread_it():
    """The old cast: the packed-along-K bytes physically transposed to [E, K/2, N], cast as plain bytes (or as FP4,
    whose pairs would then run along N): the NPU reads neither, so neither may give the right answer here."""
    w, ws, x, xs = _w4a8_operands()
    transposed = w.transpose(1, 2).contiguous()
    with pytest.raises(ValueError, match=r"weight\[0\] is read as packed FP4.*cast to FRACTAL_NZ as uint8"):
        _w4a8_gmm(CAST(transposed, 29), ws, x, xs)
    as_fp4 = CAST(transposed, 29, customize_dtype=FP8, input_dtype=FP4)
    with pytest.raises(ValueError, match=r"pairs run along the cast's last axis \(axis -1.*its pairs along axis -2"):
        _w4a8_gmm(as_fp4, ws, x, xs)


def test_nz_fp4_weights_are_not_read_as_another_dtype_and_slices_of_nz_are_refused():
    w = CAST(torch.zeros(2, 8, 16, dtype=torch.bfloat16), 29)
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"npu_grouped_matmul: weight\[0\] .* view of a FRACTAL_NZ tensor"):
        GMM([x], [w[:1]], group_list=torch.tensor([3]), group_type=0, group_list_type=1, split_item=3)
    fp4 = CAST(torch.zeros(64, 16, dtype=torch.uint8), 29, input_dtype=FP4)  # [K, N/2] pairs along N: A4W4's x2
    xq = torch.zeros(2, 32, dtype=torch.uint8)
    xs, s = torch.full((2, 1, 2), 127, dtype=torch.uint8), torch.full((1, 32, 2), 127, dtype=torch.uint8)
    kw = dict(pertoken_scale=xs, output_dtype=15, x1_dtype=FP4, x2_dtype=FP4, scale_dtype=E8M0)
    assert QMM(xq, fp4, s, pertoken_scale_dtype=E8M0, group_sizes=[1, 1, 32], **kw).shape == (2, 32)
    plain = CAST(torch.zeros(64, 16, dtype=torch.uint8), 29)
    with pytest.raises(ValueError, match=r"npu_quant_matmul: x2 is read as packed FP4.*as uint8"):
        QMM(xq, plain, s, pertoken_scale_dtype=E8M0, group_sizes=[1, 1, 32], **kw)


# --- NZ at no CPU cost ------------------------------------------------------------------------------------------


def test_a_16_bit_nz_expert_stack_is_read_from_the_nd_layout_without_onednn(monkeypatch):
    """An NZ-cast [L, K, N] stack is row-major on the CPU; without oneDNN the grouped matmul reads it from a K-major
    copy made once (the ND build's layout): the ND build's bits, and the copy is made once, not per call."""
    monkeypatch.setattr(cpu_gemm, "ONEDNN_BF16", False)
    g = torch.Generator().manual_seed(5)
    nd = torch.randn(4, 96, 512, generator=g).to(torch.bfloat16).transpose(1, 2)  # [L, K, N] view of [L, N, K] rows
    nz = CAST(nd.contiguous(), 29)
    x = torch.randn(24, 512, generator=g).to(torch.bfloat16)
    counts = torch.tensor([7, 0, 12, 5])
    call = dict(group_list=counts, group_type=0, group_list_type=1, split_item=3, tuning_config=[0])
    reads, k_major = [], cpu_gemm.k_major
    monkeypatch.setattr(cpu_gemm, "k_major", lambda w: reads.append((w, k_major(w))) or reads[-1][1])
    with torch.no_grad():
        want = GMM([x], [nd], **call)[0]
        assert not reads, "an ND stack is read as it is"
        for _ in range(2):
            assert_bitwise_equal(GMM([x], [nz], **call)[0], want, "NZ vs ND grouped matmul without oneDNN")
    assert [w is nz for w, _ in reads] == [True, True], "the NZ stack is read from its K-major copy on each call"
    (_, first), (_, second) = reads
    assert first is second and first.stride(-2) == 1, "one K-major copy (K contiguous), made on the first call"


@pytest.mark.skipif(not cpu_gemm.ONEDNN_BF16, reason="no oneDNN bf16 on this CPU (or CPU prepacking is off)")
def test_onednn_packs_an_nz_expert_from_its_rows(monkeypatch):
    """oneDNN reorders a strided weight into a layout its GEMM re-reorders on every call (tens of times slower): an
    NZ expert ([K, N] rows, read as [N, K] transposed) is packed from [N, K] rows, as the ND build's is."""
    packed, reorder = [], torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, b: packed.append(w) or reorder(w, b))
    nz = CAST(torch.randn(3, 64, 32).to(torch.bfloat16), 29)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        y = GMM([x], [nz], group_list=torch.tensor([2, 0, 3]), group_type=0, group_list_type=1, split_item=3)[0]
    assert packed and all(w.is_contiguous() for w in packed), [w.stride() for w in packed]
    assert_bitwise_equal(y[:2], cpu_gemm.linear(x[:2], nz[0].t().contiguous()), "expert 0 as a linear of its rows")
