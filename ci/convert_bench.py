"""Peak memory and speed of the W4A8 converter on a released model's shapes (random BF16 weights).

    PYTHONPATH=. python ci/convert_bench.py [--preset Qwen3-30B-A3B] [--layers 1] [--workdir DIR]

Writes a BF16 checkpoint of the preset's real shapes cut to `--layers` decoder layers (embeddings and
lm_head included), one safetensors shard per layer plus one for the rest, then runs
`python -m optimized convert --quant w4a8` on it in a fresh single-threaded process and reports its wall
time, peak anonymous memory (sampled every 10 ms, beside that of a process that only imports the converter),
VmHWM (which also counts the mmap-ed source pages), bytes in / out, and the largest source tensor: streaming
keeps the converter's own memory below a small multiple of one tensor, never near the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from fixtures.presets import preset_config


def write_checkpoint(directory: Path, preset: str, layers: int) -> tuple[int, int]:
    """A sharded BF16 checkpoint of `preset` cut to `layers` layers; returns (total bytes, largest tensor bytes)."""
    config = preset_config(preset, num_hidden_layers=layers)
    H, I, E = config.hidden_size, config.moe_intermediate_size, config.num_experts
    nq, nkv, d, V = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size
    g = torch.Generator().manual_seed(0)
    weight_map, total, largest = {}, 0, 0

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def save(file: str, tensors: dict) -> None:
        nonlocal total, largest
        save_file(tensors, directory / file, metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
            largest = max(largest, t.numel() * t.element_size())

    files = layers + 1
    save(
        f"model-00001-of-{files:05d}.safetensors",
        {
            "model.embed_tokens.weight": randn(V, H),
            "lm_head.weight": randn(V, H),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        },
    )
    for i in range(layers):
        p = f"model.layers.{i}"
        t = {
            f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"{p}.self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            f"{p}.self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": randn(nq * d, H),
            f"{p}.self_attn.k_proj.weight": randn(nkv * d, H),
            f"{p}.self_attn.v_proj.weight": randn(nkv * d, H),
            f"{p}.self_attn.o_proj.weight": randn(H, nq * d),
            f"{p}.mlp.gate.weight": randn(E, H),
        }
        for e in range(E):
            x = f"{p}.mlp.experts.{e}"
            t.update(
                {
                    f"{x}.gate_proj.weight": randn(I, H),
                    f"{x}.up_proj.weight": randn(I, H),
                    f"{x}.down_proj.weight": randn(H, I),
                }
            )
        save(f"model-{i + 2:05d}-of-{files:05d}.safetensors", t)
        del t
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (directory / "config.json").write_text(config.to_json_string())
    return total, largest


_SAMPLER = """
import threading, time
peak = {"RssAnon": 0}
def _sample():
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak["RssAnon"] = max(peak["RssAnon"], int(line.split()[1]) * 1024)
        time.sleep(0.01)
threading.Thread(target=_sample, daemon=True).start()
"""


def _peak_memory(statement: str) -> tuple[int, int]:
    """(peak anonymous bytes, sampled every 10 ms; VmHWM bytes, which also counts the mmap-ed source pages the
    process touched) of a fresh single-threaded interpreter running `statement`."""
    code = (
        _SAMPLER
        + statement
        + """
time.sleep(0.05)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print("PEAK", peak["RssAnon"], int(hwm) * 1024)
"""
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    anon, hwm = out.split("PEAK")[1].split()
    return int(anon), int(hwm)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="Qwen3-30B-A3B")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, dst = Path(tmp) / "bf16", Path(tmp) / "w4a8"
        src.mkdir()
        total, largest = write_checkpoint(src, args.preset, args.layers)
        start = time.perf_counter()
        peak, hwm = _peak_memory(
            "from optimized.__main__ import main\n"
            f"main(['convert', '--quant', 'w4a8', {str(src)!r}, {str(dst)!r}, '--no-progress'])"
        )
        seconds = time.perf_counter() - start
        out = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    baseline, _ = _peak_memory("import tqdm, optimized.model_loader.quantize, optimized.__main__")
    mib = 2**20
    print(
        f"{args.preset}, {args.layers} layer(s): source {total / mib:.0f} MiB BF16 (largest tensor "
        f"{largest / mib:.0f} MiB) -> {out / mib:.0f} MiB W4A8 in {seconds:.1f} s, one thread "
        f"({total / mib / seconds:.0f} MiB/s of source, process start included); converter peak anonymous memory "
        f"{peak / mib:.0f} MiB, of which {baseline / mib:.0f} MiB is the interpreter with torch imported: "
        f"{(peak - baseline) / mib:.0f} MiB for the data ({(peak - baseline) / total:.3f}x the checkpoint, "
        f"{(peak - baseline) / largest:.2f}x its largest tensor); VmHWM {hwm / mib:.0f} MiB (includes the "
        f"mmap-ed source pages read, which the kernel can drop)"
    )


if __name__ == "__main__":
    main()
