"""Long runs that look after themselves: data mixtures (stateless draws, exact resume, weight changes,
per-dataset eval), background, time-based and preemption-safe checkpoints (SIGTERM, kill -9), the
z-loss and loss-spike skipping, per-layer health norms, Weights & Biases offline."""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.config import ConfigError, DataConfig, MixtureEntry, load_config
from boost_jax.data.build import build_data
from boost_jax.data.corpus import files_corpus
from boost_jax.data.mixture import Mixture, counts, proportions
from boost_jax.data.prepare import PrepareConfig, prepare
from boost_jax.data.synthetic import write_synthetic
from boost_jax.runtime.errors import DataError
from boost_jax.training.run import train
from boost_jax.training.step import spike_window

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- mixtures


def test_apportionment_keeps_every_dataset_within_a_row_of_its_share():
    props = proportions([0.5, 0.3, 0.2, 0.0])
    previous = [0] * 4
    for n in range(0, 5000, 7):
        c = counts(n, props)
        assert sum(c) == n and c[3] == 0
        assert all(abs(ci - n * w) <= 1 for ci, w in zip(c, (0.5, 0.3, 0.2)))
        assert all(ci >= pi for ci, pi in zip(c, previous))  # a dataset's count never falls
        previous = c


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, Path]:
    """Three prepared datasets of one tokenizer (synthetic ids over one word vocabulary)."""
    root = tmp_path_factory.mktemp("mix")
    for i, name in enumerate(("web", "code", "books")):
        write_synthetic(root / name, [4000 + 1000 * i], vocab_size=300, seed=i)
    return {name: root / name for name in ("web", "code", "books")}


def mixture(paths: dict[str, Path], weights: dict[str, float], batch_size: int = 8) -> Mixture:
    cfg = DataConfig(source="mixture", mixture=tuple(MixtureEntry(str(paths[n]), w) for n, w in weights.items()))
    return build_data(cfg, vocab_size=300, seq_len=16, seed=0, batch_size=batch_size).train


def test_a_mixture_draws_its_weights_statelessly_and_every_dataset_in_order(synthetic):
    mix = mixture(synthetic, {"web": 0.6, "code": 0.3, "books": 0.1})
    rows = [r for step in range(250) for r in mix.rows(step)]
    share = {n: sum(name == n for name, _ in rows) / len(rows) for n in ("web", "code", "books")}
    assert share == pytest.approx({"web": 0.6, "code": 0.3, "books": 0.1}, abs=1 / len(rows))
    for name in share:  # each dataset's stream is read in order, each position once
        assert [pos for n, pos in rows if n == name] == list(range(sum(n == name for n, _ in rows)))
    again = mixture(synthetic, {"web": 0.6, "code": 0.3, "books": 0.1})  # a fresh process: the same batches
    for step in (0, 17, 249):
        np.testing.assert_array_equal(again.batch(step, 8)["inputs"], mix.batch(step, 8)["inputs"])
    it = mix.batches(40, 8)
    for step in range(40, 44):  # the prefetching iterator reads the same batches
        np.testing.assert_array_equal(next(it)["inputs"], mix.batch(step, 8)["inputs"])
    half = [mix.batch(5, 8, p, 2)["inputs"] for p in range(2)]  # processes take their rows of it
    np.testing.assert_array_equal(np.concatenate(half), mix.batch(5, 8)["inputs"])


def test_changed_weights_continue_each_dataset_where_it_stopped(synthetic):
    before = mixture(synthetic, {"web": 0.5, "code": 0.5})
    recorded = before.record()
    after = mixture(synthetic, {"web": 0.2, "code": 0.3, "books": 0.5})
    note = after.resume(recorded, 100)
    assert "weights change at step 100" in note and [s["start"] for s in after.record()] == [0, 100]
    drawn = [r for step in range(100) for r in before.rows(step)] + [r for step in range(100, 200)
                                                                       for r in after.rows(step)]
    for name in ("web", "code", "books"):  # no sequence skipped or drawn twice across the change
        assert [pos for n, pos in drawn if n == name] == list(range(sum(n == name for n, _ in drawn)))
    for step in (0, 99):  # the steps before the change are drawn as they were
        assert after.rows(step) == before.rows(step)
    same = mixture(synthetic, {"web": 0.2, "code": 0.3, "books": 0.5})
    assert same.resume(after.record(), 150) is None and same.rows(170) == after.rows(170)  # resumed again


def test_a_mixture_refuses_another_tokenizer_and_missing_datasets(synthetic, tmp_path):
    write_synthetic(tmp_path / "other", [3000], vocab_size=290)
    with pytest.raises(DataError, match="other .* was prepared with another tokenizer than web"):
        mixture({**synthetic, "other": tmp_path / "other"}, {"web": 1.0, "other": 1.0})
    with pytest.raises(DataError, match=r"data.mixture\[1\].path: .*nowhere is not a prepared dataset"):
        mixture({**synthetic, "nowhere": tmp_path / "nowhere"}, {"web": 1.0, "nowhere": 1.0})


@pytest.fixture(scope="module")
def prepared_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two real corpora (the stdlib's asyncio and email packages) prepared with one tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    cfg = PrepareConfig(vocab_size=512, val_fraction=0.25)
    prepare(files_corpus([str(STDLIB / "asyncio")], max_bytes=400_000), root / "asyncio", cfg)
    prepare(files_corpus([str(STDLIB / "email")], max_bytes=400_000), root / "email",
            PrepareConfig(vocab_size=512, val_fraction=0.25, tokenizer_path=str(root / "asyncio" / "tokenizer.json")))
    return root / "asyncio", root / "email"


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_mixture_run_evaluates_each_dataset_and_logs_health(prepared_pair, tiny_overrides, tmp_path):
    """One short run with the mixture, the z-loss, spike skipping and health norms on together."""
    asyncio_dir, email_dir = prepared_pair
    mix = f"data.mixture=[{{path: {asyncio_dir}, weight: 0.25}}, {{path: {email_dir}, weight: 0.75}}]"
    cfg = load_config(None, [*tiny_overrides, "data.source=mixture", mix, "model.vocab_size=512", "train.steps=4",
                             "log.every=2", "train.eval_every=4", "checkpoint.every=4", "train.z_loss=1e-3",
                             "train.spike_skip=3", "train.spike_window=2", "parallel.dp=1", "log.health=true",
                             f"run_dir={tmp_path}"])
    train(cfg, jax.devices()[:1])
    rows = metrics(tmp_path)
    last = rows[-1]
    assert {"eval_loss/asyncio", "eval_loss/email", "eval_bpb/asyncio", "eval_bpb/email"} <= last.keys()
    assert last["eval_loss"] == pytest.approx(0.25 * last["eval_loss/asyncio"] + 0.75 * last["eval_loss/email"])
    health = {k for k in last if k.startswith(("grad_norm/", "param_norm/", "update_norm/"))}
    groups = {"embed", "final_norm", "lm_head", *(f"layer_{i:02d}/{g}" for i in (0, 1) for g in ("attn", "mlp", "norms"))}
    assert health == {f"{kind}_norm/{g}" for kind in ("grad", "param", "update") for g in groups}
    assert not any(k.startswith("param_norm/") for k in rows[0])  # on the steps that log only
    assert all(r["spike_skipped"] in (0.0, 1.0) for r in rows)
    from boost_jax.training.evaluate import evaluate

    r = evaluate(tmp_path)  # the eval command reads the mixture too
    assert r["datasets"]["asyncio"]["loss"] == pytest.approx(last["eval_loss/asyncio"], rel=1e-5)


@pytest.mark.slow  # five short training runs (two run dirs copied from the first)
def test_a_mixture_run_resumes_exactly_and_takes_new_weights_at_a_resume(prepared_pair, tiny_overrides, tmp_path,
                                                                         capsys):
    asyncio_dir, email_dir = prepared_pair
    mix = lambda a, e: f"data.mixture=[{{path: {asyncio_dir}, weight: {a}}}, {{path: {email_dir}, weight: {e}}}]"
    common = [*tiny_overrides, "data.source=mixture", "model.vocab_size=512", "train.eval_every=0",
              "checkpoint.every=3", "train.schedule_steps=9", "parallel.dp=1"]
    run = lambda name, weights, steps: train(load_config(None, [*common, mix(*weights), f"train.steps={steps}",
                                                               f"run_dir={tmp_path / name}"]), jax.devices()[:1])
    whole = run("whole", (0.25, 0.75), 6)
    shutil.copytree(tmp_path / "whole", tmp_path / "split")  # the same run to step 6, for the second story
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")  # as if stopped after step 3's save
    assert run("resumed", (0.25, 0.75), 6)["losses"] == whole["losses"][3:]  # bit for bit
    # New weights at a resume: allowed, said, recorded; a later resume keeps the new stretch.
    capsys.readouterr()
    changed = run("resumed", (0.9, 0.1), 9)["losses"]
    assert "data.mixture weights change at step 6" in capsys.readouterr().err
    run("split", (0.9, 0.1), 7)
    assert run("split", (0.9, 0.1), 9)["losses"] == changed[1:]


# ----------------------------------------------------------------------------- stability


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_the_z_loss_adds_exactly_its_term_and_eval_leaves_it_out():
    from flax import nnx

    from boost_jax.model import Model, loss_fn
    from boost_jax.parallel import single_device_plan

    cfg = load_config(None, ["model.preset=llama-tiny"]).model
    model, plan = Model(cfg, rngs=nnx.Rngs(0)), single_device_plan(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    logits = model(tokens, plan=plan)
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    for chunk in (0, 4):
        plain, with_z = (loss_fn(model, batch, plan, loss_chunk=chunk, z_loss=w) for w in (0.0, 1e-2))
        assert float(with_z) == pytest.approx(float(plain) + 1e-2 * float(z), rel=1e-6)


def test_the_spike_window_skips_only_outliers_once_full():
    window = {"losses": jnp.zeros(4), "seen": jnp.int32(0)}
    for loss in (3.0, 3.1, 2.9, 3.0):  # filling: never a spike
        spike, window = spike_window(window, jnp.float32(loss), jnp.bool_(True), 3.0)
        assert not spike
    spike, after = spike_window(window, jnp.float32(9.0), jnp.bool_(True), 3.0)
    assert spike and int(after["seen"]) == 4  # skipped, and kept out of the window
    spike, after = spike_window(window, jnp.float32(3.05), jnp.bool_(True), 3.0)
    assert not spike and int(after["seen"]) == 5 and float(after["losses"][0]) == pytest.approx(3.05)
    spike, after = spike_window(window, jnp.float32(jnp.nan), jnp.bool_(False), 3.0)
    assert not spike and int(after["seen"]) == 4  # a non-finite loss is on_nonfinite's, never in the window


@pytest.mark.slow
def test_spike_skipping_counts_skips_resumes_exactly_and_is_inert_when_nothing_spikes(tiny_overrides, tmp_path):
    common = [*tiny_overrides, "train.eval_every=0", "train.schedule_steps=12", "parallel.dp=1", "log.every=3"]
    plain = train(load_config(None, [*common, "train.steps=12", f"run_dir={tmp_path / 'plain'}"]), jax.devices()[:1])
    never = train(load_config(None, [*common, "train.steps=12", "train.spike_skip=1e6", "train.spike_window=3",
                                     f"run_dir={tmp_path / 'never'}"]), jax.devices()[:1])
    # The window changes nothing it does not skip (to float rounding: the compiled step differs).
    np.testing.assert_allclose(never["losses"], plain["losses"], rtol=1e-6)
    tight = [*common, "train.spike_skip=0.1", "train.spike_window=3", "checkpoint.every=6"]
    whole = train(load_config(None, [*tight, "train.steps=12", f"run_dir={tmp_path / 'whole'}"]), jax.devices()[:1])
    assert sum(r["spike_skipped"] for r in metrics(tmp_path / "whole")) > 0
    train(load_config(None, [*tight, "train.steps=6", f"run_dir={tmp_path / 'resumed'}"]), jax.devices()[:1])
    second = train(load_config(None, [*tight, "train.steps=12", f"run_dir={tmp_path / 'resumed'}"]), jax.devices()[:1])
    assert second["losses"] == whole["losses"][6:]  # the window resumed with the run


# ----------------------------------------------------------------------------- checkpoints


def run_cli(run_dir: Path, tiny_overrides, *extra: str) -> subprocess.Popen:
    args = [*tiny_overrides, "train.eval_every=0", "parallel.dp=1", f"run_dir={run_dir}", *extra]
    return subprocess.Popen([sys.executable, "-m", "boost_jax.train", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def run_to_end(run_dir: Path, tiny_overrides, *extra: str) -> str:
    """A whole run in a subprocess (the reference of the interrupted ones: the same process setup,
    so the same compiled programs); its stderr."""
    proc = run_cli(run_dir, tiny_overrides, *extra)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return err


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = run_dir / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached: {proc.poll()=}")


@pytest.mark.slow  # five training processes
def test_sigterm_and_kill_9_at_any_moment_leave_a_checkpoint_the_run_resumes_from_exactly(tiny_overrides, tmp_path):
    """One run stopped three ways, then run to the end: its metrics are the uninterrupted run's, bit for
    bit. SIGTERM (no step-based save due) saves the step it is at, its only checkpoint, and exits 0.
    Then kill -9, saving every step, at a random moment after a row reached disk (inside a step or a
    save): once with the saves asynchronous (one in flight in the background), once synchronous."""
    run, steps, rarely = tmp_path / "run", "train.steps=30", "checkpoint.every=1000"
    run_to_end(tmp_path / "one", tiny_overrides, steps, rarely)
    proc = run_cli(run, tiny_overrides, steps, rarely)  # rows reach disk every 5 steps (log.every)
    wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0] < 30 and f"stopped by SIGTERM after step {saved[0]}: saved step" in err
    rng, resumed = np.random.default_rng(0), f"resumed from step {saved[0]}"  # the SIGTERM's step first
    for async_save in (True, False):
        # a row past those on disk: the resumed process has said so and run steps (under load the
        # SIGTERM can land past step 10, so a fixed row count may be on disk before it starts)
        rows = len((run / "metrics.jsonl").read_text().splitlines()) + 1
        proc = run_cli(run, tiny_overrides, steps, "checkpoint.every=1", "checkpoint.keep=2",
                       f"checkpoint.async_save={async_save}")
        wait_for_step(run, rows, proc)
        time.sleep(rng.uniform(0, 0.3))  # somewhere inside a step or a save
        proc.kill()
        _, err = proc.communicate()
        assert resumed in err, err
        resumed = "resumed from step"
    assert resumed in run_to_end(run, tiny_overrides, steps, rarely)
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(tmp_path / "one")]


@pytest.mark.slow
def test_time_based_saves_between_the_step_based_ones(tiny_overrides, tmp_path):
    train(load_config(None, [*tiny_overrides, "train.eval_every=0", "parallel.dp=1", "train.steps=30",
                             "checkpoint.every=1000", "checkpoint.every_minutes=0.001", "checkpoint.keep=100",
                             f"run_dir={tmp_path}"]), jax.devices()[:1])
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    assert len(saved) > 5 and saved[-1] == 30  # every ~60 ms, and at the end


@pytest.mark.slow
def test_wandb_logs_the_same_scalars_offline(tiny_overrides, tmp_path, monkeypatch):
    """A real offline Weights & Biases run (no network) receives every metrics.jsonl row's scalars."""
    from boost_jax.training import log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, open_run = [], log._wandb_run

    def spied(*args):
        run = open_run(*args)
        real = run.log
        run.log = lambda scalars, step: (logged.append({"step": step, **scalars}), real(scalars, step=step))
        return run

    monkeypatch.setattr(log, "_wandb_run", spied)
    train(load_config(None, [*tiny_overrides, "train.eval_every=0", "parallel.dp=1", "train.steps=4", "log.every=2",
                             "log.wandb=true", "log.health=true", f"run_dir={tmp_path}"]), jax.devices()[:1])
    rows = [{k: v for k, v in r.items() if k != "time"} for r in metrics(tmp_path)]  # the wall clock stays out of W&B
    assert logged == rows and "grad_norm/lm_head" in logged[-1]
    [record] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert record.stat().st_size > 0  # what `wandb sync` uploads later


@pytest.mark.parametrize("override, message", [
    ("train.z_loss=-0.1", "train.z_loss: must be >= 0"),
    ("train.spike_skip=-1", "train.spike_skip: must be > 0 standard deviations, or 0 = off"),
    ("train.spike_window=1", "train.spike_window: must be >= 2"),
    ("checkpoint.every_minutes=-5", "checkpoint.every_minutes: must be >= 0"),
    ("data.mixture=[{path: /a, weight: -1}]", r"data.mixture\[0\].weight: must be a finite number >= 0"),
    ("data.mixture=[{path: /a, weight: 0}]", "data.mixture: the weights sum to 0"),
])
def test_bad_values_are_one_message_each(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.source=mixture", "data.mixture=[{path: /a, weight: 1}]", override])
