"""A lost peer of a two-process run (CPU, gloo, 127.0.0.1; boost_jax/parallel/peers.py): a process
killed mid-step or mid-save, or stopped, ends the survivor within parallel.heartbeat_timeout_s and a
margin, with one message naming the lost process; the newest committed checkpoint stays readable and
a rerun of both processes resumes from it bit for bit. (A process that never joins:
tests/test_fail_safe.py, test_a_rendezvous_that_never_completes_is_one_message.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multihost import free_port

HEARTBEAT_S = 10
BOUND_S = HEARTBEAT_S + 15  # detection, then the exit; the default (20 s) keeps it under 60 s

# Process 1 waits in its save of step 8 (the survivor is then mid-save) until it is killed.
SLOW_SAVE = ("import time, pathlib, sys\n"
             "import boost_jax.model.checkpoint as c\n"
             "save = c.CheckpointStore.save\n"
             "def slow(self, step, state, meta):\n"
             "    if step == 8:\n"
             "        (self.directory.parent / 'process_1_saving').touch()\n"
             "        time.sleep(600)\n"
             "    save(self, step, state, meta)\n"
             "c.CheckpointStore.save = slow\n"
             "from boost_jax.train import main\n"
             "main(sys.argv[1:])\n")


def start(run_dir: Path, tiny_overrides, steps: int, slow_save: bool = False) -> list[subprocess.Popen]:
    port = free_port()
    common = [*tiny_overrides, f"run_dir={run_dir}", f"train.steps={steps}", "checkpoint.every=4", "checkpoint.keep=2",
              "train.schedule_steps=400", "train.eval_every=0", "log.every=1", "parallel.dp=2", "parallel.cpu_devices=1",
              f"parallel.heartbeat_timeout_s={HEARTBEAT_S}", f"parallel.coordinator=127.0.0.1:{port}",
              "parallel.num_processes=2"]
    argv = lambda i: (["-c", SLOW_SAVE] if slow_save and i == 1 else ["-m", "boost_jax.train"])
    return [subprocess.Popen([sys.executable, *argv(i), *common, f"parallel.process_id={i}"],
                             env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]


def rows(path: Path) -> dict[int, dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r for r in map(json.loads, lines)}


def wait_for(condition, procs, timeout=300):
    t0 = time.monotonic()
    while not condition():
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() - t0 < timeout
        time.sleep(0.1)


def survivor_ends(survivor: subprocess.Popen, since: float) -> tuple[str, float]:
    _, err = survivor.communicate(timeout=BOUND_S + 30)
    return err, time.monotonic() - since


def assert_one_message(err: str, rc: int, lost: str):
    assert rc == 1, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines[-1].startswith(f"lost peer: {lost}"), err
    assert "Traceback" not in err and "Check failure" not in err, err


def resumes_bit_for_bit_until_a_peer_stops(run_dir: Path, tiny_overrides, stopped: int):
    """Rerun both processes: they resume from the newest committed checkpoint, and each step the lost
    run had logged past it comes out the same (the rows it had are set aside by the rerun). Then process
    `stopped` is stopped (SIGSTOP: alive, silent): the survivor ends within the bound, naming it."""
    committed = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    before = rows(run_dir / "metrics.jsonl")
    repeated = [s for s in before if s > committed]
    assert repeated, "the lost run logged no step past its checkpoint"
    procs = start(run_dir, tiny_overrides, steps=400)
    wait_for(lambda: max(rows(run_dir / "metrics.jsonl"), default=0) > max(repeated), procs)
    procs[stopped].send_signal(signal.SIGSTOP)
    survivor = procs[1 - stopped]
    try:
        err, took = survivor_ends(survivor, time.monotonic())
    finally:
        procs[stopped].kill()
    errs = {1 - stopped: err, stopped: procs[stopped].communicate()[1]}
    assert_one_message(err, survivor.returncode, f"process {stopped}")
    assert took < BOUND_S, took
    assert f"resumed from step {committed}" in errs[0]
    after = rows(run_dir / "metrics.jsonl")
    assert sorted(after) == list(range(1, max(after) + 1))  # contiguous
    for s in repeated:
        assert (after[s]["loss"], after[s]["grad_norm"]) == (before[s]["loss"], before[s]["grad_norm"])
    assert rows(run_dir / f"metrics.jsonl.before-step-{committed}") == before


@pytest.mark.slow  # two training processes, twice
def test_a_peer_killed_mid_step_ends_the_survivor_and_the_rerun_resumes(tmp_path, tiny_overrides):
    """Process 1 killed mid-step; the rerun then loses a stopped process 1 (process 0, which serves the
    coordination service, survives both)."""
    run_dir = tmp_path / "run"
    procs = start(run_dir, tiny_overrides, steps=400)
    wait_for(lambda: len(rows(run_dir / "metrics.jsonl")) >= 6, procs)
    procs[1].kill()
    err, took = survivor_ends(procs[0], time.monotonic())
    assert_one_message(err, procs[0].returncode, "process 1")
    assert took < BOUND_S, took
    resumes_bit_for_bit_until_a_peer_stops(run_dir, tiny_overrides, stopped=1)


@pytest.mark.slow  # two training processes, twice
@pytest.mark.long  # 50 s; in the default run: a peer killed mid-step, the rerun's resume, a stopped peer
def test_a_peer_killed_mid_save_leaves_the_committed_checkpoint(tmp_path, tiny_overrides):
    """Process 1 killed in its save of step 8; the rerun then loses a stopped process 0 (the one that
    serves the coordination service: process 1 learns it from the heartbeats alone)."""
    run_dir = tmp_path / "run"
    procs = start(run_dir, tiny_overrides, steps=12, slow_save=True)
    wait_for(lambda: (run_dir / "process_1_saving").exists(), procs)
    time.sleep(1)  # process 0 is in its save of step 8 meanwhile
    procs[1].kill()
    err, took = survivor_ends(procs[0], time.monotonic())
    assert_one_message(err, procs[0].returncode, "process 1")
    assert took < BOUND_S, took
    (run_dir / "process_1_saving").unlink()
    resumes_bit_for_bit_until_a_peer_stops(run_dir, tiny_overrides, stopped=0)


@pytest.mark.slow  # two training processes
def test_a_killed_coordinator_ends_the_survivor_at_once(tmp_path, tiny_overrides):
    """Process 0 serves JAX's coordination service: killed, its survivors' JAX client aborts them at
    once with its own fatal log (jaxlib takes no Python callback for it), before any watchdog could
    speak; bounded, but not our one message (docs/guides/reliability.md, "Multi-process runs")."""
    run_dir = tmp_path / "run"
    procs = start(run_dir, tiny_overrides, steps=400)
    wait_for(lambda: len(rows(run_dir / "metrics.jsonl")) >= 6, procs)
    procs[0].kill()
    err, took = survivor_ends(procs[1], time.monotonic())
    assert procs[1].returncode != 0 and took < BOUND_S, (took, err)
    assert "detected fatal errors" in err and "another task died" in err, err


class FakeService:
    """The coordination service's key-value store, as the watchdog uses it."""

    def __init__(self):
        self.store: dict[str, str] = {}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.store[key] = value

    def key_value_try_get(self, key: str) -> str:
        if key not in self.store:
            raise KeyError(f"NOT_FOUND: {key}")
        return self.store[key]


def test_after_a_failed_collective_a_peer_silent_for_seconds_is_the_lost_one(monkeypatch):
    """Process 1 beats, process 2 never does, heartbeat_timeout_s=20. Once a collective has failed,
    process 2 is named after peers.SILENT_AFTER_FAILURE_S, not 20 s (the survivors' wait, most of a
    restart's seconds lost); without a failure nobody is named meanwhile."""
    from boost_jax.parallel import peers

    monkeypatch.setattr(peers, "PERIOD_S", 0.5)  # the clock at half speed: the same judgement in half the time
    monkeypatch.setattr(peers, "SILENT_AFTER_FAILURE_S", 4 * peers.PERIOD_S)
    service, said, dogs = FakeService(), {}, []
    monkeypatch.setattr(peers, "end", lambda message: (said.setdefault(message, time.monotonic()),
                                                       [d.stopping.set() for d in dogs]))
    t0 = time.monotonic()
    failed, calm = (peers.Watchdog(service, 0, 3, timeout_s=20) for _ in range(2))
    dogs.append(failed)
    failed.collective_failed.set()
    while time.monotonic() - t0 < peers.SILENT_AFTER_FAILURE_S + 3 * peers.PERIOD_S:
        service.key_value_set(f"{peers.KEY}/beat/1", str(time.monotonic()), allow_overwrite=True)
        time.sleep(0.1)
    calm.stopping.set()
    assert [m.split(" (killed")[0] for m in said] == [
        "lost peer: process 2: no heartbeat for 2 s after a collective with it failed"], said
    assert next(iter(said.values())) - t0 < peers.SILENT_AFTER_FAILURE_S + 2.5 * peers.PERIOD_S
