"""The Python API for notebooks and scripts. Every function checks its arguments and raises the
project's errors (`boost_jax.runtime.errors`: ConfigError, CheckpointError, ...) with a message naming the
argument, not a failure deep inside JAX.

    from boost_jax import api
    cfg = api.config("llama-tiny", "model.arch=cola")        # a preset name or a YAML path, plus overrides
    model = api.build_model(cfg)                              # a Flax NNX module, initialised from train.seed
    logits = api.forward(model, tokens)                       # int[B, S] -> fp32 [B, S, vocab], on one device
    cfg, model, step = api.restore("runs/default")            # newest checkpoint of a run dir (its parameters only)
    out = api.generate(model, [[5, 9, 31]], max_new_tokens=32)   # token ids in, new token ids out
    texts = api.generate_text(model, tokenizer, ["def main("], max_new_tokens=32)
    replies = api.generate_chat(model, api.restore_chat("runs/chat"), ["What is 2 + 3?"], max_new_tokens=32)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from boost_jax.config import Config, ConfigError, from_dict, raw_config
from boost_jax.config.presets import PRESETS
from boost_jax.data.chat import ChatTokens, check_turns
from boost_jax.data.instruct import chat_tokens
from boost_jax.data.tokenizer import eos_id as eos_id_of  # `generate` has an argument eos_id
from boost_jax.model import Model
from boost_jax.model.decode import Decoder, Sampling
from boost_jax.model.run_dir import open_run, read_config
from boost_jax.parallel import Plan, single_device_plan
from boost_jax.runtime.errors import (  # noqa: F401 -- the errors a caller catches, importable from here
    BoostJaxError,
    CheckpointError,
    DataError,
    DiskFullError,
    DivergenceError,
    PackageError,
)


def config(base: str | Path | None = None, *overrides: str) -> Config:
    """A config from a preset name (`"llama-7b"`) or a YAML file, then `key=value` overrides, read as
    `python -m boost_jax.train` reads them (with `train.init_from`, the model keys are the source's)."""
    if base is not None and not isinstance(base, (str, Path)):
        raise ConfigError(f"api.config: base must be a preset name or a YAML path, got {type(base).__name__}")
    if bad := [o for o in overrides if not isinstance(o, str)]:
        raise ConfigError(f"api.config: each override is a 'section.key=value' string, got {bad[0]!r}")
    if base is not None and str(base) in PRESETS:
        base, overrides = None, (f"model.preset={base}", *overrides)
    elif base is not None and not Path(base).is_file():
        raise ConfigError(f"{str(base)!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file")
    raw = raw_config(base, overrides)
    if (raw.get("train") or {}).get("init_from"):
        from boost_jax.training.importer import with_source_model  # lazy: the importer brings the optimizer

        raw = with_source_model(raw)
    return from_dict(raw)


def build_model(cfg: Config) -> Model:
    """The model of `cfg`, its parameters initialised from `train.seed`."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"api.build_model takes a Config (api.config(...)), got {type(cfg).__name__}")
    return Model(cfg.model, rngs=nnx.Rngs(cfg.train.seed))


def forward(model: Model, tokens: jax.Array, plan: Plan | None = None) -> jax.Array:
    """Logits of `model` run under `plan`; None runs it on one device (`single_device_plan`)."""
    _check_model(model, "api.forward")
    tokens = _check_tokens(tokens, model.cfg.vocab_size)
    if plan is not None and not isinstance(plan, Plan):
        raise ConfigError(f"api.forward: plan must be a Plan (parallel.make_plan) or None, got {type(plan).__name__}")
    plan = plan or single_device_plan(model.cfg)
    graphdef, state = nnx.split(model)
    # On the plan's layout, wherever they were (a parameter replaced by a jitted update comes back
    # committed to its own layout, and another layout would be another program).
    params = jax.device_put(nnx.to_pure_dict(state), plan.named(plan.param_specs(state)))
    run = _kept(model, ("forward", graphdef, plan),
                lambda: jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens, plan=plan)))
    return run(params, tokens)


def restore(run_dir: str | Path, step: int | None = None, overrides: Sequence[str] = (),
            plan: Plan | None = None) -> tuple[Config, Model, int]:
    """(config, model with the checkpoint's parameters, step) from a run dir, its parameters laid out
    for `plan` (None: one device). Only the parameters are read (`weights.restore_params`).
    `overrides` (`section.key=value`) may change anything but what the parameters mean (a
    `model.*` key outside checkpoint.COMPUTE_ONLY): e.g. model.dtype=bfloat16, parallel.tp=2."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ConfigError(f"api.restore: step must be a checkpoint's step (an int >= 0) or None, got {step!r}")
    if isinstance(overrides, str):
        raise ConfigError("api.restore: overrides is a list of 'section.key=value' strings, not one string")
    if plan is not None and not isinstance(plan, Plan):
        raise ConfigError(f"api.restore: plan must be a Plan (parallel.make_plan) or None, got {type(plan).__name__}")
    run = open_run(run_dir, overrides)
    model, step = run.model(step, plan or single_device_plan(run.cfg.model, run.cfg.parallel.scheme))
    return run.cfg, model, step


def run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """A run dir's config (its config.yaml, then `overrides`), after checking it is a run dir; an
    override that changes what the parameters mean is refused (model/run_dir.py's `read_config`)."""
    return read_config(run_dir, overrides)


# The positions a row of api.generate may reach when no max_len is given: a bound on its KV cache.
MAX_POSITIONS = 32768


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, plan: Plan | None = None, cache: str = "auto",
             eos_id: int | Sequence[int] | None = None, max_len: int | None = None) -> list[list[int]]:
    """Each prompt's (token ids) continuation: up to `max_new_tokens` new ids, a row stopping at
    `eos_id` (or any of several: a chat template's stop ids; not returned). Greedy at temperature 0, else
    sampled (top-k, top-p), reproducible from `seed`. `plan` None: one device. `cache`: auto (the kind whose
    decode step a roofline of the device models fastest for the model and plan, model/decode.choose_cache),
    full (keys and values), latent_v or latent (the rank-r latents of v, or of k and v: low-rank archs; with
    model.attn_rope_dims, k's latents absorbed, plus the rotary keys). `max_len`: the positions a row may reach (prompt + new), refused
    past it, as the command line refuses past train.seq_len (api.restore's cfg.train.seq_len);
    None: MAX_POSITIONS. The first call on a model (per plan, cache and eos_id) compiles
    its programs and lays out a copy of its parameters at the compute dtype; both are kept with the
    model until it is garbage-collected, so later calls compile only for a new shape bucket or
    sampling mode, and a parameter replaced since (`nnx.update`, an optimizer step) is laid out again."""
    _check_model(model, "api.generate")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or any(
            isinstance(p, (str, bytes)) or not isinstance(p, Sequence) for p in prompts):
        raise ConfigError("api.generate: prompts is a list of token-id lists ([[5, 9, 31], ...]); for text use "
                          "api.generate_text")
    for i, p in enumerate(prompts):
        if p:
            try:
                _check_tokens([p], model.cfg.vocab_size)
            except ConfigError as e:
                raise ConfigError(f"api.generate: prompts[{i}]: {e}") from None
    limit = MAX_POSITIONS if max_len is None else max_len
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"api.generate: max_len must be a positive int or None, got {max_len!r}")
    if isinstance(max_new_tokens, int) and prompts and max(map(len, prompts)) + max_new_tokens > limit:
        raise ConfigError(f"api.generate: the longest prompt ({max(map(len, prompts))} tokens) + max_new_tokens="
                          f"{max_new_tokens} is more than max_len={limit} positions"
                          + ("" if max_len else " (MAX_POSITIONS; pass max_len=cfg.train.seq_len, the context "
                                                "the model was trained on)"))
    plan = plan or single_device_plan(model.cfg)
    stops = eos_id if eos_id is None or np.ndim(eos_id) == 0 else tuple(eos_id)
    decoder = _kept(model, ("decode", nnx.graphdef(model), plan, cache, stops),
                    lambda: Decoder(model, plan, cache=cache, eos_id=stops))
    decoder.refresh(model)
    return decoder.generate(prompts, max_new_tokens, Sampling(temperature, top_k, top_p, seed)).tokens


def generate_text(model: Model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int, **kwargs) -> list[str]:
    """`generate` on texts: each prompt encoded by the (Hugging Face `tokenizers`) tokenizer, each
    continuation decoded; it stops at the tokenizer's end-of-document token."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError("api.generate_text: prompts is a list of strings; for token ids use api.generate")
    if not hasattr(tokenizer, "encode") or not hasattr(tokenizer, "decode"):
        raise ConfigError("api.generate_text: tokenizer must be a tokenizers.Tokenizer (a run dir's tokenizer.json)")
    ids = [tokenizer.encode(p).ids for p in prompts]
    out = generate(model, ids, max_new_tokens=max_new_tokens, eos_id=eos_id_of(tokenizer), **kwargs)
    return [tokenizer.decode(o) for o in out]


def chat_template(tokenizer, tokenizer_path: str | Path = "", template: str | Path = "") -> ChatTokens:
    """A chat template bound to `tokenizer` (a tokenizers.Tokenizer): `template` (a Jinja file, or
    "chatml" for the one shipped for a tokenizer without its own), else the template beside
    `tokenizer_path` (chat_template.jinja, or the chat_template of tokenizer_config.json). A run's
    own: api.restore_chat(run_dir)."""
    if not hasattr(tokenizer, "to_str"):
        raise ConfigError("api.chat_template: tokenizer must be a tokenizers.Tokenizer (a run dir's tokenizer.json)")
    return chat_tokens(tokenizer, str(tokenizer_path), str(template))


def restore_chat(run_dir: str | Path, *overrides: str) -> ChatTokens:
    """A run dir's chat template with its tokenizer (data.chat_template, else the template beside its
    tokenizer), as `generate --chat` renders it."""
    return open_run(Path(run_dir), list(overrides)).chat


def generate_chat(model: Model, chat: ChatTokens, conversations: Sequence[str | Sequence[dict]], *,
                  max_new_tokens: int, **kwargs) -> list[str]:
    """`generate` on chats: each conversation (a string: one user turn; or a list of {role, content})
    rendered by `chat`'s template with the assistant's opening (api.chat_template / api.restore_chat),
    each reply stopping at the template's end-of-turn token and decoded."""
    if not isinstance(chat, ChatTokens):
        raise ConfigError("api.generate_chat: chat must be api.chat_template(...) or api.restore_chat(run_dir)")
    if isinstance(conversations, str) or not isinstance(conversations, Sequence):
        raise ConfigError("api.generate_chat: conversations is a list, each a string (one user turn) or a list "
                          "of {role, content}")
    ids = []
    for i, c in enumerate(conversations):
        messages = [{"role": "user", "content": c}] if isinstance(c, str) else c
        ids.append(chat.encode(check_turns(messages, f"api.generate_chat: conversations[{i}]"), True,
                               f"api.generate_chat: conversations[{i}]"))
    out = generate(model, ids, max_new_tokens=max_new_tokens, eos_id=chat.stop_ids, **kwargs)
    return [chat.tokenizer.decode(o) for o in out]


# What the first call of forward/generate on a model compiled, kept for its later calls: a list of
# (key, program) per model, held weakly (it goes with the model); keys are compared with == (a Plan
# is not hashable).
_KEPT: weakref.WeakKeyDictionary[Model, list[tuple[tuple, object]]] = weakref.WeakKeyDictionary()


def _kept(model: Model, key: tuple, build: Callable[[], object]):
    """The program kept for `model` under `key`, built by `build()` on first use."""
    kept = _KEPT.setdefault(model, [])
    for k, program in kept:
        if k == key:
            return program
    kept.append((key, program := build()))
    return program


def _check_model(model, where: str) -> None:
    if not isinstance(model, Model):
        raise ConfigError(f"{where}: model must be a boost_jax Model (api.build_model or api.restore), "
                          f"got {type(model).__name__}")


def _check_tokens(tokens, vocab_size: int):
    """tokens as an int array [batch, seq] of ids in [0, vocab_size), checked where they are concrete
    (a traced array inside the caller's own jit is checked for its shape and type only)."""
    if isinstance(tokens, jax.core.Tracer):
        values = None
    else:
        values = np.asarray(tokens)
        tokens = values
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ConfigError(f"tokens must be [batch, seq] with at least one token, got shape {tuple(tokens.shape)} (a "
                          "single sequence: tokens[None])")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if values is not None and values.size and (values.min() < 0 or values.max() >= vocab_size):
        bad = int(values.min() if values.min() < 0 else values.max())
        raise ConfigError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return tokens
