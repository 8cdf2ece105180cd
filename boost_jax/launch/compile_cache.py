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
An entry JAX cannot read back (damaged, from another build) is one warning line naming it and
a fresh compile, never a crash, and the fresh program replaces the entry. A folder that cannot be
used (a file, unwritable, a full disk) is one line on stderr naming it and the setting that chose
it, and the command runs uncached.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
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
    return chosen(data)[0]


def chosen(data: DataConfig) -> tuple[Path | None, str]:
    """(`folder(data)`, the setting that named it: what a warning about the folder names)."""
    if not data.compile_cache:
        return None, "data.compile_cache"
    if data.compile_cache_dir:
        return Path(data.compile_cache_dir).expanduser(), "data.compile_cache_dir"
    if given := os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(given).expanduser(), "$JAX_COMPILATION_CACHE_DIR"
    return cache_root(data.cache_dir) / "xla", "data.cache_dir"


def enable(data: DataConfig) -> Path | None:
    """Point JAX's persistent compilation cache at `folder(data)` (any time before a compile; a
    folder already in use in this process is swapped); returns the folder, or None when uncached."""
    path, setting = chosen(data)
    if path is not None and (why := unusable(path)):
        if path not in _WARNED:
            print(f"warning: {setting}: {path} {why}; running without the compilation cache", file=sys.stderr)
            _WARNED.add(path)
        path = None
    one_line_read_errors()
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
    folder, then renamed into place, so that a concurrent reader meets the whole entry or none. An
    entry this process read and then was asked to store is one JAX could not read back (it stores
    only what it compiled): it is replaced, or it would cost a compile and a warning every run."""

    def __init__(self, path: Path):
        super().__init__(str(path), max_size=-1)
        self.served: set[str] = set()

    def get(self, key: str) -> bytes | None:
        value = super().get(key)
        if value is not None:
            self.served.add(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        entry = Path(self.path) / f"{key}{_CACHE_SUFFIX}"
        if key in self.served or not entry.exists():
            atomic_write(entry, lambda f: f.write(value))


READ_ERROR = "Error reading persistent compilation cache entry for "  # JAX's warning (jax/_src/compiler.py)


def one_line_read_errors() -> None:
    """Show JAX's warning for a cache entry it cannot read back as one line naming the folder (JAX's
    own is two, the second its source line); every other warning as before."""
    shown = warnings.showwarning
    if getattr(shown, "boost_jax", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.startswith(READ_ERROR):
            return shown(message, category, filename, lineno, file, line)
        program, _, reason = text.removeprefix(READ_ERROR).partition(": ")
        print(f"warning: compilation cache {jax.config.jax_compilation_cache_dir}: the entry of {program} could "
              f"not be read back (damaged, or from another build: {reason}); compiled afresh",
              file=sys.stderr if file is None else file)

    show.boost_jax = True
    warnings.showwarning = show


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
