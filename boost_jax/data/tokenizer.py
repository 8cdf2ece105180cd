"""Tokenizers: an existing tokenizer.json, or a BPE trained on a bounded sample of the train split.

    bpe            LLaMA-style: character BPE with byte fallback, merges learned by Hugging Face tokenizers
    byte_bpe       GPT-2 style: byte-level BPE, merges learned by Hugging Face tokenizers
    sentencepiece  bpe's tokenizer with merges learned by SentencePiece's BPE trainer (LLaMA's own
                   trainer; pip install 'boost_jax[sentencepiece]')

Every trained kind puts <pad>, <bos>, <eos> at ids 0, 1, 2, never exceeds the requested vocab_size,
and decode(encode(text)) == text, with one documented exception for the character kinds (see
`_char_tokenizer`). Training is reproducible: the same sample and vocab_size give the same
tokenizer.json, byte for byte, in any process (see `_alphabet` for the one tie we break ourselves).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import warnings
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from boost_jax.runtime.errors import DataError, PackageError

KINDS = ("bpe", "byte_bpe", "sentencepiece")
SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
_BYTES = tuple(f"<0x{b:02X}>" for b in range(256))  # SentencePiece's byte-fallback pieces
MIN_TRAINED_VOCAB = len(SPECIALS) + 256 + 1  # every kind needs every byte encodable, plus room to learn
# The BPE trainer allocates ~66 bytes per requested token up front and aborts the process (exit 134)
# when that fails (2^30 tokens ask for 70 GB); 2^24 is past any real LLM vocabulary (32k-256k).
MAX_TRAINED_VOCAB = 1 << 24
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")  # ours, LLaMA/T5, GPT-2, LLaMA-3
# GPT-2's split without the English contractions: a word or number or punctuation run with its
# leading space, and whitespace runs that leave their last space to the next word, so that a newline
# plus indentation can merge into one token instead of one token per space.
_SPLIT = r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
RECIPE = "2"  # bump whenever the training recipe below changes (part of the data cache key)
# SentencePiece reserves these characters (tab separates its TSV fields and marks pre-token
# boundaries; NUL; its whitespace and unknown marks), so private-use stand-ins carry them through its
# training. Its longest piece is 16 characters unless raised (to at most 512): HF's BPE has no cap,
# and at 16 held-out Python took ~0.6% more tokens.
_SP_RESERVED = ("\t", "\0", "\u2581", "\u2585")
_SP_MAX_PIECE = 512


class VocabWarning(UserWarning):
    """The corpus sample had too few merges to fill the requested vocabulary."""


def check_vocab_size(vocab_size: int, kind: str) -> None:
    """Refuse, before any work, a kind or a size BPE training cannot produce."""
    if kind not in KINDS:
        raise DataError(f"unknown tokenizer kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if not MIN_TRAINED_VOCAB <= vocab_size <= MAX_TRAINED_VOCAB:
        raise DataError(
            f"model.vocab_size={vocab_size} cannot be trained as a {kind!r} tokenizer: it needs "
            f"{MIN_TRAINED_VOCAB} <= vocab_size <= {MAX_TRAINED_VOCAB:,} (3 special + 256 byte tokens + merges; above "
            "that the trainer cannot allocate its tables)"
        )


def trainer_id(kind: str) -> str:
    """The trainer's packages and our recipe: a prepared dataset's recipe (and cache key) holds it."""
    packages = tokenizers.__version__
    if kind == "sentencepiece":
        packages += f"+sentencepiece-{_sentencepiece_module().__version__}"
    return f"{packages}/{RECIPE}"


def train_tokenizer(kind: str, vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """A `kind` BPE of at most vocab_size tokens trained on `texts`, which are streamed, not held, and
    may be read twice (bpe counts characters first): a list or a re-iterable, not a one-shot iterator.
    A sample too small to fill vocab_size gives a smaller tokenizer and a VocabWarning naming the size."""
    check_vocab_size(vocab_size, kind)
    if iter(texts) is texts:
        raise TypeError("train_tokenizer may read its texts twice: pass a list or a re-iterable, not an iterator")
    tok = {"bpe": _bpe, "byte_bpe": _byte_bpe, "sentencepiece": _sentencepiece}[kind](vocab_size, texts)
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


def _char_tokenizer() -> Tokenizer:
    """LLaMA/SentencePiece-style, untrained: character BPE over "▁"-for-space text, rare characters
    falling back to <0xNN> byte pieces. Lossless except that a literal "▁" (U+2581) decodes as " "."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), "isolated"),
        # "never": no dummy prefix space, so nothing needs stripping on decode (SentencePiece's
        # prefix is what makes its round trip lossy for text starting with a space).
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False),
    ])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _alphabet(chars: Counter[str], vocab_size: int) -> list[str]:
    """The characters a character kind keeps whole (the rest are spelled in bytes), in code point
    order: as many as half the room left by the specials and bytes (at most 1000), the most frequent,
    ties broken by code point (the HF trainer's own cut breaks them by hash-map order: one sample gave
    4 different tokenizers in 4 processes). "▁" always, and for every space (which training sees as
    "▁"): decode turns only a "▁" piece back into a space, so a sample without spaces would otherwise
    decode every later space as "▁"."""
    limit = max(1, min(1000, (vocab_size - len(SPECIALS) - len(_BYTES)) // 2))
    ranked = sorted(chars.keys() - {"▁", " "}, key=lambda c: (-chars[c], c))
    return sorted(["▁", *ranked[: limit - 1]])


def _bpe(vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """The HF trainer's merges over our alphabet (a first pass counts the characters)."""
    tok = _char_tokenizer()
    chars = Counter()
    for text in texts:
        chars.update(text)
    alphabet = _alphabet(chars, vocab_size)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIALS, *_BYTES],
        # Exactly our alphabet: the trainer keeps its initial alphabet first, and the limit drops the rest.
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # The byte pieces were passed as specials only to pin them at ids 3..258. They are ordinary
    # pieces: decode must not skip them as special, and the text "<0x41>" is just text.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = spec["added_tokens"][: len(SPECIALS)]
    return Tokenizer.from_str(json.dumps(spec))


def _byte_bpe(vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """GPT-2 style: BPE over the 256 bytes (shown as printable characters); lossless. Its alphabet is
    fixed, so no tie is left to the trainer's hash-map order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _sentencepiece(vocab_size: int, texts: Iterable[str]) -> Tokenizer:
    """bpe's tokenizer (the same pre-tokenizer, alphabet and layout of ids) whose merges
    SentencePiece's BPE trainer learns from our counts of the pre-tokenized words."""
    spm = _sentencepiece_module()  # before any work
    tok = _char_tokenizer()
    words, chars = Counter(), Counter()
    for text in texts:
        chars.update(text)
        words.update(w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text))
    alphabet = _alphabet(chars, vocab_size)
    pieces = _sp_pieces(spm, _within(words, set(alphabet)), alphabet,
                        vocab_size - len(SPECIALS) - len(_BYTES) - len(alphabet))
    ids = {t: i for i, t in enumerate([*SPECIALS, *_BYTES, *alphabet, *pieces])}
    # SentencePiece encodes by joining the adjacent pair that makes the best piece: an HF BPE does the
    # same with every split of each piece into two tokens as a merge, ranked by the piece.
    merges = [(p[:k], p[k:]) for p in pieces for k in range(1, len(p)) if p[:k] in ids and p[k:] in ids]
    tok.model = models.BPE(ids, merges, byte_fallback=True)
    tok.add_special_tokens(list(SPECIALS))
    return tok


def _within(words: Counter[str], alphabet: set[str]) -> Counter[str]:
    """The words cut at characters outside the alphabet: spelled in bytes, those never merge."""
    kept = Counter()
    for word, n in words.items():
        if alphabet.issuperset(word):
            kept[word] += n
            continue
        for inside, run in itertools.groupby(word, alphabet.__contains__):
            if inside:
                kept["".join(run)] += n
    return kept


def _sp_pieces(spm, words: Counter[str], alphabet: list[str], budget: int) -> list[str]:
    """SentencePiece's learned pieces (2 characters or more, in the order it learned them), at most
    `budget`, from word counts given as its "word<TAB>count" input."""
    if not words or budget <= 0:
        return []
    spare = (chr(c) for c in itertools.count(0xF0000) if chr(c) not in alphabet)
    stand_in = {c: next(spare) for c in _SP_RESERVED}
    unk = next(spare)
    to_sp, from_sp = str.maketrans(stand_in), str.maketrans({v: k for k, v in stand_in.items()})
    lines = (f"{w.translate(to_sp)}\t{n}" for w, n in sorted(words.items(), key=lambda wn: (-wn[1], wn[0])))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, input_format="tsv", model_writer=model, model_type="bpe",
        vocab_size=1 + len(alphabet) + budget, required_chars="".join(alphabet).translate(to_sp),
        character_coverage=1.0, hard_vocab_limit=False, max_sentencepiece_length=_SP_MAX_PIECE,
        max_sentence_length=1 << 30, unk_id=0, unk_piece=unk, bos_id=-1, eos_id=-1, pad_id=-1,
        # Only its BPE: the words arrive pre-tokenized and unnormalized, as the HF trainer sees them.
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_by_whitespace=False, split_by_unicode_script=False, split_by_number=False,
        num_threads=1, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = (sp.id_to_piece(i).translate(from_sp) for i in range(sp.get_piece_size()))
    return [p for p in pieces if len(p) > 1][:budget]


def _sentencepiece_module():
    try:
        import sentencepiece  # optional: only the sentencepiece kind trains with it
    except ImportError:
        raise PackageError("tokenizer kind 'sentencepiece' needs the sentencepiece package: "
                           "pip install 'boost_jax[sentencepiece]' (or choose bpe or byte_bpe)") from None
    return sentencepiece
