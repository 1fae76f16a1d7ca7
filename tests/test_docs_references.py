"""Every file, module and command the manual names exists: README.md, docs/*.md and optimized/README.md.

What is checked, in backticked spans, fenced code blocks and links:
- paths: a token whose first part is a top-level entry of the repository (`optimized/phases.py`,
  `fixtures/configs/`, `ci/test.sh`) must exist (globs must match); a link target resolves relative to its file;
- bare test files: `test_x.py` must name exactly one file of that name anywhere in the repository (the
  equivalence tests move between subdirectories, so the manual names them by file name); any other bare `x.py`
  at least one (a glob such as `test_w4a4_*.py` at least one match);
- modules: `optimized.x.y` / `reference.x` / `equivalence.x` / `fixtures.x` (with trailing attributes) import and
  have those attributes; `python -m X` / `torchrun ... -m X` name an importable module;
- commands: `python -m optimized SUB [MODE] --option ...` names a subcommand (and mode) of the CLI's parser and
  options that subcommand accepts; likewise `python -m reference SUB`.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "__pycache__", ".hypothesis", "compile_cache", "build", "dist"}
PACKAGES = ("optimized", "reference", "equivalence", "fixtures")


def manual_files() -> list[Path]:
    return [REPO / "README.md", REPO / "optimized" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@lru_cache(maxsize=None)
def repo_files() -> tuple[Path, ...]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file():
            out.append(rel)
    return tuple(out)


def top_level() -> set[str]:
    return {p.name for p in REPO.iterdir() if p.name not in SKIP_DIRS and not p.name.startswith(".")}


# ------------------------------------------------------------------------------------------ extraction

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def spans(text: str) -> list[str]:
    """The fenced blocks (continuation lines joined) and the backticked spans outside them."""
    blocks = [b.replace("\\\n", " ") for b in FENCE.findall(text)]
    rest = FENCE.sub("", text)
    return blocks + INLINE.findall(rest)


def links(text: str) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", text)) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def tokens(span: str) -> list[str]:
    out = []
    for raw in re.split(r"[\s,;=|\[\]()'\"]+", span):
        tok = raw.strip(".:`")
        tok = re.sub(r"::.*$", "", tok)
        if tok:
            out.append(tok)
    return out


# ---------------------------------------------------------------------------------------------- checks


def check_path(token: str, top: set[str]) -> str | None:
    """None if `token` is not a repository path or names one that exists; else the problem."""
    if any(ch in token for ch in "<>{}$~") or token.startswith(("/", "./", "../")):
        return None
    token = token.split("#")[0]
    first = token.split("/")[0]
    if "/" in token and first in top:
        rel = token.rstrip("/")
        if any(ch in rel for ch in "*?"):
            if not any(fnmatch.fnmatch(str(f), rel) for f in repo_files()):
                return f"{token}: no file matches"
            return None
        return None if (REPO / rel).exists() else f"{token}: no such file or directory"
    if "/" not in token and re.fullmatch(r"[\w*]+\.py", token):
        found = [f for f in repo_files() if fnmatch.fnmatch(f.name, token)]
        if not found:
            return f"{token}: no file of that name in the repository"
        if token.startswith("test_") and "*" not in token and len(found) > 1:
            return f"{token}: ambiguous, {len(found)} files of that name ({', '.join(map(str, found))})"
    return None


def check_module(token: str) -> str | None:
    token = re.sub(r"\(.*$", "", token).rstrip(".")
    if not re.fullmatch(r"(%s)(\.\w+)+" % "|".join(PACKAGES), token):
        return None
    parts = token.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(name)
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return (
                        f"{token}: {name} has no attribute {attr!r}"
                        if obj.__name__ == name
                        else f"{token}: no attribute {attr!r}"
                    )
                obj = getattr(obj, attr)
            return None
    return f"{token}: no such module"


@lru_cache(maxsize=None)
def cli_parser(package: str) -> argparse.ArgumentParser:
    if package == "optimized":
        from optimized.cli.main import parser

        return parser()
    from reference.__main__ import _parser

    return _parser()


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_command(words: list[str]) -> list[str]:
    """`words` follow `-m PACKAGE`: the subcommand, its mode and options must be the parser's."""
    package, args = words[0], words[1:]
    if package not in ("optimized", "reference") or not args or args[0].startswith("-"):
        return []
    parser, problems = cli_parser(package), []
    subs = _subparsers(parser)
    if args[0] not in subs:
        return [f"python -m {package} {args[0]}: no such subcommand (the CLI has {', '.join(subs)})"]
    sub, name = subs[args[0]], f"python -m {package} {args[0]}"
    modes = _subparsers(sub)
    if modes and len(args) > 1 and args[1] in modes:
        sub, name = modes[args[1]], f"{name} {args[1]}"
    known = set(sub._option_string_actions)
    for word in args[1:]:
        if word.startswith("--") and word.split("=")[0] not in known:
            problems.append(f"{name}: no option {word.split('=')[0]}")
    return problems


def check_runs(span: str) -> list[str]:
    """`python -m X` and `torchrun ... -m X` (not pytest's -m MARKER): X importable, and its CLI words valid."""
    problems = []
    for line in span.splitlines():
        for m in re.finditer(r"(?<!\S)-m\s+([\w.]+)", line):
            before = line[: m.start()]
            launcher = max(("python", "torchrun", "pytest", "test.sh"), key=lambda w: before.rfind(w))
            if before.rfind(launcher) < 0 or launcher in ("pytest", "test.sh"):
                continue
            module = m.group(1)
            try:
                ok = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                ok = False
            if not ok:
                problems.append(f"-m {module}: no such module")
                continue
            try:
                words = shlex.split(line[m.start(1) :].split("#")[0])
            except ValueError:
                words = line[m.start(1) :].split()
            words = [w for w in words if w not in ("&", "&&")]
            problems += check_command(words)
    return problems


def problems_in(text: str, where: Path) -> list[str]:
    top, out = top_level(), []
    for span in spans(text):
        for tok in tokens(span):
            out += [p for p in (check_path(tok, top), check_module(tok)) if p]
        out += check_runs(span)
    for target in links(text):
        path = (where.parent / target.split("#")[0]).resolve()
        if not path.exists():
            out.append(f"link {target}: no such file")
    return [f"{where.relative_to(REPO) if where.is_relative_to(REPO) else where}: {p}" for p in dict.fromkeys(out)]


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("doc", manual_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_reference_in_the_manual_exists(doc):
    assert doc.is_file(), doc
    problems = problems_in(doc.read_text(), doc)
    assert not problems, "\n".join(problems)


def test_the_manual_has_its_pages():
    names = {p.name for p in (REPO / "docs").glob("*.md")}
    assert {
        "parallel.md",
        "serving.md",
        "graph_mode.md",
        "devices.md",
        "quantization.md",
        "testing.md",
        "config.md",
        "errors.md",
        "architecture.md",
    } <= names
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def test_the_checker_finds_planted_mistakes():
    planted = """
See `optimized/layers/no_such_module.py` and `fixtures/configs/` and [a page](docs/nowhere.md).
`test_no_such_test.py`, `optimized.executor.no_such`, `optimized.config.NoSuchThing`, `equivalence.nope`.
```bash
python -m optimized frobnicate --config fixtures/configs/tiny_single.yaml
torchrun --nproc-per-node 2 -m optimized generate --no-such-option
python -m optimized bench serve --url http://x --no-such-flag 1
python -m no_such_module_here
bash ci/no_such_script.sh
pytest -m equivalence
```
"""
    found = "\n".join(problems_in(planted, REPO / "README.md"))
    for expected in (
        "optimized/layers/no_such_module.py",
        "docs/nowhere.md",
        "test_no_such_test.py",
        "optimized.executor.no_such",
        "NoSuchThing",
        "equivalence.nope",
        "frobnicate",
        "--no-such-option",
        "--no-such-flag",
        "-m no_such_module_here",
        "ci/no_such_script.sh",
    ):
        assert expected in found, (expected, found)
    assert "fixtures/configs/:" not in found and "equivalence:" not in found, found
    assert len(found.splitlines()) == 11, found
