"""Instruction documents packed whole into windows, and the batches a run reads from them.

A window holds seq_len + 1 token slots filled with whole documents (a row is never split: one longer
than a window was refused or cut when it was encoded, data/instruct.py) and padding. Each epoch
draws the documents in a seeded order of its own and packs them first-fit into up to `OPEN`
windows at a time (the fullest is closed when none has room), so the windows hold >= 90% tokens
when documents are short against a window. The windows of epoch after epoch form one stream; the
batch of step k is its windows [k B, (k + 1) B), a pure function of (seed, k): a resume mid-epoch
is exact.

A batch is inputs/targets (the slots [:-1] and [1:]) with each token's `segment_ids` (its document
in the row; padding is one more) and `positions` (from 0 in each document), so attention stays in
a document, and `weights` float32: a target's weight is its share of the global batch's targets
times the batch's positions, so that the model's loss, sum(weight x cross-entropy) / positions,
is the mean over the global batch's target tokens under any micro-batching or data-parallel split
(0 for a non-target, a padding slot or a next token in another document).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from boost_jax.runtime.errors import ConfigError

Batch = dict[str, np.ndarray]
OPEN = 64  # windows filled at once: more packs tighter, each document tries each


@dataclass(frozen=True)
class Documents:
    """One split's documents end to end: document i is tokens[starts[i]:starts[i + 1]], and
    targets[j] says whether token j is one the loss is taken over."""

    tokens: np.ndarray  # int32 [N]
    targets: np.ndarray  # bool [N]
    starts: np.ndarray  # int64 [D + 1]

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)


def pack(lengths: np.ndarray, order: np.ndarray, capacity: int) -> list[list[int]]:
    """The documents of `order` (indices into `lengths`) in windows of `capacity` slots, first fit
    over the `OPEN` windows being filled; windows in the order they were closed, then the open ones."""
    closed, open_, room = [], [], []
    for d in order.tolist():
        n = int(lengths[d])
        i = next((i for i, r in enumerate(room) if r >= n), None)
        if i is None:
            if len(open_) == OPEN:
                full = min(range(OPEN), key=room.__getitem__)
                closed.append(open_.pop(full))
                room.pop(full)
            open_.append([])
            room.append(capacity)
            i = len(open_) - 1
        open_[i].append(d)
        room[i] -= n
    return closed + open_


class PackedSplit:
    """One split of packed documents: the loader's Split interface (batch, batches, eval_batches)."""

    def __init__(self, docs: Documents, *, seq_len: int, seed: int, name: str, pad_id: int):
        self.docs, self.seq_len, self.name, self.pad_id = docs, seq_len, name, pad_id
        if docs.count < 1:
            raise ConfigError(f"{name} data has no rows")
        self.seed = int.from_bytes(hashlib.sha256(f"boost_jax:packed:{seed}".encode()).digest()[:4], "big")
        self._epoch = lru_cache(maxsize=2)(self._pack_epoch)
        self._ends = [len(self._epoch(0))]  # cumulative windows through each epoch packed so far
        self.num_windows = self._ends[0]  # epoch 0's

    def _pack_epoch(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s windows (-1: the documents in file order, what an eval reads)."""
        order = (np.arange(self.docs.count) if epoch < 0
                 else np.random.default_rng([self.seed, epoch]).permutation(self.docs.count))
        return pack(self.docs.lengths, order, self.seq_len + 1)

    def window(self, k: int) -> list[int]:
        """Window k of the training stream (epochs end to end)."""
        while k >= self._ends[-1]:
            self._ends.append(self._ends[-1] + len(self._epoch(len(self._ends))))
        epoch = int(np.searchsorted(self._ends, k, side="right"))
        return self._epoch(epoch)[k - (self._ends[epoch - 1] if epoch else 0)]

    def fill(self) -> float:
        """Share of epoch 0's input positions that hold a token (not padding)."""
        windows = self._epoch(0)
        used = sum(min(int(self.docs.lengths[w].sum()), self.seq_len) for w in windows)
        return used / (len(windows) * self.seq_len)

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch `step`."""
        return self._rows([self.window(step * batch_size + i) for i in range(batch_size)],
                          process_index, process_count)

    def batches(self, start: int, batch_size: int, process_index: int = 0, process_count: int = 1,
                prefetch: int = 2) -> Iterator[Batch]:
        """`batch(start)`, `batch(start + 1)`, ... (packing is cheap: no reader thread)."""
        step = start
        while True:
            yield self.batch(step, batch_size, process_index, process_count)
            step += 1

    def eval_batches(self, n: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> list[Batch]:
        """The first n batches of the documents in file order, the same every call; a split with
        fewer windows is cycled."""
        windows = self._epoch(-1)
        return [self._rows([windows[(b * batch_size + i) % len(windows)] for i in range(batch_size)],
                           process_index, process_count) for b in range(n)]

    def _rows(self, windows: list[list[int]], process_index: int, process_count: int) -> Batch:
        if len(windows) % process_count:
            raise ConfigError(f"train.batch_size={len(windows)} must be divisible by the number of processes "
                              f"({process_count})")
        rows = np.stack([self._slots(w) for w in windows])  # [B, 4, S + 1]
        tokens, targets, segments, positions = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
        counted = (targets[:, 1:] == 1) & (segments[:, 1:] == segments[:, :-1])
        total = int(counted.sum())
        weights = counted * np.float32(counted.size / total if total else 0.0)
        per = len(windows) // process_count
        mine = slice(process_index * per, (process_index + 1) * per)
        return {"inputs": tokens[mine, :-1], "targets": tokens[mine, 1:], "segment_ids": segments[mine, :-1],
                "positions": positions[mine, :-1], "weights": weights[mine].astype(np.float32)}

    def _slots(self, window: list[int]) -> np.ndarray:
        """A window's tokens, target flags, documents and positions, int32 [4, seq_len + 1]."""
        out = np.zeros((4, self.seq_len + 1), np.int32)
        out[0] = self.pad_id
        at = 0
        for j, d in enumerate(window):
            lo, hi = self.docs.starts[d], self.docs.starts[d + 1]
            n = hi - lo
            out[0, at:at + n] = self.docs.tokens[lo:hi]
            out[1, at:at + n] = self.docs.targets[lo:hi]
            out[2, at:at + n] = j
            out[3, at:at + n] = np.arange(n)
            at += n
        out[2, at:] = len(window)  # padding: a segment of its own, never a target
        out[3, at:] = np.arange(self.seq_len + 1 - at)
        return out
