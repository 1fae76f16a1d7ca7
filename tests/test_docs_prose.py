"""The manual is written for a reader: no pasted module docstrings, each passage told once, the how-tos present.

- No "Notes from the code" section and no heading that is a module path (the mark of a docstring pasted into a
  page), and no module docstring sending its reader to such a section: a module's contract lives in its own
  docstring, the topic's story in one page.
- No long sentence told twice anywhere in the manual (a topic told in two places drifts apart).
- The how-to sections exist where a reader looks for them.
- `python -m optimized --help` names every scheme `convert` writes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PASTED = "Notes from the code"
MODULE_HEADING = re.compile(r"^#{2,6}[ \t]+`[\w/]+\.py`[ \t]*$", re.M)
HOW_TOS = {
    "quantization.md": "How to add a quantization scheme",
    "parallel.md": "How to add a parallel layout or a token exchange",
    "architecture.md": "How to add an operator family",
    "config.md": "How to run a new recipe file",
}


def manual() -> list[Path]:
    return [REPO / "README.md", REPO / "optimized" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def sources() -> list[Path]:
    return sorted(
        p for pkg in ("optimized", "reference", "equivalence", "fixtures") for p in (REPO / pkg).rglob("*.py")
    )


def pasted_notes(text: str) -> list[str]:
    found = [PASTED] if PASTED in text else []
    return found + MODULE_HEADING.findall(text)


def test_no_pasted_notes_in_the_manual():
    problems = {str(p.relative_to(REPO)): pasted_notes(p.read_text()) for p in manual()}
    assert not {k: v for k, v in problems.items() if v}, problems


def test_no_module_docstring_points_at_pasted_notes():
    pointing = [str(p.relative_to(REPO)) for p in sources() if PASTED in p.read_text()]
    assert not pointing, f"these modules send their reader to a '{PASTED}' section instead of stating it: {pointing}"


def sentences(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # commands may well repeat
    text = re.sub(r"^\|.*$", "", text, flags=re.M)  # table rows
    flat = " ".join(text.split())
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+", flat) if len(s.strip()) >= 100]


def repeated_sentences(pages: dict[str, str]) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for name, text in pages.items():
        for s in sentences(text):
            seen.setdefault(s, []).append(name)
    return {s: where for s, where in seen.items() if len(where) > 1}


def test_no_passage_told_twice():
    repeats = repeated_sentences({str(p.relative_to(REPO)): p.read_text() for p in manual()})
    assert not repeats, "\n".join(f"{where}: {s[:120]}..." for s, where in repeats.items())


@pytest.mark.parametrize("page, heading", sorted(HOW_TOS.items()))
def test_the_how_to_sections_exist(page, heading):
    headings = re.findall(r"^#{2,3}\s+(.*?)\s*$", (REPO / "docs" / page).read_text(), re.M)
    assert heading in headings, (page, heading, headings)


def test_the_checks_find_planted_notes():
    planted = "# Page\n\n## Notes from the code\n\n### `optimized/phases.py`\n\ntext\n"
    assert pasted_notes(planted) == [PASTED, "### `optimized/phases.py`"]
    sentence = "A sentence long enough to count as a passage of the manual, told once here and then again elsewhere. "
    assert repeated_sentences({"a.md": sentence, "b.md": "Intro. " + sentence}) == {sentence.strip(): ["a.md", "b.md"]}
    assert not repeated_sentences({"a.md": sentence, "b.md": "```\n" + sentence + "\n```\n"})


def test_convert_help_names_every_scheme():
    from optimized.cli.convert import QUANT_TYPES
    from optimized.cli.main import parser

    sub = next(a for a in parser()._actions if a.dest == "command")
    help_line = next(a.help for a in sub._choices_actions if a.dest == "convert")
    missing = [q for q in QUANT_TYPES if q.upper() not in help_line]
    assert not missing, (missing, help_line)
