"""Every bad input a user can make gives one named line and exit status 2 from both CLIs, never a traceback
or a wrong answer: broken checkpoint files, configs of other / unsupported models, bad prompts, bad paths.

Each case copies the tiny fixture, breaks one thing, runs `python -m optimized generate` and `python -m
reference generate` in-process on it, and checks the message names the file / key / tensor and the fix.
In-process, anything but the CLIs' one-line usage error would surface here as an exception, not SystemExit(2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.checkpoints import checkpoint
from optimized.__main__ import main as optimized_main
from reference.__main__ import main as reference_main

REPO = Path(__file__).resolve().parent.parent
SINGLE = str(REPO / "fixtures" / "configs" / "tiny_single.yaml")


def _copy(tmp_path: Path, sharded: bool = False) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny", sharded=sharded), dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])


def _corrupt_header(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:16] = b"{garbage"
    (d / "model.safetensors").write_bytes(bytes(data))


def _int32_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _drop_shard(d: Path) -> None:
    (d / "model-00003-of-00009.safetensors").unlink()


def _write_index(text: str):
    return lambda d: (d / "model.safetensors.index.json").write_text(text)


def _nan_weight(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"][3] = float("nan")  # one row
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _wrong_shard(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.o_proj.weight"
    index["weight_map"][name] = next(
        f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name]
    )
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _nested(file: str, depth: int = 100_000):
    return lambda d: (d / file).write_text("[" * depth + "]" * depth)


def _write(file: str, text: str):
    return lambda d: (d / file).write_text(text)


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}

# (id, sharded, break it, what both messages contain, what only the optimized one contains, reference too?)
CASES = [
    (
        "zero-byte file",
        False,
        lambda d: (d / "model.safetensors").write_bytes(b""),
        ["model.safetensors", "not a readable safetensors file", "header too small", "re-download"],
        True,
    ),
    ("truncated file", False, _truncate, ["model.safetensors", "not a readable safetensors file", "re-download"], True),
    (
        "corrupt header",
        False,
        _corrupt_header,
        ["model.safetensors", "not a readable safetensors file", "invalid JSON in header"],
        True,
    ),
    ("shard missing", True, _drop_shard, ["model-00003-of-00009.safetensors", "incomplete"], True),
    (
        "index bad JSON",
        True,
        _write_index("{not json"),
        ["model.safetensors.index.json is not valid JSON", "re-download"],
        True,
    ),
    (
        "index without weight_map",
        True,
        _write_index('{"metadata": {}}'),
        ["model.safetensors.index.json has no 'weight_map'", "re-download"],
        True,
    ),
    (
        "int32 tensor",
        False,
        _int32_tensor,
        ["model.layers.0.self_attn.o_proj.weight", "dtype torch.int32", "config.json declares", "re-convert"],
        True,
    ),
    (
        "llama config",
        False,
        lambda d: _edit_config(d, model_type="llama"),
        ["config.json has model_type='llama'", "qwen3_moe"],
        True,
    ),
    (
        "missing head count",
        False,
        lambda d: _edit_config(d, num_attention_heads=None),
        ["config.json", "num_attention_heads", "missing"],
        True,
    ),
    (
        "missing expert count",
        False,
        lambda d: _edit_config(d, num_local_experts=None),
        ["config.json", "num_experts", "missing"],
        True,
    ),
    (
        "broken tokenizer.json",
        False,
        lambda d: (d / "tokenizer.json").write_text("{broken"),
        ["cannot load the tokenizer of", "tokenizer.json", "--prompt-ids"],
        True,
    ),
    (
        "zero kv heads",
        False,
        lambda d: _edit_config(d, num_key_value_heads=0),
        ["num_key_value_heads=0", "positive integer"],
        True,
    ),
    ("zero experts", False, lambda d: _edit_config(d, num_local_experts=0), ["num_experts=0"], True),
    (
        "sliding window",
        False,
        lambda d: _edit_config(d, use_sliding_window=True, sliding_window=64),
        ["use_sliding_window=True", "not supported"],
        True,
    ),
    (
        "yarn rope",
        False,
        lambda d: _edit_config(d, rope_parameters=YARN),
        ["rope_type", "='yarn' is not supported"],
        True,
    ),
    (
        "gelu activation",
        False,
        lambda d: _edit_config(d, hidden_act="gelu"),
        ["hidden_act='gelu'", "not supported"],
        True,
    ),
    (
        "tied embeddings",
        False,
        lambda d: _edit_config(d, tie_word_embeddings=True),
        ["tie_word_embeddings=True", "not supported by the optimized model"],
        False,
    ),  # the reference supports it
    (
        "no tokenizer, text prompt",
        False,
        lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
        ["the checkpoint has no tokenizer", "--prompt-ids"],
        True,
    ),
    (
        "NaN weight",
        False,
        _nan_weight,  # else token 0 forever, exit 0
        ["tensor 'model.layers.0.self_attn.o_proj.weight' holds 128 non-finite value(s) (NaN or inf)", "re-download"],
        True,
    ),
    (
        "index names a shard without the tensor",
        True,
        _wrong_shard,  # the reference reads every shard, no index
        [
            "model.safetensors.index.json maps tensor 'model.layers.0.self_attn.o_proj.weight' to",
            "which does not contain it",
            "re-download",
        ],
        False,
    ),
    (
        "config.json nested 100000 deep",
        False,
        _nested("config.json"),
        ["config.json is nested too deeply", "levels); "],
        True,
    ),  # the limit is the process's recursion limit
    (
        "generation_config.json nested 100000 deep",
        False,
        _nested("generation_config.json"),
        ["generation_config.json is nested too deeply"],
        True,
    ),
    (
        "truncated generation_config.json",
        False,
        _write("generation_config.json", '{"eos_token_id": [1,'),
        ["generation_config.json is not valid JSON", "--ignore-eos"],
        False,
    ),  # the reference's own tokenizer helpers
    (
        "eos_token_id 'abc'",
        False,
        _write("generation_config.json", '{"eos_token_id": "abc"}'),
        ["generation_config.json: eos_token_id must be a non-negative integer or a list of them; got 'abc'"],
        False,
    ),
]


def _error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.count("\n") == 1 and ": error: " in err, err  # one line
    return err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_is_one_named_line_exit_2(case, tmp_path, capsys):
    _, sharded, breaks, needles, reference_too = case
    path = _copy(tmp_path, sharded)
    breaks(path)
    err = _error(
        optimized_main,
        ["generate", "--config", SINGLE, "--model-path", str(path), "--prompt", "hi", "--max-new-tokens", "2"],
        capsys,
    )
    assert err.startswith("python -m optimized: error: ")
    for needle in needles:
        assert needle in err, f"optimized: {needle!r} not in {err!r}"
    if reference_too:
        err = _error(
            reference_main, ["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2"], capsys
        )
        assert err.startswith("python -m reference: error: ")
        for needle in needles:
            assert needle in err, f"reference: {needle!r} not in {err!r}"


@pytest.mark.parametrize(
    "main, argv",
    [
        (optimized_main, ["generate", "--config", SINGLE, "--prompt"]),
        (reference_main, ["generate", "--model", "MODEL", "--prompt"]),
    ],
)
def test_non_utf8_prompt_is_refused(main, argv, capsys):
    text = "caf" + b"\xff".decode("utf-8", "surrogateescape")  # how Python receives a non-UTF-8 argv byte
    argv = [str(checkpoint("tiny")) if a == "MODEL" else a for a in argv] + [text]
    err = _error(main, argv, capsys)
    assert "is not valid UTF-8 (byte 0xff at character 3)" in err and "--prompt-ids" in err


def test_missing_model_path_is_named_by_both_clis(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    err = _error(reference_main, ["generate", "--model", missing, "--prompt", "a"], capsys)
    assert f"model path {missing!r} does not exist" in err  # not a hub repo-id message
    err = _error(optimized_main, ["generate", "--config", SINGLE, "--model-path", missing, "--prompt", "a"], capsys)
    assert f"model_path {missing!r} does not exist" in err


def test_chat_mode_needs_text_and_a_template(tmp_path, capsys):
    err = _error(optimized_main, ["generate", "--config", SINGLE, "--prompt-ids", "1,2", "--chat"], capsys)
    assert "--chat applies the chat template to text prompts" in err
    path = _copy(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    err = _error(reference_main, ["generate", "--model", str(path), "--prompt", "hi", "--chat"], capsys)
    assert "chat mode needs a chat template" in err


# ------------------------------------------------------------------------------------------------- W4A8


@pytest.fixture(scope="module")
def w4a8(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("w4a8") / "ckpt"
    assert optimized_main(["convert", "--quant", "w4a8", "--no-progress", str(checkpoint("tiny")), str(dst)]) == 0
    return dst


def _w4a8_copy(w4a8: Path, tmp_path: Path) -> Path:
    shutil.copytree(w4a8, tmp_path / "w4a8")
    return tmp_path / "w4a8"


def _generate_w4a8(path: Path, capsys) -> str:
    return _error(
        optimized_main,
        [
            "generate",
            "--config",
            SINGLE,
            "--model-path",
            str(path),
            "--dtype",
            "bfloat16",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "2",
        ],
        capsys,
    )


def test_e8m0_scale_byte_0xff_is_named(w4a8, tmp_path, capsys):
    path = _w4a8_copy(w4a8, tmp_path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    tensors[name][0, 0] = 0xFF  # E8M0 NaN: the converter never writes it
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    err = _generate_w4a8(path, capsys)
    assert f"tensor {name!r} holds 1 E8M0 scale byte(s) 0xFF" in err


def test_converted_checkpoint_without_quantization_config_blames_the_missing_key(w4a8, tmp_path, capsys):
    path = _w4a8_copy(w4a8, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    err = _generate_w4a8(path, capsys)
    assert "config.json has no 'quantization_config', but the checkpoint holds quantized tensors" in err
    assert "float8" not in err and "restore it" in err


def test_reference_fake_quant_wants_the_bf16_source(w4a8, capsys):
    err = _error(
        reference_main,
        ["generate", "--model", str(w4a8), "--fake-quant", "w4a8", "--dtype", "bfloat16", "--prompt", "hi"],
        capsys,
    )
    assert "is already quantized" in err and "point --model at the BF16 source it was converted from" in err


# ----------------------------------------------------------------------------------- run time, library API


def test_non_finite_logits_stop_generation_naming_step_and_request(capsys, tmp_path):
    """A NaN logits row stops generation with the step and request named (greedy and sampled), not token 0
    forever; through the CLI (weight check skipped) too."""
    from optimized.executor.model_runner import ModelRunner, NonFiniteLogitsError
    from optimized.executor.sampling import SamplingParams
    from optimized.model_loader.build import load_model

    model = load_model(checkpoint("tiny"), dtype=torch.float32)
    runner, steps = ModelRunner(model, 16), []

    def nan_at_step_2_for_request_1(ids, meta, caches):
        logits = model(ids, meta, caches)
        steps.append(len(steps) + 1)
        if steps[-1] == 2:
            logits[1, 7] = float("nan")
        return logits

    runner.decode_forward = nan_at_step_2_for_request_1
    for sampling in (None, SamplingParams(temperature=0.8, seed=0)):
        steps.clear()
        with pytest.raises(
            NonFiniteLogitsError,
            match=r"^decode step 2 produced non-finite logits \(NaN or inf\) for "
            r"request 1, after 2 generated token\(s\)",
        ):
            runner.generate([[1, 2, 3], [4, 5]], 6, sampling=sampling)
    path = _copy(tmp_path)
    _nan_weight(path)
    err = _error(
        optimized_main,
        ["generate", "--config", SINGLE, "--model-path", str(path), "--prompt", "hi", "--no-weight-check"],
        capsys,
    )
    assert "the prefill produced non-finite logits (NaN or inf) for request 0, after 0 generated token(s)" in err


def test_generate_and_model_name_bad_token_ids():
    from equivalence.support.parallel_support import paged_cache
    from optimized.executor.model_runner import ModelRunner
    from optimized.model_loader.build import load_model

    model = load_model(checkpoint("tiny"), dtype=torch.float32, num_hidden_layers=1)
    runner = ModelRunner(model, 16)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] = 2.0 \(float\) is not an integer token id"):
        runner.generate([[1, 2.0, 3]], 2)
    with pytest.raises(ValueError, match=r"prompts must be a list of token-id lists"):
        runner.generate([1, 2, 3], 2)
    cache, table = paged_cache(model, [4])
    ids, meta, _ = runner.prefill_inputs([[1, 2, 3]], table)
    with pytest.raises(ValueError, match=r"input_ids holds token id 600, outside the vocabulary \[0, 512\)"):
        model(torch.tensor([1, 600, 3]), meta, cache.layers)
    with pytest.raises(ValueError, match=r"input_ids holds token id -1, outside the vocabulary"):
        model(torch.tensor([1, -1, 3]), meta, cache.layers)
    with pytest.raises(TypeError, match=r"input_ids must hold integer token ids .*got dtype torch.float32"):
        model(ids.float(), meta, cache.layers)
