"""`python -m boost_jax.train [CONFIG.yaml] [section.key=value ...] [--timings]`: parse, build, loop.

With no arguments it trains the default small CoLA model on the Python standard library's source
(offline) on whatever devices exist. Re-running with the same `run_dir` resumes from the newest
checkpoint; the loss trajectory is bitwise identical to an uninterrupted run on CPU. --timings logs
the seconds to the first step, by phase: import, data, restore, compile, run (boost_jax/launch/startup.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time

import jax

from boost_jax.config import Config, from_args
from boost_jax.configs import BASE
from boost_jax.launch.startup import Startup, line as startup_line
from boost_jax.runtime.cli import DEBUG_HELP, run_main
from boost_jax.runtime.errors import ConfigError, DiskFullError, PackageError
from boost_jax.runtime.paths import check_writable_dir, disk_full, is_disk_full

USAGE = __doc__.strip().splitlines()[0]
TIMINGS = "--timings"

def main(argv: list[str] | None = None) -> None:
    """The command line: a config, then the run (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def _main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nEvery key is documented in {BASE}. {DEBUG_HELP}")
        return
    startup = Startup() if TIMINGS in args else None
    cfg = from_args([a for a in args if a != TIMINGS])
    from boost_jax.launch.prepare import prepare_jax
    from boost_jax.parallel import init_distributed
    from boost_jax.parallel.peers import watch

    prepare_jax(cfg)
    init_distributed(cfg.parallel)
    try:
        with watch(cfg.parallel.heartbeat_timeout_s):  # a lost peer ends this process with one message
            train(cfg, startup=startup)
    except DiskFullError:
        raise
    except OSError as e:  # a full disk under a write without its own message (config.yaml, tokenizer.json)
        if not is_disk_full(e):
            raise
        raise disk_full(e.filename or cfg.run_dir, "the run's files", 1 << 20,
                        "the checkpoints committed before are untouched") from None


def check_packages(cfg: Config) -> None:
    """Name, before any work, the optional packages this run needs and lacks (importing the
    package does not need them: a GPU machine's own Python stack may have neither)."""
    need = {"grain": "the data loader (boost_jax/data/loader.py)"}
    if cfg.log.tensorboard:
        need["tensorboardX"] = "log.tensorboard=true (or set log.tensorboard=false)"
    if cfg.data.tokenizer == "sentencepiece" and cfg.data.source in ("stdlib", "files") and not cfg.data.tokenizer_path:
        need["sentencepiece"] = "data.tokenizer=sentencepiece (pip install 'boost_jax[sentencepiece]')"
    if cfg.log.wandb:
        need["wandb"] = "log.wandb=true (pip install 'boost_jax[wandb]', or set log.wandb=false)"
    # Found, not imported: tensorboardX would import torch where it is installed (training/log.py).
    missing = [f"{package}, for {why}" for package, why in need.items() if importlib.util.find_spec(package) is None]
    if missing:
        raise PackageError("not installed: " + "; ".join(missing) + ". pip install what is missing")


def train(cfg: Config, devices: list[jax.Device] | None = None, startup: Startup | None = None) -> dict:
    """Train per `cfg` on `devices` (default: all); returns a summary of the run (losses, throughput).
    `startup`: time the start to the first step by phase, logged after it."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"train.train takes a Config (api.config(...) or config.load_config(...)), got "
                          f"{type(cfg).__name__}")
    lap = startup.lap if startup is not None else lambda phase: None
    check_packages(cfg)
    from boost_jax.analysis.flops import count, device_peak_flops
    from boost_jax.data.build import build_data, check_run_tokenizer
    from boost_jax.parallel import make_plan
    from boost_jax.runtime.cache import cache_root
    from boost_jax.training.log import RunLog
    from boost_jax.training.microbatch_fit import fit_resume
    from boost_jax.training.muon_layout import placements
    from boost_jax.training.parts import (
        Checkpoints,
        Evaluator,
        Meter,
        NonFiniteGuard,
        Preemption,
        Profiler,
        RunDir,
        any_process,
        finite,
    )
    from boost_jax.training.recovery import Recovery
    from boost_jax.training.step import device_batch, setup

    lap("import")
    t, m = cfg.train, cfg.model
    # A mesh the devices cannot hold, or a train.muon.comm its split refuses, is refused before the
    # run dir is made or locked.
    plan = make_plan(cfg, devices)
    placements(cfg, plan)
    with contextlib.ExitStack() as closing:  # on any exit: release the run dir, close the log, wait for saves
        run_dir = RunDir(cfg, primary=jax.process_index() == 0)
        closing.callback(run_dir.release)
        fit_note = None
        if run_dir.saved is not None:  # a resume, maybe on fewer devices, each holding more of the batch
            cfg, fit_note = fit_resume(cfg, plan)
            if fit_note:
                t, plan = cfg.train, make_plan(cfg, devices)
        check_writable_dir(cache_root(cfg.data.cache_dir), "data.cache_dir")
        data = build_data(cfg.data, vocab_size=m.vocab_size, seq_len=t.seq_len, seed=t.seed, batch_size=t.batch_size)
        lap("data")
        run, state = setup(cfg, plan)
        ckpt = Checkpoints(cfg, run, run_dir.path)
        closing.callback(ckpt.close)
        state, start, resumed_loss = ckpt.resume(state)
        check_run_tokenizer(data.tokenizer, run_dir.path / "tokenizer.json")
        mixture_note = data.train.resume(ckpt.meta.get("mixture"), start) if data.parts else None
        record = lambda: {"mixture": data.train.record()} if data.parts else {}  # what a checkpoint adds
        process = (jax.process_index(), jax.process_count())
        recovery = Recovery(run_dir.path / "metrics.jsonl", start, primary=process[0] == 0)  # read before RunLog rewrites it
        log = RunLog(run_dir.path, cfg.log, total_steps=t.steps, start_step=start, primary=process[0] == 0,
                     run_config=cfg.to_dict())
        closing.callback(log.close)
        counts = count(m, t.seq_len)
        peak, peak_source = device_peak_flops(m.dtype, cache_root(cfg.data.cache_dir))
        meter = Meter(cfg, plan.mesh.size, start, counts.train_flops_per_token, peak)
        on_cpu = jax.devices()[0].platform == "cpu"
        log.line(f"model {m.preset} arch={m.arch} d={m.d_model} layers={m.n_layers} heads={m.n_heads}/{m.n_kv_heads} "
                 f"ranks={m.attn_rank}/{m.mlp_rank} params={counts.params / 1e6:.2f}M "
                 f"| {cfg.parallel.scheme} on mesh {dict(plan.mesh.shape)} of {plan.mesh.size} x "
                 f"{jax.devices()[0].device_kind} | data {data.stats.get('train_tokens', 0):,} train tokens "
                 f"| peak {peak / 1e12:.2f} TFLOP/s per {'host' if on_cpu else 'device'} ({peak_source})")
        if note := run_dir.schedule_note():
            log.line(note)
        if start >= t.steps:
            log.line(f"run_dir already holds step {start} >= train.steps={t.steps}; nothing to do")
            return {"start_step": start, "losses": []}
        if ckpt.restored:
            log.line(f"resumed from step {start} ({ckpt.source}"
                     + (f", loss {resumed_loss:.4f})" if resumed_loss is not None else ")")
                     + (f"; {fit_note}" if fit_note else ""))
            if fresh := ckpt.meta.get("fresh_state"):
                log.line(f"the checkpoint holds no {', '.join(fresh)} state: it starts fresh")
            if before := ckpt.meta.get("optimizer_reset"):
                log.line(f"train.optimizer {before} -> {t.optimizer} (train.reset_optimizer=true): the parameters "
                         f"resume, the {t.optimizer} state starts fresh")
        elif fit_note:  # a run dir with a config but no checkpoint starts at step 0
            log.line(fit_note)
        if mixture_note:
            log.line(mixture_note)

        lap("restore")  # the state (restored or initialised) and the run's log and meter
        batches = data.train.batches(start, t.batch_size, *process)  # read ahead while the device computes
        t0 = time.perf_counter()
        step_fn = run.train_step.lower(state, device_batch(data.train.batch(start, t.batch_size, *process),
                                                          run.batch_sharding)).compile()
        log.line(f"compiled train step in {time.perf_counter() - t0:.1f}s")
        lap("compile")
        evaluate, guard, profiler = Evaluator(cfg, run, data, process), NonFiniteGuard(cfg), Profiler(cfg, run_dir.path)
        closing.callback(profiler.close)
        preempt = Preemption()
        closing.callback(preempt.close)
        losses, pending, evals, summary, stopped = [], [], {}, {}, None
        loop_start = time.perf_counter()
        for step in range(start, t.steps):
            profiler.before(step + 1)
            state, metrics = step_fn(state, device_batch(next(batches), run.batch_sharding))
            profiler.after(step + 1, metrics)
            if step == start and process[0] == 0:
                jax.block_until_ready(metrics)
                run_dir.claim(data.tokenizer)
            if step == start and startup is not None:
                jax.block_until_ready(metrics)
                lap("run")
                log.line(startup_line(startup.seconds(), "first step"))
            pending.append(metrics)
            done = step + 1
            if evaluate.due(done):
                paused = meter.pause(state)
                evals[done] = evaluate(state)
                meter.resume(paused)
                e = evals[done]
                log.line(f"eval step {done} | loss {e['eval_loss']:.4f} | ppl {e['eval_ppl']:.2f} | bpb {e['eval_bpb']:.4f}")
            save, log_due = ckpt.due(done), done % cfg.log.every == 0 or done == t.steps
            local = ckpt.local_due(done)
            # A signal or the clock asks for a save: decided by all processes alike, at a log line
            # (every step with one process).
            if process[1] == 1 or save or log_due:
                signalled = any_process(preempt.received is not None)
                stopped = (preempt.received or "a signal to another process") if signalled else None
                save = save or any_process(ckpt.overdue()) or (stopped is not None and ckpt.enabled)
            if not (save or local or log_due or stopped):  # one host sync per log interval and before every checkpoint
                continue
            fetched = jax.device_get(pending)  # waits for the steps in flight: the meter reads after it
            speed = meter.read(done)
            rows, bad = [], None
            for at, r in enumerate(fetched, start=done - len(pending) + 1):
                health = r.pop("health", {})
                logs = at % cfg.log.every == 0 or at == t.steps
                rows.append({"step": at, **{k: float(v) for k, v in r.items()}, **speed, **evals.pop(at, {}),
                             **({k: float(v) for k, v in health.items()} if logs else {}), "time": time.time()})
                if at == start + 1 and (lost := recovery.fields(rows[-1])):
                    rows[-1].update(lost)
                    log.line(recovery.line(lost))
                log.record(rows[-1])
                if guard.first_bad(rows[-1]):
                    bad = rows[-1]
                    break
            losses += [r["loss"] for r in rows]
            summary, pending = rows[-1], []
            if log_due or bad or stopped:
                log.line(step_line(summary, t.steps, guard))
            log.flush()  # rows up to `done` are on disk before its checkpoint can commit
            if bad:
                raise guard.stop(bad, ckpt.saved_step)
            log.advance(len(rows), loss=f"{summary['loss']:.3f}")
            if save or local:
                paused = meter.pause(state)
                (ckpt.save if save else ckpt.save_local)(done, state, summary["loss"] if finite(summary) else None,
                                                         record())
                meter.resume(paused)
            if stopped:
                saved = f"saved step {done} in {ckpt.directory}" if ckpt.enabled else "checkpointing is off: not saved"
                log.line(f"stopped by {stopped} after step {done}: {saved}; rerun the same command to resume")
                break
        return {"start_step": start, "losses": losses, "loop_s": time.perf_counter() - loop_start,
                **({"stopped_by": stopped} if stopped else {}), **summary}


def step_line(row: dict, steps: int, guard) -> str:
    """The log line of a step's metrics row, with the updates dropped so far (`NonFiniteGuard`)."""
    dropped = [f"{n} {what}" for n, what in ((guard.skipped, "non-finite updates skipped"),
                                            (guard.spikes, "loss spikes skipped")) if n]
    # No MFU over 100%: the peak it divides by came out low (training.parts.Meter).
    mfu = f"MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "MFU n/a (over 100%: the peak is too low)"
    return (f"step {row['step']}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | gnorm {row['grad_norm']:.3f} "
            f"| {row['tokens_per_s']:,.0f} tok/s | {row['step_time_s'] * 1e3:.0f} ms/step "
            f"| {row['tflops_per_s']:.3f} TFLOP/s | {mfu}" + "".join(f" | {d}" for d in dropped))


if __name__ == "__main__":
    main()
