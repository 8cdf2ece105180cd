"""python -m boost_jax.eval RUN_DIR [--step N] [--split val|train] [--max-tokens N] [section.key=value ...] [--json]

Evaluates a run's checkpoint (the newest, or --step): loss, perplexity, bits per byte (the summed loss
in bits over the UTF-8 bytes of the evaluated tokens' decoded text) and the tokens evaluated. By
default on the run's own validation data and the batches its training loop evaluates
(train.eval_batches of train.batch_size x train.seq_len), so the loss equals the loop's eval at that
step; --max-tokens evaluates at least that many tokens instead. Any prepared dataset with the run's
tokenizer works (`data.source=prepared data.path=DIR`; another tokenizer is refused by name), under
any layout (`parallel.*`, as training lays it out); a key that would change what the parameters mean
is refused.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from boost_jax.cli import run_dir_args, run_dir_parser, run_main
from boost_jax.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    """The command line (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    p = run_dir_parser("python -m boost_jax.eval", __doc__)
    p.add_argument("--split", default="val", choices=["val", "train"])
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at least this many tokens (whole batches)")
    a = run_dir_args(p, argv)
    if a.max_tokens < 0:
        raise ConfigError(f"--max-tokens must be >= 0 (0: the run's own eval batches), got {a.max_tokens}")
    return a


def evaluate(run_dir: str | Path, overrides=(), step: int | None = None, split: str = "val",
             max_tokens: int = 0) -> dict:
    """The eval figures of a run dir's checkpoint (the module docstring says which)."""
    import jax

    from boost_jax import api
    from boost_jax.data.build import build_data, check_run_tokenizer
    from boost_jax.parallel import make_plan
    from boost_jax.parallel.mesh import mesh_devices
    from boost_jax.training import Evaluator

    run_dir = Path(run_dir)
    cfg = api.run_config(run_dir, overrides)
    t = cfg.train
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed,
                      batch_size=t.batch_size)
    if not data.eval_sets(split):
        raise ConfigError(f"{data.directory} has no validation split (data.val_fraction=0?); pass --split train")
    check_run_tokenizer(data.tokenizer, run_dir / "tokenizer.json")
    plan = make_plan(cfg, mesh_devices(cfg.parallel))
    run, state, step = api.restore_state(run_dir, cfg, plan, step)
    batches = math.ceil(max_tokens / (t.batch_size * t.seq_len)) if max_tokens else t.eval_batches
    evaluator = Evaluator(cfg, run, data, (jax.process_index(), jax.process_count()), split, batches)
    out = evaluator(state)
    per_dataset = {name: {"loss": out[f"eval_loss/{name}"], "bits_per_byte": out[f"eval_bpb/{name}"]}
                   for name in evaluator.sets if name}
    return {"run_dir": str(run_dir), "step": step, "dataset": str(data.directory), "split": split,
            "loss": out["eval_loss"], "perplexity": out["eval_ppl"], "bits_per_byte": out["eval_bpb"],
            "tokens": out["eval_tokens"], "bytes": sum(evaluator.bytes(name) for name in evaluator.sets),
            **({"datasets": per_dataset} if per_dataset else {})}


def _main(argv: list[str]) -> None:
    a = parse(argv)
    from boost_jax import api
    from boost_jax.parallel import prepare_jax

    prepare_jax(api.run_config(a.run_dir, a.config))
    r = evaluate(a.run_dir, a.config, a.step, a.split, a.max_tokens)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{r['run_dir']} step {r['step']} on {r['dataset']} ({r['split']}, {r['tokens']:,} tokens): loss "
          f"{r['loss']:.4f} | ppl {r['perplexity']:.2f} | bits per byte {r['bits_per_byte']:.4f}")


if __name__ == "__main__":
    main()
