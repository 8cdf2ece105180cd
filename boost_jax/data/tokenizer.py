"""Tokenizers: an existing tokenizer.json (data.tokenizer_path), or a BPE trained on the train split.

Both trained kinds put <pad>, <bos>, <eos> at ids 0, 1, 2, never exceed the model's vocab_size, and
decode(encode(text)) == text, with one documented exception for kind "bpe" (see `_bpe`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from boost_jax.config import ConfigError, DataConfig
from boost_jax.data.cache import atomic_write, cache_root, digest
from boost_jax.data.corpus import Document

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
_BYTES = tuple(f"<0x{b:02X}>" for b in range(256))  # SentencePiece's byte-fallback pieces
_MIN_VOCAB = len(SPECIALS) + 256 + 1  # both kinds need every byte encodable, plus room to learn
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")  # ours, LLaMA/T5, GPT-2, LLaMA-3
# GPT-2's split without the English contractions: a word or number or punctuation run with its
# leading space, and whitespace runs that leave their last space to the next word, so that a newline
# plus indentation can merge into one token instead of one token per space.
_SPLIT = r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_RECIPE = "1"  # part of the cache key: bump whenever the training recipe below changes


def get_tokenizer(
    cfg: DataConfig, vocab_size: int, train_docs: Sequence[Document], fingerprint: str
) -> Tokenizer:
    """cfg.tokenizer_path if set, else a `cfg.tokenizer` BPE of at most vocab_size tokens trained on
    train_docs, cached under <cache>/tokenizers/ by (fingerprint of train_docs, kind, size, version)."""
    if cfg.tokenizer_path:
        tok = _load_given(Path(cfg.tokenizer_path).expanduser(), vocab_size)
    else:
        if vocab_size < _MIN_VOCAB:
            raise ConfigError(
                f"model.vocab_size={vocab_size} is too small to train data.tokenizer={cfg.tokenizer!r}: "
                f"it needs >= {_MIN_VOCAB} (3 special + 256 byte tokens + merges)"
            )
        key = digest(fingerprint, cfg.tokenizer, str(vocab_size), tokenizers.__version__, _RECIPE)
        path = cache_root(cfg) / "tokenizers" / f"{key}.json"
        tok = _load_cached(path)
        if tok is None:
            tok = _train(cfg.tokenizer, vocab_size, train_docs)
            spec = tok.to_str().encode()
            atomic_write(path, lambda f: f.write(spec))
    # Documents are data: a literal "<eos>" in a source file must stay text, not become the control token.
    tok.encode_special_tokens = True
    return tok


def eos_id(tok: Tokenizer) -> int:
    """The end-of-document token that separates packed documents."""
    for name in _EOS_NAMES:
        if (i := tok.token_to_id(name)) is not None:
            return i
    raise ConfigError(f"tokenizer has no end-of-document token; looked for {list(_EOS_NAMES)}")


def _load_given(path: Path, vocab_size: int) -> Tokenizer:
    if not path.is_file():
        raise ConfigError(f"data.tokenizer_path: {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for any unparsable file
        raise ConfigError(f"data.tokenizer_path: {path} is not a tokenizers JSON file ({e})") from None
    if (n := tok.get_vocab_size()) > vocab_size:
        raise ConfigError(
            f"data.tokenizer_path: {path} has {n} tokens, more than model.vocab_size={vocab_size}"
        )
    return tok


def _load_cached(path: Path) -> Tokenizer | None:
    """The cached tokenizer, or None if missing or corrupt (then it is retrained, not fatal)."""
    try:
        return Tokenizer.from_file(str(path)) if path.is_file() else None
    except Exception:  # tokenizers raises a bare Exception for any unparsable file
        return None


def _train(kind: str, vocab_size: int, docs: Sequence[Document]) -> Tokenizer:
    tok, trainer = _bpe(vocab_size) if kind == "bpe" else _byte_bpe(vocab_size)
    tok.train_from_iterator((d.text for d in docs), trainer, length=len(docs))
    if kind == "bpe":
        # The byte pieces were passed as specials only to pin them at ids 3..258. They are ordinary
        # pieces: decode must not skip them as special, and the text "<0x41>" is just text.
        spec = json.loads(tok.to_str())
        spec["added_tokens"] = spec["added_tokens"][: len(SPECIALS)]
        tok = Tokenizer.from_str(json.dumps(spec))
    return tok


def _bpe(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    """LLaMA/SentencePiece-style: character BPE over "▁"-for-space text, rare characters falling back
    to <0xNN> byte pieces. Lossless except that a literal "▁" (U+2581) in the input decodes as " "."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), "isolated"),
        # "never": no dummy prefix space, so nothing needs stripping on decode (SentencePiece's
        # prefix is what makes its round trip lossy for text starting with a space).
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False),
    ])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIALS, *_BYTES],
        # The alphabet is added whole, so cap it to keep the total within vocab_size; characters past
        # the cap (the rarest) are spelled in bytes.
        limit_alphabet=max(1, min(1000, (vocab_size - len(SPECIALS) - len(_BYTES)) // 2)),
        show_progress=False,
    )
    return tok, trainer


def _byte_bpe(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    """GPT-2 style: BPE over the 256 bytes (shown as printable characters); lossless."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer
