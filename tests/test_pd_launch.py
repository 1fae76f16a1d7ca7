"""`python -m optimized pd`: two instances and the router on one machine, with stand-in instances
(equivalence/support/fake_pd_instance.py) in place of `serve --pd-role`: progress lines, the router serving once
both instances are healthy, SIGTERM stopping all three, an instance that exits named (status 1), one that fails to
start named in one line (status 2). The command lines of real instances: plain for one process, their own torchrun
job (its own rendezvous) for several."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from equivalence.support.fake_pd_instance import MODEL, expected_tokens
from optimized.pd.launch import serve_command

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "fixtures" / "configs" / "tiny_single.yaml")
WAIT_S = 60  # a bound on waiting for the launcher (never a timing assertion)

LAUNCH = """
import json
import sys
from equivalence.support.fake_pd_instance import fake_serve_command
from optimized.cli.common import fail
from optimized.cli.main import parser
from optimized.errors import UsageError
from optimized.cli.pd import run
kw = json.loads(sys.argv[1])
try:
    sys.exit(run(parser().parse_args(sys.argv[2:]), command=fake_serve_command(**kw)))
except UsageError as e:
    fail(str(e))
"""


def launch(tmp_path, **fake):
    port_file = tmp_path / "router.port"
    args = ["pd", "--prefill-config", CONFIG, "--decode-config", CONFIG, "--port", "0", "--port-file", str(port_file)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, json.dumps(fake), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, port_file


def wait_for(path: Path, proc) -> int:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the router's port file never appeared"
        time.sleep(0.1)
    return int(path.read_text())


def completion(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        http.client.HTTPConnection(host, int(port), timeout=5).request("GET", "/health")
    except ConnectionRefusedError:
        return True
    return False


def instance_urls(out: str) -> dict[str, str]:
    return {
        line.split()[1]: line.split()[4].rstrip(";")
        for line in out.splitlines()
        if line.startswith("pd: ") and " instance bound " in line
    }


def test_the_launcher_serves_through_the_router_and_sigterm_stops_all_three(tmp_path):
    proc, port_file = launch(tmp_path)
    try:
        port = wait_for(port_file, proc)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        status, answer = completion(port, body)
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == expected_tokens(body, 4)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert any(line.startswith("pd: starting the prefill instance (") for line in lines), out
    assert any(line.startswith("pd: starting the decode instance (") for line in lines), out
    assert any(line.startswith("pd: decode instance ready at http://127.0.0.1:") for line in lines), out
    assert any(line.startswith(f"pd-router: serving {MODEL} on http://127.0.0.1:{port} ") for line in lines), out
    urls = instance_urls(out)
    assert set(urls) == {"prefill", "decode"}, out
    assert "pd: stopped the prefill instance" in lines and "pd: stopped the decode instance" in lines
    for url in [*urls.values(), f"http://127.0.0.1:{port}"]:
        assert refused(url), f"{url} still answers after the launcher stopped"


def test_an_instance_that_exits_is_named_and_the_launcher_stops_the_other(tmp_path):
    proc, port_file = launch(tmp_path, die="decode", die_after_s=1.0)
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (out, err)
    assert f"pd: the decode instance ({CONFIG}, 1 process) exited with status 3; stopping" in out.splitlines()
    assert "pd: stopped the prefill instance" in out.splitlines()
    prefill = instance_urls(out)["prefill"]
    assert refused(prefill)


def test_an_instance_that_fails_to_start_is_one_line_and_status_2(tmp_path):
    proc, _ = launch(tmp_path, fail_start="prefill")
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, (out, err)
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"python -m optimized: error: the prefill instance ({CONFIG}, 1 process) exited with status 4 before it "
        "could bind its port"
    ), err
    assert "pd: stopped the decode instance" in out.splitlines()


@pytest.mark.parametrize("nproc", [1, 2])
def test_an_instance_is_a_plain_process_or_its_own_torchrun_job(nproc):
    cmd = serve_command("decode", "D.yaml", nproc, "/tmp/d.port", "127.0.0.1", ["--served-model-name", "m"])
    serve = ["-m", "optimized", "serve", "--config", "D.yaml", "--pd-role", "decode", "--host", "127.0.0.1"]
    serve += ["--port", "0", "--port-file", "/tmp/d.port", "--served-model-name", "m"]
    if nproc == 1:
        assert cmd == [sys.executable, *serve]
    else:  # --standalone: the job's rendezvous on a port the kernel picks, never the other instance's
        assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *serve]


def test_bad_launch_options_are_named(capsys):
    from optimized.__main__ import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["pd", "--prefill-config", CONFIG, "--decode-config", "no/such.yaml", "--port", "0"])
    assert e.value.code == 2
    assert "--decode-config 'no/such.yaml' is not a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["pd", "--prefill-config", CONFIG, "--decode-config", CONFIG, "--decode-nproc", "0"])
    assert "--decode-nproc=0 must be >= 1" in capsys.readouterr().err
