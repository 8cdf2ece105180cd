"""The project's user-facing errors: each message names what is wrong and where.

A command-line `main` turns any `BoostJaxError` into its message on stderr and a non-zero exit;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class BoostJaxError(Exception):
    """Bad input or state a user can fix (config, data, checkpoint, run dir); the message says how."""

    kind = "error"  # how the command line introduces the message


class ConfigError(BoostJaxError, ValueError):
    """A configuration key or value is invalid; the message names it."""

    kind = "config error"


class DataError(BoostJaxError, ValueError):
    """A corpus, prepared dataset or tokenizer cannot be used; the message names the file."""

    kind = "data error"


class PackageError(BoostJaxError, ImportError):
    """A package the run needs is not installed (a minimal stack, e.g. a GPU machine's own, lacks it)."""

    kind = "missing package"


class CheckpointError(BoostJaxError, RuntimeError):
    """A checkpoint or run dir cannot be used as asked; the message names it."""

    kind = "checkpoint error"


class DiskFullError(BoostJaxError, OSError):
    """A write found no space left on its device; the message names the path, the space free and needed."""

    kind = "disk full"


class DivergenceError(BoostJaxError, FloatingPointError):
    """Training produced a non-finite loss or gradient norm; the message names the first bad step."""

    kind = "training diverged"
