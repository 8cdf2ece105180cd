"""`bench checkpoint [CONFIG.yaml] [section.key=value ...]`: what a save costs the train loop.

Trains --steps steps saving every --every (a save-heavy run) with Orbax writing in the background
(`checkpoint.async_save=true`) and waiting for each save (false), alternated --reps times on fresh
run dirs, and prints the loop's median seconds per step of each (compile and data preparation
excluded) and their ratio. The config is the train command's (default: llama-tiny).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import jax

from boost_jax.bench.common import config_of, parse, parser, train_to_end
from boost_jax.config import ConfigError

DEFAULTS = ["model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "data.max_bytes=300000"]
QUIET = ["log.progress=false", "log.tensorboard=false", "train.eval_every=0", "parallel.dp=1"]


def measure(args: list[str], steps: int, every: int, reps: int) -> dict:
    per_step: dict[str, list[float]] = {"async": [], "sync": []}
    with tempfile.TemporaryDirectory(prefix="boost_jax_bench_ckpt_") as tmp:
        for rep in range(reps):
            for mode in per_step:  # alternated: machine noise hits both alike
                cfg = config_of([*DEFAULTS, *args, *QUIET, f"train.steps={steps}", f"checkpoint.every={every}",
                                 f"checkpoint.async_save={mode == 'async'}", f"log.every={steps}",
                                 f"run_dir={Path(tmp) / f'{mode}-{rep}'}"])
                per_step[mode].append(train_to_end(cfg, jax.devices()[:1])["loop_s"] / steps)
    sync, background = (statistics.median(per_step[m]) for m in ("sync", "async"))
    return {"steps": steps, "every": every, "reps": reps, "sync_s_per_step": sync, "async_s_per_step": background,
            "sync_over_async": sync / background, "runs_s_per_step": per_step}


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench checkpoint", __doc__)
    p.add_argument("--steps", type=int, default=60, help="steps of each run")
    p.add_argument("--every", type=int, default=2, help="checkpoint.every of each run")
    p.add_argument("--reps", type=int, default=3, help="runs of each mode, alternated")
    a = parse(p, argv)
    if a.steps < 1 or a.every < 1 or a.reps < 1:
        raise ConfigError("--steps, --every and --reps must be at least 1")
    if bad := [c for c in a.config if c.split("=")[0] in ("train.steps", "checkpoint.every", "checkpoint.async_save",
                                                         "run_dir")]:
        raise ConfigError(f"{bad[0]}: bench checkpoint sets the steps, the saves and the run dir of each run")
    r = measure(a.config, a.steps, a.every, a.reps)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{a.steps} steps, a save every {a.every}, median of {a.reps} runs each: waiting for each save "
          f"{1e3 * r['sync_s_per_step']:.1f} ms/step, saving in the background {1e3 * r['async_s_per_step']:.1f} ms/step "
          f"({r['sync_over_async']:.2f}x)")
