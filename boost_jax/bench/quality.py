"""`bench quality [CONFIG.yaml] [section.key=value ...]`: the low-rank quality claim, measured.

Trains dense, svd, cola and lax from scratch on one corpus at equal tokens (--tokens), then cola and
svd again at dense's training FLOPs (more tokens: their FLOPs per token are lower), evaluates each
with `python -m boost_jax.eval`'s evaluator on the validation split, and compresses the trained dense
model to the svd arch at rank d/4 (`--method svd` and `whiten`), evaluated before and after
--recover-steps of continued training. Every run is an ordinary run dir under --work (rerunning
resumes or skips what is done). The config (default: the quickstart's llama-mini on the Python
standard library) is every run's, with the arch and train.steps set per run; --json prints
everything, and `bench report --quality-json` puts it on the results page.

`--vary train.optimizer=adamw,muon,spectron` compares optimizers instead: dense and cola (spectron:
low-rank archs only) at equal tokens, each optimizer at the best of a learning-rate grid (--lrs, three
values, every run's loss printed), then a second seed at that rate only; the table shows both seeds'
losses and their spread.

`--vary model.attn_latent_heads=1,2,4` measures what latent heads cost (docs/design.md section 11), and
`--vary model.attn_rope_dims=0,16,32` what decoupled RoPE costs: cola with each value at equal tokens,
the protocol's learning rate, --seeds seeds (default 2: 0 and 1, another initialisation and batch
order); the table shows each seed's loss, their mean and spread (largest - smallest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import get_args

import jax

from boost_jax.bench.common import parse, parser, train_to_end
from boost_jax.config import Config, ConfigError, OptimizerName, from_args
from boost_jax.data.build import build_data
from boost_jax.model.counts import count
from boost_jax.training.evaluate import evaluate
from boost_jax.training.importer import convert

TRAINED_ARCHS = ("dense", "svd", "cola", "lax")  # from scratch at equal tokens (config.archs.ARCHS: every arch)
MATCHED = ("svd", "cola")  # trained again at dense's FLOPs
# What the quality runs share unless the config says otherwise: the quickstart's model and corpus at
# sequence 256, evaluated on 8 validation batches ~10 times per run.
PROTOCOL = ["model.preset=llama-mini", "train.seq_len=256", "train.batch_size=16", "train.lr=3e-3",
            "train.eval_batches=8", "checkpoint.keep=1", "log.progress=false", "log.tensorboard=false"]


def run_args(args: list[str], arch: str, steps: int, run_dir: Path) -> list[str]:
    return [*PROTOCOL, *args, f"model.arch={arch}", f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}",
            f"train.eval_every={max(1, steps // 10)}", f"checkpoint.every={steps}", "parallel.dp=1", f"run_dir={run_dir}"]


def curve(run_dir: Path, flops_per_token: float, tokens_per_step: int) -> list[dict]:
    """The run's eval points: step, tokens, training FLOPs, loss, bits per byte."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "tokens": r["step"] * tokens_per_step, "flops": r["step"] * tokens_per_step * flops_per_token,
             "eval_loss": r["eval_loss"], "eval_bpb": r.get("eval_bpb")} for r in rows if "eval_loss" in r]


def final_eval(run_dir: Path, max_tokens: int) -> dict:
    r = evaluate(run_dir, max_tokens=max_tokens)
    return {k: r[k] for k in ("step", "loss", "perplexity", "bits_per_byte", "tokens")}


def train_run(args: list[str], arch: str, steps: int, run_dir: Path, max_tokens: int, log) -> dict:
    cfg = from_args(run_args(args, arch, steps, run_dir))
    t0 = time.perf_counter()
    summary = train_to_end(cfg, jax.devices()[:1])
    c = count(cfg.model, cfg.train.seq_len)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    out = {"arch": arch, "run_dir": str(run_dir), "steps": steps, "tokens": steps * tokens_per_step,
           "params": c.params, "train_flops_per_token": c.train_flops_per_token,
           "train_flops": steps * tokens_per_step * c.train_flops_per_token, "seconds": time.perf_counter() - t0,
           "tokens_per_s": summary.get("tokens_per_s"), "curve": curve(run_dir, c.train_flops_per_token, tokens_per_step),
           "final": final_eval(run_dir, max_tokens)}
    log(f"  {arch} {steps} steps: val loss {out['final']['loss']:.4f}, ppl {out['final']['perplexity']:.2f} "
        f"({out['seconds'] / 60:.1f} min)")
    return out


def recover(args: list[str], dense: dict, method: str, steps: int, work: Path, max_tokens: int, log) -> dict:
    """The trained dense model factored to svd at rank d/4 by `method`, evaluated, trained on `steps`."""
    run_dir = work / f"dense-to-svd-{method}"
    base = from_args(run_args(args, "dense", dense["steps"], Path(dense["run_dir"])))
    rank = base.model.d_model // 4
    if not (run_dir / "config.yaml").is_file():
        data = build_data(base.data, vocab_size=base.model.vocab_size, seq_len=base.train.seq_len, seed=0).directory
        convert(argparse.Namespace(src=Path(dense["run_dir"]), run_dir=run_dir, config=[], step=None, to="svd",
                                   rank=rank, method=method, calibration=data, samples=64, json=True))
    compressed = final_eval(run_dir, max_tokens)
    cfg = from_args([str(run_dir / "config.yaml"), f"train.steps={steps}", f"train.eval_every={max(1, steps // 5)}",
                     f"train.warmup_steps={max(1, steps // 10)}", "train.lr=1e-3", f"checkpoint.every={steps}"])
    train_to_end(cfg, jax.devices()[:1])
    recovered = final_eval(run_dir, max_tokens)
    log(f"  dense -> svd rank {rank} ({method}): ppl {compressed['perplexity']:.2f}, after {steps} steps "
        f"{recovered['perplexity']:.2f}")
    return {"method": method, "rank": rank, "steps": steps,
            "tokens": steps * cfg.train.batch_size * cfg.train.seq_len, "compressed": compressed, "recovered": recovered}


def steps_for(base: Config, tokens: int) -> tuple[int, int]:
    """(steps, tokens per step) of an equal-token run of `tokens` under `base` (the protocol's config)."""
    per_step = base.train.batch_size * base.train.seq_len
    return max(10, tokens // per_step), per_step


def compare_optimizers(args: list[str], optimizers: list[str], lrs: list[float], tokens: int, work: Path,
                       max_tokens: int, archs: tuple[str, ...] = ("dense", "cola"), log=print) -> dict:
    """Each optimizer on each arch at equal tokens: the learning-rate grid, the best rate's run and a
    second seed at it (`train.seed=1`: another initialisation and batch order)."""
    steps, per_step = steps_for(from_args([*PROTOCOL, *args, "parallel.dp=1"]), tokens)
    rows, evaluated = [], None
    for arch in archs:
        for name in optimizers:
            if name == "spectron" and arch == "dense":
                continue  # spectron updates factor pairs: low-rank archs only (its config check says so)
            log(f"{arch} {name}: learning rates {', '.join(map(str, lrs))}, {steps} steps each")
            opt = [f"train.optimizer={name}"]
            grid = [train_run([*args, *opt, f"train.lr={lr}"], arch, steps, work / f"{arch}-{name}-lr{lr}", max_tokens, log)
                    for lr in lrs]
            best = min(range(len(lrs)), key=lambda i: grid[i]["final"]["loss"])
            again = train_run([*args, *opt, f"train.lr={lrs[best]}", "train.seed=1"], arch, steps,
                              work / f"{arch}-{name}-lr{lrs[best]}-seed1", max_tokens, log)
            losses = [grid[best]["final"]["loss"], again["final"]["loss"]]
            evaluated = again["final"]["tokens"]  # every run evaluates the same split
            rows.append({"arch": arch, "optimizer": name, "grid": [{"lr": lr, "loss": r["final"]["loss"]}
                                                                   for lr, r in zip(lrs, grid)],
                         "best_lr": lrs[best], "seed_losses": losses, "mean_loss": sum(losses) / 2,
                         "spread": abs(losses[0] - losses[1]), "perplexity": grid[best]["final"]["perplexity"],
                         "minutes": sum(r["seconds"] for r in (*grid, again)) / 60})
    return {"tokens": steps * per_step, "steps": steps, "lrs": lrs, "eval_tokens": max_tokens,
            "evaluated_tokens": evaluated, "rows": rows}


# The model keys `--vary` compares at equal tokens on cola: the result's key, the run dirs' prefix and the
# table's first column.
MODEL_AXES = {"model.attn_latent_heads": ("latent_heads", "heads", "latent heads g"),
              "model.attn_rope_dims": ("rope_dims", "rope", "rotary dims d_r")}


def compare_model_values(args: list[str], key: str, values: list[int], tokens: int, work: Path, max_tokens: int,
                         seeds: int = 2, log=print) -> dict:
    """cola with each value of the model key `key` (MODEL_AXES) at equal tokens, seeds 0 to `seeds` - 1."""
    steps, per_step = steps_for(from_args([*PROTOCOL, *args, "parallel.dp=1"]), tokens)
    field, prefix = key.partition(".")[2], MODEL_AXES[key][1]
    rows, evaluated = [], None
    for v in values:
        log(f"cola, {key}={v}: seeds 0 to {seeds - 1}, {steps} steps each")
        runs = [train_run([*args, f"{key}={v}", f"train.seed={seed}"], "cola", steps,
                          work / f"cola-{prefix}{v}-seed{seed}", max_tokens, log) for seed in range(seeds)]
        losses = [r["final"]["loss"] for r in runs]
        evaluated = runs[-1]["final"]["tokens"]  # every run evaluates the same split
        rows.append({field: v, "params": runs[0]["params"], "seed_losses": losses,
                     "mean_loss": sum(losses) / seeds, "spread": max(losses) - min(losses),
                     "minutes": sum(r["seconds"] for r in runs) / 60})
    return {"key": key, "tokens": steps * per_step, "steps": steps, "eval_tokens": max_tokens,
            "evaluated_tokens": evaluated, "rows": rows}


def model_values_table(o: dict) -> list[str]:
    """Markdown: each value of the varied key, its seeds' losses, their mean and spread (largest - smallest)."""
    key = o.get("key", "model.attn_latent_heads")  # results saved before --vary took other keys
    field, title = key.partition(".")[2], MODEL_AXES[key][2]
    n = len(o["rows"][0]["seed_losses"])
    lines = [f"| {title} | params | {' / '.join(f'seed {i}' for i in range(n))} | mean val loss | spread | minutes |",
             "|---|---|---|---|---|---|"]
    for r in o["rows"]:
        lines.append(f"| {r[field]} | {r['params'] / 1e6:.2f}M | {' / '.join(f'{x:.4f}' for x in r['seed_losses'])} | "
                     f"{r['mean_loss']:.4f} | {r['spread']:.4f} | {r['minutes']:.1f} |")
    return lines


def vary_model_values(vary: str, config: list[str]) -> tuple[str, list[int]]:
    """The key and whole-number values of `--vary model.KEY=V1,V2,...` (a key of MODEL_AXES), checked."""
    key, _, values = vary.partition("=")
    if key not in MODEL_AXES:
        raise ConfigError(f"--vary {vary!r}: bench quality varies train.optimizer or one of {sorted(MODEL_AXES)}")
    try:
        numbers = [int(x) for x in values.split(",")]
    except ValueError:
        raise ConfigError(f"--vary {vary!r}: expected whole numbers separated by commas") from None
    if bad := [c for c in config if c.split("=")[0] in (key, "train.seed")]:
        raise ConfigError(f"{bad[0]}: with --vary, bench quality sets {key} and the seed of each run")
    return key, numbers


def optimizer_table(o: dict) -> list[str]:
    """Markdown: each optimizer's grid, best rate and its two seeds."""
    lines = ["| arch | optimizer | val loss per lr (" + ", ".join(f"{lr:g}" for lr in o["lrs"]) + ") | best lr | "
             "seed 0 / seed 1 | mean | spread |", "|---|---|---|---|---|---|---|"]
    for r in o["rows"]:
        grid = ", ".join(f"{g['loss']:.4f}" for g in r["grid"])
        lines.append(f"| {r['arch']} | {r['optimizer']} | {grid} | {r['best_lr']:g} | {r['seed_losses'][0]:.4f} / "
                     f"{r['seed_losses'][1]:.4f} | {r['mean_loss']:.4f} | {r['spread']:.4f} |")
    return lines


def measure(args: list[str], tokens: int, recover_steps: int, work: Path, max_tokens: int, log=print) -> dict:
    base = from_args([*PROTOCOL, *args, "parallel.dp=1"])
    steps, per_step = steps_for(base, tokens)
    flops = {arch: count(from_args([*PROTOCOL, *args, f"model.arch={arch}"]).model, base.train.seq_len).train_flops_per_token
             for arch in TRAINED_ARCHS}
    runs = []
    for arch in TRAINED_ARCHS:
        log(f"{arch}: {steps} steps of {per_step} tokens")
        runs.append({**train_run(args, arch, steps, work / arch, max_tokens, log), "budget": "tokens"})
    for arch in MATCHED:
        matched = round(steps * flops["dense"] / flops[arch])
        log(f"{arch} at dense's FLOPs: {matched} steps")
        runs.append({**train_run(args, arch, matched, work / f"{arch}-flops", max_tokens, log), "budget": "flops"})
    dense = runs[0]
    recovery = [recover(args, dense, method, recover_steps, work, max_tokens, log) for method in ("svd", "whiten")]
    m = base.model
    return {"model": m.preset, "d_model": m.d_model, "n_layers": m.n_layers, "rank": m.d_model // 4,
            "seq_len": base.train.seq_len, "batch_size": base.train.batch_size, "corpus": base.data.source,
            "tokens": steps * per_step, "eval_tokens": max_tokens, "runs": runs, "recovery": recovery,
            "command": " ".join(["python -m boost_jax.bench quality", *args, f"--tokens {tokens}",
                                 f"--recover-steps {recover_steps}"])}


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench quality", __doc__)
    p.add_argument("--tokens", type=int, default=1_200_000, help="training tokens of each equal-token run")
    p.add_argument("--recover-steps", type=int, default=100, help="continued training of the compressed dense model")
    p.add_argument("--eval-tokens", type=int, default=200_000, help="validation tokens of each final eval")
    p.add_argument("--work", type=Path, default=Path("runs/quality"), help="where the run dirs go")
    p.add_argument("--vary", metavar="train.optimizer=A,B,...",
                   help="compare optimizers instead of archs (or model.attn_latent_heads=G1,G2,... or "
                        "model.attn_rope_dims=D1,D2,...: cola with each value)")
    p.add_argument("--seeds", type=int, default=2, help="with --vary model.KEY=...: seeds per value")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="with --vary: the learning-rate grid (three values)")
    a = parse(p, argv)
    if a.tokens < 1 or a.recover_steps < 1 or a.eval_tokens < 1 or a.seeds < 2:
        raise ConfigError("--tokens, --recover-steps and --eval-tokens must be at least 1, --seeds at least 2")
    if bad := [c for c in a.config if c.split("=")[0] in ("model.arch", "train.steps", "run_dir")]:
        raise ConfigError(f"{bad[0]}: bench quality sets the arch, the steps and the run dir of each run")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    if a.vary is not None and a.vary.partition("=")[0] in MODEL_AXES:
        key, values = vary_model_values(a.vary, a.config)
        seeds = [f"--seeds {a.seeds}"] if a.seeds != 2 else []
        result = {MODEL_AXES[key][0]: compare_model_values(a.config, key, values, a.tokens, a.work, a.eval_tokens,
                                                           seeds=a.seeds, log=log),
                  "command": " ".join(["python -m boost_jax.bench quality", *a.config, f"--tokens {a.tokens}",
                                       f"--eval-tokens {a.eval_tokens}", *seeds, f"--vary {a.vary}"])}
        lines = model_values_table(result[MODEL_AXES[key][0]])
    elif a.vary is not None:
        optimizers, lrs = vary_optimizers(a.vary, a.lrs, a.config)
        result = {"optimizers": compare_optimizers(a.config, optimizers, lrs, a.tokens, a.work, a.eval_tokens, log=log),
                  "command": " ".join(["python -m boost_jax.bench quality", *a.config, f"--tokens {a.tokens}",
                                       f"--vary {a.vary} --lrs {a.lrs}"])}
        lines = optimizer_table(result["optimizers"])
    else:
        result = measure(a.config, a.tokens, a.recover_steps, a.work, a.eval_tokens, log=log)
        lines = table(result)
    if a.json:
        print(json.dumps(result, indent=1))
        return
    for line in lines:
        print(line)


def vary_optimizers(vary: str, lrs: str, config: list[str]) -> tuple[list[str], list[float]]:
    """The optimizers of `--vary train.optimizer=...` and the --lrs grid, each checked by name."""
    key, _, values = vary.partition("=")
    if key != "train.optimizer" or not values:
        raise ConfigError(f"--vary {vary!r}: bench quality varies train.optimizer=A,B,... only")
    optimizers = values.split(",")
    if bad := [o for o in optimizers if o not in get_args(OptimizerName)]:
        raise ConfigError(f"--vary: unknown optimizer {bad[0]!r}; choose from {list(get_args(OptimizerName))}")
    try:
        grid = [float(x) for x in lrs.split(",")]
    except ValueError:
        raise ConfigError(f"--lrs {lrs!r}: expected three numbers, e.g. 1e-3,3e-3,1e-2") from None
    if len(grid) != 3 or min(grid) <= 0:
        raise ConfigError(f"--lrs {lrs!r}: expected three positive learning rates")
    if bad := [c for c in config if c.split("=")[0] in ("train.optimizer", "train.lr", "train.seed")]:
        raise ConfigError(f"{bad[0]}: with --vary, bench quality sets the optimizer, the rate and the seed of each run")
    return optimizers, grid


def table(q: dict) -> list[str]:
    """Markdown: each run's final validation figures, and the compressed dense model's recovery."""
    lines = ["| arch | budget | steps | tokens | training PFLOP | params | val loss | perplexity | bits/byte | minutes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in q["runs"]:
        f = r["final"]
        lines.append(f"| {r['arch']} | {r['budget']} | {r['steps']} | {r['tokens']:,} | {r['train_flops'] / 1e15:.3f} | "
                     f"{r['params'] / 1e6:.2f}M | {f['loss']:.4f} | {f['perplexity']:.2f} | {f['bits_per_byte']:.4f} | "
                     f"{r['seconds'] / 60:.1f} |")
    return lines


def ratios(q: dict) -> dict[str, float]:
    """Perplexity of each low-rank run over dense's."""
    dense = next(r for r in q["runs"] if r["arch"] == "dense")["final"]["perplexity"]
    return {f"{r['arch']}/{r['budget']}": r["final"]["perplexity"] / dense for r in q["runs"] if r["arch"] != "dense"}


if __name__ == "__main__":
    main(sys.argv[1:])
