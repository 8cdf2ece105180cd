"""A lost peer of a multi-process run: a process killed, stopped (SIGSTOP) or cut off ends every
other process within parallel.heartbeat_timeout_s (and a second or two), each with one message
naming it, instead of leaving them blocked in a collective until the job's wall clock runs out.

Each process's `Watchdog` beats through JAX's coordination service (its key-value store, served by
process 0) every second and reads the others' beats, on threads of its own, so a process blocked in
a collective still judges. A process whose beat has not changed for heartbeat_timeout_s, or a
coordination service that has not answered for as long, is lost: one line on stderr, exit 1.
JAX's own heartbeat (`backstop_s`, kept longer) is the backstop: it reports a loss as a fatal log
with a C++ stack, and its callback cannot be a Python function (jaxlib cannot pass it the status).
A collective that fails first (a peer killed mid-step resets its connections: gloo raises at once)
waits for the watchdog to name the lost process (`watch`), which then takes a peer silent for
SILENT_AFTER_FAILURE_S as lost rather than waiting out the whole timeout. Orbax commits a checkpoint
by renaming its finished folder, so the newest committed one is untouched and a rerun resumes from it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from jax._src import distributed  # the coordination client (no public handle in jax 0.10)

PERIOD_S = 1.0
KEY = "boost_jax/peers"
# Once a collective has failed here the run cannot go on, and a live peer beats every PERIOD_S: a
# peer silent for this long is the lost one, without waiting out heartbeat_timeout_s (at most that).
SILENT_AFTER_FAILURE_S = 4 * PERIOD_S


def backstop_s(timeout_s: int) -> int:
    """JAX's heartbeat and shutdown timeouts: past the watchdog's, so that it reports first."""
    return 2 * timeout_s + 10


class Watchdog:
    """Beats for this process and judges the others' beats (module docstring)."""

    def __init__(self, client, process_id: int, num_processes: int, timeout_s: int):
        self.client, self.process_id, self.timeout_s = client, process_id, timeout_s
        now = time.monotonic()
        self.seen = {p: ("", now) for p in range(num_processes) if p != process_id}  # last beat, when it changed
        self.done: set[int] = set()
        self.answered = now  # the coordination service's last answer
        self.stopping = threading.Event()
        self.collective_failed = threading.Event()  # set by `watch`: judge by SILENT_AFTER_FAILURE_S
        self.threads = [threading.Thread(target=f, name=f"boost_jax-peers-{f.__name__}", daemon=True)
                        for f in (self._beat, self._judge)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """This process ends normally: the others stop watching it."""
        self.stopping.set()
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{KEY}/done/{self.process_id}", "1", allow_overwrite=True)

    def _beat(self) -> None:
        n = 0
        while not self.stopping.wait(PERIOD_S):
            n += 1
            try:
                self.client.key_value_set(f"{KEY}/beat/{self.process_id}", str(n), allow_overwrite=True)
                for p in self.seen:
                    if self._get(f"{KEY}/done/{p}"):
                        self.done.add(p)
                    beat = self._get(f"{KEY}/beat/{p}")
                    if beat != self.seen[p][0]:
                        self.seen[p] = (beat, time.monotonic())
                self.answered = time.monotonic()
            except Exception:  # the service did not answer: the judge counts the time since it last did
                pass

    def _get(self, key: str) -> str:
        try:
            return self.client.key_value_try_get(key)
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return ""
            raise

    def _judge(self) -> None:
        while not self.stopping.wait(PERIOD_S):
            now, failed = time.monotonic(), self.collective_failed.is_set()
            window = min(self.timeout_s, SILENT_AFTER_FAILURE_S) if failed else self.timeout_s
            silent = sorted(p for p, (_, at) in self.seen.items() if p not in self.done and now - at > window)
            if self.stopping.is_set():
                return
            if now - self.answered > self.timeout_s:
                lost = "process 0 (the coordinator): its coordination service did not answer"
            elif silent:
                lost = f"{', '.join(f'process {p}' for p in silent)}: no heartbeat"
            else:
                continue
            shortened = failed and silent and window < self.timeout_s
            over = (f"{window:.0f} s after a collective with it failed" if shortened
                    else f"parallel.heartbeat_timeout_s={self.timeout_s} s")
            end(f"lost peer: {lost} for {over} (killed, stopped or cut off); process {self.process_id} stops too. "
                "The newest committed checkpoint is kept: rerun every process to resume from it")


@contextlib.contextmanager
def watch(timeout_s: int) -> Iterator[None]:
    """Watch the other processes of a multi-process run (no-op with one) while the block runs. A
    collective or coordination error inside it (a peer lost mid-step) waits, at most timeout_s and
    a margin, for the watchdog to name the lost process; without that, the error itself ends it."""
    state = distributed.global_state
    if state.client is None or (state.num_processes or 1) < 2:
        yield
        return
    dog = Watchdog(state.client, state.process_id, state.num_processes, timeout_s)
    try:
        yield
    except Exception as e:
        if not is_collective_failure(e):
            dog.stopping.set()  # not `stop`: the others must find this process gone, not done
            raise
        dog.collective_failed.set()
        time.sleep(timeout_s + 10 * PERIOD_S)  # the watchdog ends the process meanwhile
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        end(f"lost peer: a collective failed ({first[:300]}) and no process was found lost within "
            f"parallel.heartbeat_timeout_s={timeout_s} s; this process stops. The newest committed checkpoint is "
            "kept: rerun every process to resume from it")
    dog.stop()


def is_collective_failure(error: BaseException) -> bool:
    """An error of a collective or of the coordination service, as a lost peer raises them."""
    text = f"{type(error).__name__}: {error}"
    return any(s in text for s in ("Gloo", "gloo", "Connection reset", "Connection closed", "UNAVAILABLE",
                                   "DEADLINE_EXCEEDED", "coordination service", "Barrier", "barrier"))


def end(message: str) -> None:
    """One message on stderr and exit 1 now: no atexit (JAX's shutdown would wait on the lost
    process, then abort with a stack), no cleanup that waits on a collective."""
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    os._exit(1)
