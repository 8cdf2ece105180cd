"""The project's on-disk cache (prepared corpora, the CPU's measured matmul peak, the planner's
compiles): where it lives, how it is written, how it is keyed. No JAX, no config: the data
preparation processes use it too."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def cache_root(cache_dir: str = "") -> Path:
    """The cache folder: `cache_dir` (the config's `data.cache_dir`), else $BOOST_JAX_CACHE, else
    ~/.cache/boost_jax."""
    return Path(cache_dir or os.environ.get("BOOST_JAX_CACHE") or "~/.cache/boost_jax").expanduser()


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
