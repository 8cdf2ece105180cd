"""What a restart cost, added to the first metrics row after it (and said in one log line):

    restart_from      the step the run resumed from
    steps_recomputed  the steps the lost run had logged past it, which this run computes again
    seconds_lost      wall seconds from the lost run's last logged row to this first row after it
    goodput           the run's useful step time so far (the step times of the rows kept) over the wall
                      time since its first step began: 1.0 for a run never lost nor stopped

Read from metrics.jsonl as the lost run left it, before RunLog sets its rows past the resumed step aside.
"""

from __future__ import annotations

import json
from pathlib import Path


class Recovery:
    def __init__(self, metrics: Path, start: int, primary: bool):
        """`primary`: the process that writes metrics.jsonl (the others add nothing)."""
        self.start, self.before = start, _rows(metrics) if primary else []

    def fields(self, row: dict) -> dict:
        """The restart's fields for `row`, the first row after the resumed step; {} where nothing was
        logged before (a fresh run)."""
        timed = [r for r in self.before if "time" in r and "step_time_s" in r]
        if not timed:
            return {}
        last = max(timed, key=lambda r: r["step"])
        began = min(r["time"] - r["step_time_s"] for r in timed)
        useful = sum(r["step_time_s"] for r in timed if r["step"] <= self.start) + row["step_time_s"]
        return {"restart_from": self.start, "steps_recomputed": max(0, last["step"] - self.start),
                "seconds_lost": row["time"] - last["time"], "goodput": useful / (row["time"] - began)}

    @staticmethod
    def line(lost: dict) -> str:
        return (f"restart from step {lost['restart_from']}: {lost['steps_recomputed']} steps recomputed, "
                f"{lost['seconds_lost']:.1f}s lost since the last logged step, goodput so far {100 * lost['goodput']:.1f}%")


def _rows(metrics: Path) -> list[dict]:
    """The rows of a metrics file (lines that are no row, a write cut short, skipped)."""
    if not metrics.is_file():
        return []
    rows = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows
