"""`bench startup [CONFIG.yaml] [section.key=value ...]`: the seconds from a command to its first result,
from an empty compilation cache (cold) and again from the one it filled (warm).

Trains the config (default: the quickstart's, --steps steps), then runs `train` (a new run dir), `eval`
and `generate` on it (or those of --commands), each twice in a fresh process with its own compilation
cache folder: first empty, then as the first run left it. Each run is timed by its wall clock here and
splits its own start (`--timings`: import, data, restore, compile, run; launch/startup.py). --json prints everything;
`bench report` puts it on the results page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from boost_jax.bench.common import child_failed, parse, parser
from boost_jax.config import ConfigError, from_args
from boost_jax.launch.startup import PHASES, parse_line

PROMPT, NEW_TOKENS = "def main(", 40  # a generate as docs/guides/inference.md shows it
COMMANDS = ("train", "eval", "generate")


def commands(args: list[str], steps: int, work: Path, trial: str) -> dict[str, list[str]]:
    """Each command's argument list (after `python -m`) for `trial` (cold, warm): train a run dir of
    its own, eval and generate the run of trial "run" (work/train-run)."""
    run = str(work / "train-run")
    return {
        "train": ["boost_jax.train", *args, f"train.steps={steps}", f"run_dir={work / f'train-{trial}'}",
                  "log.progress=false", "--timings"],
        "eval": ["boost_jax.eval", run, "--json"],
        "generate": ["boost_jax.generate", run, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json"],
    }


def timed(argv: list[str], cache: Path, log) -> dict:
    """One fresh process of `python -m argv` with its compilation cache in `cache`: wall seconds and its split."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *argv, f"data.compile_cache_dir={cache}"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise child_failed(f"bench startup: python -m {' '.join(argv)}", proc.returncode, proc.stderr)
    split = json.loads(proc.stdout)["startup_s"] if "--json" in argv else parse_line(proc.stderr)
    if split is None:
        raise RuntimeError(f"bench startup: python -m {' '.join(argv)} printed no start-up line:\n{proc.stderr[-2000:]}")
    log(f"  {argv[0].split('.')[-1]}: {wall:.1f} s wall, {split['total']:.1f} s to its first result")
    return {"wall_s": wall, "startup_s": split}


def measure(args: list[str], steps: int, work: Path, log=print, names: tuple[str, ...] = COMMANDS) -> dict:
    from_args([*args, f"train.steps={steps}"])  # a bad config fails before any process starts
    if set(names) - {"train"}:
        log(f"training the run the others read ({steps} steps)")
        timed(commands(args, steps, work, "run")["train"], work / "xla-run", log)
    cold, warm = commands(args, steps, work, "cold"), commands(args, steps, work, "warm")
    rows = []
    for name in names:
        log(f"{name}: cold, then warm")
        cache = work / f"xla-{name}"
        first, second = timed(cold[name], cache, log), timed(warm[name], cache, log)
        rows.append({"command": name, "cold": first, "warm": second,
                     "warm_over_cold": second["wall_s"] / first["wall_s"]})
    return {"config": args, "steps": steps, "phases": list(PHASES), "rows": rows,
            "commands": [f"python -m {' '.join(cold[n])}" for n in names],
            "command": " ".join(["python -m boost_jax.bench startup", *args, f"--steps {steps}"])}


def table(r: dict) -> list[str]:
    """Markdown: each command's wall time and seconds to its first result, cold and warm, with the split."""
    split = lambda s: " + ".join(f"{k} {s[k]:.1f}" for k in r["phases"])
    lines = ["| command | cold: wall s | cold: to first result (import + data + restore + compile + run) | warm: wall s | "
             "warm: to first result | warm / cold |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        c, w = row["cold"], row["warm"]
        lines.append(f"| {row['command']} | {c['wall_s']:.1f} | {c['startup_s']['total']:.1f} ({split(c['startup_s'])}) | "
                     f"{w['wall_s']:.1f} | {w['startup_s']['total']:.1f} ({split(w['startup_s'])}) | "
                     f"{row['warm_over_cold']:.2f} |")
    return lines


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench startup", __doc__)
    p.add_argument("--steps", type=int, default=20, help="training steps of the run eval and generate read")
    p.add_argument("--work", type=Path, help="where the runs and caches go (default: a temporary folder)")
    p.add_argument("--commands", default=",".join(COMMANDS), help=f"which to time, in order (default: {','.join(COMMANDS)})")
    a = parse(p, argv)
    names = tuple(a.commands.split(","))
    if unknown := [n for n in names if n not in COMMANDS]:
        raise ConfigError(f"--commands {a.commands}: unknown command {unknown[0]!r}; choose from {', '.join(COMMANDS)}")
    if len(set(names)) < len(names):  # a command's second "cold" run would read the cache its first one filled
        raise ConfigError(f"--commands {a.commands}: a command named twice; name each once")
    if a.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {a.steps}")
    if bad := [c for c in a.config if c.split("=")[0] in ("run_dir", "train.steps", "data.compile_cache_dir")]:
        raise ConfigError(f"{bad[0]}: bench startup sets the run dirs, the steps and the cache folders")
    if a.work is not None and a.work.exists() and not a.work.is_dir():
        raise ConfigError(f"--work {a.work} is a file: name a folder (made if missing), or leave --work out "
                          "for a temporary one")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(a.config, a.steps, a.work or Path(tmp), log, names)
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print("\n".join(table(result)))


if __name__ == "__main__":
    main(sys.argv[1:])
