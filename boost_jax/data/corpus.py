"""Text corpora as named documents: the Python standard library's own source (default) or user files."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from boost_jax.config import ConfigError, DataConfig

# Installed third-party packages and bytecode are not the standard library's source.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    name: str  # stable identity: picks the val split, the stdlib sample and the cache keys
    text: str


def load_documents(cfg: DataConfig) -> list[Document]:
    """The documents of `cfg.source`, at most `cfg.max_bytes` UTF-8 bytes in all (0 = no cap), by name."""
    if cfg.source == "stdlib":
        docs = _stdlib(cfg.max_bytes)
    else:
        docs = _files(cfg.paths, cfg.jsonl_key, cfg.max_bytes)
    return sorted(docs, key=lambda d: d.name)


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val): whole documents, visited in the order of a stable hash of their names, go to
    val while they fit in `val_fraction` of the corpus characters. Counting size, not documents,
    keeps val useful when sizes vary a lot (an empty `__init__.py` is a document too, and so is a
    70 kB test file). Neither side is left empty."""
    if val_fraction <= 0:
        return list(docs), []
    if len(docs) < 2:
        raise ConfigError(
            f"data.val_fraction={val_fraction} needs at least 2 documents, found {len(docs)}; "
            "add data or set data.val_fraction=0"
        )
    budget = val_fraction * sum(len(d.text) for d in docs)
    val, size = set(), 0
    for d in sorted(docs, key=lambda d: _unit_hash("split", d.name))[: len(docs) - 1]:
        if not val or size + len(d.text) <= budget:
            val.add(d.name)
            size += len(d.text)
    return [d for d in docs if d.name not in val], [d for d in docs if d.name in val]


def corpus_fingerprint(docs: Sequence[Document]) -> str:
    """sha256 over names and texts (length-prefixed, so boundaries are unambiguous): a cache key."""
    h = hashlib.sha256()
    for d in docs:
        name, text = d.name.encode(), d.text.encode()
        h.update(b"%d:%d:" % (len(name), len(text)))
        h.update(name)
        h.update(text)
    return h.hexdigest()


def _unit_hash(use: str, name: str) -> float:
    """A stable pseudo-random number in [0, 1) for `name` (Python's hash() is salted per process).
    Each `use` draws independently: were the stdlib sample and the val split to share one hash, the
    sample (low hashes first) would hold mostly val documents."""
    return int.from_bytes(hashlib.sha1(f"{use}:{name}".encode()).digest()[:8], "big") / 2**64


def _stdlib(max_bytes: int) -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for f in filenames:
            path = Path(dirpath, f)
            if f.endswith(".py") and path.is_file():
                sizes[path.relative_to(root).as_posix()] = path.stat().st_size
    # Under a cap, visit files in stable pseudo-random order and take each that still fits: a sample
    # spread over the whole tree rather than the alphabetically first packages (asyncio, ctypes, ...).
    chosen, total = [], 0
    for name in sorted(sizes, key=lambda name: _unit_hash("sample", name)):
        if not max_bytes or total + sizes[name] <= max_bytes:
            chosen.append(name)
            total += sizes[name]
    docs = []
    for name in chosen:
        try:
            # Bytes, not read_text(): newline translation would alter files with \r\n.
            docs.append(Document(name, (root / name).read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue  # a few test fixtures are deliberately not UTF-8
    return docs


def _files(patterns: Sequence[str], key: str, max_bytes: int) -> list[Document]:
    # Under a cap, take a prefix in path (and line) order, so a huge corpus is never read in full.
    docs, total = [], 0
    for path in _expand(patterns):
        for doc in _jsonl(path, key) if path.suffix == ".jsonl" else [_text(path)]:
            size = len(doc.text.encode())
            if max_bytes and total + size > max_bytes:
                return docs
            docs.append(doc)
            total += size
    return docs


def _expand(patterns: Sequence[str]) -> list[Path]:
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
            raise ConfigError(f"data.paths: {pattern!r} matches no file")
        files |= found
    return sorted(files, key=str)


def _text(path: Path) -> Document:
    try:
        return Document(str(path), path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"data.paths: {path} is not UTF-8 text (byte {e.start}); narrow the pattern, e.g. dir/**/*.txt"
        ) from None


def _jsonl(path: Path, key: str) -> Iterator[Document]:
    """One document per line: obj[key]. Lazy, so a cap stops reading early."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"data.paths: {where} is not valid JSON ({e})") from None
            text = obj.get(key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"data.paths: {where} has no string field {key!r} (data.jsonl_key)")
            yield Document(where, text)
