"""Instruction data (data.format=chat / prompt_completion): rows -> documents with targets -> packed
windows -> batches whose weighted loss is the mean over the target tokens."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import DataConfig
from boost_jax.data.build import build_data
from boost_jax.data.chat import load_chat_template
from boost_jax.data.instruct import Recipe, chat_tokens, encode_rows
from boost_jax.data.packing import Documents, PackedSplit, pack
from boost_jax.data.tokenizer import load_tokenizer, train_tokenizer
from boost_jax.layers.cross_entropy import cross_entropy_sum
from boost_jax.runtime.errors import ConfigError, DataError


def rows(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                 {"role": "assistant", "content": f"{a + b}"}]})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A chat file, its prompt_completion twin and a tokenizer trained on them."""
    d = tmp_path_factory.mktemp("instruct")
    data = rows(200)
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (d / "pc.jsonl").write_text("".join(json.dumps({"prompt": r["messages"][0]["content"],
                                                    "completion": " " + r["messages"][1]["content"]}) + "\n"
                                        for r in data))
    train_tokenizer("bpe", 300, [json.dumps(r) for r in data]).save(str(d / "tokenizer.json"))
    return d


def chat_data(folder, tmp_path, seq_len=64, **knobs):
    cfg = DataConfig(source="files", paths=(str(folder / "chat.jsonl"),), format="chat", chat_template="chatml",
                     tokenizer_path=str(folder / "tokenizer.json"), cache_dir=str(tmp_path), **knobs)
    return build_data(cfg, vocab_size=512, seq_len=seq_len, seed=0, completion_only=True)


def test_chat_batches_mask_attention_positions_and_targets(folder, tmp_path):
    data = chat_data(folder, tmp_path, val_fraction=0.1)
    tok, b = data.tokenizer, data.train.batch(0, 4)
    assert {k: v.shape for k, v in b.items()} == dict.fromkeys(
        ("inputs", "targets", "segment_ids", "positions", "weights"), (4, 64))
    for r in range(4):
        for seg in np.unique(b["segment_ids"][r]):
            at = b["segment_ids"][r] == seg
            assert (b["positions"][r][at] == np.arange(at.sum())).all()  # each document from 0
        # The targets are the answers and the <eos> closing each turn, nothing of the user's.
        text = tok.decode([int(t) for t, w in zip(b["targets"][r], b["weights"][r], strict=True) if w > 0],
                          skip_special_tokens=False)
        assert text and "What" not in text and "<|im_start|>" not in text and text.count("<eos>") >= 1
    counted = b["weights"] > 0
    assert np.allclose(b["weights"][counted], b["weights"].size / counted.sum())
    assert data.stats["val_documents"] > 0 and data.val.eval_batches(1, 4)[0]["weights"].any()


def test_weighted_loss_is_the_mean_over_targets_under_any_split():
    """The weights make sum(w * xent) / positions the targets' mean, for the whole batch or summed
    over micro-batches; their gradient is the masked mean's."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 8, 11)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (4, 8)), jnp.int32)
    mask = rng.random((4, 8)) < 0.3
    weights = jnp.asarray(mask * (mask.size / mask.sum()), jnp.float32)
    want = lambda x: (-jax.nn.log_softmax(x) * jax.nn.one_hot(targets, 11)).sum(-1)[mask].mean()
    ours = lambda x: cross_entropy_sum(x, targets, 0.0, weights) / targets.size
    halves = lambda x: sum(cross_entropy_sum(x[i:i + 2], targets[i:i + 2], 0.0, weights[i:i + 2]) / 16
                           for i in (0, 2)) / 2
    np.testing.assert_allclose(ours(logits), want(logits), rtol=1e-6)
    np.testing.assert_allclose(halves(logits), want(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(want)(logits), rtol=1e-5, atol=1e-7)


def test_epochs_reshuffle_and_resume_exactly(folder, tmp_path):
    """Windows repeat epoch after epoch, each in its own order; batch k is a function of (seed, k):
    a fresh split (a resumed run) reads the same batches from any step, mid-epoch included."""
    data = chat_data(folder, tmp_path)
    split = data.train
    per_epoch = split.num_windows
    first, second = [split.window(k) for k in range(per_epoch)], [split.window(per_epoch + k) for k in range(per_epoch)]
    assert sorted(d for w in first for d in w) == sorted(d for w in second for d in w) == list(range(split.docs.count))
    assert first != second
    step = per_epoch // 4 + 1  # batches of 4 windows: this one starts inside epoch 1
    again = chat_data(folder, tmp_path).train
    for k in (0, step, step + 3):
        a, b = split.batch(k, 4), again.batch(k, 4)
        assert all(np.array_equal(a[key], b[key]) for key in a)
    # Two processes' rows are the global batch's, and their weights the global batch's too.
    whole = split.batch(step, 4)
    halves = [split.batch(step, 4, p, 2) for p in (0, 1)]
    for key in whole:
        assert np.array_equal(np.concatenate([h[key] for h in halves]), whole[key])


def test_packing_fills_windows():
    lengths = np.random.default_rng(0).integers(20, 120, 2000)
    windows = pack(lengths, np.arange(2000), 513)
    assert sorted(d for w in windows for d in w) == list(range(2000))
    assert all(lengths[w].sum() <= 513 for w in windows)
    assert lengths.sum() / (len(windows) * 513) > 0.95


def test_prompt_completion_and_loss_on_all(folder, tmp_path):
    tok = load_tokenizer_of(folder)
    recipe = Recipe("prompt_completion", True, 65, "none", 0.0)
    docs, stats = encode_rows([("pc.jsonl:1", {"prompt": "What is 1 + 2?", "completion": " 3"})], recipe, tok, None)
    d = docs["train"]
    assert tok.decode(d.tokens[d.targets].tolist(), skip_special_tokens=False) == " 3<eos>"
    every, _ = encode_rows([("pc.jsonl:1", {"prompt": "What is 1 + 2?", "completion": " 3"})],
                           Recipe("prompt_completion", False, 65, "none", 0.0), tok, None)
    assert every["train"].targets.all() and stats["train_targets"] == len(tok.encode(" 3").ids) + 1


def load_tokenizer_of(folder):
    return load_tokenizer(folder / "tokenizer.json")


def test_bad_rows_are_named(folder, tmp_path):
    tok = load_tokenizer_of(folder)
    chat = chat_tokens(tok, str(folder / "tokenizer.json"), "chatml")
    recipe = Recipe("chat", True, 65, "none", 0.0, "chatml")
    long = {"messages": [{"role": "user", "content": "x " * 80}, {"role": "assistant", "content": "y"}]}
    for row, message in [({"text": "hi"}, "f.jsonl:4: no 'messages'"),
                         ({"messages": [{"role": "bot", "content": "x"}]}, "f.jsonl:4: message 0 has the unknown role"),
                         ({"messages": [{"role": "user", "content": ""}]}, "f.jsonl:4: message 0 .user. has empty"),
                         (long, "f.jsonl:4: .* tokens, longer than a window of train.seq_len . 1 = 65")]:
        with pytest.raises(DataError, match=message):
            encode_rows([("f.jsonl:4", row)], recipe, tok, chat)
    with pytest.raises(DataError, match="f.jsonl:2: no 'completion'"):
        encode_rows([("f.jsonl:2", {"prompt": "x"})], Recipe("prompt_completion", True, 65, "none", 0.0), tok, None)
    cut, stats = encode_rows([("f.jsonl:4", long)], Recipe("chat", True, 65, "right", 0.0, "chatml"), tok, chat)
    assert cut["train"].lengths.tolist() == [65] and stats["truncated_rows"] == 1
    with pytest.raises(ConfigError, match="a chat needs a chat template"):
        load_chat_template(folder / "tokenizer.json", "", tok)


def test_split_needs_rows():
    empty = Documents(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(1, np.int64))
    with pytest.raises(ConfigError, match="train data has no rows"):
        PackedSplit(empty, seq_len=8, seed=0, name="train", pad_id=0)
