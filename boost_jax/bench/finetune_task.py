"""`bench finetune`'s task: name the parameters of a Python `def` line, built offline from the corpus
a run pre-trains on (the standard library by default), with answers checked exactly.

A row is one chat: the user turn `Parameters of: def f(self, key, default=None, *args, **kw) -> int:`,
the assistant turn `self, key, default, args, kw` (every parameter's name in order, as Python's own
parser reads the line: positional-only, positional, *args, keyword-only, **kwargs; defaults and
annotations dropped). Lines are the corpus's one-line `def`s of 2 to 6 parameters (`self` alone, which
most test methods take, would make a third of the rows one answer) and at most
`MAX_CHARS` characters, each distinct line once; a stable hash of the line holds a share out.

Why a small model learns it: every answer token is (a piece of) a token of the prompt, so the reply is
a copy with a rule (keep the names, drop what follows `=` or `:`), the kind of in-context copying
pre-training on code builds, and the rule is the same on every row: nothing is memorised, and a
held-out line is as hard as a seen one.

`score` measures a model on the held-out rows: greedy replies (the chat template's generation
prompt, stopping at its end-of-turn token) equal to the answer exactly, and the completion loss (the
mean cross-entropy over the assistant turn as the template renders it after the generation prompt,
with ChatML the reply, its end-of-turn eos and the newline closing the turn: the targets
`train.loss_on=completion` trains on).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import optax

from boost_jax import api
from boost_jax.data.chat import ChatTokens
from boost_jax.data.corpus import Corpus, Skipped, unit_hash

MAX_CHARS = 80  # the longest def line taken (its row stays ~40 tokens: many rows fill a window)
MIN_PARAMS, MAX_PARAMS = 2, 6
QUESTION = "Parameters of: "
SCORE_BATCH = 32  # held-out rows per forward / generate call
HELDOUT_SHARE = 0.1  # of the lines, held out by a stable hash


@dataclass(frozen=True)
class Task:
    """The task's files: train.jsonl (fine-tuned on) and heldout.jsonl (scored), and what they hold."""

    train: Path
    heldout: Path
    stats: dict


def parameters(line: str) -> list[str] | None:
    """The parameter names of a one-line `def ...:` (None: not one, or outside the task's bounds)."""
    try:
        tree = ast.parse(line + "\n    pass\n")
    except SyntaxError:
        return None
    fn = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *filter(None, [a.vararg]), *a.kwonlyargs, *filter(None, [a.kwarg]))]
    return names if MIN_PARAMS <= len(names) <= MAX_PARAMS else None


def rows_of(corpus: Corpus) -> list[tuple[str, str]]:
    """(def line, answer) of each distinct qualifying line of the corpus, in a stable order."""
    seen = {}
    for doc in corpus.documents(Skipped()):
        for raw in doc.text.splitlines():
            line = raw.strip()
            if line.startswith(("def ", "async def ")) and line.endswith(":") and len(line) <= MAX_CHARS and line not in seen:
                if (names := parameters(line)) is not None:
                    seen[line] = ", ".join(names)
    return sorted(seen.items(), key=lambda kv: unit_hash("finetune-order", kv[0]))


def messages(line: str, answer: str | None = None) -> list[dict]:
    user = [{"role": "user", "content": QUESTION + line}]
    return user if answer is None else [*user, {"role": "assistant", "content": answer}]


def build_task(corpus: Corpus, out: Path, train_rows: int, heldout_rows: int,
               heldout_share: float = HELDOUT_SHARE) -> Task:
    """train.jsonl and heldout.jsonl in `out` (at most `train_rows` and `heldout_rows` rows; a line
    is held out by a stable hash of it, whatever the caps); written once, read back after."""
    train, heldout = out / "train.jsonl", out / "heldout.jsonl"
    stats_file = out / "task.json"
    if stats_file.is_file():
        return Task(train, heldout, json.loads(stats_file.read_text()))
    pairs = rows_of(corpus)
    held = [p for p in pairs if unit_hash("finetune-heldout", p[0]) < heldout_share][:heldout_rows]
    kept = [p for p in pairs if unit_hash("finetune-heldout", p[0]) >= heldout_share][:train_rows]
    if not held or not kept:
        raise ValueError(f"the corpus has too few one-line defs for the task ({len(pairs)})")
    out.mkdir(parents=True, exist_ok=True)
    for path, part in ((train, kept), (heldout, held)):
        path.write_text("".join(json.dumps({"messages": messages(line, answer)}) + "\n" for line, answer in part))
    stats = {"lines": len(pairs), "train_rows": len(kept), "heldout_rows": len(held),
             "example": messages(*kept[0])}
    stats_file.write_text(json.dumps(stats, indent=1))  # last: its presence means the task is whole
    return Task(train, heldout, stats)


def read_rows(path: Path) -> list[tuple[str, str]]:
    """(def line, answer) of a task file's rows."""
    out = []
    for line in path.read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        out.append((user["content"].removeprefix(QUESTION), assistant["content"]))
    return out


def score(model, chat: ChatTokens, rows: list[tuple[str, str]], max_new_tokens: int) -> dict:
    """Held-out exact match (greedy) and completion loss of `model` on `rows` (one device)."""
    prompts = [chat.encode(messages(line), add_generation_prompt=True) for line, _ in rows]
    replies = []
    for i in range(0, len(prompts), SCORE_BATCH):
        out = api.generate(model, prompts[i:i + SCORE_BATCH], max_new_tokens=max_new_tokens, eos_id=chat.stop_ids)
        replies += [chat.tokenizer.decode(o) for o in out]
    exact = [r.strip() == answer for r, (_, answer) in zip(replies, rows)]
    return {"exact_match": sum(exact) / len(rows), "rows": len(rows),
            "completion_loss": completion_loss(model, chat, rows),
            "examples": [{"line": line, "answer": answer, "reply": r} for (line, answer), r in zip(rows[:3], replies)]}


def completion_loss(model, chat: ChatTokens, rows: list[tuple[str, str]]) -> float:
    """Mean cross-entropy over the assistant turns' target tokens of `rows`, each row alone (padded)."""
    encoded = [chat.encode_turns(messages(line, answer)) for line, answer in rows]
    width = -(-max(len(ids) for ids, _ in encoded) // 16) * 16  # one shape for every batch
    total, count = 0.0, 0
    for i in range(0, len(encoded), SCORE_BATCH):
        part = encoded[i:i + SCORE_BATCH]
        part += [part[-1]] * (SCORE_BATCH - len(part))  # a whole batch (one program); the copies are not counted
        tokens = np.zeros((SCORE_BATCH, width), np.int32)
        mask = np.zeros((SCORE_BATCH, width - 1), bool)
        for j, (ids, targets) in enumerate(part):
            tokens[j, :len(ids)] = ids
            mask[j, :len(ids) - 1] = np.asarray(targets[1:]) & (i + j < len(encoded))
        logits = api.forward(model, jax.numpy.asarray(tokens[:, :-1]))
        ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), tokens[:, 1:]))
        total += float(ce[mask].sum())
        count += int(mask.sum())
    return total / count
