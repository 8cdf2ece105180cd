"""`python -m boost_jax.train [CONFIG.yaml] [section.key=value ...] [--timings]`: parse, then train.

With no arguments it trains the default small CoLA model on the Python standard library's source
(offline) on whatever devices exist. Re-running with the same `run_dir` resumes from the newest
checkpoint; the loss trajectory is bitwise identical to an uninterrupted run on CPU. --timings logs
the seconds to the first step, by phase: import, data, restore, compile, run (boost_jax/launch/startup.py).
The run itself is boost_jax/training/run.py's `train`.
"""

from __future__ import annotations

from boost_jax.config import from_dict, raw_args
from boost_jax.config.packages import check_packages
from boost_jax.configs import BASE
from boost_jax.runtime.cli import DEBUG_HELP, run_main
from boost_jax.runtime.errors import DiskFullError
from boost_jax.runtime.paths import disk_full, is_disk_full

USAGE = __doc__.strip().splitlines()[0]
TIMINGS = "--timings"


def main(argv: list[str] | None = None) -> None:
    """The command line: a config, then the run (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def _main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nEvery key is documented in {BASE}. {DEBUG_HELP}")
        return
    # JAX is imported past the help and the config's checks, so both answer at once.
    if TIMINGS in args:
        from boost_jax.launch.startup import Startup  # lazy: keeps --help free of JAX

        startup = Startup()
    else:
        startup = None
    raw = raw_args([a for a in args if a != TIMINGS])
    if (raw.get("train") or {}).get("init_from"):  # the model is the source's (training/importer.py)
        from boost_jax.training.importer import with_source_model  # lazy: keeps --help free of JAX

        raw = with_source_model(raw)
    cfg = from_dict(raw)
    check_packages(cfg)  # before the loop's modules import them
    from boost_jax.launch.prepare import prepare_jax  # lazy: keeps --help free of JAX
    from boost_jax.parallel import init_distributed  # lazy: keeps --help free of JAX
    from boost_jax.parallel.peers import watch  # lazy: keeps --help free of JAX

    prepare_jax(cfg)  # before any module below compiles or places an array
    init_distributed(cfg.parallel)
    from boost_jax.analysis.microbatch_fit import fit_resume  # lazy: keeps --help free of JAX
    from boost_jax.training.run import train  # lazy: keeps --help free of JAX (and grain, named missing above)

    try:
        with watch(cfg.parallel.heartbeat_timeout_s):  # a lost peer ends this process with one message
            train(cfg, startup=startup, resume_fit=fit_resume)
    except DiskFullError:
        raise
    except OSError as e:  # a full disk under a write without its own message (config.yaml, tokenizer.json)
        if not is_disk_full(e):
            raise
        raise disk_full(e.filename or cfg.run_dir, "the run's files", 1 << 20,
                        "the checkpoints committed before are untouched") from None


if __name__ == "__main__":
    main()
