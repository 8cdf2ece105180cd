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
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from boost_jax.runtime.cli import run_dir_args, run_dir_parser, run_main
from boost_jax.runtime.errors import ConfigError

if TYPE_CHECKING:
    from boost_jax.launch.startup import Startup


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


def evaluate(run_dir: str | Path, overrides=(), step: int | None = None, split: str = "val",
             max_tokens: int = 0, startup: Startup | None = None) -> dict:
    """The eval figures of a run dir's checkpoint (the module docstring says which); `startup`: time
    the start to the loss by phase."""
    import jax

    from boost_jax import api
    from boost_jax.data.build import build_data, check_run_tokenizer
    from boost_jax.model.weights import restore_params
    from boost_jax.parallel import make_plan
    from boost_jax.parallel.mesh import mesh_devices
    from boost_jax.training.parts import Evaluator
    from boost_jax.training.step import evaluation

    lap = startup.lap if startup is not None else lambda phase: None
    lap("import")
    run_dir = Path(run_dir)
    cfg = api.run_config(run_dir, overrides)
    t = cfg.train
    # The layout and the checkpoint first: a config that is not the checkpoint's model is named as
    # such, before its data is prepared.
    plan = make_plan(cfg, mesh_devices(cfg.parallel))
    params, step = restore_params(run_dir, cfg, plan, step)
    lap("restore")
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed,
                      batch_size=t.batch_size)
    if not data.eval_sets(split):
        raise ConfigError(f"{data.directory} has no validation split (data.val_fraction=0?); pass --split train")
    check_run_tokenizer(data.tokenizer, run_dir / "tokenizer.json")
    lap("data")
    batches = split_batches(data.eval_sets(split), split, max_tokens, t.batch_size, t.seq_len) if max_tokens \
        else t.eval_batches
    evaluator = Evaluator(cfg, evaluation(cfg, plan), data, (jax.process_index(), jax.process_count()), split, batches)
    out = evaluator({"params": params})
    lap("run")
    per_dataset = {name: {"loss": out[f"eval_loss/{name}"], "bits_per_byte": out[f"eval_bpb/{name}"]}
                   for name in evaluator.sets if name}
    return {"run_dir": str(run_dir), "step": step, "dataset": str(data.directory), "split": split,
            "loss": out["eval_loss"], "perplexity": out["eval_ppl"], "bits_per_byte": out["eval_bpb"],
            "tokens": out["eval_tokens"], "bytes": sum(evaluator.bytes(name) for name in evaluator.sets),
            **({"datasets": per_dataset} if per_dataset else {})}


def split_batches(sets: dict, split: str, max_tokens: int, batch_size: int, seq_len: int) -> int:
    """The batches --max-tokens asks for, at most the split's whole batches (its smallest dataset's,
    for a mixture): past them the windows would be counted twice. A clamp is named on stderr."""
    asked = math.ceil(max_tokens / (batch_size * seq_len))
    windows = min(s.num_windows for s in sets.values())
    whole = max(1, windows // batch_size)
    if asked <= whole:
        return asked
    print(f"note: --max-tokens {max_tokens:,} is more than the {split} split holds ({windows:,} windows of "
          f"{seq_len} tokens): evaluating its {whole} whole batch(es) of train.batch_size={batch_size}, "
          f"{whole * batch_size * seq_len:,} tokens", file=sys.stderr, flush=True)
    return whole


def _main(argv: list[str]) -> None:
    from boost_jax.launch.startup import Startup, line

    startup = Startup()
    a = parse(argv)
    from boost_jax import api
    from boost_jax.launch.prepare import prepare_jax

    prepare_jax(api.run_config(a.run_dir, a.config))
    r = evaluate(a.run_dir, a.config, a.step, a.split, a.max_tokens, startup)
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
