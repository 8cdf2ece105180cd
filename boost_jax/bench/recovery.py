"""`bench recovery [CONFIG.yaml] [section.key=value ...] [--processes 4] [--survivors 2] [--steps 60]
[--kill-between 20 45] [--local-every 5] [--every 50] [--seed 0] [--json]`: what losing a host costs.

Trains --steps steps as --processes processes of one simulated CPU device each (JAX's distributed
runtime on 127.0.0.1), kills one process with SIGKILL once the run has logged a step drawn at random
from --kill-between, deletes that process's local tier (its disk is gone with it), lets the survivors
end on their own (they detect the lost peer: parallel.heartbeat_timeout_s), and reruns the same command
as --survivors processes on the same run dir. Once with the persistent tier alone (checkpoint.every),
once with two tiers (checkpoint.local_every too); each time it prints the step killed at and resumed
from, the steps recomputed, the seconds lost (the lost run's last logged step to the first step after
the restart), the seconds from the restart command to that step, the goodput so far, and the largest
relative difference of the losses after the restart from an uninterrupted --processes run's; then
where the seconds lost went: the last step to the kill, the kill to the survivors' end (their
lost-peer verdict, parallel.heartbeat_timeout_s), and the restart's start-up by phase (`train
--timings`: import, data, restore, compile, run).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from boost_jax.bench.common import child_failed, parse, parser
from boost_jax.config import ConfigError, from_args
from boost_jax.launch.startup import PHASES, parse_line
from boost_jax.runtime.cli import at_least

DEFAULTS = ["model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "data.max_bytes=300000",
            "train.eval_every=0", "train.warmup_steps=2", "train.lr=1e-2"]
# One simulated device per process, the data-parallel width filled by whatever processes there are: the
# same command runs on the survivors. log.every=1 logs every step, the metrics this measures.
FIXED = ["log.progress=false", "log.tensorboard=false", "log.every=1", "parallel.cpu_devices=1", "parallel.dp=-1",
         "parallel.heartbeat_timeout_s=10"]
SET_HERE = ("train.steps", "checkpoint.every", "checkpoint.local_every", "checkpoint.local_dir", "run_dir",
            "parallel.num_processes", "parallel.process_id", "parallel.coordinator")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """`processes` training processes of one command (their stderr in files: a pipe nobody reads
    fills and blocks a run)."""

    def __init__(self, config: list[str], processes: int, logs: Path):
        port, logs = free_port(), Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        self.errs = [logs / f"process-{i}.stderr" for i in range(processes)]
        self.procs = []
        for i, err in enumerate(self.errs):
            with err.open("w") as f:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "boost_jax.train", *config, f"parallel.coordinator=127.0.0.1:{port}",
                     f"parallel.num_processes={processes}", f"parallel.process_id={i}"],
                    env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.DEVNULL, stderr=f))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            self.end()
        return [p.returncode for p in self.procs]

    def end(self) -> None:
        """Kill what is still running (an error or Ctrl-C here must leave no training process)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def stderr(self, i: int = 0) -> str:
        return self.errs[i].read_text()


def rows(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # a line being written
            continue
        out[row["step"]] = row
    return out


def command(config: list[str], steps: int, every: int, local_every: int, run_dir: Path, local: Path) -> list[str]:
    tiers = [f"checkpoint.local_every={local_every}", f"checkpoint.local_dir={local}/{{process}}"] if local_every else []
    return [*config, f"train.steps={steps}", f"checkpoint.every={every}", *tiers, f"run_dir={run_dir}"]


def uninterrupted(config: list[str], processes: int, steps: int, every: int, work: Path) -> dict[int, float]:
    """The losses of the run never lost, by step."""
    run_dir = work / "reference"
    launch = Launch(command(config, steps, every, 0, run_dir, work), processes, work / "reference-logs")
    if (rc := launch.wait(timeout=60 * steps)) != [0] * processes:
        raise child_failed("bench recovery: the uninterrupted run", max(rc), launch.stderr())
    return {s: r["loss"] for s, r in rows(run_dir).items()}


def trial(config: list[str], processes: int, survivors: int, steps: int, kill_at: int, every: int, local_every: int,
          work: Path, before_restart: Callable[[], None] | None = None, restart_overrides: tuple[str, ...] = ()
          ) -> dict:
    """Kill the last process once step `kill_at` is logged, delete its local tier, restart on `survivors`
    (after `before_restart`, a test's probe of the stopped run; with `restart_overrides`, e.g. a mesh
    the survivors' devices can form)."""
    run_dir, local = work / "run", work / "local"
    argv = command(config, steps, every, local_every, run_dir, local)
    first = Launch(argv, processes, work / "logs-before")
    try:
        while max(rows(run_dir), default=0) < kill_at:
            if any(p.poll() is not None for p in first.procs):
                raise child_failed("bench recovery: the run before the kill", 1, first.stderr())
            time.sleep(0.05)
        first.procs[-1].send_signal(signal.SIGKILL)
        t_kill = time.time()
        shutil.rmtree(local / str(processes - 1), ignore_errors=True)  # its disk went with it
        first.wait(timeout=120)  # the survivors see the lost peer and end
        t_ended = time.time()
    finally:
        first.end()
    before = rows(run_dir)
    killed_at = max(before)  # the last step logged before the loss (a step in flight may log after the kill)
    if before_restart is not None:
        before_restart()
    t_restart = time.time()
    second = Launch([*argv, *restart_overrides, "--timings"], survivors, work / "logs-after")
    if (rc := second.wait(timeout=60 * steps)) != [0] * survivors:
        raise child_failed("bench recovery: the restart", max(rc, key=abs), second.stderr())
    after = rows(run_dir)
    restart = next(r for r in after.values() if "restart_from" in r)
    return {"killed_at": killed_at, "resumed_from": restart["restart_from"],
            "steps_recomputed": restart["steps_recomputed"], "seconds_lost": restart["seconds_lost"],
            # Where seconds_lost went: the last step logged to the kill, the kill to the survivors'
            # end (their lost-peer verdict), then the restart command to its first step, by phase.
            "last_step_to_kill_s": t_kill - before[killed_at]["time"], "survivors_end_s": t_ended - t_kill,
            "start_up": parse_line(second.stderr()),
            "restart_to_first_step_s": restart["time"] - t_restart, "goodput": restart["goodput"],
            "losses": {s: r["loss"] for s, r in after.items()},
            "resumed_line": next((line for line in second.stderr().splitlines() if line.startswith("resumed from")), "")}


def max_rel_diff(losses: dict[int, float], reference: dict[int, float], since: int) -> float:
    return max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference if s > since)


def recovery(args: list[str], processes: int, survivors: int, steps: int, kill_between: tuple[int, int],
             local_every: int, every: int, seed: int) -> dict:
    recipe, overrides = (args[:1], args[1:]) if args and "=" not in args[0] else ([], args)
    config = [*recipe, *DEFAULTS, *overrides, *FIXED]
    from_args([*config, f"train.steps={steps}"])  # a bad key is named here, before any process starts
    kill_at = random.Random(seed).randint(*kill_between)
    with tempfile.TemporaryDirectory(prefix="boost_jax_recovery_") as tmp:
        reference = uninterrupted(config, processes, steps, every, Path(tmp))
        out = {"processes": processes, "survivors": survivors, "steps": steps, "kill_at": kill_at, "every": every,
               "local_every": local_every}
        for name, local in (("persistent", 0), ("two_tiers", local_every)):
            r = trial(config, processes, survivors, steps, kill_at, every, local, Path(tmp) / name)
            r["max_rel_loss_diff"] = max_rel_diff(r.pop("losses"), reference, r["resumed_from"])
            out[name] = r
    return out


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench recovery", __doc__)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--survivors", type=int, default=2, help="processes of the restart")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-between", type=int, nargs=2, default=(20, 45), metavar=("FIRST", "LAST"),
                   help="the kill comes once the run has logged a step drawn from FIRST..LAST")
    p.add_argument("--local-every", type=int, default=5, help="checkpoint.local_every of the two-tier run")
    p.add_argument("--every", type=int, default=50, help="checkpoint.every (the persistent tier) of both runs")
    p.add_argument("--seed", type=int, default=0, help="draws the step of the kill")
    a = parse(p, argv)
    at_least(a, processes=2, survivors=1, steps=2, local_every=1, every=1)
    first, last = a.kill_between
    if not (1 <= first <= last < a.steps and a.survivors < a.processes):
        raise ConfigError(f"--kill-between {first} {last} must be steps 1 <= FIRST <= LAST < --steps={a.steps}, and "
                          f"--survivors={a.survivors} fewer than --processes={a.processes}")
    if bad := [c for c in a.config if c.split("=")[0] in (*SET_HERE, *(f.split("=")[0] for f in FIXED))]:
        raise ConfigError(f"{bad[0].split('=')[0]}: bench recovery sets it (its flags name what may change)")
    r = recovery(a.config, a.processes, a.survivors, a.steps, (first, last), a.local_every, a.every, a.seed)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['processes']} processes, one killed (SIGKILL) after step {r['kill_at']} with its local tier deleted, "
          f"restarted on {r['survivors']}; {r['steps']} steps, persistent every {r['every']}:")
    for name, label in (("persistent", "persistent tier alone"), ("two_tiers", f"two tiers (local every {r['local_every']})")):
        t = r[name]
        print(f"  {label:32s} killed at {t['killed_at']:3d} resumed from {t['resumed_from']:3d} | "
              f"{t['steps_recomputed']:3d} steps recomputed | {t['seconds_lost']:6.1f} s lost "
              f"({t['restart_to_first_step_s']:.1f} s restart -> first step) | goodput {100 * t['goodput']:5.1f}% | "
              f"max rel loss diff {t['max_rel_loss_diff']:.1e}")
        phases = " + ".join(f"{k} {t['start_up'][k]:.1f}" for k in PHASES) if t["start_up"] else "not logged"
        print(f"  {'':32s} lost = last step to kill {t['last_step_to_kill_s']:.1f} + survivors' end "
              f"{t['survivors_end_s']:.1f} + restart start-up ({phases}) + the rest")
