"""The code's floors: each module imports only from its own floor or those below (docs/design.md,
"How the code is organised"), no two modules import each other, and the tables every command
validates against load no JAX."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# Lowest first. A name is a module or a package (its modules, and its __init__).
FLOORS = [
    {"errors", "presets", "archs", "schemes", "cli", "cache", "paths", "configs", "pallas_kernels"},
    {"config"},
    {"data", "remat", "parallel", "flops", "health", "host_memory", "optimizers", "compile_cache", "startup"},
    {"layers"},
    {"model"},
    {"weights", "step", "checkpoint", "log", "decode"},
    {"analysis", "train", "training", "api", "export", "generate", "eval", "compress", "lm_eval"},
    {"planner", "plan", "convert"},
    {"bench", "__main__"},
]


def modules() -> dict[str, Path]:
    files = {}
    for pkg in ("boost_jax", "pallas_kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(p for p in parts if p != "__init__")] = path
    return files


def imports(path: Path, *, type_only: bool = False) -> set[str]:
    """Every boost_jax / pallas_kernels module this file imports, at the top or inside a function (not
    under `if TYPE_CHECKING:`, which names types for annotations and never runs, unless `type_only`)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = node.body if type_only else []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in ("boost_jax", "pallas_kernels")}


def floor(module: str) -> int:
    name = "pallas_kernels" if module.startswith("pallas_kernels") else (module.split(".") + ["__init__"])[1]
    if module == "boost_jax":
        return len(FLOORS)  # the package's own __init__ imports nothing
    return next(i for i, names in enumerate(FLOORS) if name in names)


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


# Type-only imports too where the modules are free of them (a circle a reader follows is one even if
# it never runs): parallel/ and layers/.
@pytest.mark.parametrize("within, type_only", [(("boost_jax", "pallas_kernels"), False),
                                               (("boost_jax.parallel", "boost_jax.layers"), True)])
def test_no_import_circles(within, type_only):
    known = {m: p for m, p in modules().items() if m.startswith(within)}
    graph = {m: {t if t in known else t.rsplit(".", 1)[0] for t in imports(p, type_only=type_only)} & set(known) - {m}
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
    # A package's __init__ re-exporting its own modules is not a circle of two modules.
    circles = [c for c in circles if not all(x == c[0] or x.startswith(c[0] + ".") or c[0].startswith(x + ".")
                                             for x in c)]
    assert circles == []


def test_attention_knows_no_scheme():
    """layers/attention.py is handed what it attends over by the plan's projections (parallel/): it
    imports nothing from parallel/ and reads no mesh split, scheme, collective or low-rank factor."""
    path = ROOT / "boost_jax" / "layers" / "attention.py"
    assert sorted(m for m in imports(path, type_only=True) if m.startswith("boost_jax.parallel")) == []
    source = path.read_text()
    assert [w for w in (".size(", ".axis(", ".scheme", ".mesh", "cp_attention", "psum", ".b[", ".a[") if w in source] == []


@pytest.mark.parametrize("module", ["boost_jax.config", "boost_jax.schemes", "boost_jax.archs", "boost_jax.cache",
                                    "boost_jax.data.prepare", "boost_jax.data.__main__"])
def test_tables_and_data_preparation_load_no_jax(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("package", sorted({p.parent for p in (ROOT / "boost_jax").rglob("__init__.py")}), ids=str)
def test_every_package_docstring_names_what_is_in_its_folder(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
             if p.name not in ("__init__.py", "__pycache__") and (p.suffix in (".py", ".yaml") or p.is_dir())}
    missing = sorted(n for n in names if n not in doc)
    assert missing == [], f"{package}/__init__.py's docstring does not name {missing}"


def test_the_design_docs_floor_table_is_the_one_checked_here():
    import re

    rows = re.findall(r"^\| (\d) \| (.*?) \|", (ROOT / "docs" / "design.md").read_text(), re.M)
    table = [{name.strip("/") for name in re.findall(r"`([^`]+)`", names)} for _, names in rows]
    assert table == FLOORS
