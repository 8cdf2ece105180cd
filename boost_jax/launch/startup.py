"""Where a command's start goes (`--timings`): the seconds from the process's start to its first
result (generate: the first token; train: the first step; eval: the first loss), split into
import, data, restore, compile and run.

    startup = Startup()               # import: the process's age now
    ...; startup.lap("data")          # the seconds since the last lap are data's, net of compiling
    startup.seconds()                 # {"import": ..., "data": ..., ..., "total": ...}

compile is every trace, lowering and XLA compile (or read from the persistent compilation cache)
that JAX reports through `jax.monitoring` while it is watched, whichever phase it happened in; each
other phase counts its seconds without them.
"""

from __future__ import annotations

import os
import re
import time

import jax
from jax._src import dispatch  # the names of jax.monitoring's compile events (not public in jax 0.10)

PHASES = ("import", "data", "restore", "compile", "run")
# Tracing, lowering to XLA, and XLA's compile or the cache's read: one after another for a program.
COMPILE_EVENTS = (dispatch.JAXPR_TRACE_EVENT, dispatch.JAXPR_TO_MLIR_MODULE_EVENT, dispatch.BACKEND_COMPILE_EVENT)


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; elsewhere 0: import then goes uncounted)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class Startup:
    """The phases of a command's start, timed from the process's start (the module docstring)."""

    def __init__(self):
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._phases["import"] = process_age()
        self._last, self._counted = time.perf_counter(), _COMPILING[0]

    def lap(self, phase: str) -> None:
        """The seconds since the last lap are `phase`'s, those JAX spent compiling meanwhile compile's."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; the phases are {PHASES}")
        now, compiled = time.perf_counter(), _COMPILING[0] - self._counted
        self._phases[phase] += max(0.0, now - self._last - compiled)
        self._phases["compile"] += compiled
        self._last, self._counted = now, _COMPILING[0]

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds so far, and their total."""
        return {**{k: round(v, 3) for k, v in self._phases.items()}, "total": round(sum(self._phases.values()), 3)}


# The seconds JAX has spent compiling in this process since this module was imported: one listener
# for the process, which every Startup reads.
_COMPILING = [0.0]


def _on_event(event: str, seconds: float, **_) -> None:
    if event in COMPILE_EVENTS:
        _COMPILING[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_event)


def line(seconds: dict[str, float], result: str) -> str:
    """One line of `Startup.seconds()`: the seconds to `result` ("first token"), then each phase's."""
    return (f"start-up: {seconds['total']:.2f} s to the {result} = "
            + " + ".join(f"{k} {seconds[k]:.2f}" for k in PHASES))


def parse_line(text: str) -> dict[str, float] | None:
    """The seconds of the last `line` in a command's output (train's log), or None if it has none."""
    found = re.findall(r"start-up: ([\d.]+) s to the [^=]+= (.+)", text)
    if not found:
        return None
    total, phases = found[-1]
    seconds = {name: float(value) for name, value in (p.split() for p in phases.split(" + "))}
    return {**seconds, "total": float(total)}
