"""python -m boost_jax.generate RUN_DIR (--prompt TEXT | --prompts-file FILE) [--step N] [--max-new-tokens N]
[--chat] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--cache auto|full|latent_v|latent] [section.key=value ...]
[--json]

Continues text with a trained run's model (its newest checkpoint, or --step), tokenized by the run's
own tokenizer. One --prompt streams its continuation to stdout as it is produced; --prompts-file
takes one prompt per line (a batch: prompts of different lengths are decoded together, each row
stopping at the end-of-document token). --chat makes each prompt one user turn of a chat, rendered by
the run's chat template (data.chat_template, else the template beside its tokenizer) with the
assistant's opening, each reply stopping at the template's end-of-turn token. --json prints one object: prompts, the new token ids and
texts, and timings (prefill and decode tokens/s). The overrides are the train config's: the layout
(`parallel.tp=2 parallel.dp=1`; decoding runs with parallel.pp=1) or how the model computes
(`model.dtype=bfloat16`); a key that would change what the parameters mean is refused. A prompt plus
--max-new-tokens longer than the context the model was trained on (train.seq_len) is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from boost_jax.config.archs import AUTO_CACHE, CACHE_KINDS
from boost_jax.runtime.cli import run_dir_args, run_dir_parser, run_main
from boost_jax.runtime.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    """The command line (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    p = run_dir_parser("python -m boost_jax.generate", __doc__)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="one prompt (its continuation is streamed)")
    given.add_argument("--prompts-file", type=Path, help="a UTF-8 text file, one prompt per line")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is one user turn, rendered by the run's chat template with the assistant's "
                        "opening; the reply stops at the template's end-of-turn token")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timings", action="store_true", help="print on stderr the seconds to the first token, by "
                   "phase: import, data, restore, compile, run (--json has them always)")
    p.add_argument("--cache", default=AUTO_CACHE, choices=[AUTO_CACHE, *CACHE_KINDS],
                   help="auto (default): the kind whose decode step a roofline of the device models fastest for this "
                        "model and layout (printed with why); full: keys and values; latent_v: keys and v's rank-r "
                        "latent; latent: both latents, absorbed with model.attn_rope_dims (low-rank archs; "
                        "layers/kv_cache.py)")
    a = run_dir_args(p, argv)
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {a.max_new_tokens}")
    from boost_jax.model.decode import Sampling  # lazy: keeps --help free of JAX

    a.sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed)  # checks --temperature, --top-k, --top-p
    return a


def read_prompts(a: argparse.Namespace) -> list[str]:
    if a.prompt is not None:
        prompts = [a.prompt]
    else:
        try:
            raw = a.prompts_file.read_bytes()
        except OSError as e:
            raise ConfigError(f"--prompts-file {a.prompts_file}: cannot read it ({e.strerror})") from None
        if b"\0" in raw:
            raise ConfigError(f"--prompts-file {a.prompts_file}: not a text file (it holds NUL bytes)")
        try:
            prompts = [line for line in raw.decode("utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError as e:
            raise ConfigError(f"--prompts-file {a.prompts_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if a.prompt is None and not prompts:
        raise ConfigError(f"--prompts-file {a.prompts_file}: holds no prompt (one per non-empty line)")
    if not prompts or any(not p for p in prompts):
        raise ConfigError("--prompt is empty: a continuation needs some text to continue")
    return prompts


def _main(argv: list[str]) -> None:
    a = parse(argv)
    prompts = read_prompts(a)
    from boost_jax.launch.startup import Startup, line  # lazy: keeps --help free of JAX

    startup = Startup()  # its import phase is the process's age: the flags' checks count in it
    from boost_jax.model.decode import Decoder, choose_cache  # lazy: keeps --help free of JAX
    from boost_jax.model.run_dir import open_run  # lazy: keeps --help free of JAX

    startup.lap("import")
    # The run dir and its config.yaml first: what a damaged one names. Decoding keeps glibc's
    # defaults (launch/host_memory.py).
    run = open_run(a.run_dir, a.config, decoding=True, prepare=True, reuse_memory=False)
    cfg = run.cfg
    if not (a.run_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{a.run_dir} has no tokenizer.json (a run writes it after its first step)")
    plan, tok = run.plan, run.tokenizer
    if a.chat:  # the template's rendering (its control tokens parsed) and its end-of-turn stops
        ids = [run.chat.encode([{"role": "user", "content": p}], True, f"prompt {i}") for i, p in enumerate(prompts)]
        stops = run.chat.stop_ids
    else:
        ids, stops = [tok.encode(p).ids for p in prompts], run.eos
    if empty := [i for i, x in enumerate(ids) if not x]:
        raise ConfigError(f"prompt {empty[0]} encodes to no tokens")
    startup.lap("data")
    # The parameters read straight onto the plan; the decoder keeps them (no other copy is held).
    model, step = run.model(a.step)
    decoder = Decoder(model, plan, cache=a.cache, eos_id=stops)
    del model
    cache = {"cache": decoder.cache_name, "cache_auto": a.cache == AUTO_CACHE}
    if a.cache == AUTO_CACHE:  # one line saying what auto chose and why
        choice = choose_cache(cfg.model, plan)
        cache.update(cache_bytes_per_token=choice.bytes_per_token, cache_step_us=choice.step_us)
        print(f"cache: {choice.why()}", file=sys.stderr)
    startup.lap("restore")
    streaming = len(prompts) == 1 and not a.json
    shown = [""]

    def stream(rows):  # print the new text as it comes (decoding all so far: merges change bytes)
        text = tok.decode(rows[0])
        sys.stdout.write(text[len(shown[0]):] if text.startswith(shown[0]) else "\n" + text)
        sys.stdout.flush()
        shown[0] = text

    first: dict[str, float] = {}  # the start-up's seconds, taken at the first token

    def on_tokens(rows):
        if not first:
            startup.lap("run")
            first.update(startup.seconds())
        if streaming:
            stream(rows)

    if streaming and not a.chat:  # a chat shows the reply alone
        sys.stdout.write(prompts[0])
    out = decoder.generate(ids, a.max_new_tokens, a.sampling, max_len=cfg.train.seq_len, on_tokens=on_tokens)
    texts = [tok.decode(t) for t in out.tokens]
    if a.json:
        print(json.dumps({"run_dir": str(a.run_dir), "step": step, **cache, "prompts": prompts,
                          "prompt_ids": ids, "tokens": out.tokens, "texts": texts, **out.timings(),
                          "startup_s": first}, indent=1))
    elif streaming:
        print()  # the continuation was streamed
    else:
        for prompt, text in zip(prompts, texts):
            print(f"{prompt}\n> {text}\n" if a.chat else f"{prompt}{text}\n")
    if a.timings:
        print(line(first, "first token"), file=sys.stderr)


if __name__ == "__main__":
    main()
