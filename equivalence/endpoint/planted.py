"""Test-only launcher: our server with a bug planted at run time, without touching the optimized sources.

    python -m equivalence.endpoint.planted BUG_FILE serve --config X.yaml --port P

The model `optimized serve` loads is wrapped in one layer; before every call the wrappers read BUG_FILE ("KIND LAYER",
or empty for no bug), so one server process serves the clean model and each bug in turn:
- rotary: that layer's q/k rotary with cos and sin swapped;
- expert: the first local expert that receives rows in a call has its output x1.5;
- kv_slot: decode steps write the new token's K/V one slot early (prefill writes stay right);
- double_reduce: the layer's MoE output added twice (an all-reduce on top of the MoE's own reduction, world 2).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

KINDS = ("rotary", "expert", "kv_slot", "double_reduce")


def active(bug_file: Path, layer: int, kind: str) -> bool:
    try:
        text = bug_file.read_text().split()
    except OSError:
        return False
    return len(text) == 2 and text[0] == kind and int(text[1]) == layer


def plant(model, bug_file: Path) -> None:
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        qkv, update, forward = attn.qkv, attn.kv_cache_update, layer.forward

        def rotary(hidden, cos, sin, _i=i, _qkv=qkv):
            return _qkv(hidden, sin, cos) if active(bug_file, _i, "rotary") else _qkv(hidden, cos, sin)

        def kv_slot(k, v, meta, kv_cache, _i=i, _update=update):
            if active(bug_file, _i, "kv_slot") and not meta.is_prefill:
                meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping - 1)
            return _update(k, v, meta, kv_cache)

        def layer_forward(*args, _i=i, _forward=forward, **kwargs):
            out, residual = _forward(*args, **kwargs)
            return (out + out if active(bug_file, _i, "double_reduce") else out), residual

        attn.qkv, attn.kv_cache_update, layer.forward = rotary, kv_slot, layer_forward
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            efwd = experts.forward

            def expert(x, tokens_per_expert, _i=i, _efwd=efwd):
                out = _efwd(x, tokens_per_expert)
                if not active(bug_file, _i, "expert"):
                    return out
                counts = tokens_per_expert.long().tolist()
                e = next((j for j, n in enumerate(counts) if n), None)
                if e is None:
                    return out
                start = sum(counts[:e])
                out = out.clone()
                out[start : start + counts[e]] *= 1.5
                return out

            experts.forward = expert


def main(argv: list[str]) -> int:
    bug_file = Path(argv[0])
    from optimized.model_loader import build

    load = build.load_model

    def load_with_bugs(*args, **kwargs):
        model = load(*args, **kwargs)
        plant(model, bug_file)
        return model

    build.load_model = load_with_bugs
    from optimized.cli.main import main as optimized_main

    return optimized_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
