"""Prepared datasets written directly (no corpus, no encode): random ids over a word-level vocab.
For measuring the loader at sizes no test corpus reaches (10^9 tokens) and for exact-content tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models

from boost_jax.data.shards import TOKENIZER, Index, Shard, shard_name, token_dtype, write_index
from boost_jax.data.tokenizer import SPECIALS, tokenizer_hash

_BLOCK = 1 << 24  # tokens generated at a time: memory stays flat however large the dataset


def write_synthetic(directory: Path, shard_tokens: list[int], vocab_size: int, seed: int = 0) -> Index:
    """Train shards of the given sizes (val empty) of uniform random ids in [0, vocab_size)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.save(str(directory / TOKENIZER))
    dtype, rng = token_dtype(vocab_size), np.random.default_rng(seed)
    shards = []
    for i, n in enumerate(shard_tokens):
        top = -1
        with open(directory / shard_name("train", i), "wb") as f:
            for lo in range(0, n, _BLOCK):
                block = rng.integers(0, vocab_size, min(_BLOCK, n - lo), dtype=dtype)
                top = max(top, int(block.max()))
                f.write(block.tobytes())
        shards.append(Shard(shard_name("train", i), n, 0, top))
    index = Index(dtype=dtype.name, vocab_size=vocab_size, eos_id=SPECIALS.index("<eos>"),
                  tokenizer_sha256=tokenizer_hash(Tokenizer.from_file(str(directory / TOKENIZER))),
                  source_fingerprint="synthetic", recipe={"synthetic_seed": seed},
                  splits={"train": shards, "val": []}, stats={"skipped_lines": 0})
    write_index(directory, index)
    return index
