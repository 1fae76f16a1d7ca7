"""The CLI run in-process for a user error: exit status 2 and one line on stderr."""

from __future__ import annotations

import pytest

from optimized.__main__ import main as cli_main


def run_error(argv, capsys) -> str:
    """Run the CLI in-process, expect exit status 2; return stderr (asserted to be one line)."""
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m optimized: error: "), err
    return err
