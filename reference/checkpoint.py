"""Read Hugging Face Qwen3-MoE checkpoints (config.json + safetensors) into the reference model.

Tensor names are the per-expert checkpoint names (`model.layers.N.mlp.experts.E.gate_proj.weight`, ...).
The fused transformers-v5 expert tensors, when present, are split into those names:
  `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] -> experts.E.gate_proj.weight [I, H] (first half)
                                                          and experts.E.up_proj.weight [I, H] (second half)
  `model.layers.N.mlp.experts.down_proj`    [E, H, I]  -> experts.E.down_proj.weight [H, I]
Every mismatch between the checkpoint and the model (missing, unexpected, mis-shaped, non-float tensor, a
dtype other than the one config.json declares) and every unreadable file (bad index JSON, index without
`weight_map`, missing shard, empty / truncated / corrupt safetensors) raises CheckpointError naming the
tensor or file. config.json must say model_type qwen3_moe and give the model's sizes explicitly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3MoeConfig

from reference.model import Qwen3MoeForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """The checkpoint does not fit the model (the message names the tensor)."""


def _listing(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# transformers fills absent keys with defaults (the 30B model's): a config without them would load silently.
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "max_position_embeddings",
)


def load_config(path) -> Qwen3MoeConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} does not exist or is not a directory")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"model path {str(path)!r} has no config.json; point it at a Hugging Face checkpoint directory"
        )
    try:
        config_dict = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    model_type = config_dict.get("model_type")
    if model_type != "qwen3_moe":
        raise CheckpointError(f"{file} has model_type={model_type!r}; expected 'qwen3_moe'")
    for name, stored in Qwen3MoeConfig.attribute_map.items():  # transformers v5 writes num_local_experts
        if stored in config_dict:
            config_dict.setdefault(name, config_dict[stored])
    required = list(REQUIRED_KEYS)
    only, step = config_dict.get("mlp_only_layers") or [], config_dict.get("decoder_sparse_step") or 1
    if any(i not in only and (i + 1) % step == 0 for i in range(config_dict.get("num_hidden_layers") or 0)):
        required += ["num_experts", "num_experts_per_tok"]  # some layer is sparse
    missing = [k for k in required if k not in config_dict]
    if missing:
        raise CheckpointError(
            f"{file}: required key(s) {', '.join(missing)} missing (transformers would use "
            "defaults); add them from the released model's config.json"
        )
    return Qwen3MoeConfig.from_pretrained(path)


def _declared_dtype(path: Path) -> torch.dtype | None:
    """config.json's `dtype` (or `torch_dtype`): every tensor of an unquantized checkpoint has it."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _open(file: Path):
    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found; the checkpoint is incomplete (re-download it)") from None
    except Exception as e:  # safetensors' own SafetensorError for empty, truncated or corrupt files
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({e}); re-download or re-convert it"
        ) from None


def split_fused_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace fused expert tensors (transformers v5 in-memory layout) by per-expert checkpoint names."""
    out = {}
    for name, t in state_dict.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        if t.dim() != 3:
            raise CheckpointError(f"fused expert tensor {name} has shape {tuple(t.shape)}; expected 3 dims")
        if kind == "gate_up_proj":
            if t.shape[1] % 2:
                raise CheckpointError(f"fused expert tensor {name} has shape {tuple(t.shape)}: odd gate+up size")
            gate, up = t.chunk(2, dim=1)  # [E, I, H] each
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        else:
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()  # [H, I]
    return out


def read_state_dict(path) -> dict[str, torch.Tensor]:
    """All tensors of `path/model.safetensors` or of the shards listed in `path/model.safetensors.index.json`."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path / INDEX_FILE} is not valid JSON ({e}); re-download it") from None
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{path / INDEX_FILE} has no 'weight_map' (tensor name -> shard file); re-download it"
            )
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with _open(path / file) as f:
            for name in f.keys():
                if name in tensors:
                    raise CheckpointError(f"tensor {name} appears in more than one file of {path} (again in {file})")
                tensors[name] = f.get_tensor(name)
    if weight_map is not None:
        absent = [n for n in weight_map if n not in tensors]
        if absent:
            raise CheckpointError(f"{INDEX_FILE} lists tensor(s) its shards lack: {_listing(absent)}")
    return split_fused_experts(tensors)


def model_from_state_dict(
    config: Qwen3MoeConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    router_dtype: str = "activation",
    source: str = "state dict",
) -> Qwen3MoeForCausalLM:
    """Build the reference model from a checkpoint-named state dict, strictly (fused experts are split)."""
    state_dict = split_fused_experts(state_dict)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config, router_dtype)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # shares model.embed_tokens.weight
        if "lm_head.weight" in state_dict:
            lm, emb = state_dict["lm_head.weight"], state_dict.get("model.embed_tokens.weight")
            if emb is None or lm.shape != emb.shape or not torch.equal(lm, emb):
                raise CheckpointError(
                    f"{source}: tie_word_embeddings=True but tensor lm_head.weight differs from "
                    "model.embed_tokens.weight"
                )
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    missing = expected.keys() - state_dict.keys()
    if missing:
        raise CheckpointError(f"{source} is missing tensor(s): {_listing(missing)}")
    unexpected = state_dict.keys() - expected.keys()
    if unexpected:
        raise CheckpointError(f"{source} has unexpected tensor(s): {_listing(unexpected)}")
    for name, shape in expected.items():
        t = state_dict[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(t.shape)} in the checkpoint but the model expects {shape}"
            )
        if not t.dtype.is_floating_point:
            raise CheckpointError(
                f"{source}: tensor {name} has dtype {t.dtype}; expected a float dtype "
                "(quantized checkpoints are not read by the reference)"
            )
        bad = int((~torch.isfinite(t)).sum())  # NaN, +inf and -inf alike
        if bad:
            raise CheckpointError(
                f"{source}: tensor {name!r} holds {bad} non-finite value(s) (NaN or inf); the "
                "checkpoint is corrupt: re-download or re-convert it"
            )
    # Fresh (aligned, contiguous) copies: results must not depend on where a tensor sat in its file
    # (CPU kernels take different vector paths for differently aligned memory).
    weights = {n: state_dict[n].to(dtype=dtype, copy=True, memory_format=torch.contiguous_format) for n in expected}
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(path, dtype: torch.dtype = torch.float32, router_dtype: str = "activation") -> Qwen3MoeForCausalLM:
    path = Path(path)
    config = load_config(path)
    state_dict = read_state_dict(path)
    declared = _declared_dtype(path)
    for name, t in state_dict.items():
        if declared is not None and t.dtype != declared:
            raise CheckpointError(
                f"checkpoint {path}: tensor {name} has dtype {t.dtype} but config.json declares "
                f"dtype {declared}; the file is corrupt or from another conversion: re-download or "
                "re-convert it"
            )
    return model_from_state_dict(config, state_dict, dtype, router_dtype, source=f"checkpoint {path}")
