"""python -m boost_jax [COMMAND [args]]: the commands, one line each; `python -m boost_jax COMMAND ...`
runs `python -m boost_jax.COMMAND ...` (each command's --help has its own)."""

import runpy
import sys

# Each command is the module `boost_jax.<name>`, run as a program.
COMMANDS = {
    "train": "train a model (or resume a run dir) from the config: YAML file, then section.key=value",
    "data": "prepare a tokenized dataset from text, JSONL or Parquet files (data prepare ... --out DIR)",
    "eval": "loss, perplexity and bits per byte of a run's checkpoint, on any layout",
    "generate": "continue text with a run's checkpoint, on any layout (streams; --json)",
    "serve": "an OpenAI-compatible HTTP server of a run's checkpoint: continuous batching, a paged KV cache",
    "lm_eval": "lm-evaluation-harness tasks on a run's checkpoint (--tasks and lm-eval's other flags)",
    "export": "a run's checkpoint as safetensors (the Hugging Face LLaMA layout for dense)",
    "convert": "start a run dir from a Hugging Face LLaMA, an export or a run (--to svd factors it)",
    "plan": "the layout planner: the fastest layout of a model that fits a number of GPUs",
    "compile": "every program of a run compiled by XLA:GPU for A100 / H100 / H200 nodes, without a GPU",
    "study": "a fair comparison: archs x optimizers x sizes x budgets, tuned rates, seeds, fitted compute multipliers",
    "bench": "benchmarks: comm, step, profile, memory, kernels, decode, quality, paper, report, ...",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = "\n".join(f"  {name:{width}s}  {line}" for name, line in COMMANDS.items())
    return (f"usage: python -m boost_jax COMMAND [args]  (the same as python -m boost_jax.COMMAND [args])\n\n"
            f"commands:\n{lines}\n\nEach command's flags: python -m boost_jax.COMMAND --help")


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        sys.exit(f"config error: unknown command {argv[0]!r}: choose one of {', '.join(COMMANDS)} "
                 f"(python -m boost_jax --help lists them)")
    sys.argv = [f"python -m boost_jax.{argv[0]}", *argv[1:]]
    runpy.run_module(f"boost_jax.{argv[0]}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
