"""On a real GPU: the programs `python -m boost_jax.compile --save DIR` compiled without one, loaded and
run, and the device's own compile of the same run beside the deviceless one (memory, collectives,
library calls). scripts/gpu_check.sh runs it; by hand:

    JAX_PLATFORMS=cpu python -m boost_jax.compile CONFIG... --hardware h200-141gb --gpus 1 --save DIR
    python scripts/aot_check.py DIR CONFIG...           # on the GPU; prints one JSON object
"""

import json
import pickle
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.serialize_executable import deserialize_and_load

from boost_jax.analysis.compiled import compile_timed, read, run_programs
from boost_jax.config import load_config
from boost_jax.parallel import make_plan


def zeros(info, sharding):
    """An argument of the program's shape and layout: zeros, or key 0 for a PRNG key."""
    if jax.dtypes.issubdtype(info.dtype, jax.dtypes.prng_key):
        return jax.device_put(jax.random.key(0), sharding)
    return jax.device_put(jnp.zeros(info.shape, info.dtype), sharding)


def main(folder: Path, overrides: list[str]) -> dict:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        assert isinstance(manifest["devices"], int) and isinstance(manifest["programs"], list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        sys.exit(f"{folder / 'manifest.json'}: not the manifest `python -m boost_jax.compile --save` writes "
                 f"({type(e).__name__}: {e})")
    cfg = load_config(None, overrides)
    plan = make_plan(cfg, jax.devices()[:manifest["devices"]])
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "programs": []}
    for (name, compile_), deviceless in zip(run_programs(cfg, plan).items(), manifest["programs"]):
        compiled, seconds = compile_timed(compile_)  # the device's own compile, with autotuning
        own = read(name, compiled, seconds, cfg, plan)
        row = {"name": name, "deviceless_peak": deviceless["memory"]["peak"], "device_peak": own["memory"]["peak"],
               "same_collectives": own["collectives"] == deviceless["collectives"],
               "deviceless_calls": deviceless["custom_calls"], "device_calls": own["custom_calls"]}
        if deviceless.get("executable"):
            in_tree, out_tree = pickle.loads((folder / f"{name}.trees").read_bytes())
            loaded = deserialize_and_load((folder / deviceless["executable"]).read_bytes(), in_tree, out_tree)
            args = jax.tree.map(zeros, compiled.args_info[0], compiled.input_shardings[0])
            outs = jax.block_until_ready(loaded(*args))
            row["loaded_and_ran"] = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(outs)
                                        if jnp.issubdtype(x.dtype, jnp.floating))
        out["programs"].append(row)
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2:]), indent=1))
