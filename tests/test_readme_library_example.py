"""The README's library example is the two-line API and runs as written (on the tiny fixture's configs): in one
process, and as the same script on 2 ranks under torchrun, where only rank 0 gets outputs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "fixtures" / "configs"


def library_example(config: str) -> str:
    text = (REPO / "README.md").read_text()
    after = text[text.index("As a library") :]
    code = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    assert "from optimized import LLM, SamplingParams" in code and "assembly" not in code, code
    return code.replace('"qwen3_30b_tp8.yaml"', repr(str(CONFIGS / config)))


def outputs_of(stdout: str) -> list[str]:
    """The example's lines: `finish_reason [ids] 'text'`."""
    return [line for line in stdout.splitlines() if re.match(r"(stop|length) \[[\d, ]+\] ", line)]


def test_the_library_example_runs_as_written(capsys):
    exec(compile(library_example("tiny_single.yaml"), "README.md (library example)", "exec"), {"__name__": "x"})
    out = capsys.readouterr().out
    assert out.startswith("plan: batch 1"), out  # planned for its one prompt
    (line,) = outputs_of(out)
    ids = [int(t) for t in re.search(r"\[(.*)\]", line).group(1).split(",")]
    assert 1 <= len(ids) <= 32 and (line.startswith("length") == (len(ids) == 32)), line


def test_the_library_example_under_torchrun_two_ranks(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(library_example("tiny_tp2.yaml"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(outputs_of(out.stdout)) == 1, out.stdout  # rank 0 prints its output, rank 1 got []
    assert out.stdout.count("plan: batch 1") == 1, out.stdout
