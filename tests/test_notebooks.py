"""The notebooks run top to bottom on CPU (a fresh kernel each, 8 simulated devices)."""

import os
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))

# A notebook's knobs at a test's size, for a notebook whose cost is its sizes: run as a cell right after its
# cell tagged "parameters" (papermill's convention; scripts/make_notebooks.py writes it with `parameters`).
# Every cell still runs, with its asserts; the full sizes are the notebook's own. A notebook without such a
# cell runs as it is (quickstart: 6 steps instead of its 30 saved no measurable CPU time: its compiles are its
# cost); one with it needs a line here.
SMALL = {
    "schemes": 'model = "llama-tiny"\nreps, steps = 1, 1',  # btp's latents still under 1/4 of vanilla's bytes
}


def test_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} == {"fine-tuning", "quickstart", "schemes"}


def with_small_parameters(nb, name: str):
    """`nb` with SMALL[name] run after its parameters cell (a KeyError names a tagged notebook without a line
    in SMALL; a line in SMALL needs exactly one tagged cell); `nb` as it is where it has neither."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not tagged and name not in SMALL:
        return nb
    assert len(tagged) == 1, f"{name}: {len(tagged)} cells tagged parameters, expected one"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(SMALL[name]))
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, cache_dir):
    nb = with_small_parameters(nbformat.read(path, as_version=4), path.stem)
    env = {"JAX_PLATFORMS": "cpu", "BOOST_JAX_CACHE": str(cache_dir), "MPLBACKEND": "Agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if path.stem in SMALL:  # the small values ran, and so the cells after them read them
        assert next(c for c in nb.cells if c.source == SMALL[path.stem]).get("execution_count")
