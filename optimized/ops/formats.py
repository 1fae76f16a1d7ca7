"""Storage formats: `npu_format_cast` and the FRACTAL_NZ rules its consumers read by (docs/nz_format.md).

On an NPU a tensor's ACL format is how its bytes lie in device memory: ND (2) is row-major, FRACTAL_NZ (29) tiles the
last two axes of the cast tensor into fractals of 16 rows x C0 elements, C0 = 32 bytes / the size of the element type
the cast is told (`customize_dtype`, else `input_dtype`, else the tensor's dtype). The logical tensor (shape, values,
what `.cpu()` gives back) is unchanged, but a consumer reads the fractals: which axis holds C0, and for packed FP4
(`input_dtype=float4_e2m1fn_x2`) which axis holds the pairs, is fixed by the cast, not by the view handed later.

The portable cast returns the logical values (a new contiguous tensor: the layout the CPU kernels are fast on) and
records the NZ layout on its storage, as torch_npu keeps the format in the storage's descriptor. `nz_fractals`
produces the FRACTAL_NZ arrangement itself from a recorded tensor (and `from_nz_fractals` reads it back); the
consumers (`nz_operand`, `check_nz_read`) refuse an NZ operand the NPU would misread, naming the fix.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from .registry import register
from .validation import check, fail

OP = "npu_format_cast"
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
# The formats a weight is cast to here (an NPU knows more, for convolution layouts the model never uses).
_FORMATS = {ACL_FORMAT_ND: "ND", ACL_FORMAT_FRACTAL_NZ: "FRACTAL_NZ"}

FRACTAL_ROWS = 16  # M0: rows of one fractal, every element type
FRACTAL_ROW_BYTES = 32  # C0 * element size
FLOAT4_E2M1FN_X2 = 296  # torch_npu.float4_e2m1fn_x2: uint8 storage, two E2M1 codes a byte (low nibble first)

# Element types the cast takes, by the codes an `int?` dtype argument arrives as (torch ScalarType numbers, torch_npu's
# private codes): name, bits. 4-byte types tile as float16 unless told otherwise (torch_npu's default).
_ELEMENTS = {
    1: ("int8", 8),
    0: ("uint8", 8),
    3: ("int32", 32),
    6: ("float32", 32),
    5: ("float16", 16),
    15: ("bfloat16", 16),
    24: ("float8_e4m3fn", 8),
    292: ("float8_e4m3fn", 8),
    FLOAT4_E2M1FN_X2: ("float4_e2m1fn_x2", 4),
}
_CODE_OF_DTYPE = {
    torch.int8: 1,
    torch.uint8: 0,
    torch.int32: 3,
    torch.float32: 6,
    torch.float16: 5,
    torch.bfloat16: 15,
    torch.float8_e4m3fn: 24,
}


@dataclass(frozen=True)
class NzLayout:
    """A FRACTAL_NZ cast: `shape` the cast tensor's (its storage units: bytes for packed FP4), `element` what the
    fractals hold, `c0` elements per fractal row (along the cast's last axis), `FRACTAL_ROWS` rows per fractal."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    element: str
    c0: int

    @property
    def fp4(self) -> bool:
        return self.element == "float4_e2m1fn_x2"

    @property
    def c0_storage(self) -> int:
        """C0 in storage units (a byte holds two FP4 codes)."""
        return self.c0 // 2 if self.fp4 else self.c0

    @property
    def fractal_shape(self) -> tuple[int, ...]:
        """The NZ storage shape: [..., ceil(C/C0), ceil(R/16)*16, C0] for a cast tensor [..., R, C]."""
        *lead, rows, cols = self.shape
        c0 = self.c0_storage
        return (*lead, math.ceil(cols / c0), math.ceil(rows / FRACTAL_ROWS) * FRACTAL_ROWS, c0)


@dataclass(frozen=True)
class NzOperand:
    """An NZ tensor as a consumer was handed it: the cast tensor itself, or its transpose over the last two axes."""

    layout: NzLayout
    transposed: bool

    @property
    def inner_axis(self) -> int:
        """The view's axis that runs along the fractal rows (C0, and the FP4 pairs): the cast's last axis."""
        return -2 if self.transposed else -1


# id(storage) -> (weak reference to the storage, its NzLayout): the format lives with the memory, not the tensor object
# (a Parameter or a view of the cast's output shares it); dropped when the storage is freed.
_LAYOUTS: dict[int, tuple[weakref.ref, NzLayout]] = {}


def _remember(t: torch.Tensor, layout: NzLayout) -> None:
    storage = t.untyped_storage()
    key = id(storage)

    def forget(ref, key=key):
        if _LAYOUTS.get(key, (None,))[0] is ref:
            del _LAYOUTS[key]

    _LAYOUTS[key] = (weakref.ref(storage, forget), layout)


def nz_layout(t: torch.Tensor) -> NzLayout | None:
    """The FRACTAL_NZ layout recorded for `t`'s memory, or None (ND)."""
    if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
        return None
    storage = t.untyped_storage()
    hit = _LAYOUTS.get(id(storage))
    return hit[1] if hit is not None and hit[0]() is storage else None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _swap_last(values: tuple) -> tuple:
    return (*values[:-2], values[-1], values[-2])


def nz_operand(op: str, name: str, t: torch.Tensor) -> NzOperand | None:
    """How an operator reads `t`: None for an ND tensor; for an NZ one, whether it is handed transposed. Any other
    view of NZ memory (a slice, a reshape) is refused: the NPU reads the fractals of the whole cast tensor."""
    layout = nz_layout(t)
    if layout is None:
        return None
    shape, strides = tuple(t.shape), tuple(t.stride())
    cast_strides = _contiguous_strides(layout.shape)
    if t.storage_offset() == 0 and shape == layout.shape and strides == cast_strides:
        return NzOperand(layout, transposed=False)
    if t.storage_offset() == 0 and shape == _swap_last(layout.shape) and strides == _swap_last(cast_strides):
        return NzOperand(layout, transposed=True)
    fail(
        op,
        f"{name} (shape {shape}, strides {strides}) is a view of a FRACTAL_NZ tensor of shape {layout.shape}; the "
        f"NPU reads an NZ operand whole: the cast tensor itself or its transpose(-1, -2)",
    )
    return None


def check_nz_read(op: str, name: str, operand: NzOperand | None, fp4_axis: int | None = None) -> None:
    """An NZ operand read as its own dtype (`fp4_axis` None) or as packed FP4 with the pairs along view axis
    `fp4_axis` (-1 or -2) is read as the cast laid it out; otherwise the NPU would misread it: a named error."""
    if operand is None:
        return
    layout = operand.layout
    if fp4_axis is None:
        check(
            not layout.fp4,
            op,
            f"{name} is FRACTAL_NZ cast with input_dtype=float4_e2m1fn_x2 (296, packed FP4 pairs) but is read as "
            f"{layout.dtype}",
        )
        return
    check(
        layout.fp4,
        op,
        f"{name} is read as packed FP4 (float4_e2m1fn_x2) but was cast to FRACTAL_NZ as {layout.element} "
        f"(fractal rows of {layout.c0} bytes, no input_dtype): the NPU would read each byte's two codes as "
        f"neighbours along the fractal rows of other values. Cast the checkpoint-order storage [..., N, K/2] with "
        f"customize_dtype=float8_e4m3fn, input_dtype=float4_e2m1fn_x2 (296) and hand the matmul its transpose(-1, -2)",
    )
    check(
        operand.inner_axis == fp4_axis,
        op,
        f"{name} is FRACTAL_NZ packed FP4 whose pairs run along the cast's last axis (axis {operand.inner_axis} of "
        f"this view, shape {_view_shape(operand)}), but this operand holds its pairs along axis {fp4_axis}: the NPU "
        f"would pair the wrong codes. Cast the storage packed along the reduction axis [..., N, K/2] and pass its "
        f"transpose(-1, -2)",
    )


def _view_shape(operand: NzOperand) -> tuple[int, ...]:
    return _swap_last(operand.layout.shape) if operand.transposed else operand.layout.shape


# --- the FRACTAL_NZ arrangement -----------------------------------------------------------------------------------


def nz_fractals(t: torch.Tensor, layout: NzLayout) -> torch.Tensor:
    """The FRACTAL_NZ storage of the cast tensor `t` (its layout `layout`): [..., C1, R1*16, C0] with element
    (r, c) of each matrix at [c // C0, r, c % C0]; padding (R up to 16s, C up to C0s) is zero."""
    *lead, rows, cols = layout.shape
    c1, rows_padded, c0 = layout.fractal_shape[-3:]
    padded = t.new_zeros((*lead, rows_padded, c1 * c0))
    padded[..., :rows, :cols] = t
    return padded.view(*lead, rows_padded, c1, c0).transpose(-3, -2).contiguous()


def from_nz_fractals(fractals: torch.Tensor, layout: NzLayout) -> torch.Tensor:
    """The cast tensor back from its FRACTAL_NZ storage (the inverse of `nz_fractals`)."""
    *lead, rows, cols = layout.shape
    c1, rows_padded, c0 = fractals.shape[-3:]
    nd = fractals.transpose(-3, -2).reshape(*lead, rows_padded, c1 * c0)
    return nd[..., :rows, :cols].contiguous()


# --- npu_format_cast ------------------------------------------------------------------------------------------------


def _code(value) -> int | None:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, torch.dtype):
        check(value in _CODE_OF_DTYPE, OP, f"dtype {value} has no FRACTAL_NZ element type")
        return _CODE_OF_DTYPE[value]
    return int(value)


def _element(self: torch.Tensor, customize_dtype, input_dtype) -> tuple[str, int]:
    """What the fractals hold and C0 (elements per fractal row), per the cast's dtype arguments."""
    input_code, custom_code = _code(input_dtype), _code(customize_dtype)
    if input_code is not None:
        check(
            input_code == FLOAT4_E2M1FN_X2,
            OP,
            f"input_dtype={input_code}; allowed: None or 296 (float4_e2m1fn_x2, two FP4 codes a uint8 byte)",
        )
        check(
            self.dtype in (torch.uint8, torch.int8),
            OP,
            f"input_dtype=296 (packed FP4) needs uint8 / int8 storage; got {self.dtype}",
        )
    check(
        self.dtype in _CODE_OF_DTYPE or input_code is not None,
        OP,
        f"self has dtype {self.dtype}; FRACTAL_NZ takes {sorted(str(d) for d in _CODE_OF_DTYPE)}",
    )
    element = _ELEMENTS[input_code][0] if input_code is not None else _ELEMENTS[_CODE_OF_DTYPE[self.dtype]][0]
    if custom_code is None:
        custom_code = input_code if input_code is not None else _CODE_OF_DTYPE[self.dtype]
        if _ELEMENTS[custom_code][1] == 32:  # 4-byte types tile as float16 by default
            custom_code = 5
    check(
        custom_code in _ELEMENTS,
        OP,
        f"customize_dtype={custom_code}; allowed codes: "
        + ", ".join(f"{c} ({n})" for c, (n, _) in sorted(_ELEMENTS.items())),
    )
    return element, FRACTAL_ROW_BYTES * 8 // _ELEMENTS[custom_code][1]


# schema: npu_format_cast(Tensor self, int acl_format, *, int? customize_dtype=None, int? input_dtype=None) -> Tensor
# values: unchanged (a layout of the same logical tensor); FRACTAL_NZ tiles the last two axes of self (2 to 6 dims).
def _validate(self: torch.Tensor, acl_format: int, customize_dtype, input_dtype) -> NzLayout | None:
    check(
        acl_format in _FORMATS,
        OP,
        f"acl_format={acl_format} is not supported; allowed: "
        + ", ".join(f"{code} ({name})" for code, name in _FORMATS.items()),
    )
    if acl_format != ACL_FORMAT_FRACTAL_NZ:
        check(
            customize_dtype is None and input_dtype is None,
            OP,
            f"customize_dtype / input_dtype describe a FRACTAL_NZ cast; got {customize_dtype} / {input_dtype} with "
            f"acl_format={acl_format}",
        )
        return None
    check(
        self.dim() >= 2,
        OP,
        f"FRACTAL_NZ (29) tiles the last two axes: self must have >= 2 dims; got shape {tuple(self.shape)}",
    )
    check(self.dim() <= 6, OP, f"FRACTAL_NZ (29) takes 2 to 6 dims; got shape {tuple(self.shape)}")
    element, c0 = _element(self, customize_dtype, input_dtype)
    return NzLayout(tuple(self.shape), self.dtype, element, c0)


def npu_format_cast(self: torch.Tensor, acl_format: int, *, customize_dtype=None, input_dtype=None) -> torch.Tensor:
    layout = _validate(self, acl_format, customize_dtype, input_dtype)
    out = self.clone(memory_format=torch.contiguous_format)  # an operator may not alias its input
    if layout is not None and out.device.type != "meta":
        _remember(out, layout)
    return out


def _fake(self: torch.Tensor, acl_format: int, *, customize_dtype=None, input_dtype=None) -> torch.Tensor:
    _validate(self, acl_format, customize_dtype, input_dtype)
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


register("npu_format_cast", npu_format_cast, _fake)
