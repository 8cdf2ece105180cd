"""python -m boost_jax.eval RUN_DIR [--step N] [--split val|train] [--max-tokens N] [section.key=value ...] [--json]
[--timings]

Evaluates a run's checkpoint (the newest, or --step): loss, perplexity, bits per byte (the summed loss
in bits over the UTF-8 bytes of the evaluated tokens' decoded text) and the tokens evaluated. By
default on the run's own validation data and the batches its training loop evaluates
(train.eval_batches of train.batch_size x train.seq_len), so the loss equals the loop's eval at that
step; --max-tokens evaluates at least that many tokens instead. Any prepared dataset with the run's
tokenizer works (`data.source=prepared data.path=DIR`; another tokenizer is refused by name), under
any layout (`parallel.*`, as training lays it out); a key that would change what the parameters mean
is refused. --timings prints on stderr the seconds to the first loss, by phase (import, data,
restore, compile, run); --json has them always.
"""

from __future__ import annotations

import argparse
import json
import sys

from boost_jax.runtime.cli import run_dir_args, run_dir_parser, run_main
from boost_jax.runtime.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    """The command line (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    p = run_dir_parser("python -m boost_jax.eval", __doc__)
    p.add_argument("--split", default="val", choices=["val", "train"])
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at least this many tokens (whole batches)")
    p.add_argument("--timings", action="store_true", help="print on stderr the seconds to the loss, by phase")
    a = run_dir_args(p, argv)
    if a.max_tokens < 0:
        raise ConfigError(f"--max-tokens must be >= 0 (0: the run's own eval batches), got {a.max_tokens}")
    return a


def _main(argv: list[str]) -> None:
    a = parse(argv)
    from boost_jax.launch.startup import Startup, line  # lazy: keeps --help free of JAX

    startup = Startup()  # its import phase is the process's age: the flags' checks count in it
    from boost_jax.training.evaluate import evaluate  # lazy: keeps --help free of JAX

    r = evaluate(a.run_dir, a.config, a.step, a.split, a.max_tokens, startup, prepare=True)
    seconds = startup.seconds()
    if a.json:
        print(json.dumps({**r, "startup_s": seconds}, indent=1))
    else:
        print(f"{r['run_dir']} step {r['step']} on {r['dataset']} ({r['split']}, {r['tokens']:,} tokens): loss "
              f"{r['loss']:.4f} | ppl {r['perplexity']:.2f} | bits per byte {r['bits_per_byte']:.4f}")
    if a.timings:
        print(line(seconds, "loss"), file=sys.stderr)


if __name__ == "__main__":
    main()
