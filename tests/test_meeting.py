"""The processes' meeting point (training/meeting.py) in a two-process run (CPU, gloo, 127.0.0.1): what
one process alone learns (a SIGTERM, its clock asking for a save) is decided by both at one step, so
both stop or save after the same step, and the run resumes from that checkpoint bit for bit."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_lost_peer import rows, wait_for
from test_multihost import free_port

# Process 1's clock alone asks for a save, at its third meeting (after step 3: log.every=1 makes every
# step a meeting); process 0's never does (checkpoint.every_minutes=0).
CLOCK_OF_ONE = ("import sys\n"
                "import boost_jax.training.checkpointing as c\n"
                "calls = []\n"
                "def overdue(self):\n"
                "    calls.append(1)\n"
                "    return len(calls) == 3\n"
                "c.Checkpointing.overdue = overdue\n"
                "from boost_jax.train import main\n"
                "main(sys.argv[1:])\n")


def start(run_dir: Path, tiny_overrides, steps: int, *extra: str, patch_1: str | None = None) -> list[subprocess.Popen]:
    port = free_port()
    common = [*tiny_overrides, f"run_dir={run_dir}", f"train.steps={steps}", "checkpoint.every=1000",
              "checkpoint.keep=10", "train.schedule_steps=400", "train.eval_every=0", "log.every=1", "parallel.dp=2",
              "parallel.cpu_devices=1", f"parallel.coordinator=127.0.0.1:{port}", "parallel.num_processes=2", *extra]
    argv = lambda i: ["-c", patch_1] if patch_1 and i == 1 else ["-m", "boost_jax.train"]
    return [subprocess.Popen([sys.executable, *argv(i), *common, f"parallel.process_id={i}"],
                             env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Both processes' stderr, after both exited 0."""
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [err for _, err in outs]


def saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def same_rows(a: dict, b: dict, steps) -> None:
    for s in steps:
        assert (a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]), s


@pytest.mark.slow  # two training processes, three times
def test_one_process_clock_or_sigterm_saves_or_stops_both_after_the_same_step_and_the_run_resumes_exactly(
        tmp_path, tiny_overrides):
    """Process 1 alone learns twice: its clock asks for a save (after step 3), then a SIGTERM comes to it
    alone. Both save after step 3 (both wrote their shards of it), then both stop and save after one step
    k. The run resumes from k; then, k and later deleted, from 3: the rows of steps 4..k are the stopped
    run's and those of k+1, k+2 the first resume's, bit for bit (a wrong save of either step shows)."""
    run_dir = tmp_path / "run"
    procs = start(run_dir, tiny_overrides, 200, patch_1=CLOCK_OF_ONE)
    wait_for(lambda: len(rows(run_dir / "metrics.jsonl")) >= 5, procs)
    procs[1].send_signal(signal.SIGTERM)  # process 0 hears of it only at the meeting
    errs = finish(procs)
    [three, k] = saved(run_dir)  # the clock's save, and one save after the step both stopped at
    assert three == 3 and 5 <= k < 200 and sorted(rows(run_dir / "metrics.jsonl")) == list(range(1, k + 1))
    # Process 0 logs (process 1 says only that it received the signal); both exited 0, so neither
    # waited in a collective the other never joined.
    assert "SIGTERM: saving the current step" in errs[1] and "SIGTERM" not in errs[0]
    assert f"stopped by a signal to another process after step {k}: saved step {k}" in errs[0]
    assert f"resumed from step {k}" in finish(start(run_dir, tiny_overrides, k + 2))[0]
    resumed = rows(run_dir / "metrics.jsonl")  # steps 1..k: the stopped run's rows, kept
    for step in saved(run_dir)[1:]:
        shutil.rmtree(run_dir / "checkpoints" / str(step))
    assert "resumed from step 3" in finish(start(run_dir, tiny_overrides, k + 2))[0]
    same_rows(rows(run_dir / "metrics.jsonl"), resumed, range(1, k + 3))
