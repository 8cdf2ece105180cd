"""Token arrays and the batches cut from them.

Documents are encoded once, joined with <eos> into one 1-D array (cached as .npy), and cut into
windows. The training order is a pure function of (seed, step), so a checkpoint stores only the step
and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from boost_jax.config import ConfigError
from boost_jax.data.cache import atomic_write, digest
from boost_jax.data.corpus import Document, corpus_fingerprint
from boost_jax.data.tokenizer import eos_id

Batch = dict[str, np.ndarray]  # inputs, targets: int32 [rows, seq_len]
_FORMAT = "1"  # part of the cache key: bump whenever the array layout below changes
_CHUNK = 256  # documents per encode_batch call: parallel, yet bounded memory for the Encodings


def encode_documents(docs: Sequence[Document], tok: Tokenizer, cache_dir: Path) -> np.ndarray:
    """All token ids of `docs`, each document followed by <eos>, as one 1-D uint16 (uint32 for big
    vocabularies) array; cached in <cache_dir>/tokens/ by (the documents, the tokenizer)."""
    eos = eos_id(tok)
    dtype = np.dtype(np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32)
    tok_hash = hashlib.sha256(tok.to_str().encode()).hexdigest()
    key = digest(corpus_fingerprint(docs), tok_hash, str(tok.encode_special_tokens), _FORMAT)
    path = cache_dir / "tokens" / f"{key}.npy"
    if (tokens := _load(path, dtype)) is not None:
        return tokens
    parts = [np.zeros(0, dtype)]
    for i in range(0, len(docs), _CHUNK):
        # encode_batch_fast: like encode_batch, minus the character offsets we do not need.
        encodings = tok.encode_batch_fast([d.text for d in docs[i : i + _CHUNK]], add_special_tokens=False)
        parts += [np.array(e.ids + [eos], dtype) for e in encodings]
    tokens = np.concatenate(parts)
    atomic_write(path, lambda f: np.save(f, tokens))
    return tokens


def _load(path: Path, dtype: np.dtype) -> np.ndarray | None:
    """The cached array, or None if missing or corrupt (then it is rebuilt, not fatal)."""
    try:
        tokens = np.load(path) if path.is_file() else None
    except (OSError, ValueError, EOFError):
        return None
    return tokens if tokens is not None and tokens.ndim == 1 and tokens.dtype == dtype else None


class PackedDataset:
    """Windows of seq_len + 1 tokens at stride seq_len (neighbours share one boundary token, so every
    token after the first is a target exactly once per epoch): inputs = w[:-1], targets = w[1:]."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0, name: str = "data"):
        self.tokens, self.seq_len, self.seed, self.name = tokens, seq_len, seed, name
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"{name} data has {len(tokens)} tokens, too few for one window of seq_len+1="
                f"{seq_len + 1}; add data (data.max_bytes), shorten train.seq_len"
                + (" or change data.val_fraction" if name == "val" else "")
            )

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch `step`: global sample k = step * batch_size + row
        is window permutation(seed, epoch)[k % num_windows] with epoch = k // num_windows."""
        if batch_size > self.num_windows:
            raise ConfigError(
                f"{self.name} data has {self.num_windows} windows of seq_len={self.seq_len}, fewer than "
                f"train.batch_size={batch_size}; add data (data.max_bytes) or shrink the batch or seq_len"
            )
        k = step * batch_size + _rows(batch_size, process_index, process_count)
        epoch, i = np.divmod(k, self.num_windows)
        windows = np.empty_like(k)
        for e in np.unique(epoch):  # one or two epochs per batch
            windows[epoch == e] = _permutation(self.seed, int(e), self.num_windows)[i[epoch == e]]
        return self._gather(windows)

    def eval_batches(
        self, n: int, batch_size: int, process_index: int = 0, process_count: int = 1
    ) -> list[Batch]:
        """The first n batches in order, unshuffled: the same every call. A split shorter than
        n * batch_size windows is cycled through again rather than refused."""
        rows = _rows(batch_size, process_index, process_count)
        return [self._gather((b * batch_size + rows) % self.num_windows) for b in range(n)]

    def _gather(self, windows: np.ndarray) -> Batch:
        x = self.tokens[windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def _rows(batch_size: int, process_index: int, process_count: int) -> np.ndarray:
    """Global row numbers of this process's contiguous slice of the batch."""
    if batch_size % process_count:
        raise ConfigError(
            f"train.batch_size={batch_size} must be divisible by the number of processes ({process_count})"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    per = batch_size // process_count
    return np.arange(process_index * per, (process_index + 1) * per)


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """The window order of one epoch; cached, since every step of the epoch reuses it."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_windows)
    perm.flags.writeable = False  # shared by every caller through the cache
    return perm
