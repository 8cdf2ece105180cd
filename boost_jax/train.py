"""`python -m boost_jax.train [CONFIG.yaml] [section.key=value ...]`: parse, build, loop.

With no arguments it trains the default small CoLA model on the Python standard library's source
(offline) on whatever devices exist. Re-running with the same `run_dir` resumes from the newest
checkpoint; the loss trajectory is bitwise identical to an uninterrupted run on CPU.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from boost_jax.config import Config, ConfigError, load_config

USAGE = __doc__.strip().splitlines()[0]

# Keys that must not change when a run dir is resumed: they change what the checkpoint means.
FROZEN_ON_RESUME = ("model", "data", "train.batch_size", "train.seq_len", "train.seed")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(USAGE + "\n\nEvery key is documented in configs/base.yaml.")
        return
    path = args[0] if args and "=" not in args[0] else None
    try:
        cfg = load_config(path, args[1:] if path else args)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    from boost_jax.mesh import init_distributed, simulate_cpu_devices

    try:
        simulate_cpu_devices(cfg.parallel.cpu_devices)
        init_distributed(cfg.parallel)
        train(cfg)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def check_resume_compatible(cfg: Config, run_dir: Path) -> dict | None:
    """The saved config of an existing run, after checking the frozen keys did not change."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        return None
    saved, new = yaml.safe_load(saved_path.read_text()), cfg.to_dict()
    pick = lambda d, key: _get(d, key.split("."))
    changed = [k for k in FROZEN_ON_RESUME if pick(saved, k) != pick(new, k)]
    if changed:
        raise ConfigError(
            f"run_dir {run_dir} holds a run with a different {', '.join(changed)}; "
            "use a new run_dir (the existing run was left untouched)"
        )
    return saved


def _get(d, keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def train(cfg: Config, devices: list[jax.Device] | None = None) -> dict:
    """Train per `cfg` on `devices` (default: all); returns a summary of the run (losses, throughput)."""
    from boost_jax.checkpoint import CheckpointError, Checkpointer
    from boost_jax.data.build import build_data, check_run_tokenizer
    from boost_jax.data.cache import cache_root
    from boost_jax.flops import count, device_peak_flops
    from boost_jax.log import RunLog
    from boost_jax.mesh import make_mesh, sharding_rules
    from boost_jax.step import device_batch, setup

    t, run_dir = cfg.train, Path(cfg.run_dir)
    saved = check_resume_compatible(cfg, run_dir)
    mesh = make_mesh(cfg.parallel, devices)
    rules = sharding_rules(cfg, mesh)
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed)
    run, state = setup(cfg, mesh, rules)

    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep) if cfg.checkpoint.every else None
    start = (ckpt.latest_step() or 0) if ckpt else 0
    if start:
        state, meta = ckpt.restore(start, state)
        if meta.get("data_position") != start * t.batch_size:
            raise CheckpointError(f"checkpoint step {start} in {ckpt.directory} records data position "
                                  f"{meta.get('data_position')}, expected {start * t.batch_size}")
    check_run_tokenizer(data.tokenizer, run_dir / "tokenizer.json")
    if jax.process_index() == 0:
        cfg.dump(run_dir / "config.yaml")
        data.tokenizer.save(str(run_dir / "tokenizer.json"))  # travels with the run (and its export)

    counts = count(cfg.model, t.seq_len)
    peak, peak_source = device_peak_flops(cfg.model.dtype, cache_root(cfg.data))
    n_dev = mesh.size
    # Simulated CPU devices share the host's cores: the measured peak is per host, not per device.
    on_cpu = jax.devices()[0].platform == "cpu"
    peak_devices = jax.process_count() if on_cpu else n_dev
    pi, pc = jax.process_index(), jax.process_count()
    batches = data.train.batches(start, t.batch_size, pi, pc)  # read ahead while the device computes

    log = RunLog(run_dir, cfg.log, total_steps=t.steps, start_step=start, primary=pi == 0)
    m = cfg.model
    log.line(
        f"model {m.preset} arch={m.arch} d={m.d_model} layers={m.n_layers} heads={m.n_heads}/{m.n_kv_heads} "
        f"ranks={m.attn_rank}/{m.mlp_rank} params={counts.params / 1e6:.2f}M "
        f"| {cfg.parallel.scheme} on mesh {dict(mesh.shape)} of {n_dev} x {jax.devices()[0].device_kind} "
        f"| data {data.stats.get('train_tokens', 0):,} train tokens "
        f"| peak {peak / 1e12:.2f} TFLOP/s per {'host' if on_cpu else 'device'} ({peak_source})"
    )
    if saved and saved["train"]["steps"] != t.steps and not t.schedule_steps:
        log.line(f"note: train.steps changed {saved['train']['steps']} -> {t.steps}: the LR schedule "
                 "horizon changed with it (fix train.schedule_steps to keep one schedule across extensions)")
    if start >= t.steps:
        log.line(f"run_dir already holds step {start} >= train.steps={t.steps}; nothing to do")
        log.close()
        return {"start_step": start, "losses": []}
    if start:
        log.line(f"resumed from step {start} ({ckpt.directory})")

    t0 = time.perf_counter()
    step_fn = run.train_step.lower(state, device_batch(data.train.batch(start, t.batch_size, pi, pc),
                                                      run.batch_sharding)).compile()
    log.line(f"compiled train step in {time.perf_counter() - t0:.1f}s")

    losses, pending, evals, summary = [], [], {}, {}
    tick, tick_step, paused = time.perf_counter(), start, 0.0  # paused: eval + checkpoint time
    for step in range(start, t.steps):
        state, metrics = step_fn(state, device_batch(next(batches), run.batch_sharding))
        pending.append(metrics)
        done = step + 1
        last = done == t.steps
        if data.val is not None and t.eval_every and (done % t.eval_every == 0 or last):
            p0 = pause(state)
            evals[done] = evaluate(run, state, data, cfg, pi, pc)
            paused += time.perf_counter() - p0
            log.line(f"eval step {done} | loss {evals[done]['eval_loss']:.4f} | ppl {evals[done]['eval_ppl']:.2f}")
        if done % cfg.log.every == 0 or last:
            rows = jax.device_get(pending)  # one host sync per log interval, not per step
            now = time.perf_counter()
            step_time = (now - tick - paused) / (done - tick_step)
            tok_s = t.batch_size * t.seq_len / step_time
            flops_s = tok_s * counts.train_flops_per_token
            for i, r in enumerate(rows):
                at = done - len(rows) + i + 1
                row = {"step": at, **{k: float(v) for k, v in r.items()},
                       "tokens_per_s": tok_s, "step_time_s": step_time,
                       "tflops_per_s": flops_s / 1e12, "mfu": flops_s / (peak_devices * peak), **evals.pop(at, {})}
                log.record(row)
                losses.append(row["loss"])
            summary = row
            log.line(
                f"step {done}/{t.steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} "
                f"| {tok_s:,.0f} tok/s | {step_time * 1e3:.0f} ms/step | {flops_s / 1e12:.3f} TFLOP/s "
                f"| MFU {100 * row['mfu']:.1f}%"
            )
            log.advance(len(rows), loss=f"{row['loss']:.3f}")
            pending, tick, tick_step, paused = [], now, done, 0.0
        if ckpt and (done % cfg.checkpoint.every == 0 or last):
            p0 = pause(state)
            ckpt.save(done, state, {"step": done, "data_position": done * t.batch_size})
            paused += time.perf_counter() - p0
        log.flush()
    if ckpt:
        ckpt.wait()
        ckpt.close()
    log.close()
    return {"start_step": start, "losses": losses, **summary}


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
    return {"eval_loss": loss, "eval_ppl": math.exp(loss)}


if __name__ == "__main__":
    main()
