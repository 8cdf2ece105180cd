#!/usr/bin/env bash
# GPU readiness, on a lent GPU machine's own Python stack as is (no install, no tensorboardX / grain /
# zstandard needed), from a copy of the repo:
#     OUT=/some/dir PYTHONPATH=. bash scripts/gpu_check.sh
# Stages, each under `timeout` (11.5 minutes at most in all); a failed stage does not stop the next:
#   env      versions (python, jax, jaxlib, flax, optax, orbax, ...) and the devices   -> env.txt
#   imports  boost_jax and its train / bench modules import                            -> imports.txt
#   tests    the gpu-marked tests                                   -> gpu_tests.txt, gpu_tests.xml
#   kernels  bench kernels (Pallas vs XLA) at llama-7b tp=4 shapes, bf16               -> kernels.json
#   step     bench step llama-1b cola tp=1 bf16, batch 8 x 2048, with MFU against the
#            datasheet peak (flops.PEAK_BF16_FLOPS)                                    -> step.json
#   aot      llama-60m cola bf16 compiled for one H200 without the GPU (python -m boost_jax.compile
#            --save, JAX on the CPU), then on the GPU: the saved executables loaded and run, and the
#            device's own compile beside the deviceless one (scripts/aot_check.py)     -> aot.json
# Output goes to $OUT (default: runs/gpu_check/<time>), each stage's stderr to <stage>.log; a summary
# ends the run. Exit status: 1 if a stage failed, else 0; without a GPU it says so and exits 0.
# PYTHON picks the interpreter (default: python, or python3 where there is no python).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python >/dev/null && echo python || echo python3)}

if ! backend=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null); then
    echo "$PY cannot import jax: activate the project's environment or set PYTHON" >&2
    exit 1
fi
if [[ "$backend" != "gpu" ]]; then
    echo "no GPU (jax backend: $backend): skipped"
    exit 0
fi
OUT=${OUT:-runs/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
echo "gpu_check: output in $OUT"

summary=()
failed=0
# stage NAME SECONDS STDOUT_FILE CMD...: run CMD under a time limit; stdout to the file, stderr to NAME.log.
stage() {
    local name=$1 limit=$2 out=$3 start=$SECONDS rc=0
    shift 3
    echo "== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$out" 2>"$OUT/$name.log" || rc=$?
    local took=$((SECONDS - start)) verdict=ok
    if ((rc == 124 || rc == 137)); then
        verdict="TIMED OUT after ${limit}s"
    elif ((rc != 0)); then
        verdict="FAILED (exit $rc)"
    fi
    if [[ $verdict != ok ]]; then
        failed=1
        tail -n 20 "$out" "$OUT/$name.log"
    fi
    summary+=("$(printf '%-8s %-26s %4ss  %s' "$name" "$verdict" "$took" "$out")")
}

stage env 30 "$OUT/env.txt" "$PY" - <<'EOF'
import importlib.metadata as md, platform, jax
print("python", platform.python_version())
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "tokenizers", "safetensors", "numpy",
          "pytest", "tensorboardX", "grain", "zstandard"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "not installed")
print("plugins", " ".join(sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("jax-cuda"))) or "-")
print("backend", jax.default_backend(), "devices", jax.device_count())
print("device_kind", jax.devices()[0].device_kind)
EOF
cat "$OUT/env.txt"
stage imports 45 "$OUT/imports.txt" "$PY" - <<'EOF'
import boost_jax, boost_jax.api, boost_jax.train, boost_jax.bench.step, boost_jax.bench.profile, boost_jax.bench.kernels
print("boost_jax, api, train, bench step / profile / kernels import")
EOF
# tests/conftest.py defaults JAX_PLATFORMS to cpu and XLA_FLAGS to a low CPU opt level: pin both. Only
# the files with gpu-marked tests are collected (others import packages this stack may lack).
mapfile -t gpu_files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
stage tests 120 "$OUT/gpu_tests.txt" env JAX_PLATFORMS=cuda XLA_FLAGS="${XLA_FLAGS:-}" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" "${gpu_files[@]}"
stage kernels 60 "$OUT/kernels.json" "$PY" -m boost_jax.bench kernels model.preset=llama-7b parallel.tp=4 \
    train.batch_size=4 train.seq_len=4096 model.dtype=bfloat16 --json
stage step 165 "$OUT/step.json" "$PY" -m boost_jax.bench step model.preset=llama-1b model.arch=cola parallel.tp=1 \
    parallel.dp=1 train.batch_size=8 train.seq_len=2048 model.dtype=bfloat16 --reps 3 --steps 3 --json
AOT_RUN=(model.preset=llama-60m model.arch=cola model.dtype=bfloat16 parallel.dp=1 train.batch_size=4
         train.seq_len=512 train.eval_every=0)
stage aot_compile 150 "$OUT/aot_compile.txt" env JAX_PLATFORMS=cpu "$PY" -m boost_jax.compile "${AOT_RUN[@]}" \
    --hardware h200-141gb --gpus 1 --save "$OUT/aot"
stage aot 120 "$OUT/aot.json" "$PY" scripts/aot_check.py "$OUT/aot" "${AOT_RUN[@]}"

echo
echo "== summary ($OUT)"
printf '%s\n' "${summary[@]}"
if [[ -s "$OUT/step.json" ]]; then
    "$PY" - "$OUT/step.json" <<'EOF' || true
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
mfu = "MFU %.1f%% of the datasheet peak" % (100 * r["mfu"]) if "mfu" in r else "no datasheet peak for this device"
print("%s %s/%s tp=%d %s, batch %d x %d: %.0f ms/step, %.0f tokens/s, %s, %.1f%% of the measured matmul peak"
      % (r["model"], r["arch"], r["scheme"], r["tp"], r["dtype"], r["batch"], r["seq"], 1e3 * r["median_step_s"],
         r["tokens_per_s"], mfu, 100 * r["fraction_of_peak"]))
EOF
fi
exit "$failed"
