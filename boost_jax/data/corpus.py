"""Corpora as streams of named documents: user files (text, .jsonl, .jsonl.gz, .jsonl.zst, Parquet)
or the Python standard library's own source. Nothing here holds more than one document (one text
file, one Parquet record batch) in memory."""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from boost_jax.runtime.errors import DataError

# Installed third-party packages and bytecode are not the standard library's source.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_PARQUET = ".parquet"
_SNIFF = 8192  # bytes looked at for NUL, the sign of a binary file


@dataclass(frozen=True)
class Document:
    name: str  # where it came from: file, file:line or file#row; named in errors
    text: str


@dataclass
class Skipped:
    """Malformed .jsonl lines passed over under `skip_bad_lines`: reported, never silent."""

    lines: int = 0
    first: list[str] = field(default_factory=list)  # the first few, as file:line

    def add(self, where: str) -> None:
        self.lines += 1
        if len(self.first) < 5:
            self.first.append(where)


@dataclass(frozen=True)
class Corpus:
    """Files read in this order. `root` names documents relative to it (the stdlib corpus);
    `skip_undecodable` passes over non-UTF-8 files (a few stdlib test fixtures are) instead of
    refusing them as binary."""

    files: tuple[Path, ...]
    text_key: str = "text"
    max_bytes: int = 0  # stop before the document that would cross this many text bytes; 0 = all
    skip_bad_lines: bool = False
    skip_undecodable: bool = False
    root: Path | None = None

    def fingerprint(self) -> str:
        """sha256 over each file's name, size and mtime and the reading settings: cheap (no file is
        read), and any edit, addition or removal changes it."""
        # Not skip_bad_lines: skipping changes no document, so a prepare stopped by a bad line can
        # be finished with the flag.
        h = hashlib.sha256(json.dumps([self.text_key, self.max_bytes]).encode())
        for f in self.files:
            st = f.stat()
            h.update(f"\0{self._name(f)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()

    def size(self) -> int:
        """Bytes on disk (compressed where compressed): the progress bar's total."""
        return sum(f.stat().st_size for f in self.files)

    def documents(self, skipped: Skipped) -> Iterator[Document]:
        total = 0
        for f in self.files:
            for doc in self._read(f, skipped):
                size = len(doc.text.encode())
                if self.max_bytes and total + size > self.max_bytes:
                    return
                total += size
                yield doc

    def _name(self, f: Path) -> str:
        return f.relative_to(self.root).as_posix() if self.root else str(f)

    def _read(self, f: Path, skipped: Skipped) -> Iterator[Document]:
        name = f.name.lower()
        if name.endswith(_JSONL):
            yield from _jsonl(f, self.text_key, skipped if self.skip_bad_lines else None)
        elif name.endswith(_PARQUET):
            yield from _parquet(f, self.text_key)
        elif (doc := _text(f, self._name(f), self.skip_undecodable)) is not None:
            yield doc


def files_corpus(patterns: Sequence[str], text_key: str = "text", max_bytes: int = 0,
                 skip_bad_lines: bool = False) -> Corpus:
    return Corpus(expand(patterns), text_key, max_bytes, skip_bad_lines)


def stdlib_corpus(max_bytes: int) -> Corpus:
    """The interpreter's own .py files; under a cap, a stable pseudo-random sample of whole files
    spread over the tree rather than the alphabetically first packages (asyncio, ctypes, ...)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes: dict[Path, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for f in filenames:
            path = Path(dirpath, f)
            if f.endswith(".py") and path.is_file():
                sizes[path] = path.stat().st_size
    chosen, total = [], 0
    for path in sorted(sizes, key=lambda p: unit_hash("sample", p.relative_to(root).as_posix())):
        if not max_bytes or total + sizes[path] <= max_bytes:
            chosen.append(path)
            total += sizes[path]
    return Corpus(tuple(sorted(chosen)), skip_undecodable=True, root=root)


def unit_hash(use: str, key: str) -> float:
    """A stable pseudo-random number in [0, 1) for `key` (Python's hash() is salted per process).
    Each `use` draws independently: were the stdlib sample and the val split to share one hash, the
    sample (low hashes first) would hold mostly val documents."""
    return int.from_bytes(hashlib.sha1(f"{use}:{key}".encode()).digest()[:8], "big") / 2**64


def expand(patterns: Sequence[str]) -> tuple[Path, ...]:
    """Files named by `patterns` (files, directories searched recursively, or globs), sorted, unique."""
    files: set[Path] = set()
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        matches = [pattern] if os.path.exists(pattern) else glob.glob(pattern, recursive=True)
        found = set()
        for m in map(Path, matches):
            if m.is_dir():  # skip hidden entries (.git, .DS_Store) and bytecode
                found.update(
                    f for f in m.rglob("*")
                    if f.is_file() and not any(p.startswith(".") or p == "__pycache__"
                                               for p in f.relative_to(m).parts)
                )
            else:
                found.add(m)
        if not found:
            raise DataError(f"{pattern!r} matches no file")
        files |= found
    return tuple(sorted(files, key=str))


def _text(path: Path, name: str, skip_undecodable: bool) -> Document | None:
    data = path.read_bytes()  # bytes, not read_text(): newline translation would alter \r\n files
    try:
        if b"\0" in data[:_SNIFF]:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        return Document(name, data.decode("utf-8"))
    except UnicodeDecodeError as e:
        if skip_undecodable:
            return None
        raise DataError(
            f"{path} looks binary, not UTF-8 text ({e.reason} at byte {e.start}); narrow the pattern "
            f"(e.g. dir/**/*.txt) or use one of the formats read as records: {', '.join(_JSONL)}, {_PARQUET}"
        ) from None


def _open(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard  # optional: zstandard (.zst corpora; a GPU machine's stack may lack it)
        except ImportError:
            raise DataError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from None

        # Buffered: the raw zstd reader cannot iterate lines.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True))
    return path.open("rb")


def _stream_errors(path: Path) -> tuple[type[Exception], ...]:
    """What reading a damaged file raises: OSError/EOFError (plain, .gz), zstandard's own (.zst)."""
    if path.name.lower().endswith(".zst"):
        import zstandard  # optional: zstandard (.zst corpora)

        return OSError, EOFError, zstandard.ZstdError
    return OSError, EOFError


def _jsonl(path: Path, key: str, skipped: Skipped | None) -> Iterator[Document]:
    """One document per line: obj[key]. A malformed line stops the read, naming file and line,
    unless `skipped` collects it."""
    with _open(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    if skipped is None:
                        raise DataError(f"{where} is not valid JSON ({e}); --skip-bad-lines passes over "
                                        "such lines (counted and reported)") from None
                    skipped.add(where)
                    continue
                text = obj.get(key) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{where} has no string field {key!r} (choose it with --text-key / "
                                    "data.text_key)")
                yield Document(where, text)
        except _stream_errors(path) as e:  # a damaged .gz / .zst stream
            raise DataError(f"{path} cannot be decompressed ({e})") from None


def records(files: Sequence[Path]) -> Iterator[tuple[str, dict]]:
    """Each row of .jsonl(.gz/.zst) and Parquet files, whole (instruction data: data.format=chat or
    prompt_completion), named as "file:line" or "file#row". Another kind of file, a line that is not
    a JSON object, or a damaged stream raises DataError naming it."""
    for path in files:
        name = path.name.lower()
        if name.endswith(_JSONL):
            yield from _jsonl_records(path)
        elif name.endswith(_PARQUET):
            yield from _parquet_records(path)
        else:
            raise DataError(f"{path}: instruction rows are read from {', '.join(_JSONL)} or {_PARQUET} files, "
                            "one row per line or record")


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    with _open(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({e})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{path}:{lineno} is not a JSON object")
                yield f"{path}:{lineno}", obj
        except _stream_errors(path) as e:
            raise DataError(f"{path} cannot be decompressed ({e})") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq  # optional: pyarrow (Parquet corpora; 0.4 s of import)

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for a non-Parquet file
        raise DataError(f"{path} is not a Parquet file ({e})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield f"{path}#{row}", obj
            row += 1


def _parquet(path: Path, key: str) -> Iterator[Document]:
    import pyarrow.parquet as pq  # optional: pyarrow (Parquet corpora; 0.4 s of import)

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for a non-Parquet file
        raise DataError(f"{path} is not a Parquet file ({e})") from None
    columns = pf.schema_arrow.names
    if key not in columns:
        raise DataError(f"{path} has no column {key!r} (columns: {columns}); choose it with --text-key")
    row = 0
    for batch in pf.iter_batches(columns=[key], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataError(f"{path}#{row}: column {key!r} is {text!r}, not a string")
            yield Document(f"{path}#{row}", text)
            row += 1
