"""The prepared-dataset format: raw token shards and one JSON index, checked against each other.

    DIR/index.json        format, dtype, vocab, eos, tokenizer hash, source fingerprint, recipe, splits
    DIR/tokenizer.json    the tokenizer the ids belong to
    DIR/train-00000.bin   little-endian uint16 (vocab <= 65536) or uint32 token ids, each document
    DIR/val-00000.bin     followed by <eos>; shard i of both splits comes from input chunk i

Raw arrays (not .npy) so any tool can np.memmap them; the index is the only header.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from boost_jax.runtime.cache import atomic_write
from boost_jax.runtime.errors import DataError

INDEX, TOKENIZER = "index.json", "tokenizer.json"
SPLITS = ("train", "val")
FORMAT = 1  # bump whenever the layout above changes


@dataclass(frozen=True)
class Shard:
    file: str  # relative to the dataset dir
    tokens: int
    documents: int
    max_id: int  # the largest id in the shard (-1 if empty): checked against the vocab at open


@dataclass(frozen=True)
class Index:
    dtype: str  # "uint16" | "uint32"
    vocab_size: int  # of the tokenizer
    eos_id: int
    tokenizer_sha256: str
    source_fingerprint: str
    recipe: dict[str, object]  # the prepare settings the shards depend on
    splits: dict[str, list[Shard]]
    stats: dict[str, int]  # documents, text bytes, skipped lines: for reports, not checks
    format: int = FORMAT

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits[split])

    def documents(self, split: str) -> int:
        return sum(s.documents for s in self.splits[split])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(split: str, chunk: int) -> str:
    return f"{split}-{chunk:05d}.bin"


def write_index(directory: Path, index: Index) -> None:
    text = json.dumps(asdict(index), indent=1, sort_keys=True).encode()
    atomic_write(directory / INDEX, lambda f: f.write(text))


def read_index(directory: Path) -> Index:
    """The index of a prepared dataset, after checking every shard it lists is there at its size."""
    path = directory / INDEX
    if not path.is_file():
        raise DataError(f"{directory} is not a prepared dataset (no {INDEX}); make one with "
                        "python -m boost_jax.data prepare SOURCE... --out DIR")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise DataError(f"{path} has format {raw.get('format')!r}, this version reads {FORMAT}; "
                            "prepare the dataset again")
        raw["splits"] = {k: [Shard(**s) for s in v] for k, v in raw["splits"].items()}
        index = Index(**raw)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise DataError(f"{path} is not a valid index ({type(e).__name__}: {e})") from None
    if index.dtype not in ("uint16", "uint32") or set(index.splits) != set(SPLITS):
        raise DataError(f"{path}: dtype {index.dtype!r} or splits {sorted(index.splits)} not understood")
    itemsize = np.dtype(index.dtype).itemsize
    for shard in (s for split in SPLITS for s in index.splits[split]):
        f = directory / shard.file
        size = f.stat().st_size if f.is_file() else None
        if size != shard.tokens * itemsize:
            raise DataError(
                f"{f} does not match {path}: expected {shard.tokens * itemsize:,} bytes "
                f"({shard.tokens:,} {index.dtype} tokens), found "
                f"{'no file' if size is None else f'{size:,} bytes'}; prepare the dataset again"
            )
    return index


def verify_ids(directory: Path, index: Index, chunk: int = 1 << 24) -> None:
    """Read every shard (in chunks, not mapped, so memory stays flat) and check each id is below the
    tokenizer's vocab_size and the recorded max_id: an altered shard is refused, never trusted."""
    for shard in (s for split in SPLITS for s in index.splits[split]):
        top = -1
        with open(directory / shard.file, "rb") as f:
            while len(block := np.fromfile(f, dtype=index.dtype, count=chunk)):
                top = max(top, int(block.max()))
        if top != shard.max_id or top >= index.vocab_size:
            raise DataError(f"{directory / shard.file}: largest token id {top}, the index records "
                            f"{shard.max_id} below vocab_size={index.vocab_size}; prepare the dataset again")
