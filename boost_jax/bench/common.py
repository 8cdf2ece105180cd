"""What every benchmark shares: the train config as its one vocabulary (an optional YAML file, then
`section.key=value` overrides), its variants, and the simulated CPU devices its mesh needs."""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Sequence

import jax

from boost_jax.config import Config, ConfigError, from_args
from boost_jax.config.schemes import MESH_AXES
from boost_jax.launch.prepare import prepare_jax
from boost_jax.runtime.cli import DEBUG_FLAG, config_parser, refuse_retired_flags
from boost_jax.runtime.errors import BoostJaxError


def seconds(fn) -> float:
    """The wall seconds of one call of `fn`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def child_failed(what: str, returncode: int, stderr: str) -> Exception:
    """The error for a command a benchmark ran that failed: one that stopped on its own message (exit
    1, no traceback: a user error) passes it through as a BoostJaxError (no traceback of ours around
    it); anything else is a bug and keeps its stderr's tail in a RuntimeError."""
    if returncode == 1 and "Traceback" not in stderr:
        lines = [line for line in stderr.strip().splitlines() if not line.startswith(f"(rerun with {DEBUG_FLAG}")]
        return BoostJaxError(f"{what} stopped:\n" + "\n".join(lines[-20:]))
    return RuntimeError(f"{what} failed (exit {returncode}):\n{stderr[-2000:]}")


def parser(prog: str, doc: str, retired_kept: Sequence[str] = ()) -> argparse.ArgumentParser:
    """An argument parser whose positional arguments are the config; `--json` prints JSON."""
    p = config_parser(prog, doc)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(retired_kept=tuple(retired_kept))
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    refuse_retired_flags(argv, keep=p.get_default("retired_kept"))
    return p.parse_intermixed_args(argv)


def add_vary(p: argparse.ArgumentParser) -> None:
    """`--vary section.key=V1,V2,...`: one variant per value, measured side by side (several: every
    combination)."""
    p.add_argument("--vary", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="one variant per value of a config key, side by side (repeat: every combination)")


def variants(args: Sequence[str], vary: Sequence[str], decoding: bool = False) -> list[tuple[str, Config]]:
    """(label, config) of every combination of the `--vary` values (one, unlabelled, without any);
    `decoding`: `config_of`'s."""
    axes = []
    for v in vary:
        key, sep, values = v.partition("=")
        if not sep or "." not in key or not values:
            raise ConfigError(f"--vary {v!r}: expected section.key=V1,V2,...")
        axes.append([f"{key}={x}" for x in values.split(",")])
    return [(" ".join(combo), config_of(args, *combo, decoding=decoding)) for combo in itertools.product(*axes)]


def config_of(args: Sequence[str], *more: str, decoding: bool = False) -> Config:
    """The config of a command line's config arguments, with `more` overrides after them (a variant:
    another scheme, remat mode, ...), and JAX prepared for it (launch/prepare.py): its mesh's devices
    simulated on CPU (parallel.cpu_devices if set; dp = -1 counts 1, so it fills what the other axes
    leave, as in a run), its compilation cache, and parallel.cpu_reuse_memory, except for `decoding`,
    which keeps glibc's defaults as `generate` does (launch/host_memory.py says why)."""
    cfg = from_args([*args, *more])
    prepare_jax(cfg, devices=math.prod(max(getattr(cfg.parallel, a), 1) for a in MESH_AXES),
                reuse_memory=not decoding)
    return cfg


def train_to_end(cfg: Config, devices: Sequence[jax.Device] | None = None) -> dict:
    """`training.run.train` for a benchmark of several runs: a run that SIGTERM or SIGINT stopped (its
    step saved) stops the benchmark too, instead of the next run starting."""
    from boost_jax.training.run import train  # optional: grain (the loop's loader); bench step imports without it

    summary = train(cfg, None if devices is None else list(devices))
    if summary.get("stopped_by"):
        raise SystemExit(f"stopped by {summary['stopped_by']}: {cfg.run_dir} is saved; rerun the same command to "
                         "resume")
    return summary
