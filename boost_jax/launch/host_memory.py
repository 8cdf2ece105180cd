"""On CPU, one step's temporaries reuse the memory the previous step freed (`parallel.cpu_reuse_memory`).

XLA:CPU allocates a step's temporaries in one malloc (964 MB for llama-60m cola at b4 x 256) and
frees them when the step ends. glibc serves a block that large with a fresh mmap and returns it with
munmap, so every step touches all of its pages for the first time again: 250k page faults and about
0.8 s of kernel time per 2.8 s step on 2 cores (`getrusage` around one step). One malloc arena, no
mmap and no trimming make the next step's blocks come from the heap the last one freed
(docs/design.md has the measured speed-up: llama-60m cola steps 1.59x faster on 2 cores). The price
is host memory: nothing goes back to the system, and blocks of other sizes (compiles, eval steps,
checkpoints) fragment the one heap (max RSS 2.21 -> 3.06 GB for that step, 1.67 -> 2.01 GB for the
quickstart's run). On CPU it is the default for what runs training-sized steps (`train`, `eval`, the
`bench` commands that time them), as a faster allocator is what a PyTorch user on CPU would preload;
`parallel.cpu_reuse_memory=false` keeps glibc's defaults. Decoding (`generate`, `bench decode`) keeps
them always: its steps' temporaries are small, and the one arena its threads then share makes them
slower (llama-60m dense, `bench decode` on 2 cores: 1388 -> 1200 tokens/s at batch 32; `generate`
on the quickstart's run 104-108 -> 91 tokens/s).

It must run before JAX's backend starts: the runtime's threads take their arenas then, and a thread
outside the main arena still maps large blocks itself.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import platform
import sys

import jax
from jax._src import xla_bridge  # whether the backend started: no public query of this in jax 0.10

# <malloc.h>'s mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))  # -1: never trim


def runs_on_cpu(platforms: str | None) -> bool:
    """Whether JAX will run on the host, given its `jax_platforms` setting: asked for (the list starts
    with cpu), or left to JAX (None or "") with no accelerator plugin installed, so that a GPU or TPU
    host keeps glibc's defaults."""
    if platforms:
        return platforms.split(",")[0] == "cpu"
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return not plugins and importlib.util.find_spec("jax_plugins") is None and importlib.util.find_spec("libtpu") is None


def reuse_freed_memory() -> str:
    """Set glibc's malloc as the module docstring says; returns "" when it did, else why it did not."""
    if platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    if not runs_on_cpu(jax.config.jax_platforms):
        return "JAX runs on an accelerator here"
    if _backend_started():
        return "JAX's backend has started (its threads have their malloc arenas)"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    failed = [param for param, value in _SETTINGS if mallopt(param, value) != 1]
    return f"mallopt refused parameters {failed}" if failed else ""


def apply_setting(enabled: bool) -> None:
    """A command's `parallel.cpu_reuse_memory`, before JAX starts: applied where asked for and JAX
    runs on the host (an accelerator run keeps glibc's defaults without a word); where it cannot be,
    one line on stderr says why."""
    if enabled and runs_on_cpu(jax.config.jax_platforms) and (why := reuse_freed_memory()):
        print(f"parallel.cpu_reuse_memory=true has no effect: {why}", file=sys.stderr)


def _backend_started() -> bool:
    return xla_bridge.backends_are_initialized()
