"""Throughput and MFU of the steps since the last log line, eval and saves excluded."""

from __future__ import annotations

import contextlib
import time

import jax

from boost_jax.config import Config
from boost_jax.launch.peaks import remeasured_cpu_peak
from boost_jax.runtime.cache import cache_root


class Meter:
    """Tokens/s, model FLOP/s and MFU of the steps since the last reading, time spent paused (eval,
    checkpoints) excluded. An MFU over 100% is no measurement but a peak measured low: a CPU's peak
    (measured once, on a host that may have been busy, and cached) is measured again, once, and kept
    in the cache when higher; while the throughput still passes it, the row has no "mfu"."""

    def __init__(self, cfg: Config, n_devices: int, start: int, flops_per_token: float, peak_flops: float):
        t = cfg.train
        self.tokens_per_step, self.flops_per_token = t.batch_size * t.seq_len, flops_per_token
        # Simulated CPU devices share the host's cores: the measured peak is per host, not per device.
        on_cpu = jax.devices()[0].platform == "cpu"
        self.hosts = jax.process_count() if on_cpu else n_devices
        self.peak = self.hosts * peak_flops
        remeasure = lambda: remeasured_cpu_peak(cfg.model.dtype, cache_root(cfg.data.cache_dir), peak_flops)
        self.remeasure = remeasure if on_cpu else None
        self.tick, self.tick_step, self.paused_s = time.perf_counter(), start, 0.0

    @contextlib.contextmanager
    def paused(self, state):
        """Wait for the steps in flight (computing `state`), then charge the time inside to the pause,
        not to training."""
        jax.block_until_ready(state)
        since = time.perf_counter()
        yield
        self.paused_s += time.perf_counter() - since

    def read(self, done: int) -> dict:
        """The throughput of the steps since the last reading, up to step `done`."""
        now = time.perf_counter()
        step_time = (now - self.tick - self.paused_s) / (done - self.tick_step)
        tok_s = self.tokens_per_step / step_time
        flops_s = tok_s * self.flops_per_token
        if flops_s > self.peak and self.remeasure is not None:
            self.peak, self.remeasure = self.hosts * self.remeasure(), None
            now = time.perf_counter()  # measuring is not training
        self.tick, self.tick_step, self.paused_s = now, done, 0.0
        mfu = {"mfu": flops_s / self.peak} if flops_s <= self.peak else {}
        return {"tokens_per_s": tok_s, "step_time_s": step_time, "tflops_per_s": flops_s / 1e12, **mfu}
