"""`python -m equivalence.endpoint`: bad input is one line on stderr and exit status 2, before any model is loaded
where it can be (the server's reachability is asked first). The checks against live servers are in
equivalence/serving/test_endpoint.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
from equivalence.endpoint.__main__ import main  # noqa: E402
from equivalence.endpoint.servers import unused_port  # noqa: E402
from fixtures.checkpoints import checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def port():
    """A loopback port nothing listens on (held bound for the test)."""
    with unused_port() as p:
        yield p


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--url", "http://127.0.0.1:{port}/v1"], "cannot reach http://127.0.0.1:{port}/v1/models"),
        (["--url", "127.0.0.1:8000/v1"], "is not an http(s) URL"),
        (["--url", "http://127.0.0.1:{port}/v1", "--max-tokens", "0"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says, capsys, tmp_path, port):
    argv = [a.format(port=port) for a in args] + ["--model-path", str(checkpoint("tiny")), "--out", str(tmp_path)]
    assert main(argv) == 2
    assert says.format(port=port) in one_line_error(capsys)


def test_quantized_checkpoint_as_model_path_is_named(capsys, tmp_path, port):
    """At --precision w4a8 / w8a8 / fp8kv the reference fake-quantizes the BF16 checkpoint: a converted one is
    refused."""
    from fixtures.checkpoints import w4a8_checkpoint

    quantized = w4a8_checkpoint("tiny")
    assert (
        main(
            [
                "--url",
                f"http://127.0.0.1:{port}/v1",
                "--model-path",
                str(quantized),
                "--precision",
                "w4a8",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert f"--model-path {quantized} is a quantized checkpoint; give the BF16 checkpoint" in one_line_error(capsys)


def test_missing_checkpoint_and_prompts_file(capsys, tmp_path):
    assert main(["--url", "http://127.0.0.1:1/v1", "--model-path", str(tmp_path / "nope")]) == 2
    assert "is not a checkpoint directory" in one_line_error(capsys)
    assert (
        main(
            [
                "--url",
                "http://127.0.0.1:1/v1",
                "--model-path",
                str(checkpoint("tiny")),
                "--prompts",
                str(tmp_path / "none.txt"),
            ]
        )
        == 2
    )
    assert "--prompts" in one_line_error(capsys)


def test_module_entry_point_exit_status(port):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "equivalence.endpoint",
            "--url",
            f"http://127.0.0.1:{port}/v1",
            "--model-path",
            str(checkpoint("tiny")),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: cannot reach"), r.stderr
