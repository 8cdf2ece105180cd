"""A preemption notice (SIGTERM) or Ctrl-C (SIGINT) asks the loop to save the step it is at and
stop; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path


class Preemption:
    """SIGTERM (a preemption notice) or SIGINT (Ctrl-C): the loop saves the step it is at and stops,
    exit status 0. A second signal exits at once, with status 128 + its number: Orbax commits a
    checkpoint by renaming its finished directory, so what is on disk stays usable. Handlers exist
    only on the main thread (a run started from another thread keeps the default behaviour). When the
loop stops for a signal of one process is decided by all (training/meeting.py)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        # Inside another's watch (a study's runs): a signal it received before this one began counts here too.
        self.outer = next((h.__self__ for h in self.previous.values()
                           if isinstance(getattr(h, "__self__", None), Preemption)), None)
        self.received = self.received or (self.outer.received if self.outer else None)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received:
            print(f"{name} again: exiting now; the newest committed checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received = name
        print(f"{name}: saving the current step and stopping (send it again to exit at once)", file=sys.stderr,
              flush=True)

    @staticmethod
    def line(stopped: str, done: int, directory: Path | None) -> str:
        """The log line of a run `stopped` after step `done`, saved in `directory` (None: checkpointing is off)."""
        saved = f"saved step {done} in {directory}" if directory else "checkpointing is off: not saved"
        return f"stopped by {stopped} after step {done}: {saved}; rerun the same command to resume"

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.outer and self.received:  # and one received here, after the last step that asked, counts there
            self.outer.received = self.outer.received or self.received
