"""A boost_jax run dir's checkpoint as an lm-evaluation-harness model (`BoostLM`, registered as
"boost_jax" when lm-eval is installed): what `python -m boost_jax.lm_eval` runs lm-eval's command on,
and what a study scores its downstream tasks with (comparison/tasks.py). From Python:
`lm_eval.simple_evaluate(model=BoostLM(run_dir="runs/default", overrides=["parallel.tp=2"]), tasks=[...])`.

The three requests the harness makes, each answered from the model's own forward on the run's layout
(`section.key=value` overrides of its config.yaml choose it, as for `eval` and `generate`):
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

The class works without lm-eval installed (tests drive it with plain request objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boost_jax.config import from_dict
from boost_jax.model.decode import Decoder, Sampling, bucket
from boost_jax.model.run_dir import Run, open_run
from boost_jax.runtime.errors import ConfigError

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
                 overrides: Sequence[str] | str = (), config: dict | None = None, **harness):
        """`overrides`: `section.key=value` strings (or one string of them separated by spaces, as
        lm-eval's `--model_args ...,overrides=parallel.tp=2 parallel.dp=1` passes them). `config`: the
        run's config as a command already read and checked it (`Config.to_dict()`, JAX prepared from
        it), in place of reading run_dir's config.yaml again. Any other argument but the harness's own
        (HARNESS_KEYS) is refused by name: a misspelt one would be lost."""
        if unknown := [k for k in harness if k not in HARNESS_KEYS]:
            raise ConfigError(f"BoostLM: no model argument {unknown[0]!r} (the arguments: run_dir, step, "
                              "batch_size, overrides, config)")
        batch_size = positive_batch_size(batch_size)
        super().__init__()
        overrides = overrides.split() if isinstance(overrides, str) else list(overrides)
        if config is not None and overrides:
            raise ConfigError("BoostLM: overrides apply to run_dir's config.yaml; a `config` given is the config")
        # decoding's scoring: glibc's defaults
        run = Run(Path(run_dir), from_dict(config)) if config is not None else \
            open_run(run_dir, overrides, decoding=True, prepare=True, reuse_memory=False)
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
