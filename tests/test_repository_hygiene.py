"""No merge leftovers in the repository's text: a conflict marker inside a docstring or a Markdown file still imports
and renders, so nothing else would notice it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg"}
SKIP = {".git", ".venv", ".cache", ".hypothesis", "__pycache__", "build", "dist"}
MARKERS = ("<<<<<<< ", ">>>>>>> ")


def text_files(root: Path):
    for path in root.iterdir():
        if path.name in SKIP or path.name.endswith(".egg-info"):
            continue
        if path.is_dir():
            yield from text_files(path)
        elif path.suffix in TEXT:
            yield path


def conflict_lines(root: Path) -> list[str]:
    found = []
    for path in text_files(root):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(MARKERS):
                found.append(f"{path.relative_to(root)}:{n}")
    return found


def test_no_conflict_markers():
    assert not conflict_lines(ROOT), "merge conflict markers left in: " + ", ".join(conflict_lines(ROOT))


def test_the_marker_check_can_fail(tmp_path):
    (tmp_path / "m.py").write_text('"""Doc.\n<<<<<<< HEAD\nshort\n=======\nlong\n>>>>>>> branch\n"""\n')
    assert conflict_lines(tmp_path) == ["m.py:2", "m.py:6"]
