"""The data pipeline: corpus, split, tokenizers, token cache, packed windows and batch order."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from boost_jax.config import ConfigError, DataConfig
from boost_jax.data import (
    Document, PackedDataset, build_data, corpus_fingerprint, eos_id, get_tokenizer, load_documents,
    split_documents,
)
from boost_jax.data import tokenizer as tokenizer_mod
from boost_jax.data.corpus import _unit_hash

CAP = 300_000
VOCAB = 512
TRICKY = (
    "def f(x):\n\treturn  x  +   1\r\n\n    # héllo wörld ünïcödé 日本語 🤖🎉\n"
    "\t\t  mixed \t indent\n\x00\x7f <eos> <0x41> <pad>   trailing   \n\n\n"
)


@pytest.fixture(scope="module")
def stdlib_docs() -> list[Document]:
    return load_documents(DataConfig(max_bytes=CAP))


def _size(docs: list[Document]) -> int:
    return sum(len(d.text.encode()) for d in docs)


# ----------------------------------------------------------------------------- corpus


def test_stdlib_corpus_sample(stdlib_docs):
    names = [d.name for d in stdlib_docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(n.endswith(".py") for n in names)
    assert 0.9 * CAP < _size(stdlib_docs) <= CAP  # fills the cap without crossing it
    assert load_documents(DataConfig(max_bytes=CAP)) == stdlib_docs  # deterministic
    # A spread over the tree, not the alphabetically first packages.
    assert len({n[0].lower() for n in names}) >= 6
    # val holds close to 10% of the characters, never more.
    _, val = split_documents(stdlib_docs, 0.1)
    chars = lambda docs: sum(len(d.text) for d in docs)
    assert 0.08 * chars(stdlib_docs) <= chars(val) <= 0.1 * chars(stdlib_docs)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert all((root / d.name).read_bytes().decode() == d.text for d in stdlib_docs[:5])


def test_stdlib_corpus_whole_tree_excludes_installed():
    docs = load_documents(DataConfig(max_bytes=0))
    parts = {p for d in docs for p in Path(d.name).parts}
    assert not parts & {"site-packages", "dist-packages", "__pycache__"}
    assert {"os.py", "json/__init__.py"} <= {d.name for d in docs}
    assert _size(docs) > 5_000_000


def test_stdlib_corpus_rules_on_fake_tree(tmp_path, monkeypatch):
    for rel, data in {
        "a.py": b"a = 1\r\n", "pkg/b.py": "s = 'ü'\n".encode(), "notes.txt": b"not python",
        "site-packages/x.py": b"x", "dist-packages/y.py": b"y", "pkg/__pycache__/b.py": b"c",
        "latin1.py": "s = 'ü'".encode("latin-1"),
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    docs = load_documents(DataConfig())
    assert docs == [Document("a.py", "a = 1\r\n"), Document("pkg/b.py", "s = 'ü'\n")]


def test_files_source(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("alpha")
    (tmp_path / "d" / "sub" / "b.md").write_text("# beta")
    (tmp_path / "d" / ".hidden").write_text("skipped")
    rows = [{"text": "one", "id": 1}, {"text": "two"}]
    (tmp_path / "c.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n\n")
    (tmp_path / "e.txt").write_text("epsilon")
    cfg = DataConfig(source="files", paths=(str(tmp_path / "d"), str(tmp_path / "*.jsonl")))
    got = {d.name: d.text for d in load_documents(cfg)}
    jl = str(tmp_path / "c.jsonl")
    assert got == {
        str(tmp_path / "d" / "a.txt"): "alpha", str(tmp_path / "d" / "sub" / "b.md"): "# beta",
        f"{jl}:1": "one", f"{jl}:2": "two",
    }
    # A cap takes a prefix in path order: d/... sorts after c.jsonl.
    capped = load_documents(DataConfig(source="files", paths=(str(tmp_path / "*"),), max_bytes=6))
    assert [d.text for d in capped] == ["one", "two"]


def test_files_source_errors(tmp_path):
    def load(*paths: str, **kw) -> list[Document]:
        return load_documents(DataConfig(source="files", paths=paths, **kw))

    with pytest.raises(ConfigError, match="nope.txt"):
        load(str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match=r"\*\.zzz"):
        load(str(tmp_path / "*.zzz"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=rf"{bad}:2.*not valid JSON"):
        load(str(bad))
    bad.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(ConfigError, match=rf"{bad}:2.*'text'"):
        load(str(bad))
    bad.write_text('{"text": 3}\n')
    with pytest.raises(ConfigError, match=rf"{bad}:1"):
        load(str(bad))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="blob.bin.*UTF-8"):
        load(str(binary))


# ----------------------------------------------------------------------------- split


def test_split_is_stable_disjoint_and_sized():
    docs = [Document(f"doc{i}.py", str(i)) for i in range(2000)]
    train, val = split_documents(docs, 0.1)
    assert split_documents(docs, 0.1) == (train, val)
    _, val_reversed = split_documents(docs[::-1], 0.1)
    assert {d.name for d in val_reversed} == {d.name for d in val}  # input order does not matter
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert sorted(train + val, key=lambda d: d.name) == sorted(docs, key=lambda d: d.name)
    total = sum(len(d.text) for d in docs)
    assert 0.1 * total - 4 < sum(len(d.text) for d in val) <= 0.1 * total  # docs are 1-4 chars
    # Equal sizes: val is exactly a prefix of the documents in stable-hash order (name alone).
    same = [Document(f"doc{i}.py", "x") for i in range(100)]
    train, val = split_documents(same, 0.1)
    order = lambda d: _unit_hash("split", d.name)
    assert len(val) == 10 and max(map(order, val)) < min(map(order, train))


def test_split_edge_cases():
    two = [Document("a", "x"), Document("b", "y")]
    train, val = split_documents(two, 0.001)
    assert len(train) == len(val) == 1
    train, val = split_documents(two, 0.999)
    assert len(train) == len(val) == 1
    assert split_documents(two, 0.0) == (two, [])
    with pytest.raises(ConfigError, match="at least 2 documents"):
        split_documents(two[:1], 0.1)


def test_fingerprint():
    a = [Document("a", "xy"), Document("b", "z")]
    assert corpus_fingerprint(a) == corpus_fingerprint(list(a))
    assert corpus_fingerprint(a) != corpus_fingerprint([Document("a", "x"), Document("b", "yz")])
    assert corpus_fingerprint(a) != corpus_fingerprint([Document("a", "xy"), Document("c", "z")])


# ----------------------------------------------------------------------------- tokenizers


def _train(tmp_path: Path, docs: list[Document], kind: str, vocab: int = VOCAB):
    cfg = DataConfig(tokenizer=kind, cache_dir=str(tmp_path))
    return get_tokenizer(cfg, vocab, docs, corpus_fingerprint(docs)), cfg


@pytest.mark.parametrize("kind", ["bpe", "byte_bpe"])
def test_tokenizer_contract(tmp_path, stdlib_docs, kind):
    tok, _ = _train(tmp_path, stdlib_docs, kind)
    assert tok.get_vocab_size() == VOCAB  # 300 kB of code has plenty of merges to fill it
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert eos_id(tok) == 2
    ids = tok.encode(TRICKY).ids
    assert tok.decode(ids) == TRICKY  # exact round trip, default decode
    assert not {0, 1, 2} & set(ids)  # "<eos>" in the text stays text
    assert len(ids) < len(TRICKY.encode())  # merges do compress
    sample = stdlib_docs[0].text
    assert tok.decode(tok.encode(sample).ids) == sample


@pytest.mark.parametrize("kind", ["bpe", "byte_bpe"])
def test_tokenizer_round_trip_fuzz(tmp_path, stdlib_docs, kind):
    tok, _ = _train(tmp_path, stdlib_docs, kind)
    rng = np.random.default_rng(0)
    # ASCII incl. controls, whitespace runs, Latin-1, CJK, emoji; not U+2581 (see the bpe test).
    pool = [chr(c) for c in [*range(0, 128), *range(0xA0, 0x180), *range(0x4E00, 0x4E40),
                             *range(0x1F600, 0x1F640)]] + ["  ", "    ", "\t\t", "\n\n", "\r\n"]
    texts = ["".join(rng.choice(pool, size=rng.integers(0, 60))) for _ in range(300)]
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        assert tok.decode(enc.ids) == text


def test_bpe_byte_fallback_and_metaspace(tmp_path, stdlib_docs):
    tok, _ = _train(tmp_path, stdlib_docs, "bpe")
    assert [tok.id_to_token(i) for i in (3, 4, 258)] == ["<0x00>", "<0x01>", "<0xFF>"]
    ids = tok.encode("🤖").ids  # unseen in training: spelled in UTF-8 bytes
    assert [tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    assert "▁" in tok.id_to_token(tok.encode("a b").ids[-1])  # spaces are SentencePiece's "▁"
    assert tok.encode("<0x41>").ids != [tok.token_to_id("<0x41>")]  # byte pieces are not added tokens
    # The one documented normalisation: a literal U+2581 decodes as a space.
    assert tok.decode(tok.encode("a▁b").ids) == "a b"


def test_tokenizer_vocab_cap_small(tmp_path, stdlib_docs):
    for kind in ("bpe", "byte_bpe"):
        tok, _ = _train(tmp_path, stdlib_docs, kind, vocab=300)
        assert tok.get_vocab_size() <= 300
        assert tok.decode(tok.encode(TRICKY).ids) == TRICKY
    tiny = [Document("t", "ab ab ab")]
    tok, _ = _train(tmp_path, tiny, "bpe", vocab=4096)
    assert tok.get_vocab_size() < 4096 and tok.decode(tok.encode(TRICKY).ids) == TRICKY
    with pytest.raises(ConfigError, match="vocab_size=256"):
        _train(tmp_path, tiny, "bpe", vocab=256)


def test_tokenizer_cache(tmp_path, stdlib_docs, monkeypatch):
    tok, cfg = _train(tmp_path, stdlib_docs, "bpe")
    (cached,) = (tmp_path / "tokenizers").glob("*.json")
    assert not list((tmp_path / "tokenizers").glob(".*"))  # no temp file left behind

    def no_training(*a, **k):
        raise AssertionError("should have loaded from the cache")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_mod, "_train", no_training)
        again = get_tokenizer(cfg, VOCAB, stdlib_docs, corpus_fingerprint(stdlib_docs))
    assert again.to_str() == tok.to_str() and again.encode(TRICKY).ids == tok.encode(TRICKY).ids
    assert again.encode_special_tokens  # not stored in the JSON: set on every load

    cached.write_text('{"truncated": ')
    rebuilt = get_tokenizer(cfg, VOCAB, stdlib_docs, corpus_fingerprint(stdlib_docs))
    assert rebuilt.encode(TRICKY).ids == tok.encode(TRICKY).ids
    assert json.loads(cached.read_text())["model"]["type"] == "BPE"  # rewritten

    # A different corpus, kind or size is a different cache entry.
    _train(tmp_path, stdlib_docs, "byte_bpe")
    _train(tmp_path, stdlib_docs[1:], "bpe")
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 3


def test_tokenizer_path(tmp_path, stdlib_docs):
    tok, _ = _train(tmp_path, stdlib_docs, "byte_bpe")
    path = tmp_path / "tok.json"
    tok.save(str(path))
    cfg = DataConfig(tokenizer_path=str(path))
    loaded = get_tokenizer(cfg, VOCAB, [], "")
    assert loaded.encode(TRICKY).ids == tok.encode(TRICKY).ids
    assert get_tokenizer(cfg, 4 * VOCAB, [], "").get_vocab_size() == VOCAB  # smaller is fine
    with pytest.raises(ConfigError, match=f"{VOCAB} tokens.*vocab_size=100"):
        get_tokenizer(cfg, 100, [], "")
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="missing.json"):
        get_tokenizer(DataConfig(tokenizer_path=missing), VOCAB, [], "")
    (tmp_path / "corrupt.json").write_text("{}")
    with pytest.raises(ConfigError, match="corrupt.json"):
        get_tokenizer(DataConfig(tokenizer_path=str(tmp_path / "corrupt.json")), VOCAB, [], "")


# ----------------------------------------------------------------------------- packed batches


def test_windows_shift_by_one():
    ds = PackedDataset(np.arange(1000, dtype=np.uint16), seq_len=8, seed=0)
    assert ds.num_windows == 124  # (1000 - 1) // 8
    b = ds.batch(3, 4)
    assert b["inputs"].shape == b["targets"].shape == (4, 8)
    assert b["inputs"].dtype == b["targets"].dtype == np.int32
    np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)  # tokens are 0..999
    assert (b["inputs"][:, 0] % 8 == 0).all()  # windows start at multiples of seq_len


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = PackedDataset(tokens, 8, seed=1), PackedDataset(tokens, 8, seed=1)
    for step in (0, 5, 40):  # 40 is in the second epoch
        np.testing.assert_array_equal(a.batch(step, 4)["inputs"], b.batch(step, 4)["inputs"])
        np.testing.assert_array_equal(a.batch(step, 4)["inputs"], a.batch(step, 4)["inputs"])
    assert not np.array_equal(a.batch(0, 4)["inputs"], a.batch(1, 4)["inputs"])
    assert not np.array_equal(a.batch(0, 4)["inputs"], PackedDataset(tokens, 8, seed=2).batch(0, 4)["inputs"])


def test_every_window_once_per_epoch():
    ds = PackedDataset(np.arange(1000, dtype=np.uint16), seq_len=8, seed=0)
    batch = 5  # does not divide 124 windows: batches straddle epochs
    starts = np.concatenate([ds.batch(s, batch)["inputs"][:, 0] for s in range(-(-2 * 124 // batch))])
    first, second = starts[:124] // 8, starts[124:248] // 8
    assert sorted(first) == list(range(124)) and sorted(second) == list(range(124))
    assert not np.array_equal(first, second)  # each epoch has its own order
    assert not np.array_equal(first, np.arange(124))  # shuffled


def test_process_slices_make_the_global_batch():
    ds = PackedDataset(np.arange(5000, dtype=np.uint16), seq_len=16, seed=3)
    for step in (0, 7):
        full = ds.batch(step, 8)
        parts = [ds.batch(step, 8, process_index=p, process_count=4) for p in range(4)]
        for k in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])
    with pytest.raises(ConfigError, match="divisible"):
        ds.batch(0, 8, process_index=0, process_count=3)


def test_eval_batches_in_order_and_cycling():
    ds = PackedDataset(np.arange(100, dtype=np.uint16), seq_len=10, seed=0)  # 9 windows
    evals = ds.eval_batches(3, 4)
    starts = np.concatenate([b["inputs"][:, 0] for b in evals])
    np.testing.assert_array_equal(starts, [0, 10, 20, 30, 40, 50, 60, 70, 80, 0, 10, 20])
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(evals, ds.eval_batches(3, 4)))
    halves = ds.eval_batches(1, 4, process_index=1, process_count=2)[0]
    np.testing.assert_array_equal(halves["inputs"][:, 0], [20, 30])


def test_too_little_data():
    with pytest.raises(ConfigError, match="5 tokens.*seq_len\\+1=9"):
        PackedDataset(np.arange(5, dtype=np.uint16), seq_len=8, name="val")
    ds = PackedDataset(np.arange(50, dtype=np.uint16), seq_len=8)  # 6 windows
    with pytest.raises(ConfigError, match="6 windows of seq_len=8.*batch_size=16"):
        ds.batch(0, 16)


# ----------------------------------------------------------------------------- end to end


def test_build_data_end_to_end_and_token_cache(tmp_path):
    cfg = DataConfig(max_bytes=CAP, val_fraction=0.1, cache_dir=str(tmp_path))
    data = build_data(cfg, vocab_size=VOCAB, seq_len=64, seed=0)
    s = data.stats
    assert s["documents"] == s["train_documents"] + s["val_documents"] and s["val_documents"] >= 1
    assert 0.9 * CAP < s["bytes"] <= CAP and s["vocab_size"] == VOCAB
    assert s["val_tokens"] < 0.4 * s["train_tokens"]
    train = data.train.tokens
    assert train.dtype == np.uint16 and len(train) == s["train_tokens"] and train[-1] == data.eos_id
    assert (train == data.eos_id).sum() == s["train_documents"]  # exactly one <eos> per document
    assert data.val is not None and data.val.num_windows == (s["val_tokens"] - 1) // 64
    b = data.train.batch(0, 8)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert b["inputs"].max() < VOCAB

    # The first document decodes back exactly from the token stream.
    train_docs, _ = split_documents(load_documents(cfg), cfg.val_fraction)
    first = train[: int(np.argmax(train == data.eos_id))]
    assert data.tokenizer.decode(first.tolist()) == train_docs[0].text

    npys = sorted((tmp_path / "tokens").glob("*.npy"))
    assert len(npys) == 2  # train and val
    warm = build_data(cfg, vocab_size=VOCAB, seq_len=64, seed=0)
    np.testing.assert_array_equal(warm.train.tokens, train)
    for p in npys:
        p.write_bytes(p.read_bytes()[:100])  # truncated mid-array
    rebuilt = build_data(cfg, vocab_size=VOCAB, seq_len=64, seed=0)
    np.testing.assert_array_equal(rebuilt.train.tokens, train)
    np.testing.assert_array_equal(rebuilt.val.tokens, data.val.tokens)
    assert all(np.load(p).ndim == 1 for p in npys)  # rewritten whole

    no_val = build_data(DataConfig(max_bytes=CAP, val_fraction=0.0, cache_dir=str(tmp_path)),
                        vocab_size=VOCAB, seq_len=64, seed=0)
    assert no_val.val is None and no_val.stats["val_tokens"] == 0
