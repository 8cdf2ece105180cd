"""The results page's text: the template results_page.md beside this file, in parts (`<!-- part: name -->`),
each filled by `render` with the numbers and tables a section's module computes (bench/report.py puts
the sections together)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).with_name("results_page.md")


_PART = re.compile(r"^<!-- part: (\w+) -->\n", re.MULTILINE)


_WHOLE_LINE_SLOT = re.compile(r"\$(\w+)|\$\{(\w+)\}")


@functools.cache
def parts() -> dict[str, list[str]]:
    """TEMPLATE's parts by name, each the lines from its `part:` comment to the next one."""
    pieces = _PART.split(TEMPLATE.read_text())[1:]  # what precedes the first part is the template's own comment
    return {name: text.removesuffix("\n").split("\n") for name, text in zip(pieces[::2], pieces[1::2])}


def render(part: str, **slots) -> list[str]:
    """The lines of TEMPLATE's `part`, its slots filled: a slot alone on its line takes a list of lines
    (an empty one removes the line) or a string, any other slot a string or a number. An unknown part,
    or a slot of the part left unfilled, raises KeyError."""
    lines = []
    for line in parts()[part]:
        if whole := _WHOLE_LINE_SLOT.fullmatch(line):
            value = slots[whole[1] or whole[2]]
            lines += [value] if isinstance(value, str) else value
        else:
            lines.append(Template(line).substitute(slots))
    return lines


def phrase(part: str, **slots) -> str:
    """A one-line part, filled, for a slot of another part."""
    (line,) = render(part, **slots)
    return line
