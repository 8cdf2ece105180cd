"""MkDocs hooks (mkdocs.yml `hooks:`): the pages the site builds from one source elsewhere.

- `index.md` is README.md, its links moved from the repository root into docs/ (`docs/x.md` -> `x.md`,
  `boost_jax/configs/base.yaml` -> the config reference), so the front page is written once.
- `reference/config.md` is `boost_jax/configs/base.yaml` as tables: every key, its default and its comment
  (the comments are the one place a key is documented). A key of the typed config (`boost_jax.config.Config`)
  that the file does not document stops the build, naming the key.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from boost_jax.config import Config

ROOT = Path(__file__).resolve().parents[1]
BASE_YAML = ROOT / "boost_jax" / "configs" / "base.yaml"
README_LINKS = {"boost_jax/configs/base.yaml": "reference/config.md"}  # README links out of docs/, and their page
_KEY = re.compile(r"^( *)([A-Za-z_]\w*):(?: +([^#\s].*?))?(?: +# ?(.*))?$")


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=readme_page((ROOT / "README.md").read_text())))
    files.append(File.generated(config, "reference/config.md", content=config_reference(BASE_YAML.read_text())))
    return files


def readme_page(text: str) -> str:
    """README.md with its links relative to docs/; a link to another file outside docs/ is refused by name."""
    def link(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        if path.startswith("docs/"):
            path = path[len("docs/"):]
        elif path in README_LINKS:
            path = README_LINKS[path]
        else:
            raise PluginError(f"README.md links to {target!r}, outside docs/: the site cannot serve it "
                              f"(link into docs/, or map it in scripts/mkdocs_hooks.py's README_LINKS)")
        return f"]({path}{'#' + anchor if anchor else ''})"
    return re.sub(r"\]\(()([^)\s]+)\)", link, text)


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # dotted: train.muon.momentum
    default: str  # as the YAML spells it
    meaning: str


def parse(text: str) -> list[Row | tuple[str, str]]:
    """base.yaml's keys in order as Rows; a section's heading, or a comment line's note, as (kind, text)."""
    items: list[Row | tuple[str, str]] = []
    path: list[tuple[int, str]] = []  # (indent, name) of the mappings the line sits in
    seen_key = False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            if seen_key:  # the file's own header is the page's introduction, not a note
                items.append(("note", stripped.lstrip("#").strip()))
            continue
        m = _KEY.match(line)
        if not m:
            raise PluginError(f"{BASE_YAML.name}: cannot read {line!r} (one `key: value  # comment` a line)")
        indent, name, value, comment = len(m.group(1)), m.group(2), m.group(3) or "", m.group(4) or ""
        seen_key = True
        path = [(i, n) for i, n in path if i < indent]
        key = ".".join([n for _, n in path] + [name])
        if value:
            items.append(Row(key, value, comment))
        elif path:  # a nested section (train.muon): one row for it, its keys after it in the section's table
            items.append(Row(key + ".*", "", comment))
            path.append((indent, name))
        else:
            items.append(("section", key))
            if comment:
                items.append(("note", comment))
            path.append((indent, name))
    return items


def config_keys() -> list[str]:
    """Every key of the typed config, dotted, nested sections included (train.muon.momentum)."""
    def keys(obj, prefix: str):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from keys(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"
    return list(keys(Config(), ""))


def config_reference(text: str, expected: list[str] | None = None) -> str:
    """The config reference page of base.yaml's text; refuses a key of `expected` (the typed config's) it lacks."""
    items = parse(text)
    documented = {item.key for item in items if isinstance(item, Row)}
    missing = [k for k in (config_keys() if expected is None else expected) if k not in documented]
    if missing:
        raise PluginError(f"config reference: boost_jax/configs/base.yaml documents no {', '.join(missing)} "
                          "(every key of boost_jax.config.Config needs its line there)")
    header = [ln.lstrip("#")[1:] for ln in text.splitlines() if ln.startswith("#")]
    header = header[:next((i for i, ln in enumerate(header) if not ln.strip()), len(header))]  # to its blank line
    out = ["# Config reference", "",
           "Every key every command reads, with its default and meaning, generated from "
           "`boost_jax/configs/base.yaml` (the one place they are written; it ships in the package, and "
           "`python -m boost_jax.train --help` prints where). " + " ".join(ln.strip() for ln in header), ""]
    table = False
    for item in items:
        if isinstance(item, Row):
            if not table:
                out += ["| key | default | meaning |", "|---|---|---|"]
                table = True
            default = f"`{_cell(item.default)}`" if item.default else ""
            out.append(f"| `{item.key}` | {default} | {_cell(item.meaning)} |")
            continue
        kind, words = item
        table = False
        out += ["", f"## `{words}`" if kind == "section" else words, ""]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
