"""python -m boost_jax.bench {comm,step,profile,memory,kernels,paper,planner,report,data} [flags] [section.key=value ...]"""

import sys

from boost_jax.cli import DEBUG_HELP, run_main

COMMANDS = ("comm", "step", "profile", "memory", "kernels", "paper", "planner", "report", "data")
# Simulated CPU devices each command needs by default: the paper's 30B row is TP 4 x PP 4 (16 GPUs).
CPU_DEVICES = {"paper": 16, "planner": 16, "report": 16}


def main() -> None:
    run_main(_main)


def _main(args: list[str]) -> None:
    if not args or args[0] not in COMMANDS:
        sys.exit(f"usage: python -m boost_jax.bench {{{','.join(COMMANDS)}}} --help\n{DEBUG_HELP}")
    cmd, argv = args[0], args[1:]
    # Simulated host devices must be requested before JAX starts: enough for the largest mesh asked.
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") and not any(a.startswith("parallel.cpu_devices") for a in argv):
        jax.config.update("jax_num_cpu_devices", CPU_DEVICES.get(cmd, 8))
    from importlib import import_module

    import_module(f"boost_jax.bench.{cmd}").main(argv)


if __name__ == "__main__":
    main()
