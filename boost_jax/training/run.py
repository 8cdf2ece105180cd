"""`train(cfg)`: a run's parts (run_dir.py, checkpointing.py, preemption.py, meter.py, evaluate.py,
guard.py, profiler.py, metrics.py, log.py) made by `start`, then the loop
over them, each part deciding for itself when it acts (evaluate, log, save, stop) and saying what it
did. `python -m boost_jax.train` is its command line; `bench` and `comparison` call it too.

Re-running with the same `run_dir` resumes from the newest checkpoint; the loss trajectory is bitwise
identical to an uninterrupted run on CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax

from boost_jax.config import Config
from boost_jax.config.packages import check_packages
from boost_jax.config.presets import shape_name
from boost_jax.data.build import Data, build_data, check_run_tokenizer
from boost_jax.data.instruct import summary
from boost_jax.launch.peaks import device_peak_flops
from boost_jax.launch.startup import Startup, line as startup_line
from boost_jax.model.counts import Counts, count
from boost_jax.model.train_state import TrainState
from boost_jax.parallel import Plan, make_plan
from boost_jax.runtime.cache import cache_root
from boost_jax.runtime.errors import ConfigError
from boost_jax.runtime.paths import check_writable_dir
from boost_jax.training.checkpointing import Checkpointing
from boost_jax.training.evaluate import Evaluator
from boost_jax.training.guard import NonFiniteGuard
from boost_jax.training.importer import init_from_params
from boost_jax.training.log import RunLog
from boost_jax.training.loss import device_batch
from boost_jax.training.meeting import Meeting
from boost_jax.training.meter import Meter
from boost_jax.training.metrics import Metrics
from boost_jax.training.muon_layout import placements
from boost_jax.training.preemption import Preemption
from boost_jax.training.profiler import Profiler
from boost_jax.training.recovery import Recovery
from boost_jax.training.run_dir import RunDir
from boost_jax.training.step import Setup, init_state, setup

# How a resume on fewer devices sizes its micro-batches: (cfg, plan) -> (cfg, the note of what it added).
# The memory model answers (analysis/microbatch_fit.py's `fit_resume`, which sits above training/ and
# which the train command hands in); without one a resume keeps cfg's micro-batches.
ResumeFit = Callable[[Config, Plan], tuple[Config, str | None]]


def train(cfg: Config, devices: list[jax.Device] | None = None, startup: Startup | None = None,
          resume_fit: ResumeFit | None = None) -> dict:
    """Train per `cfg` on `devices` (default: all); returns a summary of the run (losses, throughput).
    `startup`: time the start to the first step by phase, logged after it. `resume_fit`: see ResumeFit."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"training.run.train takes a Config (api.config(...) or config.load_config(...)), got "
                          f"{type(cfg).__name__}")
    with contextlib.ExitStack() as closing:  # on any exit: release the run dir, close the log, wait for saves
        p, state = start(cfg, devices, startup, resume_fit, closing)
        cfg, first, log, ckpt = p.cfg, p.start, p.log, p.ckpt
        if first >= cfg.train.steps:  # said by `start`
            return {"start_step": first, "losses": []}
        batches = p.data.train.batches(first, cfg.train.batch_size, *p.process)  # read ahead while the device computes
        step_fn = p.compile(state)
        evaluate, profiler = Evaluator(cfg, p.run, p.data, p.process), Profiler(cfg, p.run_dir.path)
        closing.callback(profiler.close)
        preempt = Preemption()  # from here a signal saves the step the run is at, and stops it
        closing.callback(preempt.close)
        meeting = Meeting(preempt, ckpt)
        stopped, loop_start = None, time.perf_counter()
        for step in range(first, cfg.train.steps):
            done = step + 1
            profiler.before(done)
            state, metrics = step_fn(state, device_batch(next(batches), p.run.batch_sharding))
            profiler.after(done, metrics)
            if step == first:
                p.first_step(metrics)
            p.metrics.add(metrics)
            if evaluate.due(done):
                with p.meter.paused(state):
                    p.metrics.evaluated(done, evaluate(state.params))
            save, local, log_due = ckpt.due(done), ckpt.local_due(done), log.due(done)  # by the step count
            synced = save or local or log_due  # one host sync per log interval and before every checkpoint
            if not meeting.meets(synced):
                continue
            asks = meeting.asks()
            bad = p.metrics.fetch(done, line=log_due) if synced or asks.any else None
            agreed = meeting.decide(asks, save, diverged=bad is not None)  # the same on every process
            if agreed.diverged:  # every process read the same replicated row
                raise p.guard.stop(bad or p.metrics.summary, ckpt.saved_step)
            stopped = agreed.stop
            if stopped and not log_due:
                p.metrics.log_line()
            if agreed.save or local:
                with p.meter.paused(state):
                    (ckpt.save if agreed.save else ckpt.save_local)(done, state, p.metrics.loss(), p.record())
            if stopped:
                log.line(preempt.line(stopped, done, ckpt.directory))
                break
        return {"start_step": first, "losses": p.metrics.losses, "loop_s": time.perf_counter() - loop_start,
                **({"stopped_by": stopped} if stopped else {}), **p.metrics.summary}


@dataclass
class Parts:
    """What `start` made for the loop: the run's parts, its config (a resume on fewer devices may add
    micro-batches) and the step it starts after."""

    cfg: Config
    run: Setup
    data: Data
    run_dir: RunDir
    ckpt: Checkpointing
    log: RunLog
    meter: Meter
    guard: NonFiniteGuard
    metrics: Metrics
    start: int
    process: tuple[int, int]
    startup: Startup | None

    def lap(self, phase: str) -> None:
        if self.startup is not None:
            self.startup.lap(phase)

    def compile(self, state: TrainState):
        """The train step compiled for `state` and a batch of this run's (logged with its seconds)."""
        t, t0 = self.cfg.train, time.perf_counter()
        batch = device_batch(self.data.train.batch(self.start, t.batch_size, *self.process), self.run.batch_sharding)
        step_fn = self.run.train_step.lower(state, batch).compile()
        self.log.line(f"compiled train step in {time.perf_counter() - t0:.1f}s")
        self.lap("compile")
        return step_fn

    def first_step(self, metrics) -> None:
        """After the first step: the run dir is claimed, and the start's phases logged (`--timings`)."""
        self.run_dir.claim(self.data.tokenizer, metrics)
        if self.startup is not None:
            jax.block_until_ready(metrics)
            self.lap("run")
            self.log.line(startup_line(self.startup.seconds(), "first step"))

    def record(self) -> dict:
        """What a checkpoint records of the data beside the step: a mixture's weights history."""
        return {"mixture": self.data.train.record()} if self.data.parts else {}


def start(cfg: Config, devices: list[jax.Device] | None, startup: Startup | None, resume_fit: ResumeFit | None,
          closing: contextlib.ExitStack) -> tuple[Parts, TrainState]:
    """The run's parts and its train state (restored or initialised), each closed by `closing`; the
    banner and the resume's notes logged (or that there is nothing left to do)."""
    check_packages(cfg)
    lap = startup.lap if startup is not None else lambda phase: None
    lap("import")
    # A mesh the devices cannot hold, or a train.muon.comm its split refuses, is refused before the
    # run dir is made or locked.
    plan = make_plan(cfg, devices)
    moved = placements(cfg, plan)  # the Muon placements: they hold on a resume's plan, whose mesh is the same
    # train.init_from's parameters, read before the run dir is touched (one that holds a run resumes it)
    claimed = (Path(cfg.run_dir) / "config.yaml").is_file()
    params, init_note = init_from_params(cfg, plan) if cfg.train.init_from and not claimed else (None, None)
    run_dir = RunDir(cfg, primary=jax.process_index() == 0)
    closing.callback(run_dir.release)
    fit_note = None
    if run_dir.saved is not None and resume_fit is not None:  # maybe on fewer devices, each holding more
        cfg, fit_note = resume_fit(cfg, plan)
        if fit_note:
            plan = make_plan(cfg, devices)
    t, cache = cfg.train, cache_root(cfg.data.cache_dir)
    check_writable_dir(cache, "data.cache_dir")
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed,
                      batch_size=t.batch_size, completion_only=t.loss_on_completion(cfg.data.format))
    lap("data")
    run, state = setup(cfg, plan, params, moved=moved)
    ckpt = Checkpointing(cfg, run, run_dir.path)
    closing.callback(ckpt.close)
    state, first = ckpt.resume(state)
    if cfg.train.init_from and claimed:  # the run's own checkpoint, or (claimed, never saved) the source again
        if ckpt.restored:
            init_note = f"train.init_from ignored: the run resumes its own checkpoint step {first}"
        else:
            params, init_note = init_from_params(cfg, plan)
            state = init_state(cfg, plan, run, params)
    check_run_tokenizer(data.tokenizer, run_dir.path / "tokenizer.json")
    mixture_note = data.train.resume(ckpt.meta.get("mixture"), first) if data.parts else None
    process = (jax.process_index(), jax.process_count())
    # What a restart cost: read before RunLog rewrites the rows past the resumed step.
    recovery = Recovery(run_dir.path / "metrics.jsonl", first, primary=process[0] == 0)
    log = RunLog(run_dir.path, cfg.log, total_steps=t.steps, start_step=first, primary=process[0] == 0,
                 run_config=cfg.to_dict())
    closing.callback(log.close)
    counts = count(cfg.model, t.seq_len)
    peak, peak_source = device_peak_flops(cfg.model.dtype, cache)
    meter = Meter(cfg, plan.mesh.size, first, counts.train_flops_per_token, peak)
    log.line(banner(cfg, plan, counts, data.stats.get("train_tokens", 0), peak, peak_source))
    if cfg.data.format != "text":
        log.line(summary(cfg.data.format, t.loss_on, data.stats))
    if init_note:
        log.line(init_note)
    if note := run_dir.schedule_note():
        log.line(note)
    if first >= t.steps:
        log.line(f"run_dir already holds step {first} >= train.steps={t.steps}; nothing to do")
    else:
        for note in [*ckpt.resume_notes(fit_note), *([mixture_note] if mixture_note else [])]:
            log.line(note)
        lap("restore")  # the state (restored or initialised) and the run's log and meter
    guard = NonFiniteGuard(cfg)
    return Parts(cfg, run, data, run_dir, ckpt, log, meter, guard, Metrics(log, meter, recovery, guard, t.steps),
                 first, process, startup), state


def banner(cfg: Config, plan: Plan, counts: Counts, train_tokens: int, peak: float, peak_source: str) -> str:
    """The run's first log line: the model, the layout, the data and the peak MFU divides by."""
    m, kind = cfg.model, jax.devices()[0].device_kind
    per = "host" if jax.devices()[0].platform == "cpu" else "device"
    return (f"model {shape_name(m)} arch={m.arch} d={m.d_model} layers={m.n_layers} heads={m.n_heads}/{m.n_kv_heads} "
            f"ranks={m.attn_rank}/{m.mlp_rank} params={counts.params / 1e6:.2f}M "
            f"| {cfg.parallel.scheme} on mesh {dict(plan.mesh.shape)} of {plan.mesh.size} x {kind}, attention "
            f"{plan.attention}{f' ({plan.attention_why})' if plan.attention_why else ''} "
            f"| data {train_tokens:,} train tokens | peak {peak / 1e12:.2f} TFLOP/s per {per} ({peak_source})")
