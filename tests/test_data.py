"""The data pipeline: corpus formats, tokenizers, prepare (shards + index), the loader's batch order."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

from boost_jax.config import DataConfig
from boost_jax.data import prepare as prepare_mod
from boost_jax.data.build import build_data, check_run_tokenizer
from boost_jax.data.corpus import Corpus, Document, Skipped, files_corpus, stdlib_corpus
from boost_jax.data.loader import Split, TokenWindows
from boost_jax.data.prepare import PrepareConfig, prepare
from boost_jax.data.shards import INDEX, TOKENIZER, read_index
from boost_jax.data.synthetic import write_synthetic
from boost_jax.data.tokenizer import (
    MAX_TRAINED_VOCAB,
    VocabWarning,
    check_vocab_size,
    eos_id,
    load_tokenizer,
    train_tokenizer,
)
from boost_jax.runtime.errors import ConfigError, DataError

CAP = 300_000
VOCAB = 512
TRICKY = (
    "def f(x):\n\treturn  x  +   1\r\n\n    # héllo wörld ünïcödé 日本語 🤖🎉\n"
    "\t\t  mixed \t indent\n\x00\x7f <eos> <0x41> <pad>   trailing   \n\n\n"
)
HAS_SP = importlib.util.find_spec("sentencepiece") is not None
SP = pytest.param("sentencepiece", marks=pytest.mark.skipif(not HAS_SP, reason="pip install 'boost_jax[sentencepiece]'"))
KINDS = ("bpe", "byte_bpe", *(("sentencepiece",) if HAS_SP else ()))  # those trainable here
WORDS = "the quick brown fox jumps over a lazy dog while tokens shards and loaders keep up".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 120))) + f" #{i}" for i in range(n)]


def _text(docs: list[Document]) -> list[str]:
    return [d.text for d in docs]


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    return _text(list(stdlib_corpus(CAP).documents(Skipped())))


@pytest.fixture(scope="module")
def trained(stdlib_texts):
    return {kind: train_tokenizer(kind, VOCAB, stdlib_texts) for kind in KINDS}


@pytest.fixture(scope="module")
def given_tokenizer(tmp_path_factory) -> str:
    """Trained once, for the checks of encoding and resuming (training's own reproducibility is
    tests/test_tokenizer_reproducible.py's)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer("bpe", 300, _docs(600)).save(str(path))
    return str(path)


def _small_cfg(**kw) -> PrepareConfig:
    return PrepareConfig(**{"vocab_size": 300, "val_fraction": 0.1, "chunk_bytes": 20_000, **kw})


# ----------------------------------------------------------------------------- corpus


def test_stdlib_corpus_sample():
    corpus = stdlib_corpus(CAP)
    docs = list(corpus.documents(Skipped()))
    names = [d.name for d in docs]
    assert names == sorted(names) and all(n.endswith(".py") for n in names)
    assert 0.85 * CAP < sum(len(d.text.encode()) for d in docs) <= CAP  # non-UTF-8 fixtures skipped
    assert stdlib_corpus(CAP).fingerprint() == corpus.fingerprint()  # deterministic
    assert len({n[0].lower() for n in names}) >= 6  # a spread over the tree, not the first packages
    root = Path(sysconfig.get_paths()["stdlib"])
    assert all((root / d.name).read_bytes().decode() == d.text for d in docs[:5])
    assert not {p for n in names for p in Path(n).parts} & {"site-packages", "dist-packages", "__pycache__"}


def test_every_format_gives_the_same_documents(tmp_path):
    texts = _docs(40)
    rows = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + "\n"
    (tmp_path / "a.jsonl").write_text(rows)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    pq.write_table(pa.table({"id": list(range(40)), "text": texts}), tmp_path / "d.parquet", row_group_size=7)
    (tmp_path / "e").mkdir()
    for i, t in enumerate(texts[:3]):
        (tmp_path / "e" / f"{i}.txt").write_text(t)
    (tmp_path / "e" / ".hidden").write_text("skipped")
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"):
        docs = list(files_corpus([str(tmp_path / name)]).documents(Skipped()))
        assert _text(docs) == texts, name
    docs = list(files_corpus([str(tmp_path / "e")]).documents(Skipped()))
    assert _text(docs) == texts[:3] and docs[0].name == str(tmp_path / "e" / "0.txt")
    assert list(files_corpus([str(tmp_path / "a.jsonl")]).documents(Skipped()))[1].name == f"{tmp_path}/a.jsonl:2"
    # A glob, in path order; a cap stops before the document that would cross it.
    everything = files_corpus([str(tmp_path / "*")])
    assert len(list(everything.documents(Skipped()))) == 4 * 40 + 3
    first = len(texts[0].encode())
    capped = files_corpus([str(tmp_path / "*")], max_bytes=first + 1)
    assert _text(list(capped.documents(Skipped()))) == texts[:1]


def test_corpus_errors_name_the_problem(tmp_path):
    def read(*paths: str, **kw) -> list[Document]:
        return list(files_corpus(paths, **kw).documents(Skipped()))

    with pytest.raises(DataError, match=r"\*\.zzz.*matches no file"):
        read(str(tmp_path / "*.zzz"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n\n{"text": "also fine"}\n{broken\n')
    with pytest.raises(DataError, match=rf"{bad}:2 is not valid JSON.*--skip-bad-lines"):
        read(str(bad))
    skipped = Skipped()
    docs = list(files_corpus([str(bad)], skip_bad_lines=True).documents(skipped))
    assert _text(docs) == ["fine", "also fine"]
    assert skipped.lines == 2 and skipped.first == [f"{bad}:2", f"{bad}:5"]
    bad.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=rf"{bad}:2 has no string field 'text'"):
        read(str(bad), skip_bad_lines=True)  # a missing field is never skipped: usually the wrong key
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet has no column 'text' \(columns: \['body'\]\)"):
        read(str(tmp_path / "p.parquet"))
    (tmp_path / "blob.bin").write_bytes(b"PK\x03\x04\x00\x00binary")
    with pytest.raises(DataError, match="blob.bin looks binary"):
        read(str(tmp_path / "blob.bin"))
    (tmp_path / "latin.txt").write_bytes("s = 'ü'".encode("latin-1"))
    with pytest.raises(DataError, match="latin.txt looks binary, not UTF-8"):
        read(str(tmp_path / "latin.txt"))
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DataError, match="broken.jsonl.gz cannot be decompressed"):
        read(str(tmp_path / "broken.jsonl.gz"))


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("kind", ["bpe", "byte_bpe", SP])
def test_tokenizer_contract(trained, stdlib_texts, kind):
    tok = trained[kind]
    assert tok.get_vocab_size() == VOCAB  # 300 kB of code has plenty of merges to fill it
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert eos_id(tok) == 2
    ids = tok.encode(TRICKY).ids
    assert tok.decode(ids) == TRICKY  # exact round trip, default decode
    assert not {0, 1, 2} & set(ids)  # "<eos>" in the text stays text
    assert len(ids) < len(TRICKY.encode())  # merges do compress
    assert tok.decode(tok.encode(stdlib_texts[0]).ids) == stdlib_texts[0]
    rng = np.random.default_rng(0)
    # ASCII incl. controls, whitespace runs, Latin-1, CJK, emoji; not U+2581 (see the bpe test).
    pool = [chr(c) for c in [*range(0, 128), *range(0xA0, 0x180), *range(0x4E00, 0x4E40),
                             *range(0x1F600, 0x1F640)]] + ["  ", "    ", "\t\t", "\n\n", "\r\n"]
    texts = ["".join(rng.choice(pool, size=rng.integers(0, 60))) for _ in range(300)]
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        assert tok.decode(enc.ids) == text


@pytest.mark.parametrize("kind", ["bpe", SP])
def test_bpe_byte_fallback_and_metaspace(trained, kind):
    tok = trained[kind]
    assert [tok.id_to_token(i) for i in (3, 4, 258)] == ["<0x00>", "<0x01>", "<0xFF>"]
    ids = tok.encode("🤖").ids  # unseen in training: spelled in UTF-8 bytes
    assert [tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    assert "▁" in tok.id_to_token(tok.encode("a b").ids[-1])  # spaces are SentencePiece's "▁"
    assert tok.encode("<0x41>").ids != [tok.token_to_id("<0x41>")]  # byte pieces are not added tokens
    # The one documented normalisation: a literal U+2581 decodes as a space.
    assert tok.decode(tok.encode("a▁b").ids) == "a b"


def test_vocab_size_bounds_and_small_corpus_warning(stdlib_texts):
    for kind in KINDS:
        tok = train_tokenizer(kind, 300, stdlib_texts[:20])
        assert tok.get_vocab_size() <= 300 and tok.decode(tok.encode(TRICKY).ids) == TRICKY
    for kind in KINDS:
        with pytest.warns(VocabWarning, match=r"reached \d+ tokens, not the requested 4,096.*lower model.vocab_size"):
            tok = train_tokenizer(kind, 4096, ["ab ab ab"])
        assert tok.get_vocab_size() < 4096 and tok.decode(tok.encode(TRICKY).ids) == TRICKY
    # A sample without spaces still keeps "▁" whole: spelled in bytes, later spaces decoded as "▁".
    with pytest.warns(VocabWarning):
        tok = train_tokenizer("bpe", 300, ["日本語" * 30])
    assert tok.decode(tok.encode(TRICKY).ids) == TRICKY
    with pytest.raises(DataError, match="vocab_size=256 .* needs 260 <= vocab_size"):
        check_vocab_size(256, "bpe")
    # Past the bound, the Rust trainer aborts the whole process (exit 134): refused first, by name.
    with pytest.raises(DataError, match=f"vocab_size=5000000000 .* <= {MAX_TRAINED_VOCAB:,}"):
        train_tokenizer("bpe", 5_000_000_000, ["never read"])


def test_load_tokenizer_errors(tmp_path, trained):
    with pytest.raises(DataError, match="missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "corrupt.json").write_text("{}")
    with pytest.raises(DataError, match="corrupt.json is not a tokenizers JSON"):
        load_tokenizer(tmp_path / "corrupt.json")
    path = tmp_path / "tok.json"
    trained["byte_bpe"].save(str(path))
    assert load_tokenizer(path).encode(TRICKY).ids == trained["byte_bpe"].encode(TRICKY).ids


# ----------------------------------------------------------------------------- prepare


@pytest.fixture
def corpus(tmp_path) -> Corpus:
    src = tmp_path / "src"
    src.mkdir()
    texts = _docs(600)
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:300])
    pq.write_table(pa.table({"text": texts[300:]}), src / "b.parquet")
    return files_corpus([str(src)])


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_prepare_writes_shards_and_index(tmp_path, corpus):
    done = prepare(corpus, tmp_path / "out", _small_cfg())
    ix = done.index
    assert ix.dtype == "uint16" and len(ix.splits["train"]) == len(ix.splits["val"]) >= 4  # several chunks
    assert ix.documents("train") + ix.documents("val") == 600 and 30 <= ix.documents("val") <= 90
    assert done.encoded_tokens == ix.tokens("train") + ix.tokens("val")
    tok = load_tokenizer(tmp_path / "out" / TOKENIZER)
    train = np.concatenate([np.fromfile(tmp_path / "out" / s.file, ix.dtype) for s in ix.splits["train"]])
    assert (train == ix.eos_id).sum() == ix.documents("train") and train[-1] == ix.eos_id
    assert train.max() == max(s.max_id for s in ix.splits["train"]) < ix.vocab_size
    # Documents come back whole and in order; val ones are missing from train.
    texts = _text(list(corpus.documents(Skipped())))
    decoded = tok.decode(train.tolist(), skip_special_tokens=False).split("<eos>")[:-1]
    assert len(decoded) == ix.documents("train") and set(decoded) < set(texts)
    assert sorted(os.listdir(tmp_path / "out"))[:2] == [INDEX, TOKENIZER]  # no temp files, no .parts


def test_prepare_is_deterministic_across_runs_and_workers(tmp_path, corpus, given_tokenizer):
    one = prepare(corpus, tmp_path / "one", _small_cfg(tokenizer_path=given_tokenizer))
    two = prepare(corpus, tmp_path / "two", _small_cfg(tokenizer_path=given_tokenizer, workers=2))  # spawned
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert one.index == two.index
    again = prepare(corpus, tmp_path / "one", _small_cfg(tokenizer_path=given_tokenizer))  # done: nothing encoded
    assert again.encoded_bytes == 0 and again.index == one.index


@pytest.mark.parametrize("given", [True, False])
def test_interrupted_prepare_resumes(tmp_path, corpus, monkeypatch, given_tokenizer, given):
    cfg = _small_cfg(tokenizer_path=given_tokenizer if given else "")
    closes = []
    real_close = prepare_mod._Writer.close

    def crash_on_third(self):
        if len(closes) == 2:
            raise KeyboardInterrupt  # killed mid-prepare
        closes.append(self.chunk)
        real_close(self)

    monkeypatch.setattr(prepare_mod._Writer, "close", crash_on_third)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, cfg)
    assert not (out / INDEX).exists()  # an interrupted dataset never looks complete
    with pytest.raises(DataError, match="not a prepared dataset"):
        read_index(out)
    monkeypatch.setattr(prepare_mod._Writer, "close", real_close)
    first_shard = (out / "train-00000.bin").read_bytes(), (out / "train-00000.bin").stat().st_mtime_ns
    partial_tok = None if given else (out / ".parts" / TOKENIZER).read_bytes()
    resumed = prepare(corpus, out, cfg)
    assert ((out / "train-00000.bin").read_bytes(), (out / "train-00000.bin").stat().st_mtime_ns) == first_shard
    if given:  # byte-for-byte what an uninterrupted prepare writes
        clean = prepare(corpus, tmp_path / "clean", cfg)
        assert 0 < resumed.encoded_bytes < clean.encoded_bytes
        assert _files(out) == _files(tmp_path / "clean")
    else:  # the tokenizer trained before the interruption is the one the finished dataset carries
        assert load_tokenizer(out / TOKENIZER).to_str() == Tokenizer.from_str(partial_tok.decode()).to_str()
        assert resumed.index.documents("train") + resumed.index.documents("val") == 600


def test_prepare_refuses_what_it_would_damage(tmp_path, corpus):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty and not a prepared dataset"):
        prepare(corpus, other, _small_cfg())
    assert os.listdir(other) == ["notes.txt"]
    prepare(corpus, tmp_path / "out", _small_cfg())
    before = _files(tmp_path / "out")
    with pytest.raises(DataError, match="prepared from other inputs or settings"):
        prepare(corpus, tmp_path / "out", _small_cfg(val_fraction=0.2))
    assert _files(tmp_path / "out") == before
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="holds no documents"):
        prepare(files_corpus([str(empty)]), tmp_path / "e", _small_cfg())


def test_index_must_match_shards_and_tokenizer(tmp_path, corpus, trained):
    out = tmp_path / "out"
    prepare(corpus, out, _small_cfg())
    cfg = DataConfig(source="prepared", path=str(out))
    build_data(cfg, vocab_size=300, seq_len=16, seed=0)
    with pytest.raises(DataError, match="has 3.. tokens, more than model.vocab_size=280"):
        build_data(cfg, vocab_size=280, seq_len=16, seed=0)
    other_tok = tmp_path / "other.json"
    trained["bpe"].save(str(other_tok))
    with pytest.raises(DataError, match="is not the tokenizer .* was prepared with"):
        build_data(DataConfig(source="prepared", path=str(out), tokenizer_path=str(other_tok)),
                   vocab_size=VOCAB, seq_len=16, seed=0)
    with pytest.raises(DataError, match="does not match the run's"):
        check_run_tokenizer(load_tokenizer(out / TOKENIZER), other_tok)
    shard = out / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="train-00001.bin does not match .*index.json"):
        build_data(cfg, vocab_size=300, seq_len=16, seed=0)
    shard.write_bytes(shard.read_bytes() + b"\0\0")  # the size matches again
    (out / TOKENIZER).write_bytes(other_tok.read_bytes())
    with pytest.raises(DataError, match="tokenizer.json is not the tokenizer"):
        build_data(cfg, vocab_size=VOCAB, seq_len=16, seed=0)
    with pytest.raises(DataError, match="no index.json"):
        build_data(DataConfig(source="prepared", path=str(tmp_path)), vocab_size=300, seq_len=16, seed=0)


def test_out_of_vocab_ids_are_never_trusted(tmp_path):
    """Issue 10: a well-formed dataset with ids past the vocab gave NaN from step 1."""
    write_synthetic(tmp_path / "syn", [5000], vocab_size=300)
    shard = tmp_path / "syn" / "train-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[1234] = 299 + 7  # the index still says max_id < 300: the bytes were altered afterwards
    ids.tofile(shard)
    data = build_data(DataConfig(source="prepared", path=str(tmp_path / "syn")), vocab_size=300, seq_len=16, seed=0)
    bad_window = 1234 // 16
    with pytest.raises(DataError, match=f"token id 306 in window {bad_window} is not below .*vocab_size=300"):
        data.train.windows[bad_window]
    with pytest.raises(DataError, match="token id 306"):
        data.train.eval_batches(40, 8)  # 320 windows in order: window 77 among them
    with pytest.raises(DataError, match="token id 306"):
        for _ in data.train.batches(0, 8):  # the prefetch thread's error reaches the training loop
            pass


def test_damaged_cache_is_rebuilt(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(200)))
    cfg = DataConfig(source="files", paths=(str(src),), cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    data = build_data(cfg, vocab_size=300, seq_len=16, seed=0)
    want = data.train.batch(3, 4)["inputs"]
    shard = data.directory / "train-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[:50] = 299 + 1
    ids.tofile(shard)  # same size: only reading the ids finds it
    rebuilt = build_data(cfg, vocab_size=300, seq_len=16, seed=0)
    assert rebuilt.directory == data.directory and np.fromfile(shard, np.uint16).max() < 300
    assert rebuilt.stats["train_documents"] == data.stats["train_documents"]
    assert rebuilt.train.batch(3, 4)["inputs"].shape == want.shape


def test_a_cache_missing_its_index_is_rebuilt(tmp_path):
    """Like a truncated shard: a cached dataset without its index.json (and no interrupted prepare to
    finish) is rebuilt, not refused with "choose another --out", a flag `train` does not have."""
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(200)))
    cfg = DataConfig(source="files", paths=(str(src),), cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    data = build_data(cfg, vocab_size=300, seq_len=16, seed=0)
    (data.directory / INDEX).unlink()
    rebuilt = build_data(cfg, vocab_size=300, seq_len=16, seed=0)
    assert rebuilt.directory == data.directory and (data.directory / INDEX).is_file()
    assert rebuilt.stats["train_documents"] == data.stats["train_documents"]


def test_cli_prepare_refuses_a_val_fraction_that_holds_out_no_document(tmp_path):
    """30 documents at the default val fraction (the config's data.val_fraction): none of these
    hashes below it, so eval would have no data. Refused before anything is written, with the
    fraction that holds one out, which then does."""
    from boost_jax.data.__main__ import main

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(30, seed=5)))
    out, args = tmp_path / "out", ["--vocab-size", "300", "--workers", "1", "--no-progress"]
    with pytest.raises(SystemExit, match=f"--val-fraction {DataConfig.val_fraction} holds out none of the corpus's "
                                         "30 documents .*: --val-fraction 0.08 holds out one"):
        main(["prepare", str(src), "--out", str(out), *args])
    assert not out.exists()
    main(["prepare", str(src), "--out", str(out), "--val-fraction", "0.08", *args])
    assert read_index(out).documents("val") == 1


# A prepare's worker pool in a process of its own: the pids of its workers and resource tracker, then a wait.
POOL_PARENT = """
import os, time
from multiprocessing import resource_tracker
from tokenizers import Tokenizer, models
from boost_jax.data import encode, prepare
pool = prepare._pool(2, encode.EncodeSettings(Tokenizer(models.BPE()).to_str(), 0, "<u2", 0.1))
list(pool.map(time.sleep, [0.5, 0.5]))  # both workers started
print(*pool._processes, resource_tracker._resource_tracker._pid, flush=True)
time.sleep(120)
"""


def test_a_prepares_workers_die_with_it(tmp_path):
    """kill -9 of `data prepare --workers 2` left its workers and multiprocessing's resource tracker
    running: the workers now die with their parent, and the tracker ends with them."""
    parent = subprocess.Popen([sys.executable, "-c", POOL_PARENT], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    alive = lambda: [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
    try:
        assert len(pids) == 3 and len(alive()) == 3
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive()
    finally:
        for p in alive():
            os.kill(p, 9)


def _state(pid: int) -> str:
    """A process's state letter (Z: a zombie, ended and not yet reaped), "" once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# ----------------------------------------------------------------------------- loader


@pytest.fixture
def syn(tmp_path) -> tuple[Path, np.ndarray]:
    """Odd shard sizes (one shorter than a window) so windows cross shard boundaries."""
    write_synthetic(tmp_path / "syn", [1000, 7, 333, 2000], vocab_size=300)
    ix = read_index(tmp_path / "syn")
    tokens = np.concatenate([np.fromfile(tmp_path / "syn" / s.file, ix.dtype) for s in ix.splits["train"]])
    return tmp_path / "syn", tokens


def _split(directory: Path, seq_len: int, seed: int = 0) -> Split:
    ix = read_index(directory)
    return Split(TokenWindows(directory, ix.splits["train"], ix.dtype, seq_len, ix.vocab_size), seed=seed, name="train")


def test_windows_cross_shard_boundaries(syn):
    directory, tokens = syn
    ds = _split(directory, seq_len=16)
    assert ds.num_windows == (3340 - 1) // 16
    for w in range(ds.num_windows):  # windows 62-63 span shard 0 -> 1 -> 2
        np.testing.assert_array_equal(ds.windows[w], tokens[w * 16 : w * 16 + 17])
    b = ds.batch(3, 4)
    assert b["inputs"].shape == b["targets"].shape == (4, 16) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])


def test_batches_are_a_pure_function_of_seed_and_step(syn):
    directory, _ = syn
    a, b = _split(directory, 16, seed=1), _split(directory, 16, seed=1)
    for step in (0, 5, 60):  # 60 is in the second epoch
        np.testing.assert_array_equal(a.batch(step, 4)["inputs"], b.batch(step, 4)["inputs"])
    assert not np.array_equal(a.batch(0, 4)["inputs"], a.batch(1, 4)["inputs"])
    assert not np.array_equal(a.batch(0, 4)["inputs"], _split(directory, 16, seed=2).batch(0, 4)["inputs"])


def test_every_window_once_per_epoch(syn):
    directory, tokens = syn
    ds = _split(directory, 16)
    n, batch = ds.num_windows, 5  # 208 windows: batches straddle epochs
    starts = np.concatenate([ds.batch(s, batch)["inputs"] for s in range(-(-2 * n // batch))])
    pos = {tuple(tokens[w * 16 : w * 16 + 16]): w for w in range(n)}
    order = [pos[tuple(row)] for row in starts[: 2 * n]]
    first, second = order[:n], order[n:]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert first != second and first != list(range(n))  # shuffled, each epoch its own order


def test_resume_is_exact_and_prefetch_matches(syn):
    directory, _ = syn
    ds = _split(directory, 16, seed=4)
    it = ds.batches(7, 8)
    for step in range(7, 40):  # across the epoch boundary at 208 / 8 = 26
        got = next(it)
        np.testing.assert_array_equal(got["inputs"], ds.batch(step, 8)["inputs"])
        np.testing.assert_array_equal(got["targets"], ds.batch(step, 8)["targets"])


def test_process_slices_make_the_global_batch(syn):
    directory, _ = syn
    ds = _split(directory, 16, seed=3)
    for step in (0, 7, 30):
        full = ds.batch(step, 8)
        parts = [ds.batch(step, 8, process_index=p, process_count=4) for p in range(4)]
        for k in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])
        local = next(ds.batches(step, 8, process_index=2, process_count=4))
        np.testing.assert_array_equal(local["inputs"], parts[2]["inputs"])
    with pytest.raises(ConfigError, match="divisible"):
        ds.batch(0, 8, process_index=0, process_count=3)


def test_eval_batches_in_order_and_cycling(tmp_path):
    write_synthetic(tmp_path, [100], vocab_size=300)
    ds = _split(tmp_path, seq_len=10)  # 9 windows
    evals = ds.eval_batches(3, 4)
    firsts = [ds.windows[w][0] for w in [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]]
    np.testing.assert_array_equal(np.concatenate([b["inputs"][:, 0] for b in evals]), firsts)
    halves = ds.eval_batches(1, 4, process_index=1, process_count=2)[0]
    np.testing.assert_array_equal(halves["inputs"][:, 0], firsts[2:4])


def test_too_little_data(tmp_path):
    write_synthetic(tmp_path, [5], vocab_size=300)
    with pytest.raises(ConfigError, match="5 tokens.*seq_len\\+1=9"):
        _split(tmp_path, seq_len=8)
    with pytest.raises(ConfigError, match="0 windows of seq_len=4|windows of seq_len=4.*batch_size=16"):
        _split(tmp_path, seq_len=4).batch(0, 16)


# ----------------------------------------------------------------------------- end to end


def test_build_data_stdlib_quickstart(tmp_path):
    cfg = DataConfig(max_bytes=CAP, val_fraction=0.1, cache_dir=str(tmp_path))
    data = build_data(cfg, vocab_size=VOCAB, seq_len=64, seed=0)
    s = data.stats
    assert s["documents"] == s["train_documents"] + s["val_documents"] and s["val_documents"] >= 1
    assert s["vocab_size"] == VOCAB and data.val is not None
    assert data.directory.parent == tmp_path / "prepared"  # the same format and loader as prepared data
    b = data.train.batch(0, 8)
    assert b["inputs"].max() < VOCAB
    written = {p: p.stat().st_mtime_ns for p in data.directory.rglob("*") if p.is_file()}
    warm = build_data(cfg, vocab_size=VOCAB, seq_len=64, seed=0)  # cached: nothing re-encoded
    assert warm.directory == data.directory
    assert {p: p.stat().st_mtime_ns for p in data.directory.rglob("*") if p.is_file()} == written  # nothing rewritten
    np.testing.assert_array_equal(warm.train.batch(0, 8)["inputs"], b["inputs"])


@pytest.mark.slow  # command-line processes
def test_cli_prepare_and_one_line_errors(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(100)) + "{oops\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("BOOST_JAX_DEBUG", None)
    run = lambda *a: subprocess.run([sys.executable, "-m", "boost_jax.data", *a], capture_output=True,
                                    text=True, env=env)
    r = run("prepare", str(src), "--out", str(tmp_path / "out"), "--vocab-size", "300", "--workers", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[0] == (
        f"data error: {src}:101 is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)); --skip-bad-lines passes over such lines (counted and reported)")
    r = run("prepare", str(src), "--out", str(tmp_path / "out"), "--vocab-size", "300", "--workers", "1",
            "--skip-bad-lines", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"skipped 1 malformed lines (first: {src}:101)" in r.stdout and "MB/s" in r.stdout
    r = run("--debug", "prepare", str(tmp_path / "nothing*"), "--out", str(tmp_path / "o2"))
    assert r.returncode == 1 and "Traceback" in r.stderr and "DataError" in r.stderr


@pytest.mark.slow  # two prepares and a 10 s wait
def test_processes_sharing_a_cold_cache_prepare_it_once(tmp_path):
    """The hosts of a multi-process run start together on an empty shared cache: one prepares the
    dataset while the others wait for it (two preparers deleted each other's parts: FileNotFoundError
    in a 2-process test run). Here this process holds the dataset's lock: a build started meanwhile
    writes nothing until it is released, then reads a complete dataset."""
    import fcntl
    import time

    cfg = lambda root: DataConfig(cache_dir=str(root), max_bytes=300_000)
    build_data(cfg(tmp_path / "first"), vocab_size=512, seq_len=16, seed=0)
    (name,) = [d.name for d in (tmp_path / "first" / "prepared").iterdir() if d.is_dir()]
    shared = tmp_path / "shared" / "prepared"
    shared.mkdir(parents=True)
    code = ("import sys; from boost_jax.config import DataConfig; from boost_jax.data.build import build_data; "
            "build_data(DataConfig(cache_dir=sys.argv[1], max_bytes=300_000), vocab_size=512, seq_len=16, seed=0)")
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "shared")], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        before = []  # until it reaches the lock, says so, and waits (or exits)
        while (line := proc.stdout.readline()) and not line.startswith("waiting for another process"):
            before.append(line)
        time.sleep(1)  # long enough to see it write anything (a prepare of 300 kB takes ~3 s)
        assert name in line, "".join(before)
        assert proc.poll() is None and not (shared / name).exists()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert read_index(shared / name).splits == read_index(tmp_path / "first" / "prepared" / name).splits
