"""The steps' metrics, left on the device until the loop syncs (a log line, a checkpoint, a stop),
then fetched at once as metrics.jsonl rows: throughput (`Meter`), the evals since the last sync,
health norms on the steps that log, and after a restart what it cost (`Recovery`). A non-finite row
stops there (`NonFiniteGuard`), before any checkpoint after it."""

from __future__ import annotations

import time

import jax

from boost_jax.training.log import RunLog
from boost_jax.training.parts import Meter, NonFiniteGuard, finite
from boost_jax.training.recovery import Recovery


class Metrics:
    def __init__(self, log: RunLog, meter: Meter, recovery: Recovery, guard: NonFiniteGuard, steps: int):
        self.log, self.meter, self.recovery, self.guard, self.steps = log, meter, recovery, guard, steps
        self.pending, self.evals, self.losses, self.summary = [], {}, [], {}

    def add(self, metrics: dict) -> None:
        """A step's metrics, still on the device (reading them would wait for the step)."""
        self.pending.append(metrics)

    def evaluated(self, done: int, result: dict) -> None:
        """An eval after step `done`: a log line now, its fields in that step's row."""
        self.evals[done] = result
        self.log.line(f"eval step {done} | loss {result['eval_loss']:.4f} | ppl {result['eval_ppl']:.2f} "
                      f"| bpb {result['eval_bpb']:.4f} | over {result['eval_tokens']:,} target tokens")

    def fetch(self, done: int, line: bool) -> dict | None:
        """Wait for the steps in flight up to `done` and write their rows (and, with `line`, a log
        line); the first row the guard stops at (its log line written, no row after it), or None."""
        fetched = jax.device_get(self.pending)  # waits for the steps in flight: the meter reads after it
        speed = self.meter.read(done)
        rows, bad = [], None
        for at, r in enumerate(fetched, start=done - len(self.pending) + 1):
            health = r.pop("health", {})
            rows.append({"step": at, **{k: float(v) for k, v in r.items()}, **speed, **self.evals.pop(at, {}),
                         **({k: float(v) for k, v in health.items()} if self.log.due(at) else {}), "time": time.time()})
            if at == self.recovery.start + 1 and (lost := self.recovery.fields(rows[-1])):
                rows[-1].update(lost)
                self.log.line(self.recovery.line(lost))
            self.log.record(rows[-1])
            if self.guard.first_bad(rows[-1]):
                bad = rows[-1]
                break
        self.losses += [r["loss"] for r in rows]
        self.summary, self.pending = rows[-1], []
        if line or bad:
            self.log.line(step_line(self.summary, self.steps, self.guard))
        self.log.flush()  # rows up to `done` are on disk before its checkpoint can commit
        if not bad:
            self.log.advance(len(rows), loss=f"{self.summary['loss']:.3f}")
        return bad

    def loss(self) -> float | None:
        """The last row's loss, for the checkpoint's record (None where it is not finite)."""
        return self.summary["loss"] if finite(self.summary) else None


def step_line(row: dict, steps: int, guard) -> str:
    """The log line of a step's metrics row, with the updates dropped so far (`NonFiniteGuard`)."""
    dropped = [f"{n} {what}" for n, what in ((guard.skipped, "non-finite updates skipped"),
                                            (guard.spikes, "loss spikes skipped")) if n]
    # No MFU over 100%: the peak it divides by came out low (training.parts.Meter).
    mfu = f"MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "MFU n/a (over 100%: the peak is too low)"
    return (f"step {row['step']}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} "
            f"| {row['tokens_per_s']:,.0f} tok/s | {row['step_time_s'] * 1e3:.0f} ms/step "
            f"| {row['tflops_per_s']:.3f} TFLOP/s | {mfu}" + "".join(f" | {d}" for d in dropped))
