"""The one error of the quantization package, in its own module so every other module can raise it."""

from __future__ import annotations

from optimized.errors import UsageError


class QuantConfigError(UsageError, ValueError):
    """A quantization_config (or a KV-cache dtype choice) this model cannot run; the message names the key.

    A UsageError: the command line prints it as one line. Still a ValueError, as it always was."""
