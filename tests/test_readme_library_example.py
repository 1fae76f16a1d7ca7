"""The README's library example is the one assembly call and runs as written (on the tiny fixture's config)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def library_example() -> str:
    text = (REPO / "README.md").read_text()
    after = text[text.index("As a library") :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_the_library_example_is_the_assembly(capsys):
    code = library_example()
    assert "assembly.prepare(" in code and ".start(" in code and "load_model(" not in code, code
    code = code.replace('"qwen3_30b_tp8.yaml"', repr(str(REPO / "fixtures" / "configs" / "tiny_single.yaml")))
    exec(compile(code, "README.md (library example)", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert out.startswith("plan: batch 1"), out
    assert out.rstrip().splitlines()[-1].split()[-2:] in (["length", "None"], ["eos", "None"]), out
