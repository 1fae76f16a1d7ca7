"""W4A4 / Hadamard rotation bad input: every mistake is one named line and exit status 2 (spec a4w4_hadamard.md §4.4.5).

The converter (`convert --quant w4a4 --hadamard-weight-path`), the runtime loader (`load_model(...,
hadamard_weight_path=)`, a RotationError, which `generate` reports as a CheckpointError) and the inference config
(`model_config.enable_hadamard` / `hadamard_weight_path`): an empty path, a path that does not exist or is not a
directory, a missing `layer_k` file, a missing key, a matrix of another shape, a width not a multiple of 128.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from equivalence.support.cli_errors import run_error
from fixtures.checkpoints import (
    ROTATION_INPUT_KEY,
    ROTATION_OUTPUT_KEY,
    bf16_checkpoint,
    checkpoint,
    rotation_dir,
    w4a4_checkpoint,
    write_rotation_dir,
)
from optimized.layers import hadamard


def broken_dirs(tmp_path) -> dict[str, tuple[str, list[str]]]:
    """name -> (rotation directory, words its error must contain)."""
    good = write_rotation_dir(tmp_path / "good", "orthogonal", 2)
    no_layer = shutil.copytree(good, tmp_path / "no_layer")
    (no_layer / "layer_1_self_attn.pt").unlink()
    no_key = shutil.copytree(good, tmp_path / "no_key")
    torch.save({ROTATION_INPUT_KEY: torch.eye(128)}, no_key / "layer_1_self_attn.pt")
    nested = shutil.copytree(good, tmp_path / "nested")
    torch.save(
        {"input_transform": {"transform": {"linear": {"weight": torch.eye(128)}}}}, nested / "layer_0_self_attn.pt"
    )
    shape = shutil.copytree(good, tmp_path / "shape")
    torch.save({ROTATION_INPUT_KEY: torch.eye(64), ROTATION_OUTPUT_KEY: torch.eye(128)}, shape / "layer_0_self_attn.pt")
    not_dir = tmp_path / "file.pt"
    not_dir.write_bytes(b"x")
    return {
        "empty": ("", ["empty"]),
        "missing": (str(tmp_path / "nope"), ["does not exist", "nope"]),
        "not a directory": (str(not_dir), ["not a directory", "file.pt"]),
        "missing layer file": (str(no_layer), ["layer 1", "layer_1_self_attn.pt", "not found"]),
        "missing key": (str(no_key), ["layer 1", ROTATION_OUTPUT_KEY]),
        "nested keys": (str(nested), ["layer 0", ROTATION_INPUT_KEY, "flat"]),
        "shape": (str(shape), ["layer 0", ROTATION_INPUT_KEY, "[64, 64]", "[128, 128]"]),
    }


def test_runtime_loader_names_each_bad_directory(tmp_path):
    from optimized.model_loader.build import load_model

    for case, (path, words) in broken_dirs(tmp_path).items():
        with pytest.raises(hadamard.RotationError) as info:
            load_model(
                w4a4_checkpoint("tiny-h128", "orthogonal"),
                dtype=torch.bfloat16,
                device="cpu",
                hadamard_weight_path=path,
            )
        msg = str(info.value)
        assert "\n" not in msg and all(w in msg for w in words), (case, msg)


def test_converter_names_each_bad_directory_exit_2(tmp_path, capsys):
    src = str(bf16_checkpoint("tiny-h128"))
    for i, (case, (path, words)) in enumerate(broken_dirs(tmp_path).items()):
        err = run_error(
            [
                "convert",
                "--quant",
                "w4a4",
                "--hadamard-weight-path",
                path,
                "--no-progress",
                src,
                str(tmp_path / f"out{i}"),
            ],
            capsys,
        )
        assert all(w in err for w in words), (case, err)
        assert not (tmp_path / f"out{i}").exists() or not any((tmp_path / f"out{i}").iterdir()), case


def test_converter_names_a_singular_matrix(tmp_path, capsys):
    rot = write_rotation_dir(tmp_path / "rot", "orthogonal", 2)
    torch.save(
        {ROTATION_INPUT_KEY: torch.eye(128), ROTATION_OUTPUT_KEY: torch.zeros(128, 128)}, rot / "layer_1_self_attn.pt"
    )
    err = run_error(
        [
            "convert",
            "--quant",
            "w4a4",
            "--hadamard-weight-path",
            str(rot),
            "--no-progress",
            str(bf16_checkpoint("tiny-h128")),
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert "layer 1" in err and ROTATION_OUTPUT_KEY in err and "not invertible" in err, err


def test_width_not_a_multiple_of_128_is_refused_with_the_numbers(tmp_path, capsys):
    # tiny: hidden 64 (the converter and the runtime); tiny-h128 at attention TP 4: 8 / 4 * 32 = 64 per rank
    err = run_error(
        [
            "convert",
            "--quant",
            "w4a4",
            "--hadamard-weight-path",
            str(rotation_dir("identity")),
            "--no-progress",
            str(checkpoint("tiny")),
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert "hidden_size" in err and "64" in err and "128" in err, err
    with pytest.raises(hadamard.RotationError, match=r"8 / 4 \* 32.*= 64 is not a multiple of 128"):
        hadamard.check_widths(__import__("fixtures.tiny", fromlist=["x"]).tiny_config("tiny-h128"), 4)


def test_hadamard_path_with_another_quant_is_refused(tmp_path, capsys):
    err = run_error(
        [
            "convert",
            "--quant",
            "w4a8",
            "--hadamard-weight-path",
            str(rotation_dir("identity")),
            "--no-progress",
            str(checkpoint("tiny")),
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert "--hadamard-weight-path" in err and "w4a8" in err, err
    err = run_error(
        [
            "convert",
            "--quant",
            "w4a4",
            "--kv-cache",
            "fp8",
            "--no-progress",
            str(checkpoint("tiny")),
            str(tmp_path / "out2"),
        ],
        capsys,
    )
    assert "--kv-cache fp8" in err, err


def _yaml(tmp_path, model_path, **model_keys) -> str:
    import yaml

    cfg = {
        "model_config": {"model_path": str(model_path), **model_keys},
        "data_config": {"prompts": ["Hi"]},
        "scheduler_config": {"max_new_tokens": 2},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_config_keys_are_checked_and_named(tmp_path, capsys):
    ckpt = w4a4_checkpoint("tiny-h128", "orthogonal")
    err = run_error(
        ["generate", "--config", _yaml(tmp_path, ckpt, enable_hadamard=True, hadamard_weight_path="")], capsys
    )
    assert "model_config.hadamard_weight_path" in err and "empty" in err, err
    err = run_error(
        ["generate", "--config", _yaml(tmp_path, ckpt, hadamard_weight_path=str(rotation_dir("identity")))], capsys
    )
    assert "model_config.hadamard_weight_path" in err and "enable_hadamard" in err, err


def test_config_refuses_a_width_not_a_multiple_of_128(tmp_path, capsys):
    # a W4A4 conversion of hidden-64 tiny (no rotation: the converter allows plain W4A4), run with the rotation on
    from optimized.model_loader.quantize import convert_checkpoint

    convert_checkpoint(checkpoint("tiny"), tmp_path / "w4a4", "w4a4", progress=False)
    err = run_error(
        [
            "generate",
            "--config",
            _yaml(
                tmp_path, tmp_path / "w4a4", enable_hadamard=True, hadamard_weight_path=str(rotation_dir("identity"))
            ),
        ],
        capsys,
    )
    assert "model_config.enable_hadamard" in err and "hidden_size = 64" in err and "128" in err, err


def test_enable_hadamard_with_a_w4a8_checkpoint_is_ignored_and_said(tmp_path):
    from fixtures.checkpoints import w4a8_checkpoint
    from optimized.layers.quantization.schemes import quant_scheme, scheme_row
    from optimized.model_loader.build import load_model
    from optimized.model_loader.hf_config import load_hf_config

    path = w4a8_checkpoint("tiny")
    model = load_model(path, dtype=torch.bfloat16, device="cpu", hadamard_weight_path=str(tmp_path / "missing"))
    assert all(getattr(m, "input_rotation", None) is None for m in model.modules())
    line = hadamard.describe(scheme_row(quant_scheme(load_hf_config(path))), tmp_path)
    assert "\n" not in line and "ignored" in line and "W4A8" in line, line
    assert "ignored" not in hadamard.describe(scheme_row("w4a4"), tmp_path)
