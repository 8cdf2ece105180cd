"""The docs name only what exists: every config key a user is shown to set (`section.key=value`),
every `python -m boost_jax...` command and every `bench` command that README.md and docs/ mention."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from boost_jax.bench.__main__ import COMMANDS as BENCH_COMMANDS
from boost_jax.config import Config

ROOT = Path(__file__).parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")], key=str)


def config_keys() -> set[str]:
    keys = set()
    for f in dataclasses.fields(Config):
        section = getattr(Config(), f.name)
        if dataclasses.is_dataclass(section):
            keys.update(f"{f.name}.{g.name}" for g in dataclasses.fields(section))
        else:
            keys.add(f.name)
    return keys


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_the_docs_name_exists(doc):
    keys, sections = config_keys(), {k.split(".")[0] for k in config_keys() if "." in k}
    named = set(re.findall(rf"\b((?:{'|'.join(sections)})\.[a-z_]+)=", doc.read_text()))
    assert sorted(k for k in named if k not in keys) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_the_docs_name_exists(doc):
    text = doc.read_text()
    modules = set(re.findall(r"python -m (boost_jax(?:\.[a-z_]+)*)", text))
    assert sorted(m for m in modules if importlib.util.find_spec(m) is None) == []
    benches = set(re.findall(r"(?:python -m boost_jax\.bench|`bench) ([a-z]+)", text))
    assert sorted(benches - set(BENCH_COMMANDS)) == []
