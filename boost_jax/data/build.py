"""`build_data`: the prepared dataset a run reads, opened and checked against the run.

data.source=prepared opens data.path. stdlib and files are prepared into the cache (keyed by the
corpus fingerprint and the recipe) on first use, so every run reads the same format through one loader.
data.source=mixture opens each prepared dataset of data.mixture (one tokenizer) and draws batches
from them by their weights (data/mixture.py).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from boost_jax.config import DataConfig, mixture_name
from boost_jax.data.corpus import Corpus, expand, files_corpus, stdlib_corpus
from boost_jax.data.instruct import Recipe, chat_tokens, is_prepared, open_prepared, prepare_instruct
from boost_jax.data.loader import Split, TokenWindows
from boost_jax.data.mixture import Mixture, dataset_seed
from boost_jax.data.packing import PackedSplit
from boost_jax.data.prepare import PrepareConfig, prepare, resumes
from boost_jax.data.shards import INDEX, TOKENIZER, Index, read_index, verify_ids
from boost_jax.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash
from boost_jax.runtime.cache import cache_root, digest
from boost_jax.runtime.errors import DataError


@dataclass(frozen=True)
class Data:
    directory: Path  # the prepared dataset (a mixture's first)
    tokenizer: Tokenizer
    train: Split | Mixture | PackedSplit
    val: Split | PackedSplit | None  # None when the dataset has no val documents, or for a mixture (`parts`)
    eos_id: int
    stats: dict[str, float]  # sizes and seconds spent, for the caller to log
    parts: dict[str, tuple[Split, Split | None]] = field(default_factory=dict)  # a mixture's (train, val) by name

    def eval_sets(self, split: str) -> dict[str, Split]:
        """What an eval of `split` reads, by dataset name: a mixture's datasets, or "" for the one."""
        pick = lambda train, val: val if split == "val" else train
        sets = {name: pick(*p) for name, p in self.parts.items()} if self.parts else {"": pick(self.train, self.val)}
        return {name: s for name, s in sets.items() if s is not None}


def build_data(cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int, batch_size: int = 0,
               completion_only: bool = False) -> Data:
    """Open (preparing first for stdlib / files) and check the dataset. Prints nothing. `batch_size`:
    the global batch a mixture draws (data.source=mixture only); `completion_only`: only completions
    are targets (train.loss_on, instruction data only)."""
    t0 = time.perf_counter()
    if cfg.format != "text":
        return _instruct(cfg, vocab_size=vocab_size, seq_len=seq_len, seed=seed, completion_only=completion_only)
    if cfg.source == "mixture":
        return _mixture(cfg, vocab_size=vocab_size, seq_len=seq_len, seed=seed, batch_size=batch_size)
    if cfg.source == "prepared":
        directory = Path(cfg.path).expanduser()
        if is_prepared(directory):
            raise DataError(f"{directory} holds instruction rows: set data.format to the format it was prepared "
                            "with (chat or prompt_completion)")
        index, tok = _open(directory)
    else:
        directory, index, tok = _cached(cfg, vocab_size)
    _check_run(directory, index, cfg, vocab_size)
    t1 = time.perf_counter()
    eos = index.eos_id if cfg.document_mask else None  # batches number their documents (segment_ids)
    split = lambda name: Split(TokenWindows(directory, index.splits[name], index.dtype, seq_len, index.vocab_size),
                               seed=seed, name=name, eos_id=eos)
    stats: dict[str, float] = {
        "documents": index.documents("train") + index.documents("val"),
        "train_documents": index.documents("train"), "val_documents": index.documents("val"),
        "vocab_size": index.vocab_size, "train_tokens": index.tokens("train"), "val_tokens": index.tokens("val"),
        "skipped_lines": index.stats["skipped_lines"], "prepare_seconds": t1 - t0,
    }
    return Data(directory, tok, split("train"), split("val") if index.tokens("val") else None, index.eos_id, stats)


def _instruct(cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int, completion_only: bool) -> Data:
    """Instruction rows (data.format=chat / prompt_completion), encoded into the cache on first use
    (or a prepared instruction dataset), packed whole into windows (data/packing.py)."""
    t0 = time.perf_counter()
    if cfg.source == "prepared":
        directory = Path(cfg.path).expanduser()
        if not is_prepared(directory):
            raise DataError(f"data.format={cfg.format}: {directory} is not a prepared instruction dataset "
                            f"(python -m boost_jax.data prepare --format {cfg.format} ...)")
    else:
        tok = load_tokenizer(Path(cfg.tokenizer_path).expanduser())
        recipe = Recipe(cfg.format, completion_only, seq_len + 1, cfg.truncate, cfg.val_fraction, cfg.chat_template)
        chat = chat_tokens(tok, cfg.tokenizer_path, cfg.chat_template) if cfg.format == "chat" else None
        files = expand(cfg.paths)
        directory = cache_root(cfg.cache_dir) / "instruct" / digest(
            Corpus(files).fingerprint(), tokenizer_hash(tok), json.dumps(recipe.key(chat)))
        if not is_prepared(directory):
            prepare_instruct(files, directory, tok, chat, recipe)
    index, tok, docs = open_prepared(directory)
    recipe = index["recipe"]
    if recipe["format"] != cfg.format:
        raise DataError(f"{directory} holds data.format={recipe['format']} rows, not {cfg.format}")
    if recipe["completion_only"] != completion_only:
        raise DataError(f"{directory} was prepared with train.loss_on="
                        f"{'completion' if recipe['completion_only'] else 'all'}: set it so, or prepare again")
    if (longest := max((int(d.lengths.max()) for d in docs.values() if d.count), default=0)) > seq_len + 1:
        raise DataError(f"{directory} holds a row of {longest} tokens, longer than a window of train.seq_len + 1 = "
                        f"{seq_len + 1}: raise train.seq_len or prepare again with --seq-len {seq_len}")
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"{directory / 'tokenizer.json'} has {tok.get_vocab_size():,} tokens, more than "
                        f"model.vocab_size={vocab_size:,}")
    eos = eos_id(tok)
    split = lambda name: PackedSplit(docs[name], seq_len=seq_len, seed=seed, name=name, pad_id=eos)
    train = split("train")
    stats = {**index["stats"], "documents": docs["train"].count + docs["val"].count, "vocab_size": tok.get_vocab_size(),
             "fill": train.fill(), "prepare_seconds": time.perf_counter() - t0}
    return Data(directory, tok, train, split("val") if docs["val"].count else None, eos, stats)


def _mixture(cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int, batch_size: int) -> Data:
    """The prepared datasets of data.mixture, checked to share one tokenizer, mixed by their weights."""
    t0 = time.perf_counter()
    opened = {}
    for i, entry in enumerate(cfg.mixture):
        directory = Path(entry.path).expanduser()
        try:
            index, tok = _open(directory)
        except DataError as e:
            raise DataError(f"data.mixture[{i}].path: {e}") from None
        _check_run(directory, index, cfg, vocab_size)
        opened[mixture_name(entry)] = (directory, index, tok)
    (first, (directory, index, tok)), *others = opened.items()
    for name, (other_dir, other, _) in others:
        if other.tokenizer_sha256 != index.tokenizer_sha256:
            raise DataError(f"data.mixture: {name} ({other_dir}) was prepared with another tokenizer than {first} "
                            f"({directory}): their token ids mean other things; prepare every dataset of a mixture "
                            "with one tokenizer (python -m boost_jax.data prepare --tokenizer PATH)")
    eos = index.eos_id if cfg.document_mask else None
    parts = {}
    for name, (d, ix, _) in opened.items():
        split = lambda which: Split(TokenWindows(d, ix.splits[which], ix.dtype, seq_len, ix.vocab_size),
                                    seed=dataset_seed(seed, name), name=f"{name} {which}", eos_id=eos)
        parts[name] = (split("train"), split("val") if ix.tokens("val") else None)
    weights = {mixture_name(e): e.weight for e in cfg.mixture}
    train = Mixture({name: p[0] for name, p in parts.items()}, weights, batch_size)
    total = lambda of: sum(of(ix) for _, ix, _ in opened.values())
    stats: dict[str, float] = {
        "documents": total(lambda ix: ix.documents("train") + ix.documents("val")),
        "train_documents": total(lambda ix: ix.documents("train")), "val_documents": total(lambda ix: ix.documents("val")),
        "vocab_size": index.vocab_size, "train_tokens": total(lambda ix: ix.tokens("train")),
        "val_tokens": total(lambda ix: ix.tokens("val")), "prepare_seconds": time.perf_counter() - t0,
    }
    return Data(directory, tok, train, None, index.eos_id, stats, parts)


def check_run_tokenizer(tok: Tokenizer, saved: Path, dataset: Path | None = None) -> None:
    """A resumed run must read ids of the tokenizer it was trained with (saved in its run dir);
    `dataset`, where the caller's user chose it, is named."""
    if saved.is_file() and tokenizer_hash(load_tokenizer(saved)) != tokenizer_hash(tok):
        chosen = f" (not {dataset})" if dataset else ""
        raise DataError(f"the dataset's tokenizer does not match the run's ({saved}): its token ids mean "
                        f"other things; use the run's dataset{chosen} or a new run_dir")


def _open(directory: Path) -> tuple[Index, Tokenizer]:
    """Index and tokenizer of a prepared dataset, checked against each other and the shards' sizes."""
    index = read_index(directory)
    tok = load_tokenizer(directory / TOKENIZER)
    if tokenizer_hash(tok) != index.tokenizer_sha256 or tok.get_vocab_size() != index.vocab_size:
        raise DataError(f"{directory / TOKENIZER} is not the tokenizer {directory / INDEX} was prepared "
                        "with; prepare the dataset again")
    bad = [s.file for split in index.splits.values() for s in split if s.max_id >= index.vocab_size]
    if bad:
        raise DataError(f"{directory}: shards {bad} hold token ids >= the tokenizer's vocab_size="
                        f"{index.vocab_size:,}; prepare the dataset again")
    return index, tok


def _cached(cfg: DataConfig, vocab_size: int) -> tuple[Path, Index, Tokenizer]:
    corpus = (stdlib_corpus(cfg.max_bytes) if cfg.source == "stdlib"
              else files_corpus(cfg.paths, cfg.text_key, cfg.max_bytes))
    pcfg = PrepareConfig(vocab_size=vocab_size, tokenizer=cfg.tokenizer, tokenizer_path=cfg.tokenizer_path,
                         val_fraction=cfg.val_fraction)
    given = tokenizer_hash(load_tokenizer(Path(cfg.tokenizer_path).expanduser())) if cfg.tokenizer_path else ""
    directory = cache_root(cfg.cache_dir) / "prepared" / digest(corpus.fingerprint(), json.dumps(pcfg.recipe(given)))
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Processes sharing a cache (the hosts of one run, two runs) prepare it once: the first builds it
    # under the lock, the others wait and read its result (two preparers would delete each other's parts).
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # say why this process is idle, then wait
            print(f"waiting for another process to prepare {directory}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / INDEX).is_file():
            try:
                index, tok = _open(directory)
                verify_ids(directory, index)  # a cache is bounded by data.max_bytes: read it all
                return directory, index, tok
            except DataError:
                shutil.rmtree(directory)  # damaged or altered: rebuilt, never trusted
        elif directory.exists() and not resumes(corpus, directory, pcfg):
            shutil.rmtree(directory)  # its index lost, and no interrupted prepare to go on from: rebuilt too
        prepare(corpus, directory, pcfg)
        return directory, *_open(directory)


def _check_run(directory: Path, index: Index, cfg: DataConfig, vocab_size: int) -> None:
    if cfg.source in ("prepared", "mixture") and cfg.tokenizer_path:
        given = load_tokenizer(Path(cfg.tokenizer_path).expanduser())
        if tokenizer_hash(given) != index.tokenizer_sha256:
            raise DataError(f"data.tokenizer_path={cfg.tokenizer_path} is not the tokenizer {directory} was "
                            f"prepared with; drop data.tokenizer_path or prepare with it")
    if index.vocab_size > vocab_size:
        raise DataError(f"{directory / TOKENIZER} has {index.vocab_size:,} tokens, more than "
                        f"model.vocab_size={vocab_size:,}")
