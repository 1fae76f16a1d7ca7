"""torchair's decode attention off the NPU: `torch.ops.air.npu_fused_infer_attention_score_v2`, the fused inference
attention (v2) with its lengths as device tensors, which the recipe's `ge_graph` decode calls through `torchair.ops`.

On an NPU host torchair defines the operator (and GE compiles it); elsewhere it is defined here with torchair's schema
and the portable v2 kernel (ops/attention.py) underneath. As torchair's own CPU kernel does, it refuses to run outside
a GE graph: eager mode and captured graphs call `torch.ops.npu`'s, with host lists.
"""

from __future__ import annotations

import torch

from ..platform import torch_npu_available
from ..torchair_standin import in_ge_graph
from .attention import OP_V2, _v2
from .validation import check, fail

NAMESPACE = "air"
QUALNAME = f"{NAMESPACE}::{OP_V2}"
# torchair's schema: the v2 schema with Tensor? actual_seq_qlen / actual_seq_kvlen (and no quant_scale_p / dtype
# codes of the query and the out tensor beyond those listed).
SCHEMA = (
    f"{OP_V2}(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? pse_shift=None, Tensor? atten_mask=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, "
    "Tensor? block_table=None, Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, "
    "Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, Tensor? dequant_offset_value=None, "
    "Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, "
    "Tensor? learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, "
    'int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, '
    "int block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
    "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, "
    "int? query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
    "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, "
    "int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) "
    "-> (Tensor, Tensor)"
)
_library: torch.library.Library | None = None


def _check_lengths(query, lengths: dict) -> None:
    for name, t in lengths.items():
        if t is None:
            continue
        check(isinstance(t, torch.Tensor) and t.dim() == 1, OP_V2, f"{name} must be a 1-D tensor (torchair.ops)")
        check(not t.dtype.is_floating_point, OP_V2, f"{name} must hold integers; got {t.dtype}")
        check(t.device == query.device, OP_V2, f"{name} is on {t.device}; the query is on {query.device}")


def fia_v2_device_lengths(query, key, value, *, actual_seq_qlen=None, actual_seq_kvlen=None, **kwargs):
    """The portable v2 kernel with the lengths read from their tensors (a GE graph's FIA reads them on the device)."""
    if not in_ge_graph():
        fail(
            f"torchair.ops.{OP_V2}",
            "runs inside a GE graph only (exe_mode ge_graph's compiled decode), as torchair's kernel does; "
            f"eager mode calls torch.ops.npu.{OP_V2} with host lists",
        )
    _check_lengths(query, {"actual_seq_qlen": actual_seq_qlen, "actual_seq_kvlen": actual_seq_kvlen})
    return _v2(
        OP_V2, False, query, key, value, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, **kwargs
    )


def fia_v2_device_lengths_fake(query, key, value, **kwargs):
    return _v2(OP_V2, True, query, key, value, **kwargs)


def _defined() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(QUALNAME, "")
    except RuntimeError:
        return False
    return True


def register() -> None:
    """Define `air::npu_fused_infer_attention_score_v2` (unless torchair has); idempotent."""
    global _library
    if torch_npu_available() or _defined():
        return
    _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    _library.define(SCHEMA)
    _library.impl(OP_V2, fia_v2_device_lengths, "CompositeExplicitAutograd")
    torch.library.register_fake(QUALNAME, fia_v2_device_lengths_fake, lib=_library)


register()
