"""python -m boost_jax.data prepare SOURCE... --out DIR [flags]: make a prepared dataset.

SOURCE: text files (one document each), .jsonl / .jsonl.gz / .jsonl.zst (one per line) and .parquet
files (one per row), directories (searched recursively) or globs. Train with it:
python -m boost_jax.train data.source=prepared data.path=DIR. Instruction rows (--format chat or
prompt_completion, with the model's --tokenizer and --seq-len) are encoded with their targets into
a prepared instruction dataset, read the same way with data.format set.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from boost_jax.config import DataConfig
from boost_jax.runtime.cli import DEBUG_HELP, at_least, run_main
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.paths import check_writable_dir


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m boost_jax.data", description=__doc__.split("\n\n")[1],
                                epilog=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("prepare", help="tokenize a corpus into memory-mapped token shards")
    q.add_argument("sources", nargs="+", metavar="SOURCE")
    q.add_argument("--out", required=True, type=Path, help="the dataset dir (rerun to finish an interrupted one)")
    q.add_argument("--vocab-size", type=int, default=32000, help="tokens of the trained tokenizer")
    q.add_argument("--tokenizer", default="", metavar="PATH", help="an existing tokenizer.json instead of training one")
    q.add_argument("--tokenizer-kind", default="bpe", choices=["bpe", "byte_bpe", "sentencepiece"],
                   help="what to train (sentencepiece: bpe with merges learned by SentencePiece's trainer; "
                        "pip install 'boost_jax[sentencepiece]')")
    q.add_argument("--text-key", default="text", help="field of .jsonl lines / column of Parquet files")
    q.add_argument("--val-fraction", type=float, default=DataConfig.val_fraction,
                   help="share of documents held out (by text hash; the default is data.val_fraction's)")
    q.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encode processes (1 = in process)")
    q.add_argument("--max-bytes", type=int, default=0, help="stop after this many bytes of text (0 = all)")
    q.add_argument("--sample-mb", type=int, default=64, help="text the tokenizer is trained on")
    q.add_argument("--shard-mb", type=int, default=512, help="text per shard (and per unit of resume)")
    q.add_argument("--skip-bad-lines", action="store_true", help="pass over malformed .jsonl lines, counted")
    q.add_argument("--no-progress", action="store_true")
    q.add_argument("--format", default="text", choices=["text", "chat", "prompt_completion"],
                   help="chat: rows of messages [{role, content}]; prompt_completion: rows of prompt and completion "
                        "(both need --tokenizer, the model's, and --seq-len); text: documents (--text-key)")
    q.add_argument("--chat-template", default="", metavar="FILE",
                   help="--format chat: a Jinja template instead of the tokenizer's own; chatml = the shipped one")
    q.add_argument("--seq-len", type=int, default=0, help="instruction rows: train.seq_len of the runs that read it "
                   "(a row must fit a window of seq_len + 1 tokens)")
    q.add_argument("--loss-on", default="completion", choices=["completion", "all"],
                   help="instruction rows: the targets (train.loss_on of the runs that read it)")
    q.add_argument("--truncate", default="none", choices=["none", "right", "drop"],
                   help="instruction rows: a row longer than a window is refused, cut to its start, or left out")
    a = p.parse_args(argv)
    if a.format != "text":
        return _prepare_instruct(a)
    if a.chat_template or a.seq_len:
        raise ConfigError("--chat-template and --seq-len are for instruction rows (--format chat / prompt_completion)")
    _prepare(a)


def _prepare_instruct(a: argparse.Namespace) -> None:
    """Instruction rows into a prepared instruction dataset (data/instruct.py)."""
    from boost_jax.data.corpus import expand  # lazy: keeps --help free of numpy and tokenizers
    from boost_jax.data.instruct import Recipe, chat_tokens, is_prepared, prepare_instruct  # lazy: as above
    from boost_jax.data.tokenizer import load_tokenizer  # lazy: keeps --help free of tokenizers

    if not a.tokenizer:
        raise ConfigError(f"--format {a.format} fine-tunes a model: --tokenizer names its tokenizer.json")
    if a.seq_len < 1:
        raise ConfigError(f"--format {a.format} packs rows whole into windows: --seq-len (train.seq_len) is needed")
    if a.chat_template and a.format != "chat":
        raise ConfigError("--chat-template is read only with --format chat")
    if not 0 <= a.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {a.val_fraction}")
    check_writable_dir(a.out, "--out")
    if is_prepared(a.out):
        raise ConfigError(f"--out {a.out} already holds a prepared instruction dataset; choose another folder")
    if a.out.exists() and any(a.out.iterdir()):
        raise ConfigError(f"--out {a.out} is not empty; choose an empty or new folder")
    tok = load_tokenizer(Path(a.tokenizer).expanduser())
    chat = chat_tokens(tok, a.tokenizer, a.chat_template) if a.format == "chat" else None
    recipe = Recipe(a.format, a.loss_on == "completion", a.seq_len + 1, a.truncate, a.val_fraction, a.chat_template)
    if a.out.exists():
        a.out.rmdir()  # empty: the dataset is made beside it and renamed into place
    stats = prepare_instruct(expand(a.sources), a.out, tok, chat, recipe)
    for split in ("train", "val"):
        print(f"{split}: {stats[f'{split}_documents']:,} rows, {stats[f'{split}_tokens']:,} tokens, "
              f"{stats[f'{split}_targets']:,} targets")
    print(f"{stats['truncated_rows']:,} truncated, {stats['dropped_rows']:,} dropped | {a.out}")


def _prepare(a: argparse.Namespace) -> None:
    from boost_jax.data.corpus import files_corpus  # lazy: keeps --help free of numpy and tokenizers
    from boost_jax.data.prepare import PrepareConfig, prepare  # lazy: keeps --help free of numpy and tokenizers
    from boost_jax.data.tokenizer import MAX_TRAINED_VOCAB, MIN_TRAINED_VOCAB  # lazy: keeps --help free of tokenizers

    if not 0 <= a.val_fraction < 1:  # nan included
        raise ConfigError(f"--val-fraction must be in [0, 1), got {a.val_fraction}")
    at_least(a, workers=1, shard_mb=1, sample_mb=1, max_bytes=0)
    if not a.tokenizer and not MIN_TRAINED_VOCAB <= a.vocab_size <= MAX_TRAINED_VOCAB:
        raise ConfigError(f"--vocab-size must be in {MIN_TRAINED_VOCAB}..{MAX_TRAINED_VOCAB:,} (3 special + 256 byte tokens + merges), "
                          f"got {a.vocab_size}")
    check_writable_dir(a.out, "--out")
    cfg = PrepareConfig(
        vocab_size=a.vocab_size, tokenizer=a.tokenizer_kind, tokenizer_path=a.tokenizer, val_fraction=a.val_fraction,
        sample_bytes=a.sample_mb << 20, chunk_bytes=a.shard_mb << 20, workers=a.workers, progress=not a.no_progress,
        need_val=a.val_fraction > 0,
    )
    warnings.showwarning = lambda message, *_, **__: print(f"warning: {message}", file=sys.stderr)
    done = prepare(files_corpus(a.sources, a.text_key, a.max_bytes, a.skip_bad_lines), a.out, cfg)
    ix = done.index
    for split in ("train", "val"):
        print(f"{split}: {ix.tokens(split):,} tokens, {ix.documents(split):,} documents, "
              f"{len(ix.splits[split])} shards")
    print(f"vocab {ix.vocab_size:,} ({ix.dtype}) | {a.out}")
    if done.encoded_bytes:
        print(f"encoded {done.encoded_bytes / 1e6:,.1f} MB in {done.seconds:.1f}s: "
              f"{done.encoded_bytes / 1e6 / done.seconds:,.2f} MB/s, {done.encoded_tokens / done.seconds:,.0f} tokens/s")
    else:
        print("already prepared: nothing to do")
    if done.skipped.lines:
        print(f"skipped {done.skipped.lines:,} malformed lines (first: {', '.join(done.skipped.first)})")


if __name__ == "__main__":
    main()
