"""`bench finetune`'s task and scoring (boost_jax/bench/finetune_task.py) on a tiny case, and the issue's
target that a chat-trained dense model exported with `export --format hf` answers in transformers
(`AutoTokenizer.apply_chat_template` on the exported folder, greedy `generate`) exactly as ours, token
for token, with our completion loss."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from boost_jax import api
from boost_jax.bench import finetune
from boost_jax.bench.finetune_task import build_task, completion_loss, messages, parameters, read_rows, score
from boost_jax.config import ConfigError, DataConfig, load_config
from boost_jax.data.build import build_data
from boost_jax.data.corpus import Corpus
from boost_jax.export import export
from boost_jax.model.run_dir import open_run

# 60 distinct one-line defs of every parameter kind, and lines the task must pass over
LINES = [f"def f{i}(self, a{i}, /, b=(1, 2), *args, key{i}: int = 0, **kw):" for i in range(30)] + \
        [f"async def g{i}(x{i}, y: 'T' = None) -> int:" for i in range(30)]
SKIPPED = ["def one(self):", "def many(a, b, c, d, e, f, g):", "x = 1", "def broken(a, b:", "class C(A, B):"]


@pytest.mark.parametrize("line,names", [
    ("def f(self, a, /, b=(1, 2), *args, key: int = 0, **kw):", ["self", "a", "b", "args", "key", "kw"]),
    ("async def g(x, y: 'T' = None) -> int:", ["x", "y"]),
    ("def h(*, a, b):", ["a", "b"]),
    *((line, None) for line in SKIPPED),
])
def test_a_def_lines_parameters_are_the_names_python_reads(line, names):
    assert parameters(line) == names


def test_the_task_holds_lines_out_by_a_stable_hash(tmp_path):
    (tmp_path / "m.py").write_text("\n".join(["    " + line for line in LINES + SKIPPED]) + "\n")
    corpus = Corpus((tmp_path / "m.py",))
    task = build_task(corpus, tmp_path / "a", train_rows=1000, heldout_rows=1000, heldout_share=0.25)
    train, held = read_rows(task.train), read_rows(task.heldout)
    assert sorted(line for line, _ in train + held) == sorted(LINES)
    assert all(answer == ", ".join(parameters(line)) for line, answer in train + held)
    assert 5 <= len(held) <= 25 and not {line for line, _ in train} & {line for line, _ in held}
    again = build_task(corpus, tmp_path / "b", train_rows=1000, heldout_rows=1000, heldout_share=0.25)
    assert read_rows(again.heldout) == held  # the same lines held out, whatever run builds it


@pytest.mark.parametrize("argv,needle", [(["--seeds", "0,x"], "--seeds"), (["model.arch=cola"], "model.arch"),
                                         (["--finetune-steps", "0"], "--finetune-steps")])
def test_bad_flags_are_refused_by_name_before_any_run(argv, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        finetune.main([*argv, "--work", str(tmp_path / "w")])
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_chat_trained_dense_model_answers_in_transformers_as_ours(tmp_path, tiny_overrides, cache_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    (tmp_path / "m.py").write_text("\n".join(LINES) + "\n")
    task = build_task(Corpus((tmp_path / "m.py",)), tmp_path / "task", 1000, 6, heldout_share=0.2)
    tokenizer = build_data(DataConfig(source="stdlib", max_bytes=300000, cache_dir=str(cache_dir)), vocab_size=512,
                           seq_len=64, seed=0).directory / "tokenizer.json"
    from boost_jax.training.run import train  # optional: grain (the loop's loader)

    run_dir = tmp_path / "run"
    train(load_config(None, [*tiny_overrides, "model.arch=dense", f"run_dir={run_dir}", "train.seq_len=128",
                             "data.source=files", f"data.paths=[{task.train}]", "data.format=chat",
                             "data.chat_template=chatml", "data.val_fraction=0", "train.loss_on=completion",
                             f"data.tokenizer_path={tokenizer}", "train.steps=3", "checkpoint.every=3",
                             "train.eval_every=0", "parallel.dp=1"]), jax.devices()[:1])
    export(open_run(run_dir), tmp_path / "hf", fmt="hf")
    _, model, _ = api.restore(run_dir)
    chat = api.restore_chat(run_dir)
    rows = read_rows(task.heldout)

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # the template the export wrote beside it
    render = lambda m, prompt: tok.apply_chat_template(m, add_generation_prompt=prompt, return_dict=True)["input_ids"]
    prompts = [render(messages(line), True) for line, _ in rows]
    assert prompts == [chat.encode(messages(line), True) for line, _ in rows]
    ours = api.generate(model, prompts, max_new_tokens=10, eos_id=chat.stop_ids)
    theirs, total, count = [], 0.0, 0
    with torch.no_grad():
        for p, (line, answer) in zip(prompts, rows):
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=list(chat.stop_ids),
                              pad_token_id=chat.stop_ids[0])[0, len(p):].tolist()
            theirs.append(out[:out.index(chat.stop_ids[0])] if chat.stop_ids[0] in out else out)
            full = render(messages(line, answer), False)
            # the targets: all the assistant's turn renders after the generation prompt (ChatML: the
            # reply, its end-of-turn eos and the newline that closes the turn), as train.loss_on=completion
            logp = torch.log_softmax(hf(torch.tensor([full[:-1]])).logits[0, len(p) - 1:], -1)
            total -= float(logp[torch.arange(len(full) - len(p)), torch.tensor(full[len(p):])].sum())
            count += len(full) - len(p)
    assert theirs == ours and sum(map(len, ours)) > len(ours)  # replies compared, not only early stops
    assert np.isclose(completion_loss(model, chat, rows), total / count, rtol=1e-4)
    scored = score(model, chat, rows, max_new_tokens=10)
    replies = [chat.tokenizer.decode(t).strip() for t in theirs]
    assert scored["exact_match"] == sum(r == a for r, (_, a) in zip(replies, rows)) / len(rows)
