"""A converted W4A8 checkpoint loads sharded exactly as the slices of its unsharded load.

For world sizes 1, 2, 4 (attention TP up to 4, expert parallel, vocab-parallel embedding / lm_head), every
rank's parameters are built in this process (`ParallelState.build(rank=r, create_groups=False)`: loading
needs no collective) from the single-file and the sharded checkpoint, and compared bitwise with the layout
definitions applied to the world-1 model: merged QKV rows by heads (KV heads replicated when attention TP
exceeds them), o_proj a K-slice of whole 32-blocks (FP8 columns and their scale bytes, the scale padded to
an even block count with a zero byte), experts by expert range. The per-rank bytes read equal the bytes of
its slices. Whole-byte FP4 slicing under MoE TP and the layout / dtype / config errors are checked on
synthetic sources and copies of the tiny checkpoint. A copy with the recipe converter's config.json
quantization_config as text (§8.3: per-token FP8 kv_cache_scheme, global_compression_ratio "null") loads and
generates what the project's own conversion generates, with the FP8 cache; each deviation from it is one
QuantConfigError naming the key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from equivalence.support.compare import assert_bitwise_equal, rel_l2, tolerance
from equivalence.support.recipe_quant_config import (
    _ARGS,
    _GROUP,
    RECIPE_LINEAR_GROUP,
    RECIPE_QUANTIZATION_TEMPLATE,
)
from equivalence.support.strategies import describe_layout, layout
from fixtures.checkpoints import checkpoint, w4a8_checkpoint
from fixtures.tiny import tiny_config
from optimized.distributed import ParallelState
from optimized.layers.moe import FusedMoEGMM
from optimized.layers.quantization.errors import QuantConfigError
from optimized.layers.quantization.lifecycle import checkpoint_layout_parameters, process_weights_after_loading
from optimized.layers.quantization.w4a8 import W4A8MxFp4MoEGMMMethod
from optimized.model_loader.build import load_model
from optimized.model_loader.loader import CheckpointError, StateDictSource
from optimized.model_loader.quantize import MXFP4, mx_quantize_weight

CONFIG = tiny_config("tiny")
LAYOUTS = [
    layout(1),
    layout(2, attn_tp_size=2, embed_tp_size=2),
    layout(2, lmhead_tp_size=2),
    layout(4, attn_tp_size=4, embed_tp_size=4, lmhead_tp_size=4),
    layout(4, attn_tp_size=2),
]


def rank_params(path, lay: dict, rank: int):
    state = ParallelState.build(rank=rank, create_groups=False, **lay)
    model = load_model(path, parallel=state, dtype=torch.bfloat16)
    # in the checkpoint layouts (the build left the MX ones in the kernels' runtime layouts)
    return checkpoint_layout_parameters(model), model.weight_source.bytes_read


def expected(full: dict, lay: dict, rank: int) -> dict:
    """Rank `rank`'s parameters by the layout definitions, from the world-1 parameters `full`."""
    a_tp, e_tp, v_tp, l_tp = lay["attn_tp_size"], lay["moe_ep_size"], lay["embed_tp_size"], lay["lmhead_tp_size"]
    a, e = rank % a_tp, rank // lay["moe_tp_size"]
    nq, nkv, d, _H = CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim, CONFIG.hidden_size
    qh = nq // a_tp
    kv = range(a * nkv // a_tp, (a + 1) * nkv // a_tp) if nkv >= a_tp else [a * qh // (nq // nkv)]
    rows = [h * d + i for h in range(a * qh, (a + 1) * qh) for i in range(d)]
    rows += [nq * d + h * d + i for h in kv for i in range(d)]
    rows += [(nq + nkv) * d + h * d + i for h in kv for i in range(d)]
    cols = slice(a * qh * d, (a + 1) * qh * d)
    blocks = slice(cols.start // 32, cols.stop // 32)

    def chunk(t, parts, i):
        n = t.shape[0] // parts
        return t[i * n : (i + 1) * n]

    out = {}
    for name, t in full.items():
        if name == "embed_tokens.weight":
            out[name] = chunk(t, v_tp, rank % v_tp)
        elif name == "lm_head.weight":
            out[name] = chunk(t, l_tp, rank % l_tp)
        elif "merged_qkv_proj" in name:
            out[name] = t[rows]
        elif name.endswith("o_proj.weight"):
            out[name] = t[:, cols]
        elif name.endswith("o_proj.weight_scale"):
            s = t[:, blocks]
            out[name] = torch.cat([s, torch.zeros(s.shape[0], s.shape[1] % 2, dtype=torch.uint8)], 1)
        elif ".experts." in name:
            out[name] = chunk(t, e_tp, e)
        else:
            out[name] = t
    return out


def checkpoint_bytes(name: str, params: dict) -> int:
    """Bytes a parameter was read from: 4 per value of the fp32 fixture's kept tensors, 1 per FP8 / packed FP4
    byte, and for scales one byte per 32-block of the rank's K (not the zero byte padding to an even count)."""
    p = params[name]
    if name.endswith("_scale"):
        weight = params[name.removesuffix("_scale")]
        k = weight.shape[-1] * (2 if weight.dtype == torch.uint8 else 1)
        return p[..., 0].numel() * -(-k // 32)
    return p.numel() * (1 if p.dtype in (torch.uint8, torch.float8_e4m3fn) else 4)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_w4a8_sharded_load_equals_slices_of_unsharded(sharded):
    path = w4a8_checkpoint("tiny", sharded=sharded)
    full, _ = rank_params(path, layout(1), 0)
    assert full["layers.0.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert full["layers.1.mlp.experts.w2_weight"].dtype == torch.uint8
    for lay in LAYOUTS:
        for rank in range(lay["world_size"]):
            got, bytes_read = rank_params(path, lay, rank)
            want = expected(full, lay, rank)
            what = f"{describe_layout(lay)} rank {rank}"
            assert sorted(got) == sorted(want), what
            for name in want:
                assert_bitwise_equal(got[name], want[name], f"{what}: {name}")
            want_bytes = sum(checkpoint_bytes(name, got) for name in got)
            assert bytes_read == want_bytes, f"{what}: read {bytes_read} bytes, its slices are {want_bytes}"


def test_fp4_down_proj_is_sliced_on_whole_bytes_under_moe_tp():
    """MoE TP splits down_proj's K (= moe_intermediate): rank 1 of 2 gets packed bytes [I/4, I/2) and scale
    bytes [I/64, I/32) of every row (I = 128), gate/up their rows; other experts are skipped."""
    H, inter, experts = 64, 128, 2
    g = torch.Generator().manual_seed(0)
    state = {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            q, s = mx_quantize_weight(torch.randn(shape, generator=g).bfloat16(), MXFP4)
            state[f"m.{e}.{proj}.weight"], state[f"m.{e}.{proj}.weight_scale"] = q, s
    tp, ep = SimpleNamespace(size=2, rank=1, group=None), SimpleNamespace(size=2, rank=1, group=None)
    layer = FusedMoEGMM(experts, H, inter, tp, ep, torch.bfloat16, W4A8MxFp4MoEGMMMethod())
    source = StateDictSource(state)
    layer.load(source, "m")
    source.check_all_used()
    assert_bitwise_equal(layer.w2_weight[0], state["m.1.down_proj.weight"][:, 32:64], "w2 packed bytes")
    assert_bitwise_equal(layer.w2_weight_scale[0], state["m.1.down_proj.weight_scale"][:, 2:4], "w2 scales")
    assert_bitwise_equal(
        layer.w13_weight[0],
        torch.cat([state["m.1.gate_proj.weight"][64:], state["m.1.up_proj.weight"][64:]]),
        "w13 rows",
    )


def test_k_slice_off_the_block_grid_is_an_error_naming_the_tensor():
    """tiny's moe_intermediate_size 32 split over MoE TP 2 gives 16-element K-slices of down_proj."""
    state = {}
    for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
        state[f"m.0.{proj}.weight"], state[f"m.0.{proj}.weight_scale"] = mx_quantize_weight(torch.randn(shape), MXFP4)
    layer = FusedMoEGMM(
        1,
        64,
        32,
        SimpleNamespace(size=2, rank=1, group=None),
        SimpleNamespace(size=1, rank=0, group=None),
        torch.bfloat16,
        W4A8MxFp4MoEGMMMethod(),
    )
    with pytest.raises(CheckpointError, match=r"'m\.0\.down_proj\.weight'.*K-slice \[16, 32\) of K=32 .*32-element"):
        layer.load(StateDictSource(state), "m")


@pytest.fixture
def w4a8_copy(tmp_path):
    for item in w4a8_checkpoint("tiny").iterdir():
        shutil.copy(item, tmp_path / item.name)
    return tmp_path


def test_bf16_tensor_in_w4a8_checkpoint_is_named(w4a8_copy):
    tensors = load_file(w4a8_copy / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"].float()
    save_file(tensors, w4a8_copy / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has dtype torch\.float32 "
        r"but the model is built for MXFP8",
    ):
        load_model(w4a8_copy)


def test_quantized_checkpoint_without_quantization_config_is_named(w4a8_copy):
    config = json.loads((w4a8_copy / "config.json").read_text())
    del config["quantization_config"]
    (w4a8_copy / "config.json").write_text(json.dumps(config))
    # blamed on the missing key, not on the FP8 dtype its absence makes look wrong
    with pytest.raises(
        CheckpointError,
        match=r"config\.json has no 'quantization_config', but the checkpoint holds "
        r"quantized tensors \(\d+ MX scale tensors, e\.g\. model\.layers\.",
    ):
        load_model(w4a8_copy)


def test_unsupported_quantization_config_names_the_key(w4a8_copy):
    config = json.loads((w4a8_copy / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (w4a8_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        QuantConfigError,
        match=r"quantization_config\.config_groups \(\(weight, activation\) bits per target; w4a8: .*, w8a8: .*\)="
        r"\{'Linear': \(4, 8\), 'MoEGMM': \(4, 8\)\} is not supported",
    ):
        load_model(w4a8_copy)


def test_w4a8_checkpoint_in_float32_is_an_error():
    with pytest.raises(QuantConfigError, match="W4A8 / W8A8 checkpoints run with bfloat16 or float16 activations"):
        load_model(w4a8_checkpoint("tiny"), dtype=torch.float32)


def test_random_weights_for_a_w4a8_config_is_an_error():
    with pytest.raises(QuantConfigError, match="has a quantization_config: random weights"):
        load_model(w4a8_checkpoint("tiny"), random_weights=True)


def test_w4a8_experts_under_moe_tp_sum_to_the_unsharded_experts():
    """MoE TP 2 on synthetic W4A8 experts (I = 128: 64 per rank, two MX blocks): each rank's gate/up rows and
    SwiGLU are its slice of the unsharded ones (bitwise), and the down-projection partial products of the two
    K-slices sum to the unsharded output (the all-reduce, here in fp32) within the bound of their three bf16
    roundings, element by element, and within `moe_tp_partials.w4a8` overall."""
    H, inter, experts = 64, 128, 2
    g = torch.Generator().manual_seed(1)
    state = {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
            q, s = mx_quantize_weight(torch.randn(shape, generator=g).bfloat16(), MXFP4)
            state[f"m.{e}.{proj}.weight"], state[f"m.{e}.{proj}.weight_scale"] = q, s
    x = torch.randn(11, H, generator=g).bfloat16()
    counts = torch.tensor([7, 4])

    def layer(tp_size, tp_rank):
        tp, ep = SimpleNamespace(size=tp_size, rank=tp_rank, group=None), SimpleNamespace(size=1, rank=0, group=None)
        moe = FusedMoEGMM(experts, H, inter, tp, ep, torch.bfloat16, W4A8MxFp4MoEGMMMethod())
        moe.load(StateDictSource(state), "m")
        process_weights_after_loading(moe)  # built by hand: the build's post-load step
        return moe

    full = layer(1, 0)
    want = full(x, counts)
    parts = []
    for rank in range(2):
        part = layer(2, rank)
        got, unsharded = (checkpoint_layout_parameters(m)["w13_weight"] for m in (part, full))
        assert_bitwise_equal(
            got,
            torch.cat(
                [unsharded[:, rank * 64 : (rank + 1) * 64], unsharded[:, 128 + rank * 64 : 128 + (rank + 1) * 64]], 1
            ),
        )
        parts.append(part(x, counts).double())
    # Each partial and the unsharded output are fp32 sums rounded once to bf16 (<= 1/2 ulp each, ulp <= eps*|v|);
    # partials cancel, so the bound is on their magnitudes, not on the (smaller) result's.
    eps = torch.finfo(torch.bfloat16).eps
    err = (parts[0] + parts[1] - want.double()).abs()
    bound = eps * (parts[0].abs() + parts[1].abs() + want.double().abs())
    assert (err <= bound).all(), f"MoE TP partial sums vs unsharded: worst excess {(err - bound).max():.3e}"
    assert rel_l2(parts[0] + parts[1], want) <= tolerance("moe_tp_partials.w4a8").max_rel_l2


RECIPE_QUANTIZATION_CONFIG = RECIPE_QUANTIZATION_TEMPLATE % (
    f'"group_0": {RECIPE_LINEAR_GROUP}, "group_1": {_GROUP % (_ARGS % ("true", 8), "MoEGMM", _ARGS % ("false", 4))}'
)


@pytest.fixture
def recipe_checkpoint(w4a8_copy):
    """The tiny W4A8 tensors with config.json's quantization_config as the recipe's converter writes it."""
    config = json.loads((w4a8_copy / "config.json").read_text())
    config["quantization_config"] = json.loads(RECIPE_QUANTIZATION_CONFIG)
    (w4a8_copy / "config.json").write_text(json.dumps(config, indent=2))
    return w4a8_copy


def test_recipe_format_checkpoint_loads_and_generates_with_the_fp8_kv_cache(recipe_checkpoint):
    """The recipe's config.json (kv_cache_scheme: per-token FP8, global_compression_ratio the string "null")
    loads; the FP8 cache runs by default and generates what the project's own `--kv-cache fp8` conversion
    generates; kv_cache_dtype bfloat16 overrides it to a 16-bit cache."""
    from optimized.executor.model_runner import ModelRunner

    prompts = [[5, 6, 7, 8, 9], list(range(20, 37))]
    model = load_model(recipe_checkpoint, dtype=torch.bfloat16)
    runner = ModelRunner(model, 16)
    assert runner.kv_cache_dtype == torch.float8_e4m3fn
    ours = ModelRunner(load_model(w4a8_checkpoint("tiny", kv_cache="fp8"), dtype=torch.bfloat16), 16)
    assert runner.generate(prompts, 4).tokens == ours.generate(prompts, 4).tokens
    assert ModelRunner(model, 16, kv_cache_dtype="bfloat16").kv_cache_dtype == torch.bfloat16


def _torchrun_generate(config_path, model_path, prompt: list[int], new_tokens: int) -> list[str]:
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "optimized",
            "generate",
            "--config",
            str(config_path),
            "--model-path",
            str(model_path),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-new-tokens",
            str(new_tokens),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_recipe_format_checkpoint_under_torchrun_fp8_kv_and_bfloat16_override(recipe_checkpoint, tmp_path):
    """The recipe-format checkpoint through the CLI on two ranks (tiny_w4a8_ep2: attention TP 2, EP 2): the start-up
    line reports the per-token FP8 cache the checkpoint's kv_cache_scheme selects, and `kv_cache_dtype: bfloat16`
    in the YAML overrides it; the first generated token is the single-process run's (later tokens may part on bf16
    near-ties, `model.w4a8.bfloat16`)."""
    import yaml

    from optimized.executor.model_runner import ModelRunner

    repo_configs = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
    prompt = [5, 6, 7, 8, 9, 10, 11]
    single = ModelRunner(load_model(recipe_checkpoint, dtype=torch.bfloat16), 16).generate([prompt], 3).tokens[0]
    lines = _torchrun_generate(repo_configs / "tiny_w4a8_ep2.yaml", recipe_checkpoint, prompt, 3)
    assert any(line.startswith("kv cache: float8_e4m3fn (per-token FP8") for line in lines), lines
    ids = next(line for line in lines if line.startswith("generated ids:")).split()[2]
    assert int(ids.split(",")[0]) == single[0], (ids, single)

    override = yaml.safe_load((repo_configs / "tiny_w4a8_ep2.yaml").read_text())
    override["model_config"]["kv_cache_dtype"] = "bfloat16"
    (tmp_path / "bf16_kv.yaml").write_text(yaml.safe_dump(override))
    lines = _torchrun_generate(tmp_path / "bf16_kv.yaml", recipe_checkpoint, prompt, 3)
    assert any(
        line.startswith("kv cache: bfloat16 (unquantized") and "kv_cache_dtype: bfloat16" in line for line in lines
    ), lines


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda q: q.update(global_compression_ratio=None),
            r"quantization_config\.global_compression_ratio=None is not supported \(the converter writes 'null'\)",
        ),
        (lambda q: q.update(observer="minmax"), r"quantization_config\.observer is not a key the converter writes"),
        (lambda q: q.pop("quantization_status"), r"quantization_config\.quantization_status is missing"),
        (
            lambda q: q["ignore"].__setitem__(2, "model.layers.0.mlp.experts"),
            r"quantization_config\.ignore\[2\]='model\.layers\.0\.mlp\.experts' is not supported",
        ),
        (lambda q: q["ignore"].pop(), r"quantization_config\.ignore has 12 entries; the converter writes 13"),
        (
            lambda q: q["config_groups"]["group_1"]["input_activations"].update(group_size=16),
            r"quantization_config\.config_groups\.group_1\.input_activations\.group_size=16 is not supported",
        ),
        (lambda q: q.update(format="pack-quantized"), r"quantization_config\.format='pack-quantized' is not supported"),
    ],
    ids=[
        "compression_ratio_json_null",
        "extra_key",
        "missing_key",
        "ignore_entry",
        "ignore_short",
        "group_size",
        "format",
    ],
)
def test_recipe_config_deviation_is_an_error_naming_the_key(recipe_checkpoint, change, message):
    config = json.loads((recipe_checkpoint / "config.json").read_text())
    change(config["quantization_config"])
    (recipe_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantConfigError, match=message):
        load_model(recipe_checkpoint, dtype=torch.bfloat16)


def test_recipe_config_without_kv_cache_scheme_runs_a_16_bit_cache(recipe_checkpoint):
    from optimized.executor.model_runner import ModelRunner

    config = json.loads((recipe_checkpoint / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (recipe_checkpoint / "config.json").write_text(json.dumps(config))
    assert ModelRunner(load_model(recipe_checkpoint, dtype=torch.bfloat16), 16).kv_cache_dtype == torch.bfloat16


def test_recipe_dense_layer_with_16_bit_gate_proj_loads_as_it_is(tmp_path):
    """The recipe's converter keeps a dense layer's gate_proj in 16 bits (`mlp.gate` matches `mlp.gate_proj`)
    beside MXFP8 up/down: tiny-dense converted, its dense gate_proj weights put back as the source's tensors
    without a weight_scale. Each projection loads in the checkpoint's format (gate_proj bitwise the source's,
    up/down the MXFP8 bytes), and the model generates."""
    from optimized.executor.model_runner import ModelRunner
    from optimized.model import is_sparse_layer

    src, converted = checkpoint("tiny-dense"), w4a8_checkpoint("tiny-dense", kv_cache="fp8")
    for item in converted.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tensors, source = load_file(tmp_path / "model.safetensors"), load_file(src / "model.safetensors")
    config = tiny_config("tiny-dense")
    dense = [i for i in range(config.num_hidden_layers) if not is_sparse_layer(config, i)]
    assert dense
    for i in dense:
        name = f"model.layers.{i}.mlp.gate_proj.weight"
        tensors[name] = source[name]
        del tensors[name.replace(".weight", ".weight_scale")]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, dtype=torch.bfloat16)
    for i in dense:
        mlp = model.layers[i].mlp
        assert mlp.gate_up_proj is None and not hasattr(mlp.gate_proj, "weight_scale")
        assert_bitwise_equal(
            mlp.gate_proj.weight, source[f"model.layers.{i}.mlp.gate_proj.weight"].bfloat16(), f"layer {i} gate_proj"
        )
        assert_bitwise_equal(
            checkpoint_layout_parameters(mlp.up_proj)["weight"],
            tensors[f"model.layers.{i}.mlp.up_proj.weight"],
            f"layer {i} up",
        )
        assert mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    runner = ModelRunner(model, 16)
    assert runner.kv_cache_dtype == torch.float8_e4m3fn
    tokens = runner.generate([[5, 6, 7, 8, 9]], 3).tokens
    assert len(tokens[0]) == 3
