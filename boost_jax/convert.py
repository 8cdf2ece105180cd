"""python -m boost_jax.convert import SRC RUN_DIR [section.key=value ...] [--step N]
    [--to svd --rank R [--method svd|whiten] [--calibration DIR] [--samples N]] [--json]

Starts a run dir from a model made elsewhere. SRC is a Hugging Face LLaMA folder (config.json, one
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
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

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


def read_source(src: Path, step: int | None):
    """(model config, parameters as a pure dict of numpy arrays, tokenizer.json path) of SRC."""
    from boost_jax import api
    from boost_jax.export import load_exported

    if not src.is_dir():
        raise ConfigError(f"{src} is not a folder: give a Hugging Face LLaMA folder, an export or a run dir")
    if (src / "config.yaml").is_file():  # a run dir
        cfg, model, _ = api.restore(src, step)
        from flax import nnx

        params = jax_to_numpy(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        model_cfg = cfg.model
    else:
        if step is not None:
            raise ConfigError("--step applies to a run dir as SRC")
        model_cfg, params = load_exported(src)
    tokenizer = src / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError(f"{src} has no tokenizer.json: a run needs the tokenizer its model was trained with")
    from boost_jax.data.tokenizer import load_tokenizer

    if load_tokenizer(tokenizer).get_vocab_size() > model_cfg.vocab_size:  # a damaged file is named
        raise ConfigError(f"{tokenizer} has more tokens than the model's vocab_size {model_cfg.vocab_size}: "
                          "it is not this model's tokenizer")
    return model_cfg, params, tokenizer


def jax_to_numpy(tree):
    import jax
    import numpy as np

    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def run_config(model_cfg, overrides, run_dir: Path, src: Path):
    """The new run's config: a run dir source's own data and train sections (defaults otherwise), the
    run's tokenizer for any corpus it prepares (data.tokenizer_path), the model's every field, then
    the overrides, then its run dir."""
    import dataclasses

    from boost_jax.config import from_dict, raw_args

    raw = raw_args(list(overrides))
    if model_keys := sorted(raw.get("model", {})):
        raise ConfigError(f"model.{model_keys[0]}: the model is the source's; an import takes no model keys")
    base = {"data": {"tokenizer_path": str((run_dir / "tokenizer.json").absolute())}}
    if (src / "config.yaml").is_file():  # another run: train and read data as it did
        from boost_jax.config import load_yaml

        source = load_yaml(src / "config.yaml")
        base = {k: source[k] for k in ("train", "data", "checkpoint", "log") if k in source}
        base.setdefault("data", {})["tokenizer_path"] = str((run_dir / "tokenizer.json").absolute())
    merged = {**base, "model": dataclasses.asdict(model_cfg), "run_dir": str(run_dir)}
    for section, values in raw.items():
        merged[section] = {**merged.get(section, {}), **values} if isinstance(values, dict) else values
    merged["run_dir"] = str(run_dir)
    return from_dict(merged)


def calibration_tokens(directory: Path, tokenizer: Path, vocab_size: int, seq_len: int, samples: int, split: str):
    """(inputs, targets) [samples, seq_len] of the first windows of a prepared dataset's split; its
    tokenizer must be `tokenizer`'s."""
    import numpy as np

    from boost_jax.config import DataConfig
    from boost_jax.data.build import build_data, check_run_tokenizer

    data = build_data(DataConfig(source="prepared", path=str(directory)), vocab_size=vocab_size, seq_len=seq_len,
                      seed=0)
    check_run_tokenizer(data.tokenizer, tokenizer)
    source = data.train if split == "train" else data.val
    if source is None:
        raise ConfigError(f"--calibration {directory} has no {split} split")
    batches = source.eval_batches(-(-samples // 8), 8)
    return tuple(np.concatenate([b[k] for b in batches])[:samples] for k in ("inputs", "targets"))


def loss_of(model_cfg, params, inputs, targets) -> float:
    """Mean next-token loss of a model's parameters on tokens, one device."""
    import jax
    import optax
    from flax import nnx

    from boost_jax.model import Model
    from boost_jax.parallel import single_device_plan

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Model(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
    plan = single_device_plan(model_cfg)

    @jax.jit
    def loss(params, x, y):
        logits = nnx.merge(graphdef, params)(x, plan=plan)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return float(sum(loss(params, inputs[i:i + 8], targets[i:i + 8]) * len(inputs[i:i + 8])
                     for i in range(0, len(inputs), 8)) / len(inputs))


def write_run(cfg, params: dict, tokenizer: Path, source: str) -> None:
    """RUN_DIR as a run: config.yaml, tokenizer.json, checkpoint 0 (these parameters, a fresh optimizer),
    written in a temporary folder beside it and renamed into place when whole."""
    import jax
    import numpy as np
    from flax import nnx

    from boost_jax.model.weights import abstract_model
    from boost_jax.parallel import single_device_plan
    from boost_jax.training.checkpoint import Checkpointer, identity
    from boost_jax.training.step import setup

    run_dir = Path(cfg.run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=run_dir.parent, prefix=f".{run_dir.name}.import."))
    try:
        like = abstract_model(cfg)[1]
        params = jax.tree.map(lambda p, a: np.asarray(p, a.dtype), params, nnx.to_pure_dict(like))
        run, state = setup(cfg, single_device_plan(cfg.model, cfg.parallel.scheme), params)
        ckpt = Checkpointer(tmp / "checkpoints", cfg.checkpoint.keep)
        try:
            ckpt.save(0, state, {"step": 0, "data_position": 0, **run.checkpoint_meta(), "loss": None,
                                 "identity": identity(cfg.to_dict()), "imported_from": source})
            ckpt.wait()
        finally:
            ckpt.close()
        cfg.dump(tmp / "config.yaml")
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked before any work)
        tmp.rename(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert(a: argparse.Namespace) -> dict:
    """The import the command line describes; returns its report."""
    from boost_jax.model import compress

    model_cfg, params, tokenizer = read_source(a.src, a.step)
    out = {"source": str(a.src), "run_dir": str(a.run_dir), "arch": model_cfg.arch}
    if a.to:
        cfg = run_config(model_cfg, a.config, a.run_dir, a.src)  # checks the overrides before the slow part
        compress.svd_config(model_cfg, a.rank)  # a rank larger than a matrix, or a non-dense source
        covs, evals = None, {}
        if a.calibration is not None:
            shape = (model_cfg.vocab_size, cfg.train.seq_len, a.samples)
            calib, _ = calibration_tokens(a.calibration, tokenizer, *shape, "train")
            val_x, val_y = calibration_tokens(a.calibration, tokenizer, *shape, "val")
            evals["before"] = loss_of(model_cfg, params, val_x, val_y)
            if a.method == "whiten":
                from flax import nnx

                from boost_jax.model import Model

                model = Model(model_cfg, rngs=nnx.Rngs(0))
                nnx.update(model, params)
                covs = compress.covariances(model, calib)
        model_cfg, params, report = compress.compress(model_cfg, params, a.rank, covs)
        if fallbacks := sorted({f"layer {i} {name}: {e['whitening']}" for i, row in enumerate(report)
                                for name, e in row.items() if e.get("whitening", compress.PLAIN) != compress.PLAIN}):
            print(f"note: whitening by Cholesky ({compress.PLAIN}) failed on near-singular calibration "
                  f"covariances (--samples {a.samples}; more samples whiten better), so it fell back: "
                  + "; ".join(fallbacks), file=sys.stderr, flush=True)
        if a.calibration is not None:
            evals["after"] = loss_of(model_cfg, params, val_x, val_y)
        out["compression"] = {"method": a.method, "rank": a.rank, "layers": report,
                              **{f"val_loss_{k}": v for k, v in evals.items()}}
    cfg = run_config(model_cfg, a.config, a.run_dir, a.src)
    write_run(cfg, params, tokenizer, str(a.src))
    out["arch"] = cfg.model.arch
    return out


def _main(argv: list[str]) -> None:
    a = parse(argv)
    from boost_jax.config import from_dict, raw_args
    from boost_jax.launch.prepare import prepare_jax

    # the command's data.* keys (its model is on one device; its parallel.* keys are the new run's)
    prepare_jax(from_dict({"data": raw_args(a.config).get("data", {})}), reuse_memory=False)
    r = convert(a)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"imported {r['source']} into {r['run_dir']} ({r['arch']}); continue with: "
          f"python -m boost_jax.train {r['run_dir']}/config.yaml")
    if c := r.get("compression"):
        import math

        for i, layer in enumerate(c["layers"]):
            print(f"  layer {i}: " + ", ".join(f"{name} {100 * e['weight']:.1f}%"
                                                + (f" (output {100 * e['output']:.1f}%)" if "output" in e else "")
                                                for name, e in layer.items()))
        if "val_loss_before" in c:
            print(f"  validation loss {c['val_loss_before']:.4f} -> {c['val_loss_after']:.4f} "
                  f"(perplexity {math.exp(c['val_loss_before']):.2f} -> {math.exp(min(c['val_loss_after'], 700)):.2f})")


if __name__ == "__main__":
    main()
