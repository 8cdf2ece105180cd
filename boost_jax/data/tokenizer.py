"""Tokenizers: an existing tokenizer.json, or a BPE trained on a bounded sample of the train split.

Both trained kinds put <pad>, <bos>, <eos> at ids 0, 1, 2, never exceed the requested vocab_size, and
decode(encode(text)) == text, with one documented exception for kind "bpe" (see `_bpe`).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from boost_jax.errors import DataError

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
_BYTES = tuple(f"<0x{b:02X}>" for b in range(256))  # SentencePiece's byte-fallback pieces
MIN_VOCAB = len(SPECIALS) + 256 + 1  # both kinds need every byte encodable, plus room to learn
# The BPE trainer allocates ~66 bytes per requested token up front and aborts the process (exit 134)
# when that fails (2^30 tokens ask for 70 GB); 2^24 is past any real LLM vocabulary (32k-256k).
MAX_VOCAB = 1 << 24
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")  # ours, LLaMA/T5, GPT-2, LLaMA-3
# GPT-2's split without the English contractions: a word or number or punctuation run with its
# leading space, and whitespace runs that leave their last space to the next word, so that a newline
# plus indentation can merge into one token instead of one token per space.
_SPLIT = r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
RECIPE = "1"  # bump whenever the training recipe below changes (part of the data cache key)


class VocabWarning(UserWarning):
    """The corpus sample had too few merges to fill the requested vocabulary."""


def check_vocab_size(vocab_size: int, kind: str) -> None:
    """Refuse, before any work, a size BPE training cannot produce."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(
            f"model.vocab_size={vocab_size} cannot be trained as a {kind!r} tokenizer: it needs "
            f"{MIN_VOCAB} <= vocab_size <= {MAX_VOCAB:,} (3 special + 256 byte tokens + merges; above "
            "that the trainer cannot allocate its tables)"
        )


def train_tokenizer(kind: str, vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """A `kind` BPE of at most vocab_size tokens trained on `texts` (streamed, not held). A sample too
    small to fill vocab_size gives a smaller tokenizer and a VocabWarning naming the size reached."""
    check_vocab_size(vocab_size, kind)
    tok = _train(kind, vocab_size, texts)
    if (n := tok.get_vocab_size()) < vocab_size:
        warnings.warn(
            f"the tokenizer reached {n:,} tokens, not the requested {vocab_size:,}: its training sample "
            "has no more pairs to merge. Training goes on with model.vocab_size embedding rows, "
            f"{vocab_size - n:,} of them never used; add data or lower model.vocab_size to {n}",
            VocabWarning, stacklevel=2,
        )
    return _for_data(tok)


def load_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise DataError(f"tokenizer {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for any unparsable file
        raise DataError(f"tokenizer {path} is not a tokenizers JSON file ({e})") from None
    eos_id(tok, path)  # a tokenizer without one cannot separate documents
    return _for_data(tok)


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's JSON: its identity in a prepared dataset's index."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def eos_id(tok: Tokenizer, where: Path | str = "tokenizer") -> int:
    """The end-of-document token that separates packed documents."""
    for name in _EOS_NAMES:
        if (i := tok.token_to_id(name)) is not None:
            return i
    raise DataError(f"{where} has no end-of-document token; looked for {list(_EOS_NAMES)}")


def _for_data(tok: Tokenizer) -> Tokenizer:
    # Documents are data: a literal "<eos>" in a source file must stay text, not become the control token.
    tok.encode_special_tokens = True
    return tok


def _train(kind: str, vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    tok, trainer = _bpe(vocab_size) if kind == "bpe" else _byte_bpe(vocab_size)
    tok.train_from_iterator(texts, trainer)
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
