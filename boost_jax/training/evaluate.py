"""The eval: loss, perplexity and bits per byte over a split's first batches (`Evaluator`), which the
training loop runs every `train.eval_every` steps, and a run dir's checkpoint evaluated the same way
(`evaluate`; `python -m boost_jax.eval` describes the figures), for the eval command, the comparison
and bench. By the eval step alone (training/loss.py): nothing here imports an optimizer."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from boost_jax.config import Config
from boost_jax.data.build import build_data, check_run_tokenizer
from boost_jax.model.run_dir import open_run
from boost_jax.runtime.errors import ConfigError
from boost_jax.training.loss import device_batch, evaluation

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
    out = evaluator(params)
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


class Evaluator:
    """Loss, perplexity and bits per byte over the first `batches` (default `train.eval_batches`)
    batches of a split (always the same ones). Bits per byte: the summed loss in bits over the UTF-8
    bytes of the evaluated tokens' decoded text, comparable across tokenizers. A mixture's datasets
    are each evaluated (`eval_loss/<name>`, `eval_bpb/<name>`), and `eval_loss` and `eval_bpb` are
    their means weighted by the mixture's current weights."""

    def __init__(self, cfg: Config, run, data, process: tuple[int, int], split: str = "val",
                 batches: int | None = None):
        self.cfg, self.run, self.data, self.process = cfg, run, data, process
        self.sets = data.eval_sets(split)
        self.weights = data.train.history[-1].weights if data.parts else {"": 1.0}
        self.batches = batches or cfg.train.eval_batches
        self._bytes: dict[str, int] = {}

    def due(self, done: int) -> bool:
        """An eval after step `done`: every `train.eval_every` steps and at the end (if there is val data)."""
        t = self.cfg.train
        return bool(self.sets) and t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps)

    def __call__(self, params) -> dict:
        """The figures of the model with `params` (the state's, laid out as the eval step takes them)."""
        t = self.cfg.train
        out, losses, bpbs, counted = {}, {}, {}, {}
        for name, split in self.sets.items():
            step_losses = [self.run.eval_step(params, device_batch(b, self.run.batch_sharding))
                           for b in split.eval_batches(self.batches, t.batch_size, *self.process)]
            # Each batch's loss is the mean over its targets: weighted by their numbers, the split's.
            per_batch = self.targets(name)
            losses[name] = float(np.average(jax.device_get(step_losses), weights=per_batch))
            counted[name] = sum(per_batch)
            bpbs[name] = losses[name] * counted[name] / (self.bytes(name) * math.log(2))
            if name:
                out.update({f"eval_loss/{name}": losses[name], f"eval_bpb/{name}": bpbs[name]})
        weights = {n: self.weights[n] for n in self.sets}
        if not sum(weights.values()):  # only datasets the mixture no longer draws from have val data
            weights = dict.fromkeys(self.sets, 1.0)
        mean = lambda values: sum(weights[n] * values[n] for n in values) / sum(weights.values())
        loss = mean(losses)
        return {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_bpb": mean(bpbs),
                "eval_tokens": sum(counted.values()), **out}

    def targets(self, name: str = "") -> list[int]:
        """The target tokens of each evaluated batch of one dataset, every process's rows: all its
        positions, or those a loss mask weighs (instruction data, data/packing.py)."""
        t = self.cfg.train
        return [int((b["weights"] > 0).sum()) if "weights" in b else t.batch_size * t.seq_len
                for b in self.sets[name].eval_batches(self.batches, t.batch_size)]

    def bytes(self, name: str = "") -> int:
        """UTF-8 bytes of the evaluated targets' text of one dataset, every process's rows (counted once)."""
        if name not in self._bytes:
            t, tok = self.cfg.train, self.data.tokenizer
            rows = [[i for i, w in zip(row, weights, strict=True) if w > 0] if "weights" in b else row
                    for b in self.sets[name].eval_batches(self.batches, t.batch_size)
                    for row, weights in zip(b["targets"].tolist(), b.get("weights", b["targets"]).tolist(),
                                            strict=True)]
            self._bytes[name] = max(1, sum(len(text.encode()) for text in tok.decode_batch(rows)))
        return self._bytes[name]


def perplexity(loss: float) -> float:
    """exp(loss); a diverged model's loss beyond ~709 overflows a float: its perplexity is inf."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
