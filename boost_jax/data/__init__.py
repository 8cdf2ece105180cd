"""The data pipeline: documents -> tokenizer -> packed token windows -> deterministic batches.

    data = build_data(cfg.data, vocab_size=..., seq_len=..., seed=...)
    batch = data.train.batch(step, batch_size)              # {"inputs", "targets"}: int32 [B, S]
    evals = data.val.eval_batches(n, batch_size) if data.val else []
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenizers import Tokenizer

from boost_jax.config import DataConfig
from boost_jax.data.cache import cache_root
from boost_jax.data.corpus import Document, corpus_fingerprint, load_documents, split_documents
from boost_jax.data.loader import Batch, PackedDataset, encode_documents
from boost_jax.data.tokenizer import eos_id, get_tokenizer

__all__ = [
    "Batch", "Data", "Document", "PackedDataset", "build_data", "corpus_fingerprint",
    "encode_documents", "eos_id", "get_tokenizer", "load_documents", "split_documents",
]


@dataclass(frozen=True)
class Data:
    tokenizer: Tokenizer
    train: PackedDataset
    val: PackedDataset | None  # None when data.val_fraction = 0
    eos_id: int
    stats: dict[str, float]  # sizes and seconds spent, for the caller to log


def build_data(cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int) -> Data:
    """Load, split, tokenize (training the tokenizer on the train split only) and pack. Every
    expensive step is cached on disk, so a second run with the same inputs takes a fraction of
    the time. Prints nothing."""
    t0 = time.perf_counter()
    docs = load_documents(cfg)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    t1 = time.perf_counter()
    tok = get_tokenizer(cfg, vocab_size, train_docs, corpus_fingerprint(train_docs))
    t2 = time.perf_counter()
    train_tokens = encode_documents(train_docs, tok, cache_root(cfg))
    val_tokens = encode_documents(val_docs, tok, cache_root(cfg)) if val_docs else None
    t3 = time.perf_counter()
    stats: dict[str, float] = {
        "documents": len(docs),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "bytes": sum(len(d.text.encode()) for d in docs),
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": len(train_tokens),
        "val_tokens": 0 if val_tokens is None else len(val_tokens),
        "load_seconds": t1 - t0,
        "tokenizer_seconds": t2 - t1,
        "encode_seconds": t3 - t2,
    }
    return Data(
        tokenizer=tok,
        train=PackedDataset(train_tokens, seq_len, seed=seed, name="train"),
        val=None if val_tokens is None else PackedDataset(val_tokens, seq_len, seed=seed, name="val"),
        eos_id=eos_id(tok),
        stats=stats,
    )
