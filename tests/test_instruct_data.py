"""Instruction data (data.format=chat / prompt_completion): rows -> documents with targets -> packed
windows -> batches whose weighted loss is the mean over the target tokens."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from boost_jax.analysis.program import build
from boost_jax.config import DataConfig, load_config
from boost_jax.data.__main__ import main as prepare_main
from boost_jax.data.build import build_data
from boost_jax.data.chat import load_chat_template
from boost_jax.data.corpus import records
from boost_jax.data.instruct import Recipe, chat_tokens, encode_rows
from boost_jax.data.packing import Documents, PackedSplit, pack
from boost_jax.data.tokenizer import load_tokenizer, train_tokenizer
from boost_jax.layers.cross_entropy import cross_entropy_sum
from boost_jax.model.weights import init_params
from boost_jax.runtime.errors import ConfigError, DataError
from boost_jax.training.run import train


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


# ----------------------------------------------------------------------------- training on it


def finetune(tmp_path, tiny_overrides, folder, name, *extra):
    cfg = load_config(None, [*tiny_overrides, f"run_dir={tmp_path / name}", "data.source=files",
                             f"data.paths=[{folder / 'chat.jsonl'}]", "data.format=chat", "data.chat_template=chatml",
                             f"data.tokenizer_path={folder / 'tokenizer.json'}", "parallel.dp=1", *extra])
    return train(cfg, jax.devices()[:1]), tmp_path / name


@pytest.mark.slow  # three short runs
def test_a_chat_finetune_resumes_mid_epoch_bitwise(tmp_path, tiny_overrides, folder):
    """200 rows of ~56 tokens pack into ~50 windows of 65 slots: 6 steps of 8 windows; a resume at
    step 3 starts inside epoch 0's windows and steps past its end into epoch 1's reshuffle."""
    common = ["train.schedule_steps=9", "checkpoint.every=3", "train.eval_every=3", "data.val_fraction=0.1"]
    full, _ = finetune(tmp_path, tiny_overrides, folder, "full", *common, "train.steps=9", "checkpoint.every=0")
    first, run_dir = finetune(tmp_path, tiny_overrides, folder, "split", *common, "train.steps=4")
    (run_dir / "checkpoints" / "4").rename(tmp_path / "moved-4")  # as if it stopped before saving step 4
    second, _ = finetune(tmp_path, tiny_overrides, folder, "split", *common, "train.steps=9")
    assert second["start_step"] == 3 and second["losses"] == full["losses"][3:]  # bitwise equal floats
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[2]["eval_tokens"] > 0 and rows[2]["eval_tokens"] < 2 * 8 * 64  # targets only, counted


def test_a_bad_row_stops_the_run_before_anything_is_written(tmp_path, tiny_overrides, folder):
    bad = tmp_path / "bad.jsonl"
    bad.write_text((folder / "chat.jsonl").read_text() + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    cfg = load_config(None, [*tiny_overrides, f"run_dir={tmp_path / 'run'}", "data.source=files",
                             f"data.paths=[{bad}]", "data.format=chat", "data.chat_template=chatml",
                             f"data.cache_dir={tmp_path / 'cache'}",
                             f"data.tokenizer_path={folder / 'tokenizer.json'}", "parallel.dp=1"])
    with pytest.raises(DataError, match="bad.jsonl:201: message 0 must be an object with 'role' and 'content'"):
        train(cfg, jax.devices()[:1])
    # Only the run dir's lock (taken before anything, as every run takes it) and no dataset in the cache.
    assert {p.name for p in (tmp_path / "run").iterdir()} <= {".boost_jax.lock"}
    assert not list((tmp_path / "cache").glob("instruct/*"))


def packed_loss_and_grads(*overrides):
    """The loss and gradients of a packed batch (rows of 2-3 documents, positions from 0 in each, a
    loss mask) under a layout."""
    cfg = load_config(None, ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=4", "train.seq_len=32",
                             "parallel.dp=1", "data.source=prepared", "data.path=unused", "data.format=chat",
                             *overrides])
    prog = build(cfg)
    params = jax.device_put(init_params(cfg), jax.tree.map(lambda p: p.sharding, prog.params))
    rng = np.random.default_rng(0)
    cuts = [sorted(rng.choice(np.arange(3, 30), 2, replace=False)) for _ in range(4)]
    segments = np.stack([np.searchsorted(c, np.arange(32), side="right") for c in cuts]).astype(np.int32)
    positions = np.stack([np.arange(32) - np.concatenate([[0], c])[s] for c, s in zip(cuts, segments)])
    mask = (rng.random((4, 32)) < 0.4) & (np.roll(segments, -1, 1) == segments)
    batch = {"inputs": rng.integers(0, 512, (4, 32)).astype(np.int32),
             "targets": rng.integers(0, 512, (4, 32)).astype(np.int32), "segment_ids": segments,
             "positions": positions.astype(np.int32), "weights": (mask * (mask.size / mask.sum())).astype(np.float32)}
    batch = jax.device_put(batch, prog.batch["inputs"].sharding)
    return jax.device_get(jax.jit(jax.value_and_grad(prog.loss))(params, batch))


@pytest.mark.slow  # two compiles, ~17 s on 2 cores
def test_packed_rows_under_cp_and_tp_equal_one_device():
    """A packed batch (its segments, positions and loss weights put in cp's balanced order with the
    tokens) under cp=2 x tp=2 is the single-device loss and gradient. (RoPE is relative, so within a
    row the positions' origin does not change the loss; the segments and weights do.)"""
    (ref, ref_grads), (value, grads) = packed_loss_and_grads(), packed_loss_and_grads("parallel.cp=2", "parallel.tp=2")
    assert value == pytest.approx(ref, rel=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert np.abs(g - r).max() <= 1e-5 * np.abs(r).max()


def test_data_prepare_gives_the_batches_of_source_files(folder, tmp_path):
    prepare_main(["prepare", str(folder / "chat.jsonl"), "--out", str(tmp_path / "prepared"), "--format", "chat",
                  "--tokenizer", str(folder / "tokenizer.json"), "--chat-template", "chatml", "--seq-len", "64",
                  "--val-fraction", "0.1"])
    prepared = build_data(DataConfig(source="prepared", path=str(tmp_path / "prepared"), format="chat"),
                          vocab_size=512, seq_len=64, seed=0, completion_only=True)
    files = chat_data(folder, tmp_path / "cache", val_fraction=0.1)
    for k in (0, 7):
        a, b = prepared.train.batch(k, 4), files.train.batch(k, 4)
        assert all(np.array_equal(a[key], b[key]) for key in a)
    with pytest.raises(DataError, match="holds instruction rows: set data.format"):
        build_data(DataConfig(source="prepared", path=str(tmp_path / "prepared")), vocab_size=512, seq_len=64, seed=0)
    with pytest.raises(DataError, match="a row of .* tokens, longer than a window of train.seq_len . 1 = 33"):
        build_data(DataConfig(source="prepared", path=str(tmp_path / "prepared"), format="chat"),
                   vocab_size=512, seq_len=32, seed=0, completion_only=True)


def test_parquet_rows_read_as_jsonl_rows(folder, tmp_path):
    data = rows(5)
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "chat.parquet")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    got = list(records([tmp_path / "chat.parquet"]))
    assert [w for w, _ in got][:2] == [f"{tmp_path / 'chat.parquet'}#0", f"{tmp_path / 'chat.parquet'}#1"]
    assert [r for _, r in got] == [r for _, r in records([tmp_path / "chat.jsonl"])] == data
    with pytest.raises(DataError, match="instruction rows are read from .jsonl"):
        list(records([folder / "tokenizer.json"]))
