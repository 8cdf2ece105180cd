"""The on-disk cache shared by the tokenizer and the token arrays: where it lives, how it is written."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from boost_jax.config import DataConfig


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("BOOST_JAX_CACHE") or "~/.cache/boost_jax").expanduser()


def digest(*parts: str) -> str:
    """A short, stable cache key for `parts` (unlike hash(), equal across processes)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write to a temp file in the same folder, then rename: readers and concurrent writers
    (two runs sharing a cache) only ever see a complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide shared caches and datasets from other users
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
