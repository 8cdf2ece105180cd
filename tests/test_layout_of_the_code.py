"""The code's rooms and floors (docs/design/08-how-the-code-is-organised.md): the package root holds
the commands (and the Python API); each module imports only from its own floor or those below, type-only
imports included; no import closes a circle; the tables every command validates against load no JAX."""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# Lowest first. A name is a module, or a package (its modules and its __init__) unless one of its
# modules has an entry of its own: `config` is config/__init__.py and config/config.py, the config's
# tables sit below it.
FLOORS = [
    {"runtime", "config.presets", "config.archs", "config.schemes", "config.study", "configs", "pallas_kernels", "ops"},
    {"config"},
    {"data", "parallel", "launch", "training.optimizers", "training.health"},
    {"layers"},
    {"model", "model.transformer", "model.counts", "model.train_state", "model.checkpoint", "model.compress",
     "model.hf"},
    {"model.weights", "model.decode", "model.run_dir", "model.harness", "training.loss", "training.step", "training.muon_layout",
     "training.log", "training.local_tier", "training.recovery"},
    {"analysis", "training.run_dir", "training.checkpointing", "training.preemption", "training.meeting",
     "training.meter", "training.guard", "training.profiler", "training.metrics", "training.run", "training.evaluate", "training.importer", "api",
     "train", "export", "generate", "eval", "lm_eval", "serving", "serve"},
    {"planner", "plan", "convert", "compile", "comparison", "study"},
    {"bench", "__main__"},
]

# The folders, lowest first: a module imports from no folder above its own (a module at the package
# root counts as a folder of its own, on its floor in FLOORS).
FOLDER_FLOORS = [
    {"runtime", "configs", "pallas_kernels", "ops"},
    {"config"},
    {"data", "parallel", "launch"},
    {"layers"},
    {"model"},
    {"training"},
    {"analysis", "serving", "serve"},
    {"planner", "comparison"},
    {"bench"},
]

# Parsed once per session: every test below walks the same files (each walk re-parsed them all).
@functools.cache
def modules() -> dict[str, Path]:
    files = {}
    for pkg in ("boost_jax", "pallas_kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(p for p in parts if p != "__init__")] = path
    return files


@functools.cache
def imports(path: Path) -> frozenset[str]:
    """Every boost_jax / pallas_kernels module this file imports: at the top, inside a function, or
    under `if TYPE_CHECKING:` (a type a module names is a dependency too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return frozenset(m for m in found if m.split(".")[0] in ("boost_jax", "pallas_kernels"))


def floor(module: str) -> int:
    if module == "boost_jax":
        return len(FLOORS)  # the package's own __init__ imports nothing
    name = "pallas_kernels" if module.startswith("pallas_kernels") else module.removeprefix("boost_jax.")
    names = name.split(".")
    for n in range(len(names), 0, -1):  # the longest entry that names it or a package around it
        if found := [i for i, floor_names in enumerate(FLOORS) if ".".join(names[:n]) in floor_names]:
            return found[0]
    path = modules()[module]
    if path.name == "__init__.py" and not imports(path):
        return 0  # a folder of modules on several floors (training/): its __init__ imports nothing
    raise StopIteration(f"{module} has no floor in FLOORS")


def test_the_package_root_holds_the_commands_and_the_python_api():
    from boost_jax.__main__ import COMMANDS

    root = {p.stem for p in (ROOT / "boost_jax").glob("*.py")}
    assert root - {"__init__", "__main__", "api"} <= set(COMMANDS), "library modules at the root: move them to a room"
    folders = {p.name for p in (ROOT / "boost_jax").iterdir() if (p / "__init__.py").is_file()}
    commands = {c for c in COMMANDS if c in folders}
    assert commands == {"bench", "data", "serve"}  # the commands that are packages; every other folder is a room


def test_every_module_has_a_floor():
    for module in modules():
        floor(module)  # StopIteration names a module missing from FLOORS


def test_no_module_imports_from_a_higher_floor():
    known = modules()
    upward = []
    for module, path in known.items():
        for target in imports(path):
            target = target if target in known else target.rsplit(".", 1)[0]  # `from pkg import name`
            if target in known and target != "boost_jax" and floor(target) > floor(module):
                upward.append(f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})")
    assert upward == []


def folder_of(module: str) -> str:
    """The folder a module is in (`model` for boost_jax.model.weights), or the module itself at the root."""
    if module.startswith("pallas_kernels"):
        return "pallas_kernels"
    parts = module.split(".")
    return parts[1] if (ROOT / "boost_jax" / parts[1]).is_dir() else module


def folder_floor(folder: str) -> int:
    if "." in folder:  # a module at the package root
        return floor(folder)
    return next(i for i, names in enumerate(FOLDER_FLOORS) if folder in names)  # StopIteration: a new folder


def test_every_folder_has_a_floor():
    for module in modules():
        if module != "boost_jax":
            folder_floor(folder_of(module))


def test_no_module_imports_from_a_folder_on_a_higher_floor():
    """Folders are floors: nothing in model/ reaches training/ or analysis/, nothing in training/ reaches
    planner/, and so on (the module floors above order the modules inside a folder)."""
    known = modules()
    upward = set()
    for module, path in known.items():
        for target in imports(path):
            target = target if target in known else target.rsplit(".", 1)[0]  # `from pkg import name`
            if target in known and target != "boost_jax" and folder_floor(folder_of(target)) > folder_floor(folder_of(module)):
                upward.add(f"{module} imports {target}")
    assert not upward, sorted(upward)


def reached(module: str) -> set[str]:
    """Every module `module` imports, and what they import, to the end (function-local and type-only
    imports included)."""
    known = modules()
    seen, todo = set(), [module]
    while todo:
        for target in imports(known[todo.pop()]):
            target = target if target in known else target.rsplit(".", 1)[0]
            if target in known and target not in seen | {"boost_jax"}:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("command", ["boost_jax.generate", "boost_jax.lm_eval", "boost_jax.export", "boost_jax.serve.__main__"])
def test_inference_never_enters_training(command):
    """Serving a model reads its checkpoint through model/ (the Orbax store, the run dir): a change to
    training/ cannot break generate, lm_eval or export."""
    assert sorted(m for m in reached(command) if folder_of(m) in ("training", "analysis", "planner")) == []


def test_eval_imports_no_optimizer():
    """The eval command enters training/ only for the eval and the loss it runs (training/loss.py):
    no optimizer, nor the train step that holds one, so a change there cannot break eval."""
    entered = sorted(m for m in reached("boost_jax.eval") if folder_of(m) in ("training", "analysis", "planner"))
    assert entered == ["boost_jax.training.evaluate", "boost_jax.training.loss"]


def command_of(module: str) -> str | None:
    """The command a module is part of: `boost_jax.<command>`, or a module in its folder (bench/);
    data/ is the room of data loading too, so only its __main__ is the command."""
    from boost_jax.__main__ import COMMANDS

    parts = module.split(".")
    if parts[0] != "boost_jax" or len(parts) < 2 or parts[1] not in COMMANDS:
        return None
    return parts[1] if parts[1] != "data" or parts[2:] == ["__main__"] else None


def test_no_command_imports_another_command():
    """What two commands share lives below them (model/hf.py, model/evaluate.py, ...), so a command
    changes without breaking another."""
    known = modules()
    crossing = set()
    for module, path in known.items():
        for target in imports(path):
            target = target if target in known else target.rsplit(".", 1)[0]  # `from pkg import name`
            if command_of(module) and command_of(target) not in (None, command_of(module)):
                crossing.add(f"{module} imports {target}")
    assert crossing == set()


def test_no_import_circles():
    known = modules()
    graph = {m: {t if t in known else t.rsplit(".", 1)[0] for t in imports(p)} & set(known) - {m}
             for m, p in known.items()}
    circles = []

    def visit(node, stack):
        for nxt in graph[node]:
            if nxt in stack:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt])
        done.add(node)

    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    assert circles == []


@pytest.mark.parametrize("path", ["layers/attention.py", "ops/attention.py", "ops/ring.py"])
def test_attention_knows_no_scheme(path):
    """The attention layer is handed what it attends over by the plan's projections (parallel/), and
    the attention op (ops/) sits below both: neither imports from parallel/ or reads a mesh split,
    scheme, all-reduce or low-rank factor (the ring's permutes name the axis they are given)."""
    path = ROOT / "boost_jax" / path
    assert sorted(m for m in imports(path) if m.startswith("boost_jax.parallel")) == []
    source = path.read_text()
    assert [w for w in (".size(", ".axis(", ".scheme", ".mesh", "cp_attention", "psum", ".b[", ".a[") if w in source] == []


@pytest.mark.parametrize("path", ["ops/attention.py", "ops/ring.py"])
def test_the_attention_op_imports_nothing_of_the_package(path):
    """The op is math on arrays: the layer and the strategies call it, it calls neither."""
    assert imports(ROOT / "boost_jax" / path) == set()


NO_JAX = ["boost_jax.config", "boost_jax.config.schemes", "boost_jax.config.archs", "boost_jax.runtime.cache",
          "boost_jax.data.prepare", "boost_jax.data.__main__"]


def test_tables_and_data_preparation_load_no_jax():
    """One fresh interpreter imports them one after another and names, after each, what of JAX has
    loaded so far: the first line that is not empty is the module that brought it in."""
    code = ("import importlib, sys\n"
            f"for module in {NO_JAX!r}:\n"
            "    importlib.import_module(module)\n"
            "    print(module, sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.splitlines() == [f"{module} []" for module in NO_JAX], out.stdout


@pytest.mark.parametrize("package", sorted({p.parent for p in (ROOT / "boost_jax").rglob("__init__.py")}), ids=str)
def test_every_package_docstring_names_what_is_in_its_folder(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
             if p.name not in ("__init__.py", "__pycache__") and (p.suffix in (".py", ".yaml") or p.is_dir())}
    missing = sorted(n for n in names if n not in doc)
    assert missing == [], f"{package}/__init__.py's docstring does not name {missing}"


def test_the_design_docs_floor_tables_are_the_ones_checked_here():
    import re

    text = (ROOT / "docs" / "design" / "08-how-the-code-is-organised.md").read_text()
    floors = text[text.index("| floor | modules | job |"):].split("\n\n")[0]  # the table, to its blank line
    rows = re.findall(r"^\| (\d) \| (.*?) \|", floors, re.M)
    table = [{name.strip("/") for name in re.findall(r"`([^`]+)`", names)} for _, names in rows]
    assert table == FLOORS
    folders = text[text.index("| floor | folders | job |"):].split("\n\n")[0]
    rows = re.findall(r"^\| (\d) \| (.*?) \|", folders, re.M)
    assert [{name.strip("/") for name in re.findall(r"`([^`]+)`", names)} for _, names in rows] == FOLDER_FLOORS


def test_import_blocks_are_sorted():
    """stdlib, third party, ours, each sorted (pyproject's [tool.ruff]): `ruff check --select I --fix .` sorts them."""
    pytest.importorskip("ruff")  # the dev extra installs it
    from ruff.__main__ import find_ruff_bin

    out = subprocess.run([find_ruff_bin(), "check", "--select", "I", "--output-format", "concise", "boost_jax", "tests",
                          "scripts", "pallas_kernels"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
