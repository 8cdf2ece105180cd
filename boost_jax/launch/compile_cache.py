"""JAX's persistent compilation cache for every command (`data.compile_cache`, in
`data.compile_cache_dir`), so that a command run again starts warm: each program it compiles is
written to the cache folder, and the next process compiling the same program (same JAX, same
devices, same options) reads it back instead.

Every program is kept: JAX's thresholds, which skip programs that compiled in under a second, are
set to nothing, since on CPU a command's many programs each compile in well under a second and
together take most of its start. The folder is shared safely by concurrent processes: JAX's own
file cache writes an entry in place (`Path.write_bytes`), where a concurrent reader can meet half
of it, and its size bound's file lock fails every write once the folder holds entries of a process
without the bound (their access-time files are missing); so the cache is JAX's, unbounded as by
default, with each entry written to a temporary file and renamed into place (`AtomicFileCache`).
An entry JAX cannot read back (damaged, from another build) is a warning from JAX and a fresh
compile, never a crash. A folder that cannot be used (a file, unwritable, a full disk) is one line
on stderr naming it, and the command runs uncached.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import jax

# JAX's file cache and the module holding the one its compiles use: no public way to choose the
# cache's writer in jax 0.10.
from jax._src import compilation_cache
from jax._src.lru_cache import _CACHE_SUFFIX, LRUCache

from boost_jax.config import DataConfig
from boost_jax.runtime.cache import atomic_write, cache_root

_WARNED: set[Path] = set()  # folders already named in a warning: a bench enables per variant, warns once
_PROBE = b"\0" * 65536  # a probe write this size fails on a full disk (a bare file creation may not)


def folder(data: DataConfig) -> Path | None:
    """The cache folder (None: data.compile_cache=false): data.compile_cache_dir, else
    $JAX_COMPILATION_CACHE_DIR, else <data.cache_dir or its default>/xla."""
    if not data.compile_cache:
        return None
    given = data.compile_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return Path(given).expanduser() if given else cache_root(data.cache_dir) / "xla"


def enable(data: DataConfig) -> Path | None:
    """Point JAX's persistent compilation cache at `folder(data)` (any time before a compile; a
    folder already in use in this process is swapped); returns the folder, or None when uncached."""
    path = folder(data)
    if path is not None and (why := unusable(path)):
        if path not in _WARNED:
            print(f"warning: data.compile_cache_dir: {path} {why}; running without the compilation cache",
                  file=sys.stderr)
            _WARNED.add(path)
        path = None
    jax.config.update("jax_enable_compilation_cache", path is not None)
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, none chosen for us
        jax.config.update("jax_compilation_cache_max_size", -1)
    compilation_cache.reset_cache()  # drop a cache this process opened before
    if path is not None:
        with compilation_cache._cache_initialized_mutex:  # what JAX's first compile would open, made here
            compilation_cache._cache = AtomicFileCache(path)
            compilation_cache._cache_initialized = True
    return path


class AtomicFileCache(LRUCache):
    """JAX's file cache without a size bound, each entry written whole: to a temporary file in the
    folder, then renamed into place, so that a concurrent reader meets the whole entry or none."""

    def __init__(self, path: Path):
        super().__init__(str(path), max_size=-1)

    def put(self, key: str, value: bytes) -> None:
        entry = Path(self.path) / f"{key}{_CACHE_SUFFIX}"
        if not entry.exists():
            atomic_write(entry, lambda f: f.write(value))


def unusable(path: Path) -> str:
    """Why `path` cannot hold the cache ("" if it can): it is a file, or creating it or writing a
    probe file in it fails (no permission, a read-only or full file system)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(_PROBE)
            f.flush()
            os.fsync(f.fileno())
    except FileExistsError:
        return "is a file, not a folder"
    except NotADirectoryError:
        return "is under a file, not a folder"
    except OSError as e:
        return f"cannot be written ({e.strerror or e})"
    return ""
