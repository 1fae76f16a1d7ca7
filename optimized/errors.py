"""The package's one error contract.

Every error a user can fix (a config key, a file, a prompt, an option, an environment variable, the launch) is a
`UsageError` subclass whose message names what is wrong and the fix; most keep a second base (`ValueError`,
`RuntimeError`, `OSError`) for library callers. `python -m optimized` catches UsageError once, at its entry
(optimized/cli/main.py), and prints it as one line with exit status 2; anything else is a bug or a device failure
and keeps its traceback. tests/test_error_contract.py lists the few internal errors and fails on any other class
that is not a UsageError.
"""


class UsageError(Exception):
    """A problem the user can fix: `python -m optimized` prints it as one line and exits with status 2."""


class CheckpointError(UsageError, ValueError):
    """A checkpoint that does not match the model or cannot be read (the message names file / tensor)."""
