"""python -m boost_jax.lm_eval RUN_DIR [section.key=value ...] [--step N] --tasks TASKS [lm-eval's flags]

A boost_jax run's checkpoint as an lm-evaluation-harness model (`pip install -e ".[eval]"`): the
command is lm-eval's own (`lm-eval run`: --tasks, --include_path, --limit, --num_fewshot,
--output_path, --log_samples, --batch_size, --config, ...) with the model a run dir's, because
lm-eval's `lm_eval` command never imports boost_jax. `section.key=value` overrides of the run's
config.yaml choose the layout as for `eval` and `generate` (`parallel.tp=2 parallel.dp=1`, fsdp, dp;
no pipeline stages or context parallelism, as decoding); a key that would change what the parameters
mean is refused. The model is boost_jax/model/harness.py's `BoostLM`, given the config read here once.
lm-eval's flags that would end in a traceback of its own are checked first (a missing --config file,
an empty --tasks, a negative --num_fewshot, an --output_path that cannot be written); results that
lm-eval could not save to --output_path end the command with exit status 1 after its scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from boost_jax.config import Config
from boost_jax.launch.prepare import prepare_jax
from boost_jax.model.harness import positive_batch_size, register_model
from boost_jax.model.run_dir import open_run
from boost_jax.runtime.cli import DEBUG_HELP, run_main
from boost_jax.runtime.errors import BoostJaxError, ConfigError, PackageError
from boost_jax.runtime.paths import check_writable_dir


def check_harness_args(harness_args: Sequence[str]) -> argparse.Namespace:
    """lm-eval's flags that would end in a traceback of its own (or run as asked for nothing), named
    before the harness starts: --tasks missing or naming none (unless a --config file gives them), a
    --config that is not a file, an --include_path that is not a folder, a --limit that is not a count
    or a fraction of the examples, a negative --num_fewshot, a --batch_size that is not a row count, an
    --output_path that cannot be written. Returns the flags it read."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tasks", "-t", nargs="+")
    p.add_argument("--config", "-C")
    p.add_argument("--include_path")
    p.add_argument("--limit", "-L")
    p.add_argument("--num_fewshot", "-f")
    p.add_argument("--batch_size", "-b")
    p.add_argument("--output_path", "-o")
    a, _ = p.parse_known_args(harness_args)
    if a.config is not None and not Path(a.config).is_file():
        raise ConfigError(f"--config {a.config}: no such file (it names a YAML file of lm-eval's flags)")
    if a.tasks is not None and not [t for x in a.tasks for t in x.replace(",", " ").split()]:
        raise ConfigError(f"--tasks {' '.join(map(repr, a.tasks))}: names no task (--tasks hellaswag,arc_easy)")
    if not a.tasks and a.config is None:
        raise ConfigError("--tasks is missing: name the lm-eval tasks to run (--tasks hellaswag,arc_easy; "
                          "`lm-eval ls tasks` lists them, --include_path DIR adds local ones)")
    if a.include_path is not None and not Path(a.include_path).is_dir():
        raise ConfigError(f"--include_path {a.include_path}: no such folder (it names a folder of task YAML files)")
    if a.limit is not None:
        check_limit(a.limit)
    if a.num_fewshot is not None and not (a.num_fewshot.isdigit()):
        raise ConfigError(f"--num_fewshot must be a count of examples in each prompt (0, 1, 2, ...), got "
                          f"{a.num_fewshot!r}")
    if a.batch_size is not None:
        positive_batch_size(a.batch_size)
    if a.output_path is not None:
        out = Path(a.output_path)  # lm-eval writes a .json path's siblings, else a folder there
        check_writable_dir(out.parent if out.suffix == ".json" else out, "--output_path")
    return a


def check_limit(text: str) -> None:
    """lm-eval's --limit: a count of examples per task (a whole number), or a fraction of them below 1."""
    try:
        limit = float(text)
    except ValueError:
        limit = math.nan
    if not (0 < limit < 1 or (math.isfinite(limit) and limit >= 1 and limit == int(limit))):
        raise ConfigError(f"--limit must be a count of examples per task (1, 2, ...) or a fraction of them "
                          f"(0 < f < 1), got {text!r}")


def run_harness(argv: list[str]) -> None:
    """lm-eval's own command line on `argv`; a task it does not know, or flags its checks refuse,
    named in one message."""
    from lm_eval.__main__ import cli_evaluate  # optional: lm_eval (the eval extra)

    saved, sys.argv = sys.argv, argv
    try:
        cli_evaluate()
    except Exception as e:  # lm-eval (0.4.13) refuses its flags only in exceptions of its own
        if isinstance(e, BoostJaxError):
            raise
        if isinstance(e, ValueError) and str(e).startswith("Tasks not found"):
            missing = str(e).split(":", 1)[-1].strip()
            raise ConfigError(f"--tasks: lm-eval has no task {missing} (`lm-eval ls tasks` lists them; "
                              "--include_path DIR adds a folder of local task YAML files)") from None
        if reading_flags(e):
            raise ConfigError(f"lm-eval refused its flags: {type(e).__name__}: {e}") from None
        raise
    finally:
        sys.argv = saved


def reading_flags(error: BaseException) -> bool:
    """Whether lm-eval raised `error` while it read its command line and --config file (the last of
    its own frames in lm_eval/_cli/ or lm_eval/config/), not while it evaluated."""
    own = [f.filename.replace("\\", "/") for f in traceback.extract_tb(error.__traceback__) if "lm_eval" in f.filename]
    return bool(own) and ("lm_eval/_cli/" in own[-1] or "lm_eval/config/" in own[-1])


def saved_results(output_path: str, since: float) -> list[Path]:
    """The results files lm-eval wrote whole under --output_path since `since` (a .json path: its
    dated siblings; else the folder's model folders). A write that found the disk full leaves a
    partial file: it is no saved result."""
    out = Path(output_path)
    found = out.parent.glob(f"{out.stem}_*.json") if out.suffix == ".json" else out.glob("*/results_*.json")
    return [f for f in found if f.stat().st_mtime >= since and whole_json(f)]


def whole_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


SECTIONS = {f.name for f in dataclasses.fields(Config)}  # what starts a `section.key=value` override


def main(argv: list[str] | None = None) -> None:
    """The command line (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m boost_jax.lm_eval", description=__doc__, epilog=DEBUG_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="the checkpoint (default: the newest)")
    a, rest = p.parse_known_args(argv)
    # Our config's `section.key=value` overrides; everything else is lm-eval's.
    is_override = lambda x: not x.startswith("-") and x.split(".", 1)[0] in SECTIONS and "=" in x.split(".", 1)[-1]
    overrides, harness_args = [x for x in rest if is_override(x)], [x for x in rest if not is_override(x)]
    if taken := [f for f in ("--model", "--model_args") if any(x.split("=")[0] == f for x in harness_args)]:
        raise ConfigError(f"{taken[0]}: the model is RUN_DIR's (python -m boost_jax.lm_eval RUN_DIR --tasks ...)")
    if a.step is not None and a.step < 0:
        raise ConfigError(f"--step must be a checkpoint's step (>= 0), got {a.step}")
    flags = check_harness_args(harness_args)
    # The run dir and its overrides checked before the harness starts; the config, read here once, is the model's.
    run = open_run(a.run_dir, overrides, decoding=True)
    if register_model is None:
        raise PackageError("python -m boost_jax.lm_eval needs lm-eval: pip install -e \".[eval]\" (or pip install lm-eval)")
    prepare_jax(run.cfg, reuse_memory=False)  # decoding's scoring: glibc's memory defaults
    model_args = {"run_dir": str(a.run_dir), "config": run.cfg.to_dict(), **({} if a.step is None else {"step": a.step})}
    started = time.time()
    run_harness(["lm-eval", "run", "--model", "boost_jax", "--model_args", json.dumps(model_args), *harness_args])
    if flags.output_path is not None and not saved_results(flags.output_path, started):
        raise ConfigError(f"--output_path {flags.output_path}: lm-eval could not save the results there (its log "
                          "above says why); the scores above are all there is of this run")


if __name__ == "__main__":
    main()
