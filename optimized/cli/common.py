"""What every subcommand shares: the one-line error format and the argument parser that uses it."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

PROG = "python -m optimized"


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (no usage block), exit status 2 like argparse
        command = self.prog[len(PROG) :].strip()
        fail(f"{command}: {message}" if command else message)


def fail(message: str) -> NoReturn:
    message = " ".join(str(message).split())  # one line, whatever the exception text looked like
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_prompt_ids(text: str) -> list[int]:
    """argparse type for `--prompt-ids 1,2,3`."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3; got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0; got {text!r}")
    return ids
