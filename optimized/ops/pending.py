"""Schemas whose portable kernels come in later work: the MC2 dispatch/combine collectives. Defined now so
the whole torch_npu surface exists; calling one raises NotImplementedError naming it."""
from .registry import register_schema_only

for _name in ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"):
    register_schema_only(_name, "MC2 dispatch/combine collectives")
