"""`bench finetune [CONFIG.yaml] [section.key=value ...]`: low-rank fine-tuning, measured.

Pre-trains dense and cola on the corpus at equal tokens (--pretrain-steps; the config, default the
quickstart's llama-mini on the Python standard library, is the pre-training's), builds a chat task
from the same corpus whose answers are checked exactly (bench/finetune_task.py: name a `def` line's
parameters), and fine-tunes from each (`train.init_from`, data.format=chat with the shipped ChatML
template, train.loss_on=completion, --finetune-steps at the pre-training's batch and sequence: equal
fine-tune tokens for every path, seeds --seeds). The dense model is also factored to the svd arch at
rank d/4 and d/2 (`convert import --to svd`, plain and whitened on the fine-tune data's prompts)
before its fine-tune (then fine-tuned) and after it (the fine-tuned model factored). Each path is
scored on the held-out rows: greedy exact match and the completion loss.

Throughput: each fine-tune's train step timed beside its pre-training's (the same model, batch and
sequence; interleaved repetitions, bench step's Runner), the time packing a batch takes on the host,
and both runs' own logged tokens/s; each fine-tune batch's share of positions that hold a token.

Every run is an ordinary run dir under --work (rerunning resumes or skips what is done); --json prints
everything, and `bench report --rerender docs/results.json --finetune-json FILE` puts it on the
results page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

from boost_jax import api
from boost_jax.bench.common import parse, parser, train_to_end
from boost_jax.bench.finetune_task import build_task, messages, read_rows, score
from boost_jax.bench.step import Runner, time_runners
from boost_jax.config import Config, ConfigError, DataConfig, from_args, from_dict, raw_args
from boost_jax.data.build import build_data
from boost_jax.data.corpus import stdlib_corpus
from boost_jax.data.tokenizer import load_tokenizer
from boost_jax.training.importer import convert, with_source_model

# What the runs share unless the config says otherwise: the quickstart's model and corpus, 8 windows
# of 256 tokens a step (the fine-tune's too: its layout is the pre-training's).
PROTOCOL = ["model.preset=llama-mini", "train.seq_len=256", "train.batch_size=8", "train.lr=3e-3",
            "checkpoint.keep=1", "log.progress=false", "log.tensorboard=false", "parallel.dp=1"]
FACTORINGS = [(4, "svd"), (4, "whiten"), (2, "svd"), (2, "whiten")]  # (d / rank, method)
SCORE = "bench_finetune_score.json"  # a run dir's held-out score, kept for a rerun
SET_HERE = ("model.arch", "train.steps", "train.seed", "train.init_from", "run_dir", "data.format", "train.loss_on")


def pretrain_args(args: list[str], arch: str, steps: int, run_dir: Path) -> list[str]:
    return [*PROTOCOL, *args, f"model.arch={arch}", f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}",
            "train.eval_every=0", f"checkpoint.every={steps}", f"run_dir={run_dir}"]


def finetune_args(args: list[str], source: Path, train_file: Path, steps: int, lr: float, seed: int,
                  run_dir: Path) -> list[str]:
    return [*PROTOCOL, *args, f"train.init_from={source}", "data.source=files", f"data.paths=[{train_file}]",
            "data.format=chat", "data.chat_template=chatml", "data.val_fraction=0", "train.loss_on=completion",
            f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}", f"train.lr={lr}",
            f"train.seed={seed}", "train.eval_every=0", f"checkpoint.every={steps}", f"run_dir={run_dir}"]


def finetune_config(args: list[str]) -> Config:
    """A fine-tune's config as `python -m boost_jax.train` reads it (the model its source's)."""
    return from_dict(with_source_model(raw_args(args)))


def run(cfg: Config, log, what: str) -> dict:
    """Train `cfg`'s run to its end (a done run is left as it is); its logged tokens/s."""
    t0 = time.perf_counter()
    train_to_end(cfg, jax.devices()[:1])
    out = {"run_dir": str(cfg.run_dir), "tokens_per_s": logged_tokens_per_s(cfg)}
    log(f"  {what}: {(time.perf_counter() - t0) / 60:.1f} min, {out['tokens_per_s']:,.0f} tokens/s logged")
    return out


def logged_tokens_per_s(cfg: Config) -> float:
    """The median tokens/s the run's metrics.jsonl logged per step, its first log window (the warm-up
    after the compile) left out."""
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows
                             if "tokens_per_s" in r and r["step"] > min(cfg.log.every, cfg.train.steps - 1))


def factor(src: Path, run_dir: Path, rank: int, method: str, calibration: Path, log) -> None:
    """`convert import SRC RUN_DIR --to svd --rank R --method M [--calibration DIR]` (skipped if done):
    whitened by the calibration set's covariances, or plain SVD (no calibration read)."""
    if (run_dir / "config.yaml").is_file():
        return
    whiten = method == "whiten"
    convert(argparse.Namespace(src=src, run_dir=run_dir, config=[], step=None, to="svd", rank=rank, method=method,
                               calibration=calibration if whiten else None, samples=64, json=True))
    log(f"  {src.name} -> svd rank {rank} ({method})")


def calibration_set(task_train: Path, chat, tokenizer: Path, cfg: Config, out: Path) -> Path:
    """A prepared text dataset of the fine-tune rows' prompts as the model reads them (the template's
    user turn and the assistant's opening), for the whitened factorisation."""
    path = out / "prompts.jsonl"
    if not path.is_file():
        path.write_text("".join(json.dumps({"text": chat.template.render(messages(line), True)}) + "\n"
                                for line, _ in read_rows(task_train)))
    data = DataConfig(source="files", paths=[str(path)], tokenizer_path=str(tokenizer), val_fraction=0.1,
                      cache_dir=cfg.data.cache_dir)
    return build_data(data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len, seed=0).directory


def batch_fills(cfg: Config, steps: int) -> list[float]:
    """Each of the fine-tune's batches' share of input positions that hold a token (not padding)."""
    split = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed,
                       completion_only=True).train
    b, s = cfg.train.batch_size, cfg.train.seq_len
    used = lambda k: min(int(split.docs.lengths[split.window(k)].sum()), s)
    return [sum(used(step * b + i) for i in range(b)) / (b * s) for step in range(steps)]


def packing_seconds(cfg: Config, steps: int) -> float:
    """Median host seconds to pack one of the fine-tune's batches (the loop packs it between steps)."""
    split = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed,
                       completion_only=True).train
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        split.batch(step, cfg.train.batch_size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_times(pairs: list[tuple[str, Config, Config]], reps: int) -> list[dict]:
    """Each (arch, pre-training config, fine-tune config)'s train steps timed side by side."""
    runners = [Runner(c) for _, pre, ft in pairs for c in (pre, ft)]
    results = time_runners(runners, reps, 2)
    out = []
    for i, (arch, _, ft) in enumerate(pairs):
        pre_r, ft_r = results[2 * i], results[2 * i + 1]
        pack_s = packing_seconds(ft, 8)
        out.append({"arch": arch, "pretrain_step_s": pre_r["median_step_s"], "finetune_step_s": ft_r["median_step_s"],
                    "packing_s": pack_s, "positions_per_step": ft.train.batch_size * ft.train.seq_len,
                    "step_ratio": pre_r["median_step_s"] / ft_r["median_step_s"],
                    "ratio_with_packing": pre_r["median_step_s"] / (ft_r["median_step_s"] + pack_s)})
    return out


def score_run(run_dir: Path, chat, rows, max_new_tokens: int) -> dict:
    """`finetune_task.score` of a run dir's newest checkpoint, kept in the run dir (SCORE) and read
    back by a rerun on the same held-out rows."""
    kept = run_dir / SCORE
    key = {"rows": [line for line, _ in rows], "max_new_tokens": max_new_tokens}
    if kept.is_file() and (saved := json.loads(kept.read_text()))["key"] == key:
        return saved["score"]
    _, model, step = api.restore(run_dir)
    out = {"step": step, **score(model, chat, rows, max_new_tokens)}
    kept.write_text(json.dumps({"key": key, "score": out}))
    return out


def measure(args: list[str], pretrain_steps: int, finetune_steps: int, lr: float, seeds: list[int], work: Path,
            heldout: int, reps: int, log=print) -> dict:
    t_start = time.perf_counter()
    base = from_args(pretrain_args(args, "dense", pretrain_steps, work / "pretrain-dense"))
    d, per_step = base.model.d_model, base.train.batch_size * base.train.seq_len
    log(f"pre-training dense and cola: {pretrain_steps} steps of {per_step} tokens")
    pre = {arch: run(from_args(pretrain_args(args, arch, pretrain_steps, work / f"pretrain-{arch}")), log, arch)
           for arch in ("dense", "cola")}
    tokenizer = work / "pretrain-dense" / "tokenizer.json"
    chat = api.chat_template(load_tokenizer(tokenizer), tokenizer, "chatml")
    corpus = stdlib_corpus(base.data.max_bytes) if base.data.source == "stdlib" else None
    if corpus is None:
        raise ConfigError(f"data.source={base.data.source}: bench finetune builds its task from the stdlib corpus")
    task = build_task(corpus, work / "task", train_rows=20_000, heldout_rows=heldout)
    rows = read_rows(task.heldout)
    max_new = max(len(chat.tokenizer.encode(a, add_special_tokens=False).ids) for _, a in rows) + 4
    log(f"task: {task.stats['train_rows']} train rows, {len(rows)} held out (of {task.stats['lines']} def lines)")
    calibration = calibration_set(task.train, chat, tokenizer, base, work / "task")
    sources = {"dense": work / "pretrain-dense", "cola": work / "pretrain-cola"}
    for k, method in FACTORINGS:
        sources[f"svd d/{k} {method}, before"] = work / f"dense-svd{k}-{method}"
        factor(work / "pretrain-dense", sources[f"svd d/{k} {method}, before"], d // k, method, calibration, log)
    paths = {name: {"name": name, "seeds": []} for name in
             [*sources, *(f"svd d/{k} {method}, after" for k, method in FACTORINGS)]}
    finetunes = {}
    for seed in seeds:
        for name, src in sources.items():
            tag = name.replace("/", "").replace(", ", "-").replace(" ", "-")
            cfg = finetune_config(finetune_args(args, src, task.train, finetune_steps, lr, seed,
                                                work / f"ft-{tag}-seed{seed}"))
            finetunes[name, seed] = ft = {**run(cfg, log, f"fine-tune {name} seed {seed}"), "config": cfg}
            paths[name]["seeds"].append({"seed": seed, "tokens_per_s": ft["tokens_per_s"],
                                         **score_run(Path(cfg.run_dir), chat, rows, max_new)})
            log(f"    exact match {paths[name]['seeds'][-1]['exact_match']:.1%}, completion loss "
                f"{paths[name]['seeds'][-1]['completion_loss']:.4f}")
        tuned = Path(finetunes["dense", seed]["run_dir"])
        for k, method in FACTORINGS:
            name = f"svd d/{k} {method}, after"
            out = work / f"ft-dense-seed{seed}-svd{k}-{method}"
            factor(tuned, out, d // k, method, calibration, log)
            paths[name]["seeds"].append({"seed": seed, **score_run(out, chat, rows, max_new)})
            log(f"  {name} seed {seed}: exact match {paths[name]['seeds'][-1]['exact_match']:.1%}")
    for p in paths.values():
        p["mean_exact_match"] = statistics.mean(s["exact_match"] for s in p["seeds"])
        p["mean_completion_loss"] = statistics.mean(s["completion_loss"] for s in p["seeds"])
    ft_dense = finetunes["dense", seeds[0]]["config"]
    fills = batch_fills(ft_dense, finetune_steps)
    log(f"timing the train steps side by side ({reps} repetitions)")
    pairs = [(arch, from_args(pretrain_args(args, arch, pretrain_steps, work / f"pretrain-{arch}")),
              finetunes[arch, seeds[0]]["config"]) for arch in ("dense", "cola")]
    steps = step_times(pairs, reps)
    for s in steps:
        s["pretrain_logged_tokens_per_s"] = pre[s["arch"]]["tokens_per_s"]
        s["finetune_logged_tokens_per_s"] = finetunes[s["arch"], seeds[0]]["tokens_per_s"]
    m = base.model
    return {"model": m.preset, "d_model": d, "n_layers": m.n_layers, "seq_len": base.train.seq_len,
            "batch_size": base.train.batch_size, "corpus": base.data.source, "pretrain_steps": pretrain_steps,
            "pretrain_tokens": pretrain_steps * per_step, "finetune_steps": finetune_steps,
            "finetune_positions": finetune_steps * per_step, "finetune_lr": lr, "seeds": seeds,
            "task": task.stats, "paths": list(paths.values()),
            "fill": {"min": min(fills), "mean": statistics.mean(fills), "batches": len(fills)},
            "throughput": steps, "device": jax.devices()[0].device_kind, "minutes": (time.perf_counter() - t_start) / 60,
            "command": " ".join(["python -m boost_jax.bench finetune", *args, f"--pretrain-steps {pretrain_steps}",
                                 f"--finetune-steps {finetune_steps}", f"--finetune-lr {lr:g}",
                                 f"--seeds {','.join(map(str, seeds))}", f"--heldout {heldout}", f"--reps {reps}"])}


def table(r: dict) -> list[str]:
    """Markdown: each path's held-out exact match and completion loss, per seed and their mean."""
    seeds = " / ".join(f"seed {s}" for s in r["seeds"])
    lines = [f"| path | exact match ({seeds}) | mean | completion loss ({seeds}) | mean |", "|---|---|---|---|---|"]
    for p in r["paths"]:
        em = " / ".join(f"{100 * s['exact_match']:.1f}%" for s in p["seeds"])
        cl = " / ".join(f"{s['completion_loss']:.4f}" for s in p["seeds"])
        lines.append(f"| {p['name']} | {em} | {100 * p['mean_exact_match']:.1f}% | {cl} | {p['mean_completion_loss']:.4f} |")
    return lines


def throughput_table(r: dict) -> list[str]:
    """Markdown: each arch's pre-training and fine-tune step, side by side, and the packing's share."""
    lines = ["| arch | pre-training step | fine-tune step | packing a batch | fine-tune / pre-training tokens/s "
             "(step; with packing) | logged tokens/s (pre-training; fine-tune) |", "|---|---|---|---|---|---|"]
    for s in r["throughput"]:
        logged = " / ".join(f"{x:,.0f}" if x else "-" for x in (s["pretrain_logged_tokens_per_s"],
                                                                 s["finetune_logged_tokens_per_s"]))
        lines.append(f"| {s['arch']} | {1e3 * s['pretrain_step_s']:.0f} ms | {1e3 * s['finetune_step_s']:.0f} ms | "
                     f"{1e3 * s['packing_s']:.1f} ms | {s['step_ratio']:.2f}x; {s['ratio_with_packing']:.2f}x | {logged} |")
    return lines


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench finetune", __doc__)
    p.add_argument("--pretrain-steps", type=int, default=300, help="pre-training steps of dense and of cola")
    p.add_argument("--finetune-steps", type=int, default=60, help="steps of every fine-tune (equal tokens)")
    p.add_argument("--finetune-lr", type=float, default=1e-3, help="every fine-tune's peak learning rate")
    p.add_argument("--seeds", default="0,1", help="fine-tune seeds (batch order), comma-separated")
    p.add_argument("--heldout", type=int, default=128, help="held-out rows scored")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions of the step timing")
    p.add_argument("--work", type=Path, default=Path("runs/finetune"), help="where the run dirs go")
    a = parse(p, argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {a.seeds!r}: expected whole numbers, e.g. 0,1") from None
    if min(a.pretrain_steps, a.finetune_steps, a.heldout, a.reps) < 1 or a.finetune_lr <= 0:
        raise ConfigError("--pretrain-steps, --finetune-steps, --heldout, --reps and --finetune-lr must be positive")
    if bad := [c for c in a.config if c.split("=")[0] in SET_HERE]:
        raise ConfigError(f"{bad[0]}: bench finetune sets the arch, steps, seed, source, data format and run dir "
                          "of each run")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    result = measure(a.config, a.pretrain_steps, a.finetune_steps, a.finetune_lr, seeds, a.work, a.heldout, a.reps,
                     log=log)
    if a.json:
        print(json.dumps(result, indent=1, default=str))
        return
    for line in [*table(result), "", *throughput_table(result)]:
        print(line)
    print(f"fine-tune batches: {100 * result['fill']['min']:.1f}% of positions hold a token in the least full, "
          f"{100 * result['fill']['mean']:.1f}% on average ({result['fill']['batches']} batches)")


if __name__ == "__main__":
    main(sys.argv[1:])
