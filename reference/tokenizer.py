"""Byte-level tokenizer of the tiny fixtures and the CLIs: a token id below 256 is that byte of the UTF-8
text. Ids >= 256 have no text; `decode` shows them as `<id>`. Also the `--prompt-ids` argument parser."""
from __future__ import annotations

import argparse


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    parts: list[str] = []
    run = bytearray()
    for i in (int(i) for i in ids):
        if 0 <= i < 256:
            run.append(i)
            continue
        parts.append(run.decode("utf-8", errors="replace"))
        run.clear()
        parts.append(f"<{i}>")
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


def parse_prompt_ids(text: str) -> list[int]:
    """argparse type for `--prompt-ids 1,2,3`."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3; got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0; got {text!r}")
    return ids
