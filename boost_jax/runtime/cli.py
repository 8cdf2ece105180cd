"""The one way a command-line `main` ends on a user error: its message on stderr, exit status 1.

    def main(argv=None): run_main(_main, argv)

A `BoostJaxError` prints as one line or short paragraph; its traceback (and the libraries' log
noise) only with `--debug` or `BOOST_JAX_DEBUG=1`. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from absl import logging as absl_logging

from boost_jax.runtime.errors import BoostJaxError, ConfigError

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


CONFIG_HELP = ("an optional YAML file, then section.key=value overrides: the keys and meanings of "
               "`python -m boost_jax.train` (boost_jax/configs/base.yaml lists them)")

# Flags that once spelled a config key: each is refused with the key to write instead.
RETIRED_FLAGS = {
    "--model": "model.preset=NAME", "--arch": "model.arch=NAME", "--scheme": "parallel.scheme=NAME",
    "--tp": "parallel.tp=N", "--dp": "parallel.dp=N", "--pp": "parallel.pp=N", "--pp-repeats": "parallel.pp_repeats=N",
    "--microbatches": "train.microbatches=M", "--seq": "train.seq_len=N",
    "--batch": "train.batch_size=N (global: every data-parallel replica's rows together)",
    "--global-batch": "train.batch_size=N", "--dtype": "model.dtype=float32|bfloat16",
}


def refuse_retired_flags(argv: Sequence[str], keep: Sequence[str] = ()) -> None:
    """A flag of RETIRED_FLAGS (except those in `keep`, which this command still has) stops the command
    with the config key that replaced it."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in RETIRED_FLAGS and flag not in keep:
            raise ConfigError(f"{flag} is not a flag any more: write {RETIRED_FLAGS[flag]} "
                              "(every command reads the train config's keys)")


def config_parser(prog: str, doc: str, config: str = "[CONFIG.yaml] [section.key=value ...]") -> argparse.ArgumentParser:
    """The parser of a command that reads the train config: a YAML file, then `section.key=value`."""
    p = argparse.ArgumentParser(prog=prog, description=doc, epilog=DEBUG_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="*", metavar=config, help=CONFIG_HELP)
    return p


def run_dir_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a command on a run dir's checkpoint: RUN_DIR, then `section.key=value` overrides of
    its config.yaml (`run_dir_args` parses and checks them), --step, --json."""
    p = argparse.ArgumentParser(prog=prog, description=doc, epilog=DEBUG_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("config", nargs="*", metavar="section.key=value", help=CONFIG_HELP)
    p.add_argument("--step", type=int, default=None, help="the checkpoint (default: the newest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_dir_args(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    a = p.parse_intermixed_args(argv)
    if a.step is not None and a.step < 0:
        raise ConfigError(f"--step must be a checkpoint's step (>= 0), got {a.step}")
    if bad := [c for c in a.config if "=" not in c]:
        raise ConfigError(f"{bad[0]!r}: after RUN_DIR only section.key=value overrides (the run's config.yaml is the config)")
    return a


def at_least(a: argparse.Namespace, **bounds: float) -> None:
    """Each named flag of `a` at least its bound (`at_least(a, workers=1, max_bytes=0)`), or one
    ConfigError naming the flag (`--workers`) and its value."""
    for name, bound in bounds.items():
        value = getattr(a, name)
        if value < bound:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {bound}, got {value}")


def positive(a: argparse.Namespace, *names: str) -> None:
    """Each named flag of `a` a finite number above 0 (a float flag also parses "nan" and "inf"), or
    one ConfigError naming the flag and its value."""
    for name in names:
        value = getattr(a, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number above 0, got {value}")


def a_share(a: argparse.Namespace, name: str, of: str) -> None:
    """The named flag of `a` a share of `of` (0 <= value < 1; nan is refused too), or one ConfigError naming it."""
    value, flag = getattr(a, name), f"--{name.replace('_', '-')}"
    if not 0 <= value < 1:
        raise ConfigError(f"{flag} must be a share of {of}, 0 <= {flag} < 1, got {value}")


def int_list(text: str) -> tuple[int, ...]:
    """An argparse `type`: a comma-separated flag value such as "1,2,4" (empty: ()); argparse names
    the flag when it is not one."""
    return tuple(int(v) for v in text.split(",") if v)


def quiet_libraries() -> None:
    """Orbax and TensorStore log through absl at INFO/WARNING (save/restore chatter) and, from
    their background threads, ERROR with a traceback for a failure they also raise to the caller
    (a full disk under a checkpoint save), which the command reports by name: show only their fatal logs."""
    absl_logging.set_verbosity(absl_logging.FATAL)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
