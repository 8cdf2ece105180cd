"""python -m boost_jax.bench {comm,step,profile,memory,kernels,decode,quality,paper,planner,report,data,checkpoint,soak,startup,recovery,serve,finetune} [CONFIG.yaml] [section.key=value ...] [flags]

Every benchmark reads the train config (an optional YAML file, then `section.key=value` overrides;
`train.batch_size` is global); flags are only for what is not config (--json, repetitions, ...).
"""

import sys
from importlib import import_module

from boost_jax.config import Config, ParallelConfig
from boost_jax.runtime.cli import DEBUG_HELP, run_main

COMMANDS = ("comm", "step", "profile", "memory", "kernels", "decode", "quality", "paper", "planner", "report", "data",
            "checkpoint", "soak", "startup", "recovery", "serve", "finetune")
# Simulated CPU devices of the sweeps over the paper's table (its 30B row is TP 4 x PP 4: 16 GPUs);
# the other commands simulate their config's mesh (bench/common.py).
SWEEP_CPU_DEVICES = {"paper": 16, "planner": 16, "report": 16}
GPU_COMPILE = "--gpu-compile"  # bench paper's and bench planner's flag


def main() -> None:
    run_main(_main)


def _main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(f"{__doc__.strip()}\n\nEach command's flags: python -m boost_jax.bench COMMAND --help\n{DEBUG_HELP}")
        return
    if not args or args[0] not in COMMANDS:
        unknown = f"unknown command {args[0]!r}; " if args and not args[0].startswith("-") else ""
        sys.exit(f"{unknown}usage: python -m boost_jax.bench {{{','.join(COMMANDS)}}} --help\n{DEBUG_HELP}")
    cmd, argv = args[0], args[1:]
    from boost_jax.launch.prepare import prepare_jax  # lazy: keeps --help free of JAX

    if any(a.split("=")[0] == GPU_COMPILE for a in argv):  # a deviceless GPU compile: JAX on the CPU alone (launch/gpu_target.py)
        from boost_jax.launch.gpu_target import use_cpu_backend  # lazy: keeps --help free of JAX

        use_cpu_backend()

    # The defaults (compilation cache, a sweep's devices); a command reading a config then prepares
    # for it (bench/common.config_of), host memory included.
    prepare_jax(Config(parallel=ParallelConfig(cpu_reuse_memory=False)), devices=SWEEP_CPU_DEVICES.get(cmd, 0))
    import_module(f"boost_jax.bench.{cmd}").main(argv)


if __name__ == "__main__":
    main()
