"""Chat templates: a tokenizer's Jinja template rendered as transformers' `apply_chat_template` renders it.

    template = load_chat_template(tokenizer_path, template_file="", tokenizer=tok)  # ConfigError if none/broken
    text = template.render(messages, add_generation_prompt=True)
    chat = template.bind(tok)                       # tok: a tokenizers.Tokenizer (data/tokenizer.py)
    ids = chat.encode(messages, add_generation_prompt=True)   # == apply_chat_template(messages, ...)
    ids, targets = chat.encode_turns(messages)     # targets: the assistant turns' tokens (and end of turn)
    chat.stop_ids                                   # the end-of-turn token(s) generation stops at
    check_turns(messages, where)                    # a conversation's {role, content}s, or DataError at `where`
    check_messages(messages, where)                 # the same, for a training row (an assistant turn in it)

The template comes from `template_file` (data.chat_template) if given, else `chat_template.jinja`
beside the tokenizer (as transformers 5 saves it), else the `chat_template` key of the
`tokenizer_config.json` beside it. The environment is transformers' (jinja2's immutable sandbox,
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does
not escape HTML, `dict` and `namespace`), and the template sees the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) as transformers passes them. A `{% generation %}` block (transformers'
assistant-mask tag) renders its body. The rendered text is encoded with the special tokens it
contains parsed as such and none added, as `apply_chat_template(tokenize=True)` does by default (so
a control token typed inside a message is a control token there too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer

from boost_jax.data.tokenizer import SPECIALS, eos_id
from boost_jax.runtime.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"  # the turns train.loss_on=completion trains on
# The named special tokens transformers hands a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
PAD, BOS = SPECIALS[:2]  # a trained tokenizer's (data/tokenizer.py)
_PROBE = ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."})


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %} ... {% endgeneration %}` tag, which marks assistant text for
    its masks: here it renders its body (the masks come from the turns, `encode_turns`)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes (no way to CPython's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """transformers' `dict` global: calling and fromkeys, no attribute access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=_Dict(), namespace=_Namespace)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source text, where it came from, and the special tokens it is rendered with."""

    text: str
    where: str  # the file (and key) it was read from: every message about it names this
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def _compiled(self) -> jinja2.Template:
        try:
            return _environment().from_string(self.text)
        except jinja2.TemplateError as e:
            raise ConfigError(f"chat template {self.where} does not parse: {e}") from None

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = False, where: str = "") -> str:
        """The conversation as the template writes it; with `add_generation_prompt`, followed by the
        opening of an assistant turn. A template that refuses the conversation (raise_exception, or an
        error in its code) raises DataError naming `where` (the row) and the template."""
        compiled = self._compiled
        try:
            return compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise DataError(f"{where or 'the conversation'}: chat template {self.where} does not render it: {e}"
                            ) from None
        except Exception as e:  # a template is code: any error in it is the template's, for this row
            raise DataError(f"{where or 'the conversation'}: chat template {self.where} fails on it: "
                            f"{type(e).__name__}: {e}") from None

    def bind(self, tokenizer: Tokenizer) -> ChatTokens:
        """This template encoding with `tokenizer` (not changed: a copy parses special tokens)."""
        return ChatTokens(self, tokenizer)


class ChatTokens:
    """A template and a tokenizer: conversations as token ids, their targets, and the stop tokens."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer):
        self.template = template
        # The data path's tokenizer keeps "<eos>" in a document as text (encode_special_tokens);
        # a rendered chat's control tokens are the template's, parsed as transformers parses them.
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.encode_special_tokens = False
        self.stop_ids = self._stop_ids()

    def encode(self, messages: Sequence[Mapping], add_generation_prompt: bool = False, where: str = "") -> list[int]:
        """The rendered conversation's ids, as apply_chat_template(messages, tokenize=True) gives them."""
        text = self.template.render(messages, add_generation_prompt, where)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_turns(self, messages: Sequence[Mapping], where: str = "") -> tuple[list[int], list[bool]]:
        """The conversation's ids (as `encode`) and which of them are an assistant's: from the end of
        the generation prompt before each assistant turn to the end of that turn (its end-of-turn
        token included). Needs a template that renders each conversation as an extension of its
        first turns (every common one does); one that rewrites earlier turns is refused."""
        text = self.template.render(messages, False, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != TRAINED_ROLE:
                continue
            prompt = self.template.render(messages[:i], True, where)
            turn = self.template.render(messages[: i + 1], False, where)
            if not (text.startswith(turn) and turn.startswith(prompt)):
                raise DataError(f"{where or 'the conversation'}: chat template {self.template.where} does not "
                                f"render turn {i} as an extension of the turns before it, so its assistant "
                                "tokens cannot be told apart; set train.loss_on=all")
            spans.append((len(prompt), len(turn)))
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        targets = [any(a <= lo < b for a, b in spans) for lo, _ in enc.offsets]
        return enc.ids, targets

    def _stop_ids(self) -> tuple[int, ...]:
        """The token that closes an assistant turn (the first one the template writes after a probe
        reply's text) and the eos token, where the tokenizer has them."""
        text = self.template.render(_PROBE, False, "the probe conversation")
        reply = _PROBE[-1]["content"]
        if reply not in text:
            raise ConfigError(f"chat template {self.template.where} does not write the assistant's reply "
                              f"{reply!r} of a probe conversation; it cannot be used for chat")
        after = text[text.rindex(reply) + len(reply):]
        ids = self.tokenizer.encode(after.lstrip(" "), add_special_tokens=False).ids[:1] if after.strip() else []
        eos = self.template.special_tokens.get("eos_token")
        if eos is not None and (i := self.tokenizer.token_to_id(eos)) is not None:
            ids.append(i)
        if not ids:
            raise ConfigError(f"chat template {self.template.where} writes nothing after an assistant turn and "
                              "the tokenizer has no eos_token: generation would have no token to stop at")
        return tuple(dict.fromkeys(ids))


def check_messages(messages, where: str) -> list[dict]:
    """A training row's `messages`: `check_turns`, with at least one assistant turn to learn from."""
    out = check_turns(messages, where)
    if not any(m["role"] == TRAINED_ROLE for m in out):
        raise DataError(f"{where}: no {TRAINED_ROLE} message: nothing to learn from")
    return out


def check_turns(messages, where: str) -> list[dict]:
    """A conversation: a non-empty list of {role, content} with a known role and non-empty text, as
    plain dicts of those two keys. Anything else raises DataError naming `where`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has the unknown role {m['role']!r}; the roles are "
                            f"{', '.join(ROLES)}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise DataError(f"{where}: message {i} ({m['role']}) has empty content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def load_chat_template(tokenizer_path: str | Path, template_file: str | Path = "",
                       tokenizer: Tokenizer | None = None) -> ChatTemplate:
    """The chat template for the tokenizer.json at `tokenizer_path` (see the module's docstring for
    where it is looked for), with the special tokens of the tokenizer_config.json beside it; where
    that names none, `tokenizer`'s own <bos>, <eos> and <pad> (a trained one's, data/tokenizer.py).
    It is compiled and rendered on a probe conversation here, so a broken one fails before any work."""
    folder = Path(tokenizer_path).parent if tokenizer_path else None
    config = _read_json(folder / CONFIG_FILE) if folder and (folder / CONFIG_FILE).is_file() else {}
    specials = _own_special_tokens(tokenizer) if tokenizer is not None else {}
    if folder and (folder / "special_tokens_map.json").is_file():
        specials.update(_special_tokens(_read_json(folder / "special_tokens_map.json")))
    specials.update(_special_tokens(config))
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ConfigError(f"data.chat_template={template_file}: no such file")
        template = ChatTemplate(path.read_text(encoding="utf-8"), str(path), specials)
    elif folder and (folder / TEMPLATE_FILE).is_file():
        template = ChatTemplate((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE),
                                specials)
    elif isinstance(text := config.get("chat_template"), (str, list)):
        template = ChatTemplate(_default_template(text, folder / CONFIG_FILE), f"{folder / CONFIG_FILE}:chat_template",
                                specials)
    else:
        beside = f"beside {tokenizer_path}" if tokenizer_path else "(data.tokenizer_path is not set)"
        raise ConfigError(f"a chat needs a chat template: none in {TEMPLATE_FILE} or the chat_template key "
                          f"of {CONFIG_FILE} {beside}; set data.chat_template=FILE (a ChatML one ships as "
                          "boost_jax/configs/chatml.jinja)")
    try:
        template.render(_PROBE, True, "a probe conversation (user, assistant)")  # compiles, and fails here if broken
    except DataError as e:
        raise ConfigError(str(e)) from None
    return template


def _own_special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """A tokenizer.json's own bos, eos and pad tokens (for one without a tokenizer_config.json)."""
    own = {"bos_token": BOS, "pad_token": PAD}
    try:
        own["eos_token"] = tokenizer.id_to_token(eos_id(tokenizer))
    except DataError:
        pass  # no eos: a template that writes eos_token fails on the probe, naming it
    return {name: token for name, token in own.items() if tokenizer.token_to_id(token) is not None}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json (a string, or an AddedToken's dict)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _default_template(text: str | list, where: Path) -> str:
    """A chat_template key's template: a string, or transformers' list of named ones (its 'default')."""
    if isinstance(text, str):
        return text
    named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
    if not isinstance(named.get("default"), str):
        raise ConfigError(f"{where}: chat_template is a list of named templates without a 'default' one "
                          f"(it has {sorted(map(str, named))}); set data.chat_template=FILE")
    return named["default"]
