"""parallel.cpu_reuse_memory (boost_jax/launch/host_memory.py): on CPU, a program's freed buffers come back to
the next run instead of fresh pages, counted as the page faults of a fresh process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from boost_jax.launch.host_memory import runs_on_cpu

# Runs a program with a 64 MiB temporary (a block glibc maps afresh and unmaps by default) 14 times
# on a fresh JAX and prints the page faults of the last 8 runs (the reused heap takes some runs to
# settle: small blocks split the first holes it frees; settled from the third run on a quiet machine,
# from the ninth under CI's load). A run is ~0.45 s of CPU at the tests' -O0, a fresh JAX ~2.7 s.
PROBE = textwrap.dedent("""
    import json, resource, sys
    import jax, jax.numpy as jnp
    from boost_jax.launch.host_memory import reuse_freed_memory
    applied = reuse_freed_memory() == "" if sys.argv[1] == "reuse" else False
    x = jax.random.normal(jax.random.key(0), (2048, 4096))
    f = jax.jit(lambda x: jnp.cumsum(jnp.exp(x), axis=0)[::512].sum())
    faults = []
    for _ in range(14):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"applied": applied, "faults": faults[-8:]}))
""")


def _probe(mode: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh processes, 14 runs each; the switch's gating stays in the inner loop below
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_buffers_are_reused_instead_of_faulted_in_again():
    pages = 2 * 2048 * 4096 * 4 // 4096  # the 64 MiB temporary, in 4 KiB pages
    default, reused = _probe("default"), _probe("reuse")
    assert not default["applied"] and reused["applied"]
    assert min(default["faults"]) > pages // 2, default  # glibc's default: every run touches new pages
    # reused: once the heap has settled, the temporary lands on pages already touched
    assert max(reused["faults"][-2:]) < pages // 4, reused


def test_only_a_cpu_backend_changes_the_allocator():
    assert runs_on_cpu("cpu") and runs_on_cpu("cpu,cuda")
    assert not runs_on_cpu("cuda") and not runs_on_cpu("tpu,cpu")


def test_a_started_backend_keeps_glibcs_defaults():
    import jax

    from boost_jax.launch.host_memory import reuse_freed_memory

    jax.devices()  # the test process's backend has started: its threads have their arenas
    assert "backend has started" in reuse_freed_memory()


def test_decoding_keeps_glibcs_defaults(monkeypatch):
    from boost_jax.bench import common
    from boost_jax.launch import host_memory

    applied = []
    monkeypatch.setattr(host_memory, "reuse_freed_memory", lambda: applied.append(True) or "")
    common.config_of(["model.preset=llama-tiny"], decoding=True)  # bench decode's
    assert applied == []
    common.config_of(["model.preset=llama-tiny", "parallel.cpu_reuse_memory=false"])
    assert applied == []
    common.config_of(["model.preset=llama-tiny"])  # the timed training steps'
    assert applied == [True]
