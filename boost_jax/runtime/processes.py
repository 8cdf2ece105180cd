"""A worker process that ends with its parent: a pool's workers (and, through them, multiprocessing's
resource tracker, which lives while any of them holds its pipe) must not outlive a parent killed
with -9, which runs no cleanup of its own."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 1.0  # the watchdog's period where prctl is not there


def die_with_parent(parent: int) -> None:
    """Call first thing in a worker whose parent is process `parent` (a pool's initializer): Linux
    sends it SIGKILL when the parent dies; elsewhere a daemon thread polls for a new parent."""
    if not _death_signal(signal.SIGKILL):
        threading.Thread(target=_watch, args=(parent,), daemon=True, name="die-with-parent").start()
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


def _death_signal(sig: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: no prctl in the C library
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)
