#!/usr/bin/env bash
# Compiled (non-interpret) Pallas kernel checks: the GPU tests, then the kernel benchmark.
# On a machine without a GPU it says so and exits 0. Extra arguments go to the benchmark.
# PYTHON picks the interpreter (default: python on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if ! backend=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null); then
    echo "$PY cannot import jax: activate the project's environment or set PYTHON" >&2
    exit 1
fi
if [[ "$backend" != "gpu" ]]; then
    echo "no GPU (jax backend: $backend): skipped"
    exit 0
fi

# tests/conftest.py defaults JAX_PLATFORMS to cpu and XLA_FLAGS to a low CPU opt level: pin both.
JAX_PLATFORMS=gpu XLA_FLAGS="${XLA_FLAGS:-}" "$PY" -m pytest -m gpu -q
"$PY" -m boost_jax.bench.kernels "$@"
