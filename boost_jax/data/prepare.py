"""Corpus -> prepared dataset: tokenizer, then token shards encoded in parallel, then the index.

The document stream is cut into chunks of `chunk_bytes` of text, in input order; chunk i becomes
shards train-i.bin and val-i.bin. Cuts depend only on the input, so a rerun after an interruption
re-reads the stream but encodes only the chunks without a completion record in DIR/.parts/. A shard
is written under a temporary name and renamed when whole; its record is written after that, so a
half-written shard never looks complete. The index is written last: its presence means done.
Every file written depends only on the inputs and the recipe, not on --workers, hash seeds or
threads: two prepares of one corpus with one command are byte-identical, tokenizer included.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from boost_jax.config import DataConfig
from boost_jax.data import encode
from boost_jax.data.corpus import Corpus, Skipped, unit_hash
from boost_jax.data.shards import (
    INDEX,
    SPLITS,
    TOKENIZER,
    Index,
    Shard,
    read_index,
    shard_name,
    token_dtype,
    write_index,
)
from boost_jax.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash, train_tokenizer, trainer_id
from boost_jax.runtime.cache import atomic_write
from boost_jax.runtime.errors import DataError
from boost_jax.runtime.paths import disk_full, is_disk_full

_PARTS, _PLAN = ".parts", "plan.json"
_JOB_BYTES = 1 << 20  # text per encode job: big enough to amortise the hand-off to a worker


@dataclass(frozen=True)
class PrepareConfig:
    vocab_size: int = 32000
    tokenizer: Literal["bpe", "byte_bpe", "sentencepiece"] = "bpe"
    tokenizer_path: str = ""  # an existing tokenizer.json instead of training one
    val_fraction: float = DataConfig.val_fraction  # chance that a document goes to val, by a stable hash of its text
    sample_bytes: int = 64 << 20  # text the tokenizer is trained on: the first train documents
    chunk_bytes: int = 512 << 20  # text per shard pair (and per unit of resume)
    workers: int = 1  # encode processes; 1 = in this process (tokenizers still uses every core)
    progress: bool = False
    # Refuse a val_fraction > 0 that holds out no document (the prepare command's datasets are for
    # eval too; a run's own cache is not, and its eval checks its split). Not in the recipe.
    need_val: bool = False

    def recipe(self, tokenizer_sha256: str = "") -> dict[str, object]:
        """What the shards depend on: a different recipe is a different dataset."""
        return {"vocab_size": self.vocab_size, "tokenizer": self.tokenizer, "given_tokenizer": tokenizer_sha256,
                "val_fraction": self.val_fraction, "sample_bytes": self.sample_bytes,
                "chunk_bytes": self.chunk_bytes, "trainer": trainer_id(self.tokenizer)}


@dataclass
class Prepared:
    index: Index
    seconds: float  # this call
    encoded_bytes: int = 0  # text encoded by this call (0 when already prepared)
    encoded_tokens: int = 0
    skipped: Skipped = field(default_factory=Skipped)


def prepare(corpus: Corpus, out: Path, cfg: PrepareConfig) -> Prepared:
    """Prepare `corpus` into `out`, finishing an interrupted prepare of the same inputs; an `out`
    already done returns at once. A non-empty `out` holding anything else is refused, untouched. A
    full disk is one message: each shard is committed by rename, so a rerun finishes the prepare."""
    try:
        return _prepare(corpus, out, cfg)
    except Exception as e:  # a worker process's OSError comes back wrapped
        if not is_disk_full(e):
            raise
        raise disk_full(out, "the prepared dataset", corpus.size() * 2 // 3,  # ~3 bytes of text a token, 2 bytes each
                        "the shards finished are kept and a rerun of the same command goes on from them") from None


def resumes(corpus: Corpus, out: Path, cfg: PrepareConfig) -> bool:
    """`out` holds a prepare of these inputs and settings that stopped before its index: a rerun goes
    on from its shards."""
    return _saved_plan(out) == _plan(corpus, cfg, _given(cfg))


def _given(cfg: PrepareConfig) -> Tokenizer | None:
    return load_tokenizer(Path(cfg.tokenizer_path).expanduser()) if cfg.tokenizer_path else None


def _plan(corpus: Corpus, cfg: PrepareConfig, given: Tokenizer | None) -> dict:
    return {"source_fingerprint": corpus.fingerprint(), "recipe": cfg.recipe(tokenizer_hash(given) if given else "")}


def _saved_plan(out: Path) -> dict | None:
    """The plan an interrupted prepare left in `out` (None: none, or unreadable)."""
    try:
        return json.loads((out / _PARTS / _PLAN).read_text())
    except (OSError, ValueError):
        return None


def _prepare(corpus: Corpus, out: Path, cfg: PrepareConfig) -> Prepared:
    t0 = time.perf_counter()
    given = _given(cfg)
    plan = _plan(corpus, cfg, given)
    if (out / INDEX).is_file():
        index = read_index(out)
        if {"source_fingerprint": index.source_fingerprint, "recipe": index.recipe} != plan:
            raise DataError(f"{out} already holds a dataset prepared from other inputs or settings; "
                            "choose another --out (it was left untouched)")
        return Prepared(index, time.perf_counter() - t0)
    peek = Skipped()  # before anything is written: an empty corpus leaves no folder behind
    if next((d for d in corpus.documents(peek) if d.text.strip()), None) is None:
        raise DataError(f"the corpus ({len(corpus.files)} files: {', '.join(map(str, corpus.files[:3]))}"
                        f"{', ...' if len(corpus.files) > 3 else ''}) holds no documents with any text"
                        + (f"; {peek.lines} malformed lines were skipped" if peek.lines else ""))
    if cfg.need_val:
        _check_val(corpus, cfg.val_fraction)
    parts = out / _PARTS
    if (parts / _PLAN).exists():
        if _saved_plan(out) != plan:
            raise DataError(f"{out} holds an interrupted prepare of other inputs or settings; "
                            "delete it or choose another --out")
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"{out} is not empty and not a prepared dataset; choose another --out")
    else:
        parts.mkdir(parents=True)
        atomic_write(parts / _PLAN, lambda f: f.write(json.dumps(plan).encode()))

    tok = given or _tokenizer(corpus, out, cfg)
    dtype = token_dtype(tok.get_vocab_size())
    settings = encode.EncodeSettings(tok.to_str(), eos_id(tok), dtype.str, cfg.val_fraction)
    done = _records(out, dtype)
    skipped = Skipped()
    # The bar counts text bytes: its total is the files' size only where that is text.
    plain = not any(f.suffix in (".gz", ".zst", ".parquet") for f in corpus.files) and not corpus.max_bytes
    bar = tqdm(total=corpus.size() if plain else None, unit="B", unit_scale=True, desc="prepare",
               disable=not cfg.progress)
    writer: _Writer | None = None
    encoded = tokens = 0
    with _pool(cfg.workers, settings) as pool:
        pending: deque[tuple[int, int, Future | encode.Encoded]] = deque()

        def take() -> None:
            nonlocal writer, encoded, tokens
            chunk, size, job = pending.popleft()
            result = job.result() if isinstance(job, Future) else job
            if writer is None or writer.chunk != chunk:
                if writer is not None:
                    writer.close()
                writer = _Writer(out, chunk, dtype)
            writer.add(result)
            encoded, tokens = encoded + size, tokens + result.tokens
            bar.update(size)
            bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s", refresh=False)

        for chunk, texts, size in _jobs(corpus, skipped, cfg.chunk_bytes):
            if chunk in done:
                bar.update(size)
                continue
            pending.append((chunk, size, pool.submit(encode.encode, texts) if pool else encode.encode(texts)))
            while len(pending) > 2 * max(cfg.workers, 1):  # bounded: the corpus is never held
                take()
        while pending:
            take()
        if writer is not None:
            writer.close()
    bar.close()
    records = _records(out, dtype)
    tok.save(str(out / TOKENIZER))
    index = Index(
        dtype=dtype.name, vocab_size=tok.get_vocab_size(), eos_id=settings.eos_id,
        tokenizer_sha256=tokenizer_hash(tok), source_fingerprint=plan["source_fingerprint"],
        recipe=plan["recipe"], splits={s: [records[c][s] for c in sorted(records)] for s in SPLITS},
        stats={"skipped_lines": skipped.lines},
    )
    write_index(out, index)
    shutil.rmtree(parts)
    return Prepared(read_index(out), time.perf_counter() - t0, encoded, tokens, skipped)


def _check_val(corpus: Corpus, val_fraction: float) -> None:
    """Refused before anything is written: a val_fraction that holds out none of a small corpus's
    documents, with the fraction that would hold one out. Refused, not forced: a document's side is
    a hash of its own text (the split stays put as a corpus grows, a rerun resumes chunk by chunk, a
    duplicate never sits on both sides); picking a document for val would tie it to the whole corpus.
    Reads up to the first held-out document: about 1 / val_fraction of them."""
    lowest, count = 1.0, 0
    for doc in corpus.documents(Skipped()):
        if encode.is_val(doc.text, val_fraction):
            return
        lowest, count = min(lowest, unit_hash("split", doc.text)), count + 1
    enough = math.floor(lowest * 100) / 100 + 0.01  # the next hundredth above the lowest hash
    fix = (f"--val-fraction {enough:.2f} holds out one" if count > 1 and enough < 1
           else "it has too few documents to hold one out")
    raise DataError(f"--val-fraction {val_fraction} holds out none of the corpus's {count} documents (each goes "
                    f"to the validation split by a hash of its text), so eval would have no validation data: {fix}; "
                    "--val-fraction 0 prepares without a validation split")


def _tokenizer(corpus: Corpus, out: Path, cfg: PrepareConfig) -> Tokenizer:
    """Trained on the first `sample_bytes` of train text, or the one an interrupted prepare saved."""
    saved = out / _PARTS / TOKENIZER
    if saved.is_file():
        return load_tokenizer(saved)
    tok = train_tokenizer(cfg.tokenizer, cfg.vocab_size, _Sample(corpus, cfg.sample_bytes, cfg.val_fraction))
    spec = tok.to_str().encode()
    atomic_write(saved, lambda f: f.write(spec))
    return tok


@dataclass(frozen=True)
class _Sample:
    """The tokenizer's training text, read afresh on each pass (bpe training makes two)."""

    corpus: Corpus
    sample_bytes: int
    val_fraction: float

    def __iter__(self) -> Iterator[str]:
        total = 0
        for doc in self.corpus.documents(Skipped()):
            if encode.is_val(doc.text, self.val_fraction):
                continue
            total += len(doc.text.encode())
            if total > self.sample_bytes:
                return
            yield doc.text


def _jobs(corpus: Corpus, skipped: Skipped, chunk_bytes: int) -> Iterator[tuple[int, list[str], int]]:
    """(chunk, texts, their bytes): documents in input order, a new chunk once one holds chunk_bytes."""
    chunk, in_chunk, texts, size = 0, 0, [], 0
    for doc in corpus.documents(skipped):
        if in_chunk >= chunk_bytes:
            if texts:
                yield chunk, texts, size
            chunk, in_chunk, texts, size = chunk + 1, 0, [], 0
        n = len(doc.text.encode())
        texts.append(doc.text)
        size, in_chunk = size + n, in_chunk + n
        if size >= _JOB_BYTES:
            yield chunk, texts, size
            texts, size = [], 0
    if texts:
        yield chunk, texts, size


def _pool(workers: int, settings: encode.EncodeSettings) -> ProcessPoolExecutor | nullcontext[None]:
    """Worker processes, or None (jobs then run inline, tokenizers still using every core)."""
    if workers <= 1:
        encode.init(settings, parallel=True)
        return nullcontext()
    # spawn, not fork: the caller may be a training process with JAX's threads running.
    return ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=encode.init_worker,
                               initargs=(settings, os.getpid()))


class _Writer:
    """The two shards of one chunk, under temporary names until `close` renames them and records them."""

    def __init__(self, out: Path, chunk: int, dtype: np.dtype):
        self.out, self.chunk, self.dtype = out, chunk, dtype
        self.files = {s: open(out / f".{shard_name(s, chunk)}.tmp", "wb") for s in SPLITS}
        self.shards = {s: Shard(shard_name(s, chunk), 0, 0, -1) for s in SPLITS}

    def add(self, result: encode.Encoded) -> None:
        for s, ids, docs in (("train", result.train, result.train_docs), ("val", result.val, result.val_docs)):
            self.files[s].write(ids.tobytes())
            old = self.shards[s]
            self.shards[s] = Shard(old.file, old.tokens + len(ids), old.documents + docs,
                                   max(old.max_id, int(ids.max()) if len(ids) else -1))

    def close(self) -> None:
        for s, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(f.name, self.out / self.shards[s].file)
        record = json.dumps({s: asdict(v) for s, v in self.shards.items()}).encode()
        atomic_write(self.out / _PARTS / f"{self.chunk:05d}.json", lambda f: f.write(record))


def _records(out: Path, dtype: np.dtype) -> dict[int, dict[str, Shard]]:
    """Chunks whose record exists and whose shards have the recorded sizes: complete."""
    done = {}
    for path in sorted((out / _PARTS).glob("[0-9]*.json")):
        shards = {s: Shard(**v) for s, v in json.loads(path.read_text()).items()}
        if all((out / v.file).is_file() and (out / v.file).stat().st_size == v.tokens * dtype.itemsize
               for v in shards.values()):
            done[int(path.stem)] = shards
    return done
