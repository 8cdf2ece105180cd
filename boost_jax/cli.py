"""The one way a command-line `main` ends on a user error: its message on stderr, exit status 1.

    def main(argv=None): run_main(_main, argv)

A `BoostJaxError` prints as one line or short paragraph; its traceback (and the libraries' log
noise) only with `--debug` or `BOOST_JAX_DEBUG=1`. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

from boost_jax.errors import BoostJaxError

DEBUG_FLAG, DEBUG_ENV = "--debug", "BOOST_JAX_DEBUG"
DEBUG_HELP = f"{DEBUG_FLAG} (or {DEBUG_ENV}=1) shows the traceback behind an error message."


def run_main(fn: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> None:
    """Call `fn(args)` with `--debug` taken out of `argv` (default: sys.argv[1:])."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    args = [a for a in args if a != DEBUG_FLAG]
    if not debug:
        quiet_libraries()
    try:
        fn(args)
    except BoostJaxError as e:
        if debug:
            raise
        sys.exit(f"{e.kind}: {e}\n(rerun with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)")


def int_list(text: str) -> tuple[int, ...]:
    """An argparse `type`: a comma-separated flag value such as "1,2,4" (empty: ()); argparse names
    the flag when it is not one."""
    return tuple(int(v) for v in text.split(",") if v)


def quiet_libraries() -> None:
    """Orbax and TensorStore log through absl at INFO/WARNING (save/restore chatter, and their
    own copy of an error we already report by name): show only their errors."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)
