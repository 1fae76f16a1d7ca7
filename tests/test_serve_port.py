"""`serve` binds its port before the model loads: a taken port is one `python -m optimized: error:` line naming it
(status 2) without loading anything, and port 0 is bound at once, its number printed and written to --port-file, so
a harness reads the port the server holds instead of picking one and hoping."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from optimized.cli import serve  # noqa: E402
from optimized.cli.main import main  # noqa: E402
from optimized.errors import UsageError  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "tiny_single.yaml")


class Loaded(Exception):
    """Raised where the model would load: the test stops there."""


@pytest.fixture
def no_model(monkeypatch):
    """Serving's assembly replaced by a probe: whatever the test checks at the moment the model would load."""
    seen = []

    def probe(*_a, **_k):
        seen.append(True)
        raise Loaded

    monkeypatch.setattr(serve, "start", probe)
    monkeypatch.delenv("RANK", raising=False)
    return seen


def test_a_taken_port_is_one_line_and_status_2_before_the_model_loads(no_model, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--config", CONFIG, "--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and not no_model
    assert len(err.splitlines()) == 1 and err.startswith("python -m optimized: error: "), err
    assert f"--port={port}" in err and "already in use" in err


def test_port_0_is_bound_and_reported_before_the_model_loads(no_model, tmp_path, monkeypatch, capsys):
    port_file = tmp_path / "port"
    seen = {}

    def probe(*_a, **_k):  # the model would load now: the port is already held and told
        port = int(port_file.read_text())
        with socket.socket() as other, pytest.raises(OSError) as e:
            other.bind(("127.0.0.1", port))
        seen["port"], seen["errno"] = port, e.value.errno
        raise Loaded

    monkeypatch.setattr(serve, "start", probe)
    with pytest.raises(Loaded):
        main(["serve", "--config", CONFIG, "--port", "0", "--port-file", str(port_file)])
    assert seen["port"] > 0 and seen["errno"] == errno.EADDRINUSE
    assert f"http://127.0.0.1:{seen['port']}" in capsys.readouterr().out
    with socket.socket() as again:  # released when serve ended
        again.bind(("127.0.0.1", seen["port"]))


def test_bind_names_a_bad_port_or_host():
    from optimized.serving.listen import bind

    with pytest.raises(UsageError, match="--port=70000"):
        bind("127.0.0.1", 70000)
    with pytest.raises(UsageError, match="--host=192.0.2.1"):
        bind("192.0.2.1", 0)  # TEST-NET-1: not an address of this machine


@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout"])
def test_read_timeouts_must_be_positive(no_model, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", CONFIG, "--port", "0", flag, "0"])
    assert e.value.code == 2 and not no_model and f"{flag}=0.0 must be" in capsys.readouterr().err


def test_an_unwritable_port_file_is_named(no_model, tmp_path, capsys):
    where = tmp_path / "missing" / "port"
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", CONFIG, "--port", "0", "--port-file", str(where)])
    assert e.value.code == 2 and not no_model and f"--port-file={where}" in capsys.readouterr().err
