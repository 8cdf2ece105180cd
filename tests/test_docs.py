"""The docs name only what exists: every config key a user is shown to set (`section.key=value`),
every `python -m boost_jax...` command and every `bench` command that README.md and docs/ mention; and
the commands they show run. Every ```bash block says on the line above it whether a test runs it:
`<!-- runs: fast -->` (run here, in the inner tier: --help forms and commands of seconds),
`<!-- runs: slow -->` (run here, in the slow tier) or `<!-- not run: why -->` (a corpus, a GPU, minutes
of training; the reason names the test that covers it where one does). A runnable block runs verbatim,
as one bash script with -e, from an empty folder."""

import dataclasses
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from boost_jax.bench.__main__ import COMMANDS as BENCH_COMMANDS
from boost_jax.config import Config

ROOT = Path(__file__).parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")], key=str)
_BLOCK = re.compile(r"^(?:(<!-- (?:runs: (?:fast|slow)|not run: [^\n]+?) -->)\n)?```bash\n(.*?)^```$", re.M | re.S)


def blocks(doc: Path) -> list[tuple[str, str, str]]:
    """(marker, where, script) of each ```bash block of a doc; marker "" where the line above says nothing."""
    text, name = doc.read_text(), doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    return [(m.group(1) or "", f"{name}:{text[:m.start()].count(chr(10)) + 1}", m.group(2))
            for m in _BLOCK.finditer(text)]


def runnable(tier: str) -> list:
    return [pytest.param(script, id=where) for doc in DOCS for marker, where, script in blocks(doc)
            if marker == f"<!-- runs: {tier} -->"]


def config_keys() -> set[str]:
    keys = set()
    for f in dataclasses.fields(Config):
        section = getattr(Config(), f.name)
        if dataclasses.is_dataclass(section):
            keys.update(f"{f.name}.{g.name}" for g in dataclasses.fields(section))
        else:
            keys.add(f.name)
    return keys


def _doc_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_config_key_the_docs_name_exists(doc):
    keys, sections = config_keys(), {k.split(".")[0] for k in config_keys() if "." in k}
    named = set(re.findall(rf"\b((?:{'|'.join(sections)})\.[a-z_]+)=", doc.read_text()))
    assert sorted(k for k in named if k not in keys) == []


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_command_the_docs_name_exists(doc):
    text = doc.read_text()
    modules = set(re.findall(r"python -m (boost_jax(?:\.[a-z_]+)*)", text))
    assert sorted(m for m in modules if importlib.util.find_spec(m) is None) == []
    benches = set(re.findall(r"(?:python -m boost_jax\.bench|`bench) ([a-z]+)", text))
    assert sorted(benches - set(BENCH_COMMANDS)) == []


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_bash_block_says_whether_a_test_runs_it(doc):
    unmarked = [where for marker, where, _ in blocks(doc) if not marker]
    assert unmarked == [], ("a ```bash block needs <!-- runs: fast -->, <!-- runs: slow --> or <!-- not run: why --> "
                            f"on the line above it: {unmarked}")


def _run(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BOOST_JAX_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"exit {out.returncode}:\n{script}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("script", runnable("fast"))
def test_the_fast_commands_the_docs_show_run(script, tmp_path):
    _run(script, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("script", runnable("slow"))
def test_the_slow_commands_the_docs_show_run(script, tmp_path):
    _run(script, tmp_path)


def test_a_block_is_read_with_the_marker_on_the_line_above_it(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text("<!-- runs: fast -->\n```bash\necho a\n```\n\n<!-- runs: fast -->\n\n```bash\necho b\n```\n"
                   "<!-- not run: needs a GPU -->\n```bash\necho c\n```\n```python\nx = 1\n```\n")
    found = [(marker, script) for marker, _, script in blocks(doc)]
    assert found == [("<!-- runs: fast -->", "echo a\n"), ("", "echo b\n"), ("<!-- not run: needs a GPU -->", "echo c\n")]


def test_ci_runs_the_readmes_set_up_commands_verbatim():
    """.ci/run installs and tests with the README's two set-up commands, as written there."""
    (setup,) = [script for _, _, script in blocks(ROOT / "README.md") if "pip install" in script]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert setup.splitlines() == ['pip install -e ".[dev,gpu-compile]"', "python -m pytest -n 2 -q"]
    assert [line for line in ci if line in setup.splitlines()] == setup.splitlines()
