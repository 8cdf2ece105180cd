"""The planner's compiles on worker processes, so that they use every core: tracing a layer or a
program is single-threaded Python, and XLA's passes barely use a second thread. Each worker is a
fresh JAX on as many simulated devices as the planner's own; one worker compiles in this process."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor

from boost_jax.launch.prepare import simulate_cpu_devices


def default_workers() -> int:
    """One per core this process may use, at most 8 (each holds a compile's memory)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _start(devices: int) -> None:
    simulate_cpu_devices(devices)


class Workers:
    """`map` on `n` processes started on first use (spawned: the planner's JAX runtime has threads a
    fork would copy mid-flight), each with `devices` simulated CPU devices."""

    def __init__(self, n: int, devices: int):
        if n < 1:
            raise ValueError(f"workers: {n} must be at least 1")
        self.n, self.devices, self._pool = n, devices, None

    def map(self, fn: Callable, items: Sequence) -> Iterator:
        """fn of each item, in order, as each is done."""
        if self.n == 1 or len(items) <= 1:
            return map(fn, items)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.n, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start, initargs=(self.devices,))
        return self._pool.map(fn, items)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
