"""Errors a user can fix, shared by several wings (each names the file, tensor, key or option and the fix)."""


class UsageError(Exception):
    """A problem the user can fix: `python -m optimized` prints it as one line and exits with status 2."""


class CheckpointError(UsageError, ValueError):
    """A checkpoint that does not match the model or cannot be read (the message names file / tensor)."""
