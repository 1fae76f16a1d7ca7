"""Per-layer checkpoints of both models, captured without changing their math, in one canonical layout.

A checkpoint is (step, layer, kind): step "prefill" or "decode<s>", layer 0..N-1 (or "final" for the logits), kind
one of KINDS. Every captured tensor is canonical: [tokens, features] float, tokens in request order (the
optimized model's packed TND order; the reference's rows of each request's sequence at that step's positions).

How each side is captured (forward hooks where a module boundary exists; otherwise a wrapper of an instance
method, removed afterwards, that records what the method returns):

kind                 optimized (optimized/model.py)                    reference (reference/model.py)
input_norm           input_layernorm output (y of (y, residual))       input_layernorm output
qkv                  self_attn.qkv() -> q, k (q/k-normed, RoPE'd), v    apply_rope outputs (q, k) and v_proj output
kv_write             the cache slots of the step's tokens, read after  k (RoPE'd) and v of the step's tokens
                     the step (FP8: dequantized): catches a wrong slot
attention            self_attn output (after o_proj)                   self_attn output
residual             post_attention_layernorm's residual output        post_attention_layernorm's input
post_attention_norm  post_attention_layernorm output                   post_attention_layernorm output
router               mlp.route() top-k weights [T, K] (fp32)            block.route() weights at the replayed ids
mlp                  mlp output (MoE block or dense MLP)               mlp output
layer_out            decoder layer output summed (mlp out + residual)  decoder layer output
logits               the model's logits [T, V]                          lm_head output

qkv: per token q heads, then k heads, then v heads, each head's D values (the optimized merged layout, this
rank's heads; single-process only, see equivalence/report/divergence.py). Wrappers restore what was there before, so a
test
may plant a bug with the same kind of wrapper underneath.
"""

from __future__ import annotations

import contextlib

import torch

KINDS = ("input_norm", "qkv", "kv_write", "attention", "residual", "post_attention_norm", "router", "mlp", "layer_out")
FINAL_KINDS = ("logits",)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Any [..., F] capture -> [rows, F] float32 on the host (the report's job: compare on the CPU)."""
    return t.detach().float().reshape(-1, t.shape[-1]).cpu()


def _wrap_method(obj, name: str, make):
    """Install `make(current)` as obj.<name> (an instance attribute); return a function that restores it."""
    had = name in obj.__dict__
    before = obj.__dict__.get(name)
    setattr(obj, name, make(getattr(obj, name)))

    def restore():
        if had:
            setattr(obj, name, before)
        else:
            delattr(obj, name)

    return restore


class Capture:
    """What one model produced in one forward: {(layer, kind): tensor [rows, F]}; `layer` an int or "final"."""

    def __init__(self):
        self.values: dict[tuple, torch.Tensor] = {}
        self.extra: dict[tuple, object] = {}  # routing ids, probabilities (not compared elementwise)

    def put(self, layer, kind: str, value: torch.Tensor) -> None:
        self.values[(layer, kind)] = _rows(value)


# ------------------------------------------------------------------------------------------ optimized side


@contextlib.contextmanager
def optimized_hooks(model, capture_of_step):
    """Record the optimized model's checkpoints of every eager forward into `capture_of_step()` (a Capture)."""
    handles, restores = [], []

    def hook(layer, kind, pick):
        def fn(module, args, out):
            capture_of_step().put(layer, kind, pick(out))

        return fn

    for i, layer in enumerate(model.layers):
        handles.append(
            layer.input_layernorm.register_forward_hook(
                hook(i, "input_norm", lambda out: out[0] if isinstance(out, tuple) else out)
            )
        )
        handles.append(layer.self_attn.register_forward_hook(hook(i, "attention", lambda out: out)))
        handles.append(
            layer.post_attention_layernorm.register_forward_hook(hook(i, "post_attention_norm", lambda out: out[0]))
        )
        handles.append(layer.post_attention_layernorm.register_forward_hook(hook(i, "residual", lambda out: out[1])))
        handles.append(layer.mlp.register_forward_hook(hook(i, "mlp", lambda out: out)))
        handles.append(layer.register_forward_hook(hook(i, "layer_out", lambda out: out[0] + out[1])))

        def qkv_recorder(qkv, _i=i):
            def recorded(hidden, cos, sin):
                q, k, v = qkv(hidden, cos, sin)
                tokens = q.shape[0]
                capture_of_step().put(
                    _i, "qkv", torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
                )
                return q, k, v

            return recorded

        restores.append(_wrap_method(layer.self_attn, "qkv", qkv_recorder))

        if hasattr(layer.mlp, "route"):

            def route_recorder(route, _i=i):
                def recorded(hidden):
                    weights, ids = route(hidden)
                    cap = capture_of_step()
                    cap.put(_i, "router", weights)
                    cap.extra[(_i, "router_ids")] = ids.detach().long().cpu()
                    return weights, ids

                return recorded

            restores.append(_wrap_method(layer.mlp, "route", route_recorder))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for restore in reversed(restores):
            restore()


def read_kv_writes(model, kv_caches, slot_mapping: torch.Tensor, capture: Capture) -> None:
    """Each layer's cache entries at this step's slots, read after the step: K and V [T, 2*Nkv*D] (an FP8 cache
    dequantized with its per-token scales)."""
    slots = slot_mapping.long()
    for i, (layer, cache) in enumerate(zip(model.layers, kv_caches)):
        attn = layer.self_attn
        k_cache, v_cache, *scales = cache
        k = k_cache.reshape(-1, attn.num_kv_heads * attn.head_dim)[slots].float()
        v = v_cache.reshape(-1, attn.num_kv_heads * attn.head_dim)[slots].float()
        if scales:
            k_scale, v_scale = scales
            k = k * k_scale.reshape(-1)[slots].float()[:, None]
            v = v * v_scale.reshape(-1)[slots].float()[:, None]
        capture.put(i, "kv_write", torch.cat([k, v], dim=-1))


# ------------------------------------------------------------------------------------------ reference side


@contextlib.contextmanager
def reference_hooks(ref, capture: Capture):
    """Record the reference's checkpoints of one forward (batch 1: rows are the sequence's positions)."""
    import reference.model as rm

    handles, restores = [], []
    current = {"layer": None, "rope": []}

    def hook(layer, kind, pick=lambda out: out):
        def fn(module, args, out):
            capture.put(layer, kind, pick(out))

        return fn

    def enter_attention(layer):
        def fn(module, args):
            current["layer"], current["rope"] = layer, []

        return fn

    def leave_attention(layer):
        def fn(module, args, out):
            q, k = current["rope"][:2]  # [1, N, S, D], [1, KV, S, D]
            v = capture.values.pop((layer, "_v"))
            rows = lambda t: t.transpose(1, 2).reshape(t.shape[2], -1)  # noqa: E731  [S, heads*D]
            capture.put(layer, "qkv", torch.cat([rows(q), rows(k).float(), v], dim=-1))
            capture.put(layer, "kv_write", torch.cat([rows(k).float(), v], dim=-1))
            capture.put(layer, "attention", out)
            current["layer"] = None

        return fn

    apply_rope = rm.apply_rope

    def recorded_rope(x, cos, sin):
        y = apply_rope(x, cos, sin)
        if current["layer"] is not None:
            current["rope"].append(y.detach().float())
        return y

    for i, layer in enumerate(ref.model.layers):
        handles.append(layer.input_layernorm.register_forward_hook(hook(i, "input_norm")))
        handles.append(layer.self_attn.register_forward_pre_hook(enter_attention(i)))
        handles.append(layer.self_attn.v_proj.register_forward_hook(hook(i, "_v")))
        handles.append(layer.self_attn.register_forward_hook(leave_attention(i)))
        handles.append(
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda module, args, _i=i: capture.put(_i, "residual", args[0])
            )
        )
        handles.append(layer.post_attention_layernorm.register_forward_hook(hook(i, "post_attention_norm")))
        handles.append(layer.mlp.register_forward_hook(hook(i, "mlp")))
        handles.append(layer.register_forward_hook(hook(i, "layer_out")))
        if hasattr(layer.mlp, "route"):

            def route_recorder(route, _i=i):
                def recorded(x, expert_ids=None):
                    weights, ids, probs = route(x, expert_ids)
                    # the replayed call (expert ids given) is the one the block computes with; a plain
                    # forward has only its own
                    if expert_ids is not None or (_i, "router") not in capture.values:
                        capture.put(_i, "router", weights)
                    if expert_ids is None:
                        capture.extra[(_i, "router_probs")] = probs.detach().float().cpu()
                    return weights, ids, probs

                return recorded

            restores.append(_wrap_method(layer.mlp, "route", route_recorder))
    handles.append(ref.lm_head.register_forward_hook(hook("final", "logits")))
    rm.apply_rope = recorded_rope
    try:
        yield capture
    finally:
        rm.apply_rope = apply_rope
        for h in handles:
            h.remove()
        for restore in reversed(restores):
            restore()
