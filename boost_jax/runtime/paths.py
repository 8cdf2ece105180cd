"""What a command writes is checked before any work: a folder it can create or write in, a file
whose folder it can write in, each named in the error with the system's reason; and a run dir has
one writer at a time (`lock_dir`)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import IO

from boost_jax.runtime.errors import ConfigError, DiskFullError
from boost_jax.runtime.units import MIB


def check_writable_dir(path: str | Path, key: str) -> None:
    """`path` is a folder we can write in, or can be created as one (`key`: the flag or config key
    that named it). Nothing is created: a probe file in the nearest existing folder is written and
    removed (a permission check alone passes for root on a read-only mount or under /proc)."""
    path = Path(path).expanduser()
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {path} cannot be a folder: {existing} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot write in {existing} ({e.strerror or e}), so not {path}") from None


def check_writable_file(path: str | Path, key: str) -> None:
    """`path` can be written as a file: not a folder, in a folder we can write in."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}: {path} is a folder, not a file")
    check_writable_dir(path.parent, key)


def check_out_dir(path: str | Path, key: str, force: bool) -> None:
    """`path` is an output folder to write: one we can create or write in, empty unless `force` (so
    nothing there is replaced without asking)."""
    path = Path(path).expanduser()
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ConfigError(f"{key} {path}: the folder is not empty; pass --force to write into it (files of the same "
                          "names are replaced)")
    check_writable_dir(path, key)


LOCK = ".boost_jax.lock"


def lock_dir(path: str | Path, key: str) -> IO[str]:
    """Hold `path` (created if need be) for this process alone: an exclusive `flock` on its lock file,
    which the kernel releases when the process ends however it ends (kill -9 included), so a lock left
    by a dead process is never in the way. Another holder is named in the error. Close the returned
    file to release it."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    f = open(path / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"{key}: {path} is in use by another run ({holder}); wait for it to end or use "
                          f"another {key}") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is ENOSPC (Orbax and TensorStore wrap it)."""
    return _raised_from(error, (errno.ENOSPC,)) is not None


def refused_write(error: BaseException | None) -> str | None:
    """The system's reason ("Permission denied", "Read-only file system") if `error`, or an error it
    was raised from, is a refused write; else None."""
    code = _raised_from(error, (errno.EACCES, errno.EPERM, errno.EROFS))
    return os.strerror(code) if code else None


def _raised_from(error: BaseException | None, codes: tuple[int, ...]) -> int | None:
    """The first of the errno `codes` that `error` or one in its chain of causes has, as a number or
    as the system's text (TensorStore's errors carry only the text); else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for code in codes:
            if getattr(error, "errno", None) == code or os.strerror(code) in str(error):
                return code
        error = error.__cause__ or error.__context__
    return None


def disk_full(path: str | Path, what: str, needed_bytes: int, kept: str) -> DiskFullError:
    """The error of a write of `what` to `path` that found its device full: the space free there and
    about `needed_bytes` more, and what is `kept`."""
    path = Path(path)
    existing = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    mb = lambda n: f"{n / MIB:,.1f} MB"
    return DiskFullError(f"no space left writing {what} to {path}: {mb(free)} free on its device, about "
                         f"{mb(needed_bytes)} needed; {kept}. Free space there and rerun the same command")
