"""python -m boost_jax.convert import SRC RUN_DIR [section.key=value ...] [--step N]
    [--to svd --rank R [--method svd|whiten] [--calibration DIR] [--samples N]] [--json]

Starts a run dir from a model made elsewhere. SRC is a Hugging Face LLaMA or Qwen2 folder (config.json, one
model.safetensors or shards listed in model.safetensors.index.json, tokenizer.json; float32, float16
or bfloat16), a folder `python -m boost_jax.export` wrote (any arch, e.g. CoLA), or a boost_jax run dir
(its newest checkpoint, or --step). Weights are read tensor by tensor (the model sits in host memory
once). RUN_DIR gets config.yaml (the model's config, then the overrides: the data, batch and sequence
it will train on), the source's tokenizer.json and a checkpoint at step 0 with a fresh optimizer:
`python -m boost_jax.train RUN_DIR/config.yaml` continues from it, and `eval`, `generate` and `export`
read it. RUN_DIR must not exist or be empty; nothing is written into it unless the whole import works.

`--to svd --rank R` factors every projection of a dense model into the svd arch (`boost_jax/model/compress.py`):
`--method svd` by truncated SVD of each weight, `--method whiten` by SVD-LLM's activation-aware
variant, whitened by the Cholesky factor of each projection's input covariance over `--samples`
sequences of a prepared dataset's train split (`--calibration DIR`, the source's tokenizer). It
reports each projection's relative error (of the weight; of its output on the calibration inputs),
and with --calibration the loss and perplexity on the dataset's validation split before and after.

`model.attn_latent_heads=G`, the one model key an import takes, refactors k and v of a low-rank model
(or of the svd model `--to svd` makes) into G latent heads, the nearest block-diagonal factorisation
(`boost_jax/model/latent_heads.py` says which and why), and reports its relative error per layer;
G = 1 turns a latent-heads model back into a plain one exactly.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from boost_jax.config import from_dict, raw_args
from boost_jax.runtime.cli import CONFIG_HELP, DEBUG_HELP, run_main
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.paths import check_writable_dir


def main(argv: list[str] | None = None) -> None:
    """The command line (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def parse(argv: list[str]) -> argparse.Namespace:
    if not argv or argv[0] != "import":
        argparse.ArgumentParser(prog="python -m boost_jax.convert", description=__doc__, epilog=DEBUG_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python -m boost_jax.convert import SRC RUN_DIR ...").parse_args(argv[:1] or ["-h"])
        raise ConfigError(f"unknown command {argv[0]!r}: the command is import")
    q = argparse.ArgumentParser(prog="python -m boost_jax.convert import", description=__doc__, epilog=DEBUG_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("src", type=Path)
    q.add_argument("run_dir", type=Path)
    q.add_argument("config", nargs="*", metavar="section.key=value", help=CONFIG_HELP)
    q.add_argument("--step", type=int, default=None, help="with a run dir as SRC: its checkpoint (default: the newest)")
    q.add_argument("--to", choices=["svd"], default=None, help="factor the dense model's projections (model/compress.py)")
    q.add_argument("--rank", type=int, default=0, help="with --to svd: the rank of every projection")
    q.add_argument("--method", choices=["svd", "whiten"], default="svd")
    q.add_argument("--calibration", type=Path, default=None, help="a prepared dataset with the source's tokenizer")
    q.add_argument("--samples", type=int, default=64, help="calibration sequences (train.seq_len tokens each)")
    q.add_argument("--json", action="store_true")
    a = q.parse_intermixed_args(argv[1:])
    if bad := [c for c in a.config if "=" not in c]:
        raise ConfigError(f"{bad[0]!r}: after SRC RUN_DIR only section.key=value overrides")
    if a.to and a.rank < 1:
        raise ConfigError(f"--to svd needs --rank >= 1, got {a.rank}")
    if a.rank and not a.to:
        raise ConfigError("--rank applies with --to svd")
    if a.method == "whiten" and a.calibration is None:
        raise ConfigError("--method whiten needs --calibration DIR (a prepared dataset to whiten by)")
    if a.samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {a.samples}")
    if a.run_dir.exists() and (not a.run_dir.is_dir() or any(a.run_dir.iterdir())):
        raise ConfigError(f"{a.run_dir} exists and is not an empty folder: an import starts a new run dir")
    check_writable_dir(a.run_dir, "RUN_DIR")
    return a


def _main(argv: list[str]) -> None:
    a = parse(argv)
    from boost_jax.launch.prepare import prepare_jax  # lazy: keeps --help free of JAX
    from boost_jax.training.importer import convert  # lazy: keeps --help free of JAX

    # the command's data.* keys (its model is on one device; its parallel.* keys are the new run's)
    prepare_jax(from_dict({"data": raw_args(a.config).get("data", {})}), reuse_memory=False)
    r = convert(a)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"imported {r['source']} into {r['run_dir']} ({r['arch']}); continue with: "
          f"python -m boost_jax.train {r['run_dir']}/config.yaml")
    if c := r.get("compression"):
        for i, layer in enumerate(c["layers"]):
            print(f"  layer {i}: " + ", ".join(f"{name} {100 * e['weight']:.1f}%"
                                                + (f" (output {100 * e['output']:.1f}%)" if "output" in e else "")
                                                for name, e in layer.items()))
        if "val_loss_before" in c:
            print(f"  validation loss {c['val_loss_before']:.4f} -> {c['val_loss_after']:.4f} "
                  f"(perplexity {math.exp(c['val_loss_before']):.2f} -> {math.exp(min(c['val_loss_after'], 700)):.2f})")
    if h := r.get("latent_heads"):
        print(f"  k and v in {h['groups']} latent heads ({h['method']}), relative error:")
        for i, layer in enumerate(h["layers"]):
            print(f"  layer {i}: " + ", ".join(f"{name} {100 * e['weight']:.2f}%" for name, e in layer.items()))


if __name__ == "__main__":
    main()
