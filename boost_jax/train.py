"""`python -m boost_jax.train [CONFIG.yaml] [section.key=value ...]`: parse, build, loop.

With no arguments it trains the default small CoLA model on the Python standard library's source
(offline) on whatever devices exist. Re-running with the same `run_dir` resumes from the newest
checkpoint; the loss trajectory is bitwise identical to an uninterrupted run on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import time
from pathlib import Path

import jax
import numpy as np

from boost_jax.checkpoint import changed_keys, identity
from boost_jax.cli import DEBUG_HELP, run_main
from boost_jax.config import Config, ConfigError, load_config, load_yaml
from boost_jax.errors import DivergenceError, PackageError

USAGE = __doc__.strip().splitlines()[0]

def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def _main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nEvery key is documented in configs/base.yaml. {DEBUG_HELP}")
        return
    path = args[0] if args and "=" not in args[0] else None
    cfg = load_config(path, args[1:] if path else args)
    from boost_jax.parallel import init_distributed, simulate_cpu_devices

    simulate_cpu_devices(cfg.parallel.cpu_devices)
    init_distributed(cfg.parallel)
    train(cfg)


def check_resume_compatible(cfg: Config, run_dir: Path) -> dict | None:
    """The saved config of an existing run, after checking the frozen keys did not change. (Each
    checkpoint checks them again on restore, so this only fails earlier, before any work.)"""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return None
    aside = "move it aside to resume (each checkpoint carries the frozen keys, so the resume stays checked)"
    try:
        saved = load_yaml(saved_path)
    except ConfigError as e:
        raise ConfigError(f"{e}; {aside}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{saved_path} is damaged (not a mapping of config keys); {aside}")
    changed = changed_keys(identity(saved), identity(cfg.to_dict()))
    if changed:
        raise ConfigError(
            f"run_dir {run_dir} holds a run with a different {', '.join(changed)}; "
            "use a new run_dir (the existing run was left untouched)"
        )
    return saved


def check_writable_dir(path: Path, key: str) -> None:
    """`path` is a folder we can write in, or can be created as one: checked before any slow work."""
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {path} cannot be a folder: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write in {existing} (read-only file system or no permission)")


def check_packages(cfg: Config) -> None:
    """Name, before any work, the optional packages this run needs and lacks (importing the
    package does not need them: a GPU machine's own Python stack may have neither)."""
    need = {"grain": "the data loader (boost_jax/data/loader.py)"}
    if cfg.log.tensorboard:
        need["tensorboardX"] = "log.tensorboard=true (or set log.tensorboard=false)"
    missing = []
    for package, why in need.items():
        try:
            importlib.import_module(package)
        except ImportError:
            missing.append(f"{package}, for {why}")
    if missing:
        raise PackageError("not installed: " + "; ".join(missing) + ". pip install what is missing")


def train(cfg: Config, devices: list[jax.Device] | None = None) -> dict:
    """Train per `cfg` on `devices` (default: all); returns a summary of the run (losses, throughput)."""
    check_packages(cfg)
    from boost_jax.checkpoint import CheckpointError, Checkpointer
    from boost_jax.data.build import build_data, check_run_tokenizer
    from boost_jax.data.cache import cache_root
    from boost_jax.flops import count, device_peak_flops
    from boost_jax.log import RunLog
    from boost_jax.parallel import make_plan
    from boost_jax.step import device_batch, setup

    t, run_dir = cfg.train, Path(cfg.run_dir)
    saved = check_resume_compatible(cfg, run_dir)
    check_writable_dir(run_dir, "run_dir")
    if cfg.checkpoint.every:
        check_writable_dir(run_dir / "checkpoints", "run_dir")
    check_writable_dir(cache_root(cfg.data), "data.cache_dir")
    plan = make_plan(cfg, devices)
    mesh = plan.mesh
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed)
    run, state = setup(cfg, plan)

    run_dir.mkdir(parents=True, exist_ok=True)
    run_identity = identity(cfg.to_dict())
    with contextlib.ExitStack() as closing:  # on any exit: close the log, wait for saves in flight
        ckpt = None
        if cfg.checkpoint.every:
            ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep)
            closing.callback(ckpt.close)
        start = (ckpt.latest_step() or 0) if ckpt else 0
        if start:
            state, meta = ckpt.restore(start, state, run_identity)
            state = run.adopt(state, meta)
            if meta.get("data_position") != start * t.batch_size:
                raise CheckpointError(f"checkpoint step {start} in {ckpt.directory} records data position "
                                      f"{meta.get('data_position')}, expected {start * t.batch_size}")
        check_run_tokenizer(data.tokenizer, run_dir / "tokenizer.json")

        counts = count(cfg.model, t.seq_len)
        peak, peak_source = device_peak_flops(cfg.model.dtype, cache_root(cfg.data))
        n_dev = mesh.size
        # Simulated CPU devices share the host's cores: the measured peak is per host, not per device.
        on_cpu = jax.devices()[0].platform == "cpu"
        peak_devices = jax.process_count() if on_cpu else n_dev
        pi, pc = jax.process_index(), jax.process_count()
        batches = data.train.batches(start, t.batch_size, pi, pc)  # read ahead while the device computes

        log = RunLog(run_dir, cfg.log, total_steps=t.steps, start_step=start, primary=pi == 0)
        closing.callback(log.close)
        m = cfg.model
        log.line(
            f"model {m.preset} arch={m.arch} d={m.d_model} layers={m.n_layers} heads={m.n_heads}/{m.n_kv_heads} "
            f"ranks={m.attn_rank}/{m.mlp_rank} params={counts.params / 1e6:.2f}M "
            f"| {cfg.parallel.scheme} on mesh {dict(mesh.shape)} of {n_dev} x {jax.devices()[0].device_kind} "
            f"| data {data.stats.get('train_tokens', 0):,} train tokens "
            f"| peak {peak / 1e12:.2f} TFLOP/s per {'host' if on_cpu else 'device'} ({peak_source})"
        )
        saved_steps = saved and _get(saved, ["train", "steps"])
        if saved_steps and saved_steps != t.steps and not t.schedule_steps:
            log.line(f"note: train.steps changed {saved_steps} -> {t.steps}: the LR schedule "
                     "horizon changed with it (fix train.schedule_steps to keep one schedule across extensions)")
        if start >= t.steps:
            log.line(f"run_dir already holds step {start} >= train.steps={t.steps}; nothing to do")
            return {"start_step": start, "losses": []}
        if start:
            loss = meta.get("loss")
            log.line(f"resumed from step {start} ({ckpt.directory}"
                     + (f", loss {loss:.4f})" if loss is not None else ")"))

        t0 = time.perf_counter()
        step_fn = run.train_step.lower(state, device_batch(data.train.batch(start, t.batch_size, pi, pc),
                                                          run.batch_sharding)).compile()
        log.line(f"compiled train step in {time.perf_counter() - t0:.1f}s")

        losses, pending, evals, summary = [], [], {}, {}
        tick, tick_step, paused = time.perf_counter(), start, 0.0  # paused: eval + checkpoint time
        saved_step, n_skipped = start, 0
        for step in range(start, t.steps):
            state, metrics = step_fn(state, device_batch(next(batches), run.batch_sharding))
            if step == start and pi == 0:
                # Only a run that got through one step claims the run dir: a failed start leaves
                # no config.yaml to refuse the corrected command.
                jax.block_until_ready(metrics)
                cfg.dump(run_dir / "config.yaml")
                data.tokenizer.save(str(run_dir / "tokenizer.json"))  # travels with the run (and its export)
            pending.append(metrics)
            done = step + 1
            last = done == t.steps
            if data.val is not None and t.eval_every and (done % t.eval_every == 0 or last):
                p0 = pause(state)
                evals[done] = evaluate(run, state, data, cfg, pi, pc)
                paused += time.perf_counter() - p0
                log.line(f"eval step {done} | loss {evals[done]['eval_loss']:.4f} | ppl {evals[done]['eval_ppl']:.2f}")
            save = ckpt is not None and (done % cfg.checkpoint.every == 0 or last)
            log_due = done % cfg.log.every == 0 or last
            # One host sync per log interval and before every checkpoint, never per step.
            if not (save or log_due):
                continue
            rows = jax.device_get(pending)
            now = time.perf_counter()
            step_time = (now - tick - paused) / (done - tick_step)
            tok_s = t.batch_size * t.seq_len / step_time
            flops_s = tok_s * counts.train_flops_per_token
            bad = None
            for i, r in enumerate(rows):
                at = done - len(rows) + i + 1
                row = {"step": at, **{k: float(v) for k, v in r.items()},
                       "tokens_per_s": tok_s, "step_time_s": step_time,
                       "tflops_per_s": flops_s / 1e12, "mfu": flops_s / (peak_devices * peak), **evals.pop(at, {})}
                log.record(row)
                losses.append(row["loss"])
                n_skipped += int(row.get("skipped", 0))
                if t.on_nonfinite == "stop" and not _finite(row):
                    bad = row
                    break
            summary = row
            pending, tick, tick_step, paused = [], now, done, 0.0
            if log_due or bad:
                log.line(
                    f"step {row['step']}/{t.steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} "
                    f"| gnorm {row['grad_norm']:.3f} | {tok_s:,.0f} tok/s | {step_time * 1e3:.0f} ms/step "
                    f"| {flops_s / 1e12:.3f} TFLOP/s | MFU {100 * row['mfu']:.1f}%"
                    + (f" | {n_skipped} updates skipped" if n_skipped else "")
                )
            log.flush()  # rows up to `done` are on disk before its checkpoint can commit
            if bad:
                kept = f"; checkpoints up to step {saved_step} are kept" if ckpt and saved_step else ""
                raise DivergenceError(
                    f"non-finite loss ({bad['loss']}) or gradient norm ({bad['grad_norm']}) at step {bad['step']}"
                    f": the run stopped there and wrote no checkpoint after it{kept}. Lower train.lr (now "
                    f"{t.lr:g}) or model.init_std, or set train.on_nonfinite=skip to drop such updates")
            log.advance(len(rows), loss=f"{row['loss']:.3f}")
            if save:
                p0 = pause(state)
                loss = row["loss"] if _finite(row) else None
                ckpt.save(done, state, {"step": done, "data_position": done * t.batch_size, **run.checkpoint_meta(),
                                        "loss": loss, "identity": run_identity})
                saved_step = done
                paused += time.perf_counter() - p0
        return {"start_step": start, "losses": losses, **summary}


def _finite(row: dict) -> bool:
    return math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def _get(d, keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def pause(state) -> float:
    """Wait for the steps in flight, so time spent next is not charged to training."""
    jax.block_until_ready(state)
    return time.perf_counter()


def evaluate(run, state, data, cfg: Config, pi: int, pc: int) -> dict:
    """Mean loss over the first `train.eval_batches` validation batches (always the same ones)."""
    from boost_jax.step import device_batch

    t = cfg.train
    losses = [
        run.eval_step(state["params"], device_batch(b, run.batch_sharding))
        for b in data.val.eval_batches(t.eval_batches, t.batch_size, pi, pc)
    ]
    loss = float(np.mean(jax.device_get(losses)))
    return {"eval_loss": loss, "eval_ppl": perplexity(loss)}


def perplexity(loss: float) -> float:
    """exp(loss); a diverged model's loss beyond ~709 overflows a float: its perplexity is inf."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


if __name__ == "__main__":
    main()
