"""The encode step of `prepare`, importable by a worker process without JAX or Grain: documents ->
token ids followed by <eos>, split into train and val by a stable hash of each document's text."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from boost_jax.data.corpus import unit_hash
from boost_jax.runtime.processes import die_with_parent


@dataclass(frozen=True)
class EncodeSettings:
    """What every encode worker encodes with: the tokenizer (as JSON), <eos>, the shards' dtype, the val split."""

    tokenizer_json: str
    eos_id: int
    dtype: str  # numpy dtype string of the shards
    val_fraction: float


@dataclass(frozen=True)
class Encoded:
    train: np.ndarray
    train_docs: int
    val: np.ndarray
    val_docs: int

    @property
    def tokens(self) -> int:
        return len(self.train) + len(self.val)


_state: tuple[Tokenizer, EncodeSettings] | None = None  # set once per process by `init`


def init_worker(settings: EncodeSettings, parent: int) -> None:
    """`init` in a pool's worker process, which dies with `parent` (the prepare): a prepare killed
    with -9 leaves no worker encoding on, nor the resource tracker the workers keep alive."""
    die_with_parent(parent)
    init(settings, parallel=False)


def init(settings: EncodeSettings, parallel: bool) -> None:
    """Load the tokenizer. In a pool of worker processes each encodes on one thread (`parallel`
    False): the processes are the parallelism, and threads on top would oversubscribe the cores."""
    global _state
    if not parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_str(settings.tokenizer_json)
    tok.encode_special_tokens = True  # a literal "<eos>" in a document is text
    _state = (tok, settings)


def is_val(text: str, val_fraction: float) -> bool:
    """By content, not position or file name: the same split whatever the file layout, and an
    exact duplicate can never sit on both sides."""
    return val_fraction > 0 and unit_hash("split", text) < val_fraction


def encode(texts: list[str]) -> Encoded:
    assert _state is not None, "encode.init was not called in this process"
    tok, settings = _state
    dtype = np.dtype(settings.dtype)
    val = [is_val(t, settings.val_fraction) for t in texts]
    # encode_batch_fast: like encode_batch, minus the character offsets we do not need.
    encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
    parts: dict[bool, list[np.ndarray]] = {False: [np.zeros(0, dtype)], True: [np.zeros(0, dtype)]}
    for e, v in zip(encodings, val):
        parts[v].append(np.array(e.ids + [settings.eos_id], dtype))
    return Encoded(np.concatenate(parts[False]), val.count(False), np.concatenate(parts[True]), val.count(True))
