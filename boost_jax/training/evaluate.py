"""A run dir's checkpoint evaluated as its training loop evaluates: loss, perplexity, bits per byte
(`python -m boost_jax.eval` describes the figures), for the eval command, the comparison and bench."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from boost_jax.data.build import build_data, check_run_tokenizer
from boost_jax.model.run_dir import open_run
from boost_jax.runtime.errors import ConfigError
from boost_jax.training.parts import Evaluator
from boost_jax.training.step import evaluation

if TYPE_CHECKING:
    from boost_jax.launch.startup import Startup


def evaluate(run_dir: str | Path, overrides: Sequence[str] = (), step: int | None = None, split: str = "val",
             max_tokens: int = 0, startup: Startup | None = None, prepare: bool = False) -> dict:
    """The eval figures of a run dir's checkpoint; `startup`: time the start to the loss by phase;
    `prepare`: JAX prepared from the run's config first (a command's start)."""
    lap = startup.lap if startup is not None else lambda phase: None
    run = open_run(run_dir, overrides, prepare=prepare)
    lap("import")
    cfg, t = run.cfg, run.cfg.train
    # The layout and the checkpoint first: a config that is not the checkpoint's model is named as
    # such, before its data is prepared.
    params, step = run.params(step)
    lap("restore")
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed,
                      batch_size=t.batch_size, completion_only=t.loss_on_completion(cfg.data.format))
    if not data.eval_sets(split):
        raise ConfigError(f"{data.directory} has no validation split (data.val_fraction=0?); pass --split train")
    check_run_tokenizer(data.tokenizer, run.run_dir / "tokenizer.json", data.directory)
    lap("data")
    batches = split_batches(data.eval_sets(split), split, max_tokens, t.batch_size, t.seq_len) if max_tokens \
        else t.eval_batches
    evaluator = Evaluator(cfg, evaluation(cfg, run.plan), data, (jax.process_index(), jax.process_count()), split,
                          batches)
    out = evaluator({"params": params})
    lap("run")
    per_dataset = {name: {"loss": out[f"eval_loss/{name}"], "bits_per_byte": out[f"eval_bpb/{name}"]}
                   for name in evaluator.sets if name}
    return {"run_dir": str(run.run_dir), "step": step, "dataset": str(data.directory), "split": split,
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
