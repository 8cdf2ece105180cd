"""Batches from a prepared dataset: windows read from the token shards, ordered by Grain.

Window w is tokens [w * seq_len, w * seq_len + seq_len + 1) of the split's shards joined end to end
(neighbours share one boundary token, so every token after the first is a target once per epoch;
a window may span two shards). Grain's MapDataset gives the order: `shuffle` is a stateless
per-epoch permutation of window indices (index_shuffle, no table in memory), `repeat` runs through
epochs, `batch(rows)[p::P]` picks process p's contiguous rows of each global batch, and
`to_iter_dataset` reads batches ahead on a background thread. So the batch of step k is a pure
function of (seed, k), each process reads only its own rows, and resuming at step k is exact.

With `data.document_mask` each batch also carries `segment_ids`: a window's documents numbered
from 0, a token's id being the count of end-of-document tokens before it (the <eos> closing a
document belongs to it), so attention can stay within a document.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from boost_jax.data.shards import Shard
from boost_jax.runtime.errors import ConfigError, DataError

Batch = dict[str, np.ndarray]  # inputs, targets (and segment_ids): int32 [rows, seq_len]


class TokenWindows:
    """Grain random-access source: window i as int32 [seq_len + 1], read from the shard files."""

    def __init__(self, directory: Path, shards: list[Shard], dtype: str, seq_len: int, vocab_size: int):
        self.directory, self.seq_len, self.vocab_size = directory, seq_len, vocab_size
        kept = [s for s in shards if s.tokens]  # an empty shard has nothing to read
        self.files = [s.file for s in kept]
        self.dtype = np.dtype(dtype)
        # Positioned reads, not mmap: the kernel maps whole page-cache folios (up to 2 MB) into a
        # process that faults one page, so mapped shards grew resident memory by ~0.4 MB per window
        # read (+1.9 GB after 300 batches of a 10^9-token dataset). pread copies just the window.
        self.fds = [os.open(directory / s.file, os.O_RDONLY) for s in kept]
        self.starts = np.cumsum([0] + [s.tokens for s in kept]).tolist()  # global offset of each shard
        self.num_tokens = self.starts[-1]

    def __len__(self) -> int:
        return max(self.num_tokens - 1, 0) // self.seq_len

    def __getitem__(self, w: int) -> np.ndarray:
        lo = w * self.seq_len
        hi = lo + self.seq_len + 1
        i = bisect.bisect_right(self.starts, lo) - 1
        parts = []
        while lo < hi:
            off = lo - self.starts[i]
            take = min(hi - lo, self.starts[i + 1] - lo)
            data = os.pread(self.fds[i], take * self.dtype.itemsize, off * self.dtype.itemsize)
            parts.append(np.frombuffer(data, self.dtype))
            lo, i = lo + take, i + 1
        x = np.concatenate(parts).astype(np.int32)
        # Never trust the bytes: an id past the vocab would index past the embedding table (NaN).
        if (top := int(x.max())) >= self.vocab_size:
            raise DataError(f"{self.directory}: token id {top} in window {w} is not below the tokenizer's "
                            f"vocab_size={self.vocab_size}; the shards were altered: prepare the dataset again")
        return x


class Split:
    """One split (train or val) of a prepared dataset, cut into windows of seq_len + 1."""

    def __init__(self, windows: TokenWindows, *, seed: int, name: str, eos_id: int | None = None):
        """`eos_id`: number the documents of each row (`segment_ids`) at this end-of-document token."""
        self.windows, self.name, self.eos_id = windows, name, eos_id
        self.num_windows = len(windows)
        # Grain derives epoch e's permutation from seed + e: hash train.seed so that runs with
        # neighbouring seeds do not share permutations one epoch apart.
        self.seed = int.from_bytes(hashlib.sha256(f"boost_jax:{seed}".encode()).digest()[:4], "big")
        if self.num_windows < 1:
            raise ConfigError(
                f"{name} data has {windows.num_tokens} tokens, too few for one window of seq_len+1="
                f"{windows.seq_len + 1}; add data (data.max_bytes), shorten train.seq_len"
                + (" or change data.val_fraction" if name == "val" else "")
            )

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch `step`: rows [p * B/P, (p + 1) * B/P)."""
        return self._train(batch_size, process_index, process_count)[step]

    def batches(self, start: int, batch_size: int, process_index: int = 0, process_count: int = 1,
                prefetch: int = 2) -> Iterator[Batch]:
        """`batch(start)`, `batch(start + 1)`, ..., read `prefetch` batches ahead on a background thread."""
        ds = self._train(batch_size, process_index, process_count)[start:]
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))

    def eval_batches(self, n: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> list[Batch]:
        """The first n batches in order, unshuffled: the same every call. A split shorter than
        n * batch_size windows is cycled through again rather than refused."""
        ds = _rows(grain.MapDataset.source(self.windows).repeat(), batch_size, process_index, process_count,
                   self.eos_id)
        return [ds[b] for b in range(n)]

    def _train(self, batch_size: int, process_index: int, process_count: int) -> grain.MapDataset:
        if batch_size > self.num_windows:
            raise ConfigError(
                f"{self.name} data has {self.num_windows} windows of seq_len={self.windows.seq_len}, fewer "
                f"than train.batch_size={batch_size}; add data (data.max_bytes) or shrink the batch or seq_len"
            )
        return _rows(self.stream(), batch_size, process_index, process_count, self.eos_id)

    def stream(self) -> grain.MapDataset:
        """The windows in training order: a seeded permutation per epoch, epoch after epoch."""
        return grain.MapDataset.source(self.windows).shuffle(seed=self.seed).repeat()


def segment_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """Each token's document within its row: the number of end-of-document tokens before it."""
    ends = (inputs == eos_id).astype(np.int32)
    return np.cumsum(ends, axis=-1, dtype=np.int32) - ends


def _rows(ds: grain.MapDataset, batch_size: int, process_index: int, process_count: int,
          eos_id: int | None) -> grain.MapDataset:
    """Element k: process `process_index`'s contiguous rows of global batch k, as inputs/targets (and
    segment ids when `eos_id` is given)."""
    if batch_size % process_count:
        raise ConfigError(
            f"train.batch_size={batch_size} must be divisible by the number of processes ({process_count})"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
    per = batch_size // process_count
    return ds.batch(per)[process_index::process_count].map(lambda x: to_batch(x, eos_id))


def to_batch(windows: np.ndarray, eos_id: int | None) -> Batch:
    """Windows [rows, seq_len + 1] as inputs/targets (and segment ids when `eos_id` is given)."""
    batch = {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
    if eos_id is not None:
        batch["segment_ids"] = segment_ids(batch["inputs"], eos_id)
    return batch
