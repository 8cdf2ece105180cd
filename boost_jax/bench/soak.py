"""`bench soak [CONFIG.yaml] [section.key=value ...] [--steps N] [--every-s S] [--json]`: a long run's
host memory, open files and threads over time.

Trains --steps steps of the config (default: llama-tiny) in a fresh process with an eval every
--eval-every steps, a background checkpoint every --save-every steps kept to 3 (retention deletes
one at every save) and health logging on each log line, and samples that process's resident memory
(RSS), open file descriptors and threads every --every-s seconds, with the step it has logged. Past
the warm-up (the first --warmup of the steps: compilation, allocator pools, the first saves) each
must stay flat: RSS within --rss-bound (5%) of its value at the end of the warm-up; descriptors and
threads, in the last tenth of the samples against the first (medians, and peaks: a save or an eval
in flight holds a dozen more for a moment, at any point of the run), within 8; and metrics.jsonl
must hold every step once. Exits 1 past a bound.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from boost_jax.bench.common import child_failed, parse, parser
from boost_jax.config import ConfigError, from_args
from boost_jax.runtime.cli import a_share, at_least, positive

DEFAULTS = ["model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "data.max_bytes=300000",
            "parallel.dp=1", "train.eval_batches=2"]
FIXED = ["log.progress=false", "log.tensorboard=true", "log.health=true", "log.every=10", "checkpoint.keep=3",
         "checkpoint.async_save=true"]
COUNT_SLACK = 8  # descriptors and threads: growth allowed between the first and the last tenth


def sample(pid: int) -> dict:
    """RSS (MiB), threads and open descriptors of a live process, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def logged_steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    with metrics.open("rb") as f:
        return sum(1 for _ in f)


def watch(proc: subprocess.Popen, metrics: Path, t0: float, every_s: float) -> list[dict]:
    """Samples of a running process every `every_s` seconds until it ends."""
    samples = []
    while proc.poll() is None:
        try:
            samples.append({"s": time.monotonic() - t0, "step": logged_steps(metrics), **sample(proc.pid)})
        except (FileNotFoundError, ProcessLookupError, KeyError):  # it ended between the poll and the read (a zombie has no VmRSS)
            break
        time.sleep(every_s)
    return samples


def soak(args: list[str], steps: int, eval_every: int, save_every: int, every_s: float, warmup: float,
         rss_bound: float) -> dict:
    recipe, overrides = (args[:1], args[1:]) if args and "=" not in args[0] else ([], args)
    with tempfile.TemporaryDirectory(prefix="boost_jax_soak_") as tmp:
        run_dir = Path(tmp) / "run"
        config = [*recipe, *DEFAULTS, *overrides, *FIXED, f"train.steps={steps}", f"train.eval_every={eval_every}",
                  f"checkpoint.every={save_every}", f"run_dir={run_dir}"]
        from_args(config)  # a bad key is named here, before the run starts
        argv = [sys.executable, "-m", "boost_jax.train", *config]
        t0 = time.monotonic()
        # Its stderr to a file: a pipe nobody reads fills after ~600 log lines and blocks the run.
        err_path = Path(tmp) / "train.stderr"
        with err_path.open("w") as err_file:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err_file, text=True)
        try:
            samples = watch(proc, run_dir / "metrics.jsonl", t0, every_s)
        finally:  # an error or Ctrl-C here must not leave the run training on its own
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode:
            raise child_failed("bench soak: its training run", proc.returncode, err_path.read_text())
        rows = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        checkpoints = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    after = [s for s in samples if warmup * steps <= s["step"] < steps]  # not the last save and the exit
    if len(after) < 4:
        raise ConfigError(f"only {len(after)} samples after the warm-up: lower --every-s or raise --steps")
    head, tail = after[: max(2, len(after) // 10)], after[-max(2, len(after) // 10):]  # medians of the first and last tenth
    start, end = ({k: statistics.median(s[k] for s in part) for k in ("rss_mib", "threads", "fds")} for part in (head, tail))
    first_peak, last_peak = ({k: max(s[k] for s in part) for k in ("threads", "fds")} for part in (head, tail))
    peak = {k: max(s[k] for s in after) for k in ("rss_mib", "threads", "fds")}
    growth = {"rss": end["rss_mib"] / start["rss_mib"] - 1, "threads": end["threads"] - start["threads"],
              "fds": end["fds"] - start["fds"]}
    counts_flat = {k: max(growth[k], last_peak[k] - first_peak[k]) <= COUNT_SLACK for k in ("threads", "fds")}
    flat = {"rss": growth["rss"] <= rss_bound, **counts_flat, "metrics_contiguous": rows == list(range(1, steps + 1))}
    return {"steps": steps, "seconds": samples[-1]["s"] if samples else 0.0, "eval_every": eval_every,
            "save_every": save_every, "warmup_steps": int(warmup * steps), "after_warmup": start, "end": end,
            "peak_after_warmup": peak, "peaks_first_last_tenth": [first_peak, last_peak], "growth": growth,
            "rss_bound": rss_bound, "flat": flat, "ok": all(flat.values()),
            "checkpoints_kept": checkpoints, "samples": samples}


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench soak", __doc__)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--eval-every", type=int, default=250, help="train.eval_every of the run")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint.every of the run")
    p.add_argument("--every-s", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=0.1, help="the share of the steps before the bounds apply")
    p.add_argument("--rss-bound", type=float, default=0.05, help="RSS growth allowed past the warm-up")
    a = parse(p, argv)
    at_least(a, steps=10, eval_every=1, save_every=1)
    positive(a, "every_s", "rss_bound")
    a_share(a, "warmup", "the steps")
    if bad := [c for c in a.config if c.split("=")[0] in ("train.steps", "train.eval_every", "checkpoint.every",
                                                         "run_dir", *(f.split("=")[0] for f in FIXED))]:
        raise ConfigError(f"{bad[0]}: bench soak sets it (its flags name what may change)")
    r = soak(a.config, a.steps, a.eval_every, a.save_every, a.every_s, a.warmup, a.rss_bound)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        s, e, g = r["after_warmup"], r["end"], r["growth"]
        print(f"{r['steps']} steps in {r['seconds']:.0f} s (eval every {r['eval_every']}, a save every "
              f"{r['save_every']}, keep 3), from step {r['warmup_steps']} to the end: RSS {s['rss_mib']:.0f} -> "
              f"{e['rss_mib']:.0f} MiB ({100 * g['rss']:+.1f}%, bound {100 * r['rss_bound']:.0f}%), threads "
              f"{s['threads']:.0f} -> {e['threads']:.0f}, fds {s['fds']:.0f} -> {e['fds']:.0f}; metrics contiguous: "
              f"{r['flat']['metrics_contiguous']}; {'flat' if r['ok'] else 'NOT flat: ' + str(r['flat'])}")
    if not r["ok"]:
        sys.exit(1)
