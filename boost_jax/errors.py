"""The project's user-facing errors: each message names what is wrong and where.

A command-line `main` turns any `BoostJaxError` into its message on stderr and a non-zero exit;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class BoostJaxError(Exception):
    """Bad input or state a user can fix (config, data, checkpoint, run dir); the message says how."""


class ConfigError(BoostJaxError, ValueError):
    """A configuration key or value is invalid; the message names it."""


class DataError(BoostJaxError, ValueError):
    """A corpus, prepared dataset or tokenizer cannot be used; the message names the file."""


class CheckpointError(BoostJaxError, RuntimeError):
    """A checkpoint or run dir cannot be used as asked; the message names it."""
