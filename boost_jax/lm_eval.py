"""python -m boost_jax.lm_eval RUN_DIR [section.key=value ...] [--step N] --tasks TASKS [lm-eval's flags]

A boost_jax run's checkpoint as an lm-evaluation-harness model (`pip install -e ".[eval]"`): the
command is lm-eval's own (`lm-eval run`: --tasks, --include_path, --limit, --output_path,
--log_samples, --batch_size, ...) with the model a run dir's, because lm-eval's `lm_eval` command
never imports boost_jax. `section.key=value` overrides of the run's config.yaml choose the layout as
for `eval` and `generate` (`parallel.tp=2 parallel.dp=1`, fsdp, dp; no pipeline stages or context
parallelism, as decoding); a key that would change what the parameters mean is refused. From Python:
`lm_eval.simple_evaluate(model=BoostLM(run_dir="runs/default", overrides=["parallel.tp=2"]), tasks=[...])`.

The three requests the harness makes, each answered from the model's own forward on that layout:
- `loglikelihood(context, continuation)`: the summed log-probability of the continuation's tokens
  after the context's, and whether each is the greedy choice. The continuation's tokens are those of
  context + continuation past the context's (a leading space belongs to the continuation); an empty
  context is the end-of-document token. A sequence longer than the model's context (train.seq_len)
  keeps its last tokens.
- `loglikelihood_rolling(text)`: the summed log-probability of every token of a document, in
  consecutive windows of the model's context, the first token predicted from the end-of-document
  token (the harness's perplexity and bits per byte).
- `generate_until(context, {until, max_gen_toks, temperature, do_sample})`: the decoder's continuation
  (`boost_jax/model/decode.py`), cut at the first stop string; requests asking alike decode in batches.
Scores are summed on the devices, at the positions asked: two numbers per row come to the host.

The class works without lm-eval installed (tests drive it with plain request objects); with it, it
is an `lm_eval.api.model.LM` registered as "boost_jax".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boost_jax.config import Config
from boost_jax.model.decode import Decoder, Sampling, bucket
from boost_jax.model.run_dir import open_run, read_config
from boost_jax.runtime.cli import DEBUG_HELP, run_main
from boost_jax.runtime.errors import ConfigError, PackageError

try:  # the harness is an optional extra
    from lm_eval.api.model import LM as _Harness
    from lm_eval.api.registry import register_model
except ImportError:
    _Harness, register_model = object, None


# What the harness passes every model besides its --model_args; the layout is the config's, so unused.
HARNESS_KEYS = ("max_batch_size", "device")


class BoostLM(_Harness):
    """An lm-evaluation-harness model over a boost_jax run dir's checkpoint."""

    def __init__(self, run_dir: str | Path, step: int | None = None, batch_size: int = 8,
                 overrides: Sequence[str] | str = (), **harness):
        """`overrides`: `section.key=value` strings (or one string of them separated by spaces, as
        lm-eval's `--model_args ...,overrides=parallel.tp=2 parallel.dp=1` passes them). Any other
        argument but the harness's own (HARNESS_KEYS) is refused by name: a misspelt one would be lost."""
        if unknown := [k for k in harness if k not in HARNESS_KEYS]:
            raise ConfigError(f"BoostLM: no model argument {unknown[0]!r} (the arguments: run_dir, step, "
                              "batch_size, overrides)")
        batch_size = positive_batch_size(batch_size)
        super().__init__()
        overrides = overrides.split() if isinstance(overrides, str) else list(overrides)
        # decoding's scoring: glibc's defaults
        run = open_run(run_dir, overrides, decoding=True, prepare=True, reuse_memory=False)
        plan, self.cfg = run.plan, run.cfg
        self.model, self.step = run.model(None if step in (None, "") else int(step))
        self.tokenizer, self.eos = run.tokenizer, run.eos
        # The cache with the fewest bytes per device here; refuses pipeline stages and cp by name.
        self.decoder = Decoder(self.model, plan, cache="auto", eos_id=self.eos)
        self.context = self.cfg.train.seq_len
        split = plan.size("batch")  # rows are padded to a multiple of the data-parallel split
        self.rows = -(-batch_size // split) * split
        graphdef, params = nnx.split(self.model)
        self._scores = jax.jit(lambda p, *rows: scores(nnx.merge(graphdef, p), plan, *rows))
        self._params = params

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> BoostLM:
        """The harness's `--model_args run_dir=...,step=...,batch_size=...`."""
        args = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv)
        return cls(**args, **{k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def score(self, sequences: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(sum of log-probs, all greedy) of the last `n` tokens of each token sequence, each predicted
        from the tokens before it (sequences cut to the model's context + 1, padded to a bucket).
        Scored on the devices (`scores`): two numbers per row come back."""
        out = []
        for lo in range(0, len(sequences), self.rows):
            part = [(ids[-(self.context + 1):], n) for ids, n in sequences[lo:lo + self.rows]]
            width = bucket(max(len(ids) - 1 for ids, _ in part))
            asked = bucket(max(n for _, n in part))
            # One row count: one program per (width, asked) bucket pair. Padding rows ask for nothing.
            tokens, at, targets = (np.zeros((self.rows, k), np.int32) for k in (width, asked, asked))
            count = np.zeros(self.rows, np.int32)
            for i, (ids, n) in enumerate(part):
                tokens[i, :len(ids) - 1] = ids[:-1]
                at[i, :n] = np.arange(len(ids) - 1 - n, len(ids) - 1)  # the positions predicting the last n tokens
                targets[i, :n], count[i] = ids[-n:], n
            total, greedy = jax.device_get(self._scores(self._params, tokens, at, targets, count))
            out += [(float(total[i]), bool(greedy[i])) for i in range(len(part))]
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """(log P(continuation | context), greedy) per request (`args`: context, continuation)."""
        sequences = []
        for request in requests:
            context, continuation = request.args
            prefix = self.encode(context) if context else [self.eos]
            whole = self.encode(context + continuation) if context else prefix + self.encode(continuation)
            n = max(len(whole) - len(prefix), 1)  # the continuation's tokens (a merge across the seam counts in)
            sequences.append((whole, n))
        return self.score(sequences)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log P(text) per request (`args`: (text,)), in windows of the model's context."""
        out, c = [], self.context
        for request in requests:
            ids = [self.eos, *self.encode(request.args[0])]
            # Tokens s .. e-1 scored per window, each from up to c tokens before it.
            windows = [(ids[max(0, e - c - 1):e], e - s) for s in range(1, len(ids), c) for e in [min(s + c, len(ids))]]
            out.append(sum(score for score, _ in self.score(windows)))
        return out

    def generate_until(self, requests) -> list[str]:
        """The continuation of each request's context (`args`: context, gen_kwargs), cut at `until`.
        Requests asking alike (stop strings, max_gen_toks, temperature) decode together, `rows` at a
        time, longest first; a row's tokens never depend on the others in its batch, so each answer is
        the one it gets alone. A sampled request decodes alone: its draw would depend on its slot."""
        out, asks = [""] * len(requests), {}
        for i, request in enumerate(requests):
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            ids = (self.encode(context) or [self.eos])[-(self.context - 1):]
            asks.setdefault((until, int(kwargs.get("max_gen_toks", 256)), temperature), []).append((i, ids))
        for (until, new, temperature), members in asks.items():
            members.sort(key=lambda m: -len(m[1]))  # like lengths share a prompt bucket
            size = self.rows if temperature == 0 else 1
            for lo in range(0, len(members), size):
                part = members[lo:lo + size]
                limits = [max(1, min(new, self.context - len(ids))) for _, ids in part]  # within the context
                prompts = [ids for _, ids in part] + [part[0][1]] * (size - len(part))  # one row count: one program
                rows = self.decoder.generate(prompts, max(limits), Sampling(temperature=temperature)).tokens
                for (i, _), tokens, limit in zip(part, rows, limits):
                    text = self.tokenizer.decode(tokens[:limit])
                    out[i] = text[:min((text.find(s) for s in until if s and s in text), default=len(text))]
        return out


if register_model is not None:
    register_model("boost_jax")(BoostLM)


def scores(model, plan, tokens, at, targets, count) -> tuple[jax.Array, jax.Array]:
    """Per row of `tokens` [B, S]: the summed log-probability of `targets` [B, K] as predicted at
    positions `at` [B, K] (a row's first `count` [B] of them), and whether each is the greedy choice.
    The head runs at those K positions alone, and only the [B] sums and flags leave the devices: the
    whole [B, S, V] fp32 log-softmax read back on the host was ~2 GB per call at llama-7b."""
    h = model.hidden(tokens, plan=plan)
    logits = model.logits(jnp.take_along_axis(h, at[:, :, None], axis=1), plan)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[:, :, None], axis=-1)[:, :, 0]
    asked = jnp.arange(at.shape[1]) < count[:, None]
    return jnp.where(asked, picked, 0.0).sum(-1), jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~asked, axis=-1)


def positive_batch_size(value) -> int:
    """--batch_size (or BoostLM's batch_size): a whole number of rows, at least 1."""
    try:
        rows = int(str(value))
    except ValueError:
        rows = 0
    if rows < 1:
        raise ConfigError(f"--batch_size must be a whole number of rows, at least 1, got {value!r} (lm-eval's "
                          "'auto' is not supported: the rows are padded to the data-parallel split)")
    return rows


def check_harness_args(harness_args: Sequence[str]) -> None:
    """lm-eval's flags that would end in a traceback of its own, named before the harness starts:
    --tasks missing (unless a --config file gives them), an --include_path that is not a folder, a
    --limit that is not a count or a fraction of the examples, a --batch_size that is not a row count."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tasks", "-t", nargs="+")
    p.add_argument("--config", "-C")
    p.add_argument("--include_path")
    p.add_argument("--limit", "-L")
    p.add_argument("--batch_size", "-b")
    a, _ = p.parse_known_args(harness_args)
    if not a.tasks and a.config is None:
        raise ConfigError("--tasks is missing: name the lm-eval tasks to run (--tasks hellaswag,arc_easy; "
                          "`lm-eval ls tasks` lists them, --include_path DIR adds local ones)")
    if a.include_path is not None and not Path(a.include_path).is_dir():
        raise ConfigError(f"--include_path {a.include_path}: no such folder (it names a folder of task YAML files)")
    if a.limit is not None:
        check_limit(a.limit)
    if a.batch_size is not None:
        positive_batch_size(a.batch_size)


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
    """lm-eval's own command line on `argv`; a task it does not know named in one message."""
    from lm_eval.__main__ import cli_evaluate  # optional: lm_eval (the eval extra)

    saved, sys.argv = sys.argv, argv
    try:
        cli_evaluate()
    except ValueError as e:  # lm-eval (0.4.13) names an unknown task only in a ValueError of its own
        if isinstance(e, ConfigError) or not str(e).startswith("Tasks not found"):
            raise
        missing = str(e).split(":", 1)[-1].strip()
        raise ConfigError(f"--tasks: lm-eval has no task {missing} (`lm-eval ls tasks` lists them; --include_path "
                          "DIR adds a folder of local task YAML files)") from None
    finally:
        sys.argv = saved


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
    check_harness_args(harness_args)
    read_config(a.run_dir, overrides, decoding=True)  # a run dir and its overrides, named before the harness starts
    if register_model is None:
        raise PackageError("python -m boost_jax.lm_eval needs lm-eval: pip install -e \".[eval]\" (or pip install lm-eval)")
    model_args = {"run_dir": str(a.run_dir), "overrides": overrides, **({} if a.step is None else {"step": a.step})}
    run_harness(["lm-eval", "run", "--model", "boost_jax", "--model_args", json.dumps(model_args), *harness_args])


if __name__ == "__main__":
    main()
