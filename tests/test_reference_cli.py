"""`python -m reference generate` on a tiny checkpoint prints what greedy_generate computes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.checkpoints import checkpoint
from reference.tokenizer import decode, encode, eos_token_ids, load_tokenizer
from reference.__main__ import main as cli_main
from reference.checkpoint import load_model
from reference.generate import greedy_generate, trim_at_eos

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "reference", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_generate_prints_prompt_and_generated_ids():
    path = checkpoint("tiny")
    out = run_cli("generate", "--model", str(path), "--prompt", "hello", "--max-new-tokens", "6")
    assert out.returncode == 0, out.stderr
    tok = load_tokenizer(path)
    prompt = encode(tok, "hello")
    expected = trim_at_eos(
        greedy_generate(load_model(path), torch.tensor([prompt]), 6)[0].tolist(), eos_token_ids(path)
    )
    lines = out.stdout.splitlines()
    assert f"prompt ids: {','.join(map(str, prompt))}" in lines
    assert f"generated ids: {','.join(map(str, expected))}" in lines
    assert f"text: {decode(tok, prompt + expected)!r}" in lines


def test_generate_from_ids_bfloat16_without_cache(capsys):
    """In-process (same `main` as the subprocess above, without a second interpreter start)."""
    path = checkpoint("tiny-dense")
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(path),
                "--prompt-ids",
                "1,2,300",
                "--max-new-tokens",
                "4",
                "--dtype",
                "bfloat16",
                "--no-cache",
                "--ignore-eos",
            ]
        )
        == 0
    )
    model = load_model(path, dtype=torch.bfloat16)
    expected = greedy_generate(model, torch.tensor([[1, 2, 300]]), 4, use_cache=False)[0].tolist()
    lines = capsys.readouterr().out.splitlines()
    assert f"generated ids: {','.join(map(str, expected))}" in lines
    assert f"text: {decode(load_tokenizer(path), [1, 2, 300] + expected)!r}" in lines


@pytest.mark.parametrize("scheme", ["w4a8", "w8a8"])
def test_generate_fake_quant_runs_the_schemes_quantize_dequantized_model(scheme, capsys):
    """--fake-quant w4a8 | w8a8 (with --kv-cache fp8) prints what `load_fake_quant_model(scheme=...)` with the
    FP8 cache generates; the two schemes differ only in the experts' weight format."""
    from reference.fake_quant import fake_quantize_kv_cache, load_fake_quant_model

    path = checkpoint("tiny")
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(path),
                "--prompt-ids",
                "5,6,7,8",
                "--max-new-tokens",
                "4",
                "--dtype",
                "bfloat16",
                "--ignore-eos",
                "--fake-quant",
                scheme,
                "--kv-cache",
                "fp8",
            ]
        )
        == 0
    )
    model = fake_quantize_kv_cache(load_fake_quant_model(path, torch.bfloat16, scheme=scheme))
    expected = greedy_generate(model, torch.tensor([[5, 6, 7, 8]]), 4)[0].tolist()
    assert f"generated ids: {','.join(map(str, expected))}" in capsys.readouterr().out.splitlines()
    experts = model.model.layers[0].mlp.experts[0].down_proj.weight.float()
    plain = load_model(path, torch.float32).model.layers[0].mlp.experts[0].down_proj.weight
    # MXFP8 keeps 3 mantissa bits, MXFP4 one: the W8A8 experts sit far closer to the BF16 weights
    err = ((experts - plain).norm() / plain.norm()).item()
    assert (err < 0.05) if scheme == "w8a8" else (err > 0.05), err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,x"], "expected comma-separated integers"),
        (["--prompt", "a", "--fake-quant", "w4a4"], "invalid choice: 'w4a4'"),
        (["--prompt-ids", "1,600"], "token id 600 is outside the vocabulary [0, 512)"),
        (["--prompt", "a", "--prompt-ids", "1"], "not allowed with argument"),
        (["--prompt", "a", "--dtype", "float16"], "invalid choice"),
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt", "a", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    ],
)
def test_bad_input_is_an_argparse_error(args, message, capsys):
    """In-process (the subprocess path is the same `main`): usage errors exit 2 with the reason."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--model", str(checkpoint("tiny")), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_directory_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "a"])
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err
