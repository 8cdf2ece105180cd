"""Instruction rows (data.format=chat or prompt_completion) -> documents with their targets, prepared.

    chat               {"messages": [{"role", "content"}, ...]}: rendered by the chat template
                       (data/chat.py); targets: the assistant turns, each with its end-of-turn token
    prompt_completion  {"prompt", "completion"}: the prompt's ids (with what the tokenizer adds, e.g.
                       a bos) then the completion's and the tokenizer's eos; targets: the completion and eos

Under train.loss_on=all every token is a target. A prepared instruction dataset is a folder of
tokenizer.json, instruct.json (its format, recipe and sizes; written last: its presence means done)
and train.npz / val.npz (`Documents`). Every row is checked and encoded before anything is written,
so bad input (a row without its keys, an unknown role, empty content, a template that refuses a row,
a row longer than a window under data.truncate=none) is one message naming the file and row, with
nothing written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from boost_jax.config import DataConfig
from boost_jax.configs import CHATML
from boost_jax.data.chat import CONFIG_FILE, TEMPLATE_FILE, ChatTokens, check_messages, load_chat_template
from boost_jax.data.corpus import records, unit_hash
from boost_jax.data.packing import Documents
from boost_jax.data.shards import TOKENIZER
from boost_jax.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash
from boost_jax.runtime.errors import DataError

FORMATS = ("chat", "prompt_completion")
INDEX = "instruct.json"
RECIPE = "1"  # bump when the encoding below changes (part of the cache key)
SHIPPED_TEMPLATES = {"chatml": CHATML}  # data.chat_template names that mean a template shipped in the package


@dataclass(frozen=True)
class Recipe:
    """What a prepared instruction dataset's documents depend on, besides its rows and tokenizer."""

    format: str
    completion_only: bool  # train.loss_on: only the completions are targets
    window: int  # train.seq_len + 1: the longest document
    truncate: str  # data.truncate
    val_fraction: float
    chat_template: str = ""  # data.chat_template (format=chat)

    def key(self, chat: ChatTokens | None) -> dict:
        """The recipe as recorded (and hashed into the cache key), with the template's text."""
        return {**self.__dict__, "template": chat.template.text if chat else "", "recipe": RECIPE}


def template_path(name: str) -> str:
    """data.chat_template as a file: a shipped template's name, or the path given."""
    return str(SHIPPED_TEMPLATES.get(name, name))


def chat_tokens(tok: Tokenizer, tokenizer_path: str, chat_template: str) -> ChatTokens:
    """The chat template for `tok` (data.chat_template, else the one beside `tokenizer_path`), bound."""
    return load_chat_template(tokenizer_path, template_path(chat_template) if chat_template else "", tok).bind(tok)


def run_chat(tok: Tokenizer, saved: Path, data: DataConfig) -> ChatTokens:
    """A run's chat template bound to its tokenizer (`saved`, the run dir's tokenizer.json):
    data.chat_template, else the template beside `saved` (an imported model's folder keeps its
    tokenizer_config.json), else the one beside data.tokenizer_path (what the run was fine-tuned with)."""
    beside = saved if any((saved.parent / f).is_file() for f in (TEMPLATE_FILE, CONFIG_FILE)) else data.tokenizer_path
    return chat_tokens(tok, str(beside), data.chat_template)


def encode_row(row: dict, where: str, fmt: str, tok: Tokenizer, chat: ChatTokens | None,
               completion_only: bool) -> tuple[list[int], list[bool]]:
    """One row's ids and targets (see the module's docstring); bad input raises DataError at `where`."""
    if fmt == "chat":
        if "messages" not in row:
            raise DataError(f"{where}: no 'messages' (data.format=chat reads rows of messages: "
                            f"[{{role, content}}, ...]; the row has {sorted(row)})")
        ids, targets = chat.encode_turns(check_messages(row["messages"], where), where)
    else:
        for key in ("prompt", "completion"):
            if key not in row:
                raise DataError(f"{where}: no {key!r} (data.format=prompt_completion reads rows with prompt and "
                                f"completion; the row has {sorted(row)})")
            if not isinstance(row[key], str) or not row[key].strip():
                raise DataError(f"{where}: {key!r} is empty or not a string")
        prompt = tok.encode(row["prompt"]).ids
        completion = tok.encode(row["completion"], add_special_tokens=False).ids + [eos_id(tok)]
        ids, targets = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    return ids, (targets if completion_only else [True] * len(ids))


def encode_rows(rows: Iterable[tuple[str, dict]], recipe: Recipe, tok: Tokenizer, chat: ChatTokens | None
                ) -> tuple[dict[str, Documents], dict[str, int]]:
    """The rows as train and val documents (a row is held out by a stable hash of its content) and
    the counts: rows, truncated, dropped, tokens and targets per split."""
    parts = {"train": ([], [], [0]), "val": ([], [], [0])}
    stats = {"rows": 0, "truncated_rows": 0, "dropped_rows": 0}
    for where, row in rows:
        stats["rows"] += 1
        ids, targets = encode_row(row, where, recipe.format, tok, chat, recipe.completion_only)
        if len(ids) > recipe.window:
            if recipe.truncate == "none":
                raise DataError(f"{where}: {len(ids)} tokens, longer than a window of train.seq_len + 1 = "
                                f"{recipe.window}; set data.truncate=right (keep its start) or drop, or raise "
                                "train.seq_len")
            stats[f"{'truncated' if recipe.truncate == 'right' else 'dropped'}_rows"] += 1
            if recipe.truncate == "drop":
                continue
            ids, targets = ids[: recipe.window], targets[: recipe.window]
        split = "val" if recipe.val_fraction > 0 and unit_hash("split", json.dumps(row, sort_keys=True)) \
            < recipe.val_fraction else "train"
        tokens, flags, starts = parts[split]
        tokens.extend(ids)
        flags.extend(targets)
        starts.append(starts[-1] + len(ids))
    if not stats["rows"]:
        raise DataError("the instruction data has no rows")
    docs = {name: Documents(np.asarray(t, np.int32), np.asarray(f, bool), np.asarray(s, np.int64))
            for name, (t, f, s) in parts.items()}
    for name, d in docs.items():
        stats[f"{name}_documents"], stats[f"{name}_tokens"] = d.count, len(d.tokens)
        stats[f"{name}_targets"] = int(d.targets.sum())
    return docs, stats


def write_prepared(out: Path, tok: Tokenizer, docs: dict[str, Documents], stats: dict, recipe: dict) -> None:
    """The dataset into `out` (made whole in a temporary folder beside it, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        tok.save(str(tmp / TOKENIZER))
        for name, d in docs.items():
            np.savez(tmp / f"{name}.npz", tokens=d.tokens, targets=d.targets, starts=d.starts)
        (tmp / INDEX).write_text(json.dumps({"recipe": recipe, "tokenizer_sha256": tokenizer_hash(tok),
                                             "vocab_size": tok.get_vocab_size(), "stats": stats}, indent=1))
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_prepared(directory: Path) -> bool:
    return (directory / INDEX).is_file()


def open_prepared(directory: Path) -> tuple[dict, Tokenizer, dict[str, Documents]]:
    """A prepared instruction dataset's index, tokenizer and documents, checked against each other."""
    try:
        index = json.loads((directory / INDEX).read_text())
        tok = load_tokenizer(directory / TOKENIZER)
        docs = {}
        for name in ("train", "val"):
            with np.load(directory / f"{name}.npz") as z:
                docs[name] = Documents(z["tokens"], z["targets"], z["starts"])
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{directory} is not a whole prepared instruction dataset ({e}); prepare it again") from None
    if tokenizer_hash(tok) != index.get("tokenizer_sha256"):
        raise DataError(f"{directory / TOKENIZER} is not the tokenizer {directory / INDEX} was prepared with")
    for name, d in docs.items():
        if d.starts[-1] != len(d.tokens) or len(d.targets) != len(d.tokens) or \
                (len(d.tokens) and int(d.tokens.max()) >= tok.get_vocab_size()):
            raise DataError(f"{directory / name}.npz is damaged (its offsets or token ids do not fit); prepare "
                            "it again")
    return index, tok, docs


def prepare_instruct(files: Iterable[Path], out: Path, tok: Tokenizer, chat: ChatTokens | None, recipe: Recipe
                     ) -> dict:
    """Encode the rows of `files` (format=chat: with `chat`) into a prepared instruction dataset at
    `out`; its stats."""
    docs, stats = encode_rows(records(files), recipe, tok, chat)
    write_prepared(out, tok, docs, stats, recipe.key(chat))
    return stats


def summary(fmt: str, loss_on: str, stats: dict) -> str:
    """The training log's line on instruction data: rows, tokens, how many are targets, packing."""
    return (f"data.format={fmt}: {stats['train_documents']:,} train rows ({stats['train_tokens']:,} tokens, "
            f"{stats['train_targets']:,} of them targets under train.loss_on={loss_on}), "
            f"{stats['val_documents']:,} val rows ({stats['val_targets']:,} targets); "
            f"{stats['truncated_rows']:,} truncated, {stats['dropped_rows']:,} dropped; "
            f"packed windows hold {stats['fill']:.1%} tokens")
