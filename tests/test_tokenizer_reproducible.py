"""Reproducible preparation: the same sample and settings give the same tokenizer and dataset, byte for
byte, in any process (hash seeds, thread counts and --workers vary); the sentencepiece kind's extras."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from boost_jax.data.corpus import files_corpus
from boost_jax.data.prepare import PrepareConfig, prepare
from boost_jax.data.tokenizer import train_tokenizer, trainer_id
from boost_jax.runtime.errors import PackageError

HAS_SP = importlib.util.find_spec("sentencepiece") is not None
KINDS = ["bpe", "byte_bpe", *(["sentencepiece"] if HAS_SP else [])]
VOCAB = 600  # room for 170 characters: the cut falls among the tied CJK ones below
CJK = [chr(0x4E00 + i) for i in range(1500)]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}


def _tied_texts() -> list[str]:
    """Ties where trainers meet them: 1,500 CJK characters seen 3 times each (the alphabet is cut
    among them), words of equal counts (merge ties) and runs of one character (overlapping pairs)."""
    rng = random.Random(0)
    chars, texts = CJK[:], []
    for _ in range(3):
        rng.shuffle(chars)
        texts.append(" ".join("".join(chars[i:i + 5]) for i in range(0, len(chars), 5)))
    words = ["".join(rng.choices("abcdefgh", k=rng.randint(2, 6))) for _ in range(2000)]
    texts.append(" ".join(words) + "".join(f"\n{c * n}" for c in "-=# " for n in range(2, 30)))
    return texts


def _in_processes(code: str, *args: str) -> list[str]:
    """stdout of `code` run in two fresh interpreters with other hash seeds and thread counts."""
    outs = []
    for seed, threads in (("1", "1"), ("2", "2")):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           env={**ENV, "PYTHONHASHSEED": seed, "RAYON_NUM_THREADS": threads})
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    return outs


def test_training_is_reproducible_across_processes(tmp_path):
    # The HF trainer cut the alphabet by hash-map order: each process kept other CJK characters.
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(_tied_texts()))
    code = ("import json, sys; from boost_jax.data.tokenizer import train_tokenizer, tokenizer_hash; "
            "texts = json.load(open(sys.argv[1])); "
            f"print(json.dumps({{k: tokenizer_hash(train_tokenizer(k, {VOCAB}, texts)) for k in sys.argv[2:]}}))")
    first, second = map(json.loads, _in_processes(code, str(texts), *KINDS))
    assert first == second and len(set(first.values())) == len(KINDS)


@pytest.mark.parametrize("kind", ["bpe", pytest.param("sentencepiece", marks=pytest.mark.skipif(
    not HAS_SP, reason="pip install 'boost_jax[sentencepiece]'"))])
def test_the_alphabet_keeps_the_most_frequent_characters_ties_by_code_point(kind):
    vocab = train_tokenizer(kind, VOCAB, _tied_texts()).get_vocab()
    kept = sorted(c for c in CJK if c in vocab)  # single characters: merges make longer tokens
    assert 100 < len(kept) < len(CJK) and kept == CJK[: len(kept)]
    assert all(vocab[c] < vocab[d] for c, d in zip(kept, kept[1:]))  # in code point order


def test_prepare_twice_gives_identical_directories(tmp_path):
    """The command with its defaults (--workers = every core) in another process, against one
    in-process prepare on one worker: every file is byte-identical, index and tokenizer included."""
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t[i:i + 700]}) + "\n" for t in _tied_texts()
                           for i in range(0, len(t), 700)))
    # 27 documents: at 0.05 one is held out (the default, 0.02, holds out none of these, which the command refuses).
    prepare(files_corpus([str(src)]), tmp_path / "here", PrepareConfig(vocab_size=VOCAB, workers=1, val_fraction=0.05))
    r = subprocess.run([sys.executable, "-m", "boost_jax.data", "prepare", str(src), "--out", str(tmp_path / "there"),
                        "--vocab-size", str(VOCAB), "--val-fraction", "0.05", "--no-progress"],
                       capture_output=True, text=True,
                       env={**ENV, "PYTHONHASHSEED": "7", "RAYON_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}
    assert files(tmp_path / "here") == files(tmp_path / "there")


def test_training_reads_its_texts_twice():
    with pytest.raises(TypeError, match="may read its texts twice"):
        train_tokenizer("bpe", 300, iter(["one pass only"]))


@pytest.mark.skipif(not HAS_SP, reason="pip install 'boost_jax[sentencepiece]'")
def test_sentencepiece_learns_pieces_of_the_characters_it_reserves():
    """Tab, NUL, "▁" (a space) and "▅" mean something to SentencePiece; they still form pieces."""
    text = "\tdef f():\n\t\treturn 1\n" * 50 + "\u2585\u2585\u2585 x\x00\x00y   z " * 30
    tok = train_tokenizer("sentencepiece", 300, [text])
    assert {"\n\t", "\u2585\u2585", "\x00\x00", "▁▁"} <= set(tok.get_vocab())
    assert tok.decode(tok.encode(text).ids) == text


def test_sentencepiece_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import raises ImportError
    for call in (lambda: trainer_id("sentencepiece"), lambda: train_tokenizer("sentencepiece", 300, ["a b"])):
        with pytest.raises(PackageError, match=r"pip install 'boost_jax\[sentencepiece\]'"):
            call()
    assert "sentencepiece" not in trainer_id("bpe")
