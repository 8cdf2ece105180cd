"""Imports sit at a module's head (docs/design/08-how-the-code-is-organised.md); one inside a function
says on its line why it cannot: `# lazy: ...` (JAX, or another heavy package, kept out of a command's
--help), `# optional: ...` (a package the install may lack: torch, transformers, lm_eval, grain, ...)
or `# cycle: ...` (a circle that moving the code cannot break). And the commands' --help loads no JAX."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
MOST = 80  # issue 59's bound: 161 before it, 134 at its start
REASON = re.compile(r"#\s*(lazy|optional|cycle):\s*\S")


def local_imports(source: str) -> list[tuple[int, bool]]:
    """(line, has a reason) of each import inside a function (nested functions' once each)."""
    lines = source.splitlines()
    found = {}
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    span = lines[node.lineno - 1:node.end_lineno]
                    found[node.lineno] = any(REASON.search(line) for line in span)
    return sorted(found.items())


def test_the_reason_is_read_from_the_import_line():
    source = ("import os\n\ndef f():\n    import jax  # lazy: keeps --help free of JAX\n"
              "    import math\n\n    def g():\n        from torch import (  # optional: torch\n            nn)\n")
    assert local_imports(source) == [(4, True), (5, False), (8, True)]


def test_function_local_imports_are_few_and_each_says_why():
    found = {f"{path.relative_to(ROOT)}:{line}": why for path in sorted((ROOT / "boost_jax").rglob("*.py"))
             for line, why in local_imports(path.read_text())}
    assert [where for where, why in found.items() if not why] == []  # hoist it, or say why it cannot be
    assert len(found) <= MOST


# The commands whose --help loads no JAX, Flax, Optax or Orbax (export's and study's read the model's
# modules at their head; lm_eval's is lm-eval's own).
LIGHT_HELP = ("train", "generate", "eval", "convert", "plan", "compile", "bench", "data")


def test_the_commands_help_loads_no_jax():
    code = ("import contextlib, io, runpy, sys\n"
            f"for command in {LIGHT_HELP!r}:\n"
            "    sys.argv = [command, '--help']\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        runpy.run_module(f'boost_jax.{command}', run_name='__main__')\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'optax', 'orbax'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
