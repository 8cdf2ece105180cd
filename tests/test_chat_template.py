"""Chat templates (boost_jax/data/chat.py) render and tokenize as transformers' apply_chat_template."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from boost_jax.configs import CHATML
from boost_jax.data.chat import check_messages, load_chat_template
from boost_jax.data.tokenizer import train_tokenizer
from boost_jax.runtime.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")

# Real templates: Qwen1.5/2's ChatML (a default system turn) and Llama-3-Instruct's (bos, headers, trim).
CHATML_QWEN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
ROWS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Colour of the sky?"},
     {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "  And grass?  "},
     {"role": "assistant", "content": "Green."}],
    [{"role": "user", "content": "Ünïcödé 🙂 and\ttabs\n\nnew lines"}, {"role": "assistant", "content": "ok 👍"}],
]


def _folder(path, template, eos, bos=None):
    """A tokenizer folder as a Hub model has it: a byte-level BPE with the template's special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.dumps(r) for r in ROWS] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos,
              **({"bos_token": {"__type": "AddedToken", "content": bos, "special": True}} if bos else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("template,eos,bos,stop", [(CHATML_QWEN, "<|im_end|>", None, ["<|im_end|>"]),
                                                   (LLAMA3, "<|endoftext|>", "<|begin_of_text|>",
                                                    ["<|eot_id|>", "<|endoftext|>"])], ids=["chatml", "llama3"])
def test_ids_equal_apply_chat_template(tmp_path, template, eos, bos, stop):
    folder = _folder(tmp_path / "tok", template, eos, bos)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    chat = load_chat_template(folder / "tokenizer.json").bind(Tokenizer.from_file(str(folder / "tokenizer.json")))
    for row in ROWS:
        for prompt in (False, True):
            assert chat.template.render(row, prompt) == hf.apply_chat_template(row, tokenize=False,
                                                                               add_generation_prompt=prompt)
            want = hf.apply_chat_template(row, add_generation_prompt=prompt, return_dict=True)["input_ids"]
            assert chat.encode(row, prompt) == want
    assert list(chat.stop_ids) == [hf.convert_tokens_to_ids(t) for t in stop]
    # The assistant turns, each closed by its end-of-turn token, are the targets; nothing else is.
    ids, targets = chat.encode_turns(ROWS[1])
    assert ids == chat.encode(ROWS[1])
    trained = hf.decode([i for i, t in zip(ids, targets, strict=True) if t])
    assert trained == {"<|im_end|>": "Blue<|im_end|>\nGreen.<|im_end|>\n", "<|endoftext|>": "Blue<|eot_id|>Green.<|eot_id|>"}[eos]
    # transformers 5 saves the template as chat_template.jinja beside the tokenizer: read from there too.
    hf.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    again = load_chat_template(tmp_path / "saved" / "tokenizer.json")
    assert again.text == template and again.render(ROWS[1], True) == chat.template.render(ROWS[1], True)


def test_shipped_chatml_on_the_default_tokenizer(tmp_path):
    """The embedded default tokenizer has no template: the shipped one writes plain-text openers and
    closes each turn with the tokenizer's own <eos>, the one token generation stops at."""
    tok = train_tokenizer("bpe", 270, ["def f(x):\n    return x + 1\n"] * 50)
    tok.save(str(tmp_path / "tokenizer.json"))
    chat = load_chat_template(tmp_path / "tokenizer.json", CHATML, tok).bind(tok)
    assert chat.stop_ids == (tok.token_to_id("<eos>"),)
    ids, targets = chat.encode_turns(ROWS[0])
    assert tok.decode([i for i, t in zip(ids, targets, strict=True) if t], skip_special_tokens=False) == "2 + 3 = 5.<eos>\n"
    assert chat.template.render(ROWS[0], True).endswith("<eos>\n<|im_start|>assistant\n")


def test_bad_templates_and_rows(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="a chat needs a chat template"):
        load_chat_template(tmp_path / "tokenizer.json")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="broken.jinja does not parse"):
        load_chat_template(tmp_path / "tokenizer.json", tmp_path / "broken.jinja")
    (tmp_path / "strict.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    template = load_chat_template(tmp_path / "tokenizer.json", tmp_path / "strict.jinja")
    with pytest.raises(DataError, match="row 7.*strict.jinja does not render it: no system turns"):
        template.render([{"role": "system", "content": "x"}], where="row 7")
    for messages, message in [({"role": "user"}, "non-empty list"), ([{"role": "user"}], "'role' and 'content'"),
                              ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
                              ([{"role": "user", "content": " "}], "empty content"),
                              ([{"role": "user", "content": "x"}], "no assistant message")]:
        with pytest.raises(DataError, match=f"f.jsonl row 3: .*{message}"):
            check_messages(messages, "f.jsonl row 3")
