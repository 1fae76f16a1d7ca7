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


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}

# (id, sharded, break it, what both messages contain, what only the optimized one contains, reference too?)
CASES = [
    ("zero-byte file", False, lambda d: (d / "model.safetensors").write_bytes(b""),
     ["model.safetensors", "not a readable safetensors file", "header too small", "re-download"], True),
    ("truncated file", False, _truncate,
     ["model.safetensors", "not a readable safetensors file", "re-download"], True),
    ("corrupt header", False, _corrupt_header,
     ["model.safetensors", "not a readable safetensors file", "invalid JSON in header"], True),
    ("shard missing", True, _drop_shard,
     ["model-00003-of-00009.safetensors", "incomplete"], True),
    ("index bad JSON", True, _write_index("{not json"),
     ["model.safetensors.index.json is not valid JSON", "re-download"], True),
    ("index without weight_map", True, _write_index('{"metadata": {}}'),
     ["model.safetensors.index.json has no 'weight_map'", "re-download"], True),
    ("int32 tensor", False, _int32_tensor,
     ["model.layers.0.self_attn.o_proj.weight", "dtype torch.int32", "config.json declares", "re-convert"], True),
    ("llama config", False, lambda d: _edit_config(d, model_type="llama"),
     ["config.json has model_type='llama'", "qwen3_moe"], True),
    ("missing head count", False, lambda d: _edit_config(d, num_attention_heads=None),
     ["config.json", "num_attention_heads", "missing"], True),
    ("missing expert count", False, lambda d: _edit_config(d, num_local_experts=None),
     ["config.json", "num_experts", "missing"], True),
    ("broken tokenizer.json", False, lambda d: (d / "tokenizer.json").write_text("{broken"),
     ["cannot load the tokenizer of", "tokenizer.json", "--prompt-ids"], True),
    ("zero kv heads", False, lambda d: _edit_config(d, num_key_value_heads=0),
     ["num_key_value_heads=0", "positive integer"], True),
    ("zero experts", False, lambda d: _edit_config(d, num_local_experts=0),
     ["num_experts=0"], True),
    ("sliding window", False, lambda d: _edit_config(d, use_sliding_window=True, sliding_window=64),
     ["use_sliding_window=True", "not supported"], True),
    ("yarn rope", False, lambda d: _edit_config(d, rope_parameters=YARN),
     ["rope_type", "='yarn' is not supported"], True),
    ("gelu activation", False, lambda d: _edit_config(d, hidden_act="gelu"),
     ["hidden_act='gelu'", "not supported"], True),
    ("tied embeddings", False, lambda d: _edit_config(d, tie_word_embeddings=True),
     ["tie_word_embeddings=True", "not supported by the optimized model"], False),  # the reference supports it
    ("no tokenizer, text prompt", False, lambda d: [(d / f).unlink() for f in ("tokenizer.json",
                                                                                "tokenizer_config.json")],
     ["the checkpoint has no tokenizer", "--prompt-ids"], True),
]


def _error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.count("\n") == 1 and ": error: " in err, err   # one line
    return err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_is_one_named_line_exit_2(case, tmp_path, capsys):
    _, sharded, breaks, needles, reference_too = case
    path = _copy(tmp_path, sharded)
    breaks(path)
    err = _error(optimized_main, ["generate", "--config", SINGLE, "--model-path", str(path), "--prompt", "hi",
                                  "--max-new-tokens", "2"], capsys)
    assert err.startswith("python -m optimized: error: ")
    for needle in needles:
        assert needle in err, f"optimized: {needle!r} not in {err!r}"
    if reference_too:
        err = _error(reference_main, ["generate", "--model", str(path), "--prompt", "hi", "--max-new-tokens", "2"],
                     capsys)
        assert err.startswith("python -m reference: error: ")
        for needle in needles:
            assert needle in err, f"reference: {needle!r} not in {err!r}"


@pytest.mark.parametrize("main, argv", [
    (optimized_main, ["generate", "--config", SINGLE, "--prompt"]),
    (reference_main, ["generate", "--model", "MODEL", "--prompt"]),
])
def test_non_utf8_prompt_is_refused(main, argv, capsys):
    text = "caf" + b"\xff".decode("utf-8", "surrogateescape")     # how Python receives a non-UTF-8 argv byte
    argv = [str(checkpoint("tiny")) if a == "MODEL" else a for a in argv] + [text]
    err = _error(main, argv, capsys)
    assert "is not valid UTF-8 (byte 0xff at character 3)" in err and "--prompt-ids" in err


def test_missing_model_path_is_named_by_both_clis(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    err = _error(reference_main, ["generate", "--model", missing, "--prompt", "a"], capsys)
    assert f"model path {missing!r} does not exist" in err   # not a hub repo-id message
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
