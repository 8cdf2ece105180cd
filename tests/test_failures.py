"""Failures end safely and say so: divergence stops before a bad checkpoint, a checkpoint guards its
own resume, a CLI error is one message (no traceback), metrics survive a crash, bad inputs are named."""

import json
import math
import re
import shutil
import subprocess
import sys
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from boost_jax import api
from boost_jax.config import ConfigError, LogConfig, load_config
from boost_jax.export import export
from boost_jax.launch import peaks
from boost_jax.model.checkpoint import CheckpointStore
from boost_jax.model.hf import ExportError
from boost_jax.model.run_dir import open_run
from boost_jax.runtime.errors import CheckpointError, DivergenceError
from boost_jax.training.evaluate import Evaluator
from boost_jax.training.log import RunLog
from boost_jax.training.run import train


def config(tmp_path, tiny_overrides, *extra, name="run"):
    return load_config(None, [*tiny_overrides, f"run_dir={tmp_path / name}", "train.eval_every=0", *extra])


def cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)


def assert_one_message(proc, *needles):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def steps_in(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())


def metric_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, tiny_overrides):
    """A healthy run dir: 4 steps, checkpoints at 2 and 4. Tests work on copies."""
    path = tmp_path_factory.mktemp("good")
    train(config(path, tiny_overrides, "train.steps=4", "checkpoint.every=2"))
    return path / "run"


@pytest.fixture
def run_copy(good_run, tmp_path):
    return shutil.copytree(good_run, tmp_path / "run")


# ----------------------------------------------------------------------------- divergence


@pytest.mark.slow  # up to 12 steps, a checkpoint each
def test_divergence_stops_and_keeps_the_last_finite_checkpoint(run_copy, tiny_overrides):
    # Resume a good run with an absurd LR, saving every step with keep=2: before the guard, the
    # run ended normally and retention deleted every finite checkpoint in favour of all-NaN ones.
    with pytest.raises(DivergenceError, match=r"non-finite loss .* at step \d+") as e:
        train(load_config(None, [*tiny_overrides, f"run_dir={run_copy}", "train.eval_every=0", "train.steps=12",
                                 "train.lr=1e6", "checkpoint.every=1", "checkpoint.keep=2"]))
    bad = int(re.search(r"at step (\d+)", str(e.value)).group(1))
    assert 4 < bad <= 12
    assert max(steps_in(run_copy)) == bad - 1  # none after the bad step; the one just before kept
    assert metric_steps(run_copy) == list(range(1, bad + 1))
    _, model, _ = api.restore(run_copy)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(model))


def test_skip_mode_drops_a_non_finite_update(tiny_overrides, tmp_path):
    from boost_jax.parallel import make_plan
    from boost_jax.training.step import setup

    cfg = config(tmp_path, tiny_overrides, "train.on_nonfinite=skip", "parallel.dp=1", "train.warmup_steps=0")
    run, state = setup(cfg, make_plan(cfg, jax.devices()[:1]))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 64), dtype=np.int32)
    tokens[:, 0] = 0  # reads the poisoned embedding row below
    batch = {"inputs": tokens, "targets": tokens}
    init = jax.device_get(state)
    poisoned = jax.tree.map(np.copy, init)
    poisoned.params["embed"][0, 0] = np.nan
    new, metrics = run.train_step(jax.device_put(poisoned, run.state_shardings), batch)
    assert float(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # NaN == NaN here
    jax.tree.map(same, jax.device_get(new.params), poisoned.params)
    jax.tree.map(same, jax.device_get(new.opt_state), poisoned.opt_state)
    assert int(new.step) == 1  # the step (and its data) still advance
    clean, metrics = run.train_step(jax.device_put(init, run.state_shardings), batch)
    assert float(metrics["skipped"]) == 0
    assert not np.array_equal(jax.device_get(clean.params["embed"]), init.params["embed"])


def test_eval_perplexity_of_a_huge_loss_is_inf(tiny_overrides, tmp_path):
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("batch",)), P())
    run = SimpleNamespace(eval_step=lambda params, batch: np.float32(1e4), batch_sharding=sharding)
    batch = {"inputs": np.zeros((8, 64), np.int32), "targets": np.zeros((8, 64), np.int32)}
    tokenizer = SimpleNamespace(decode_batch=lambda rows: ["ab"] * len(rows))
    val = SimpleNamespace(eval_batches=lambda *_: [batch])
    data = SimpleNamespace(eval_sets=lambda split: {"": val}, parts={}, tokenizer=tokenizer)
    cfg = config(tmp_path, tiny_overrides, "train.eval_batches=1")
    out = Evaluator(cfg, run, data, (0, 1))(None)
    assert out["eval_loss"] == 1e4 and out["eval_ppl"] == math.inf and math.isfinite(out["eval_bpb"])


# ----------------------------------------------------------------------------- resume guard


def test_checkpoint_refuses_another_seed_without_config_yaml(run_copy, tiny_overrides):
    (run_copy / "config.yaml").unlink()
    with pytest.raises(CheckpointError, match=r"step 4 .* different train\.seed"):
        train(load_config(None, [*tiny_overrides, f"run_dir={run_copy}", "train.eval_every=0",
                                 "train.steps=6", "checkpoint.every=2", "train.seed=7"]))
    assert steps_in(run_copy) == [2, 4] and not (run_copy / "config.yaml").exists()


def test_a_failed_start_leaves_no_config_yaml(tiny_overrides, tmp_path, monkeypatch):
    def out_of_memory(self, *args, **kwargs):
        raise MemoryError("simulated: the train step does not fit")

    monkeypatch.setattr(jax.stages.Lowered, "compile", out_of_memory)
    cfg = config(tmp_path, tiny_overrides, "train.steps=2", "checkpoint.every=2")
    with pytest.raises(MemoryError):
        train(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # the corrected command will not be refused
    assert not (tmp_path / "run" / "tokenizer.json").exists()


def test_a_failed_restore_ends_its_other_reads_before_closing_their_event_loop(caplog):
    """The deterministic core of the test below: one read fails while another's thread has yet to
    report; Orbax's runner (the one boost_jax.model.checkpoint replaces) closed the loop at once, and
    the late report hit the closed loop ("Event loop is closed") and its task's exception was never
    retrieved. Here the other read ends, and is collected, before the loop closes."""
    import asyncio
    import gc

    from orbax.checkpoint._src import asyncio_utils

    import boost_jax.model.checkpoint  # noqa: F401 (installs the draining runner)

    finished = []

    async def other_read():
        loop = asyncio.get_running_loop()
        reported = loop.create_future()
        threading.Timer(0.05, loop.call_soon_threadsafe, (reported.set_result, None)).start()  # after the failure
        await reported
        finished.append("other read")
        raise OSError("the other array's read failed too")

    async def restore():
        asyncio.ensure_future(other_read())
        await asyncio.sleep(0)  # the other read is in flight
        raise OSError("one array's read failed")

    with pytest.raises(OSError, match="one array's read failed"):
        asyncio_utils.run_sync(restore())
    assert finished == ["other read"]  # its thread reported into a loop still open
    gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text  # "never retrieved", "destroyed"


@pytest.mark.slow  # a training process; the test above shows the mechanism in every run
def test_a_damaged_array_is_one_message_with_no_traceback_at_exit(run_copy, tiny_overrides):
    """One array's read fails while the others' are in flight (4 devices): Orbax closed its event loop
    under them, and as they ended they printed "Event loop is closed" and "Task exception was never
    retrieved" tracebacks after the message, in some runs (issue 62)."""
    for f in (run_copy / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.parent.parent.name.startswith("ocdbt.process_"):  # array data cut short, metadata intact
            f.write_bytes(f.read_bytes()[:100])
    proc = cli("boost_jax.train", *tiny_overrides, f"run_dir={run_copy}", "train.eval_every=0",
               "train.steps=6", "checkpoint.every=2", "parallel.cpu_devices=4", "parallel.dp=4")
    assert_one_message(proc, "checkpoint error: cannot restore checkpoint step 4", "--debug")
    assert "ERROR" not in proc.stderr, proc.stderr


@pytest.mark.slow  # a training process
def test_damaged_checkpoint_is_one_message(run_copy, tiny_overrides):
    for f in (run_copy / "checkpoints" / "4").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    proc = cli("boost_jax.train", *tiny_overrides, f"run_dir={run_copy}", "train.eval_every=0",
               "train.steps=6", "checkpoint.every=2")
    assert_one_message(proc, "checkpoint error: cannot restore checkpoint step 4", "--debug")
    assert steps_in(run_copy) == [2, 4]


def test_damaged_config_yaml_is_named(run_copy, tiny_overrides):
    (run_copy / "config.yaml").write_text("model: {arch: [cola\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: not valid YAML.*move it aside"):
        train(load_config(None, [*tiny_overrides, f"run_dir={run_copy}", "train.steps=6"]))
    with pytest.raises(ConfigError, match=r"config\.yaml: not valid YAML"):
        api.restore(run_copy)


# ----------------------------------------------------------------------------- one message per error


@pytest.mark.slow  # a process each; tests/test_train.py keeps one CLI error in the inner loop
@pytest.mark.parametrize("module, args, needle", [
    ("boost_jax.train", ["BAD_YAML"], "bad.yaml: not valid YAML"),
    ("boost_jax.train", ["train.lr=[1,"], "override 'train.lr=[1,': not valid YAML"),
    ("boost_jax.bench", ["step", "model.preset=no-such-preset"], "config error: model.preset"),
    ("boost_jax.bench", ["comm", "--model", "llama-7b"], "config error: --model is not a flag any more: write model.preset"),
    ("boost_jax.plan", ["--gpus", "4", "parallel.tp=2"], "config error: parallel.tp: the planner chooses the layout keys"),
])
def test_cli_errors_are_one_message(module, args, needle, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  arch: [cola\n")
    assert_one_message(cli(module, *[str(bad) if a == "BAD_YAML" else a for a in args]), needle)


@pytest.mark.parametrize("unusable, key", [("run", "run_dir"), ("run/checkpoints", "run_dir"),
                                           ("cache", "data.cache_dir")])
def test_unusable_dirs_are_found_before_any_work(unusable, key, tiny_overrides, tmp_path, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("data was loaded before the paths were checked")

    monkeypatch.setattr("boost_jax.data.build.build_data", no_data)
    (tmp_path / unusable).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / unusable).write_text("a file")
    cfg = config(tmp_path, tiny_overrides, "checkpoint.every=2", f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError, match=f"{re.escape(key)}: .* is a file"):
        train(cfg)


def test_api_config_lists_presets():
    with pytest.raises(ConfigError, match="neither a preset .*llama-tiny"):
        api.config("no-such-preset")


def test_malformed_cpu_peak_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(peaks, "measure_matmul_peak", lambda dtype: 1e9)
    for content in ("[1, 2]", json.dumps({peaks.cpu_peak_key("float32"): "fast"}), "{not json"):
        (tmp_path / "cpu_peak.json").write_text(content)
        assert peaks.device_peak_flops("float32", tmp_path) == (1e9, "measured:cpu")


def test_export_checks_the_tokenizer(run_copy, tmp_path):
    (run_copy / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ExportError, match="tokenizer.json is not a tokenizer"):
        export(open_run(run_copy), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- durable metrics


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_metrics_reach_disk_before_each_checkpoint(run_copy, tiny_overrides, monkeypatch):
    class Crash(Exception):
        pass

    on_disk, save = {}, CheckpointStore.save

    def save_then_crash(self, step, state, meta):
        on_disk[step] = metric_steps(run_copy)  # what a kill during this save would leave
        save(self, step, state, meta)
        if step == 8:
            raise Crash

    monkeypatch.setattr(CheckpointStore, "save", save_then_crash)
    # log.every > checkpoint.every: before, rows waited for the log interval and a crash lost them.
    with pytest.raises(Crash):
        train(load_config(None, [*tiny_overrides, f"run_dir={run_copy}", "train.eval_every=0", "train.steps=10",
                                 "checkpoint.every=2", "log.every=100"]))
    assert on_disk == {6: list(range(1, 7)), 8: list(range(1, 9))}
    assert steps_in(run_copy)[-1] == 8 and metric_steps(run_copy) == list(range(1, 9))


def test_a_torn_metrics_line_is_set_aside_on_resume(tmp_path):
    rows = "".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(1, 10))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 10, "lo')  # a row cut short by a crash
    RunLog(tmp_path, LogConfig(progress=False, tensorboard=False), total_steps=12, start_step=8).close()
    assert metric_steps(tmp_path) == list(range(1, 9))  # resumed from 8: later rows will be rewritten
    assert (tmp_path / "metrics.jsonl.damaged").read_text() == rows + '{"step": 10, "lo'


@pytest.mark.slow  # a process
def test_runs_without_the_optional_packages_import_and_a_run_names_them(tmp_path):
    """A GPU machine's own Python stack has no tensorboardX, grain or zstandard: the package, the
    train and bench modules still import, and a run says which packages it lacks, in one message."""
    code = ("import sys\n"
            "for m in ('tensorboardX', 'grain', 'zstandard'): sys.modules[m] = None\n"
            "import boost_jax, boost_jax.train, boost_jax.bench.step, boost_jax.bench.profile, boost_jax.bench.kernels\n"
            f"boost_jax.train.main(['model.preset=llama-tiny', 'log.tensorboard=true', 'run_dir={tmp_path}'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert_one_message(proc, "missing package", "grain, for the data loader", "tensorboardX, for log.tensorboard=true")
    assert not any(tmp_path.iterdir())  # named before any work


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports PyTorch whenever it is installed; a run's log keeps it out (seconds of every
    start), and torch imports as usual afterwards."""
    pytest.importorskip("torch")
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from boost_jax.config import LogConfig\n"
            "from boost_jax.training.log import RunLog\n"
            f"log = RunLog(Path({str(tmp_path)!r}), LogConfig(progress=False), total_steps=2, start_step=0)\n"
            "log.record({'step': 1, 'loss': 2.5})\n"
            "log.close()\n"
            "print('torch' in sys.modules)\n"
            "import torch\n"  # importable again afterwards
            "print(torch.ones(1).item())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "1.0"], proc.stderr
    assert [p.stat().st_size > 0 for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*")] == [True]


# ----------------------------------------------------------------------------- the last bad inputs (issue 50)


def test_checkpointing_by_time_alone_writes_checkpoints(tiny_overrides, tmp_path):
    """checkpoint.every=0 with every_minutes: saves by the clock (here every step) and at the end."""
    cfg = config(tmp_path, tiny_overrides, "train.steps=3", "checkpoint.every=0", "checkpoint.every_minutes=1e-9",
                 "checkpoint.keep=5")
    train(cfg, jax.devices()[:1])
    assert steps_in(tmp_path / "run") == [1, 2, 3]


def test_a_rerun_sets_aside_the_rows_it_rewrites(tmp_path):
    rows = "".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(1, 10))
    (tmp_path / "metrics.jsonl").write_text(rows)
    RunLog(tmp_path, LogConfig(progress=False, tensorboard=False), total_steps=12, start_step=0).close()
    assert metric_steps(tmp_path) == []
    assert (tmp_path / "metrics.jsonl.before-step-0").read_text() == rows  # nothing lost
    RunLog(tmp_path, LogConfig(progress=False, tensorboard=False), total_steps=12, start_step=0).close()
    assert not (tmp_path / "metrics.jsonl.before-step-0.1").exists()  # an empty file has nothing to set aside
    (tmp_path / "metrics.jsonl").write_text(rows)
    RunLog(tmp_path, LogConfig(progress=False, tensorboard=False), total_steps=12, start_step=4).close()
    assert metric_steps(tmp_path) == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl.before-step-4").read_text() == rows


@pytest.mark.parametrize("name", ["metrics.jsonl", ".boost_jax.lock"])
def test_a_folder_where_the_run_writes_a_file_is_named(name, tiny_overrides, tmp_path):
    (tmp_path / "run" / name).mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"run_dir: {tmp_path / 'run' / name} is a folder, not a file"):
        train(config(tmp_path, tiny_overrides, "train.steps=1"), jax.devices()[:1])


def test_an_unknown_section_in_a_runs_config_yaml_is_refused_on_resume(run_copy, tiny_overrides):
    (run_copy / "config.yaml").write_text((run_copy / "config.yaml").read_text() + "extras:\n  x: 1\n")
    before = steps_in(run_copy), metric_steps(run_copy)
    with pytest.raises(ConfigError, match=r"config.yaml is damaged or edited: unknown config key 'extras'"):
        train(config(run_copy.parent, tiny_overrides, "train.steps=6", "checkpoint.every=2"), jax.devices()[:1])
    assert (steps_in(run_copy), metric_steps(run_copy)) == before


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_eval_max_tokens_is_clamped_to_the_split_and_says_so(run_copy, capsys):
    from boost_jax.training.evaluate import evaluate

    whole = evaluate(run_copy, ["parallel.dp=1"], max_tokens=10**12)  # would be 2e9 batches unclamped
    err = capsys.readouterr().err
    assert "note: --max-tokens 1,000,000,000,000 is more than the val split holds" in err
    batches = int(re.search(r"evaluating its (\d+) whole batch", err)[1])
    assert whole["tokens"] == batches * 8 * 64 and batches >= 1
    assert evaluate(run_copy, ["parallel.dp=1"], max_tokens=batches * 8 * 64)["loss"] == whole["loss"]


def test_a_step_deleted_by_a_live_runs_retention_is_no_damage(run_copy, monkeypatch, capsys):
    """eval, generate and export read through weights.restore_params: the step they chose vanishes under
    them (a live run's checkpoint.keep) -> the newest step left, named; asked by number -> named as deleted."""
    restore = CheckpointStore._restore

    def deleted_by_retention(self, step, **items):
        if step == 4:
            shutil.rmtree(self.directory / "4")
        return restore(self, step, **items)

    monkeypatch.setattr(CheckpointStore, "_restore", deleted_by_retention)
    cfg, model, step = api.restore(run_copy)
    assert step == 2
    assert ("note: checkpoint step 4 in" in (err := capsys.readouterr().err) and "was deleted by its run's retention"
            in err and "reading step 2, the newest now" in err)
    monkeypatch.setattr(CheckpointStore, "_restore", lambda self, step, **items: (
        shutil.rmtree(self.directory / str(step)), restore(self, step, **items))[1])
    with pytest.raises(CheckpointError, match=r"step 2 in .* was deleted by its run's retention .* holds steps \[\]"):
        api.restore(run_copy, step=2)


def test_a_step_retention_is_deleting_is_no_damage(run_copy, monkeypatch, capsys):
    """Orbax deletes a step file by file and its folder stays listed until the last is gone: a read in
    between finds files missing (NOT_FOUND) in a step that is still listed. Where a newer step exists,
    the step is given checkpoint.DELETING_S to vanish; one that stays is damaged."""
    from boost_jax.model import checkpoint, weights

    restore = CheckpointStore._restore
    monkeypatch.setattr(checkpoint, "DELETING_S", 0.5)
    monkeypatch.setattr(weights, "checkpoint_step", lambda run_dir, ckpt, step: 2)  # listed when 2 was the newest
    damaged = shutil.copytree(run_copy, run_copy.parent / "damaged")
    shutil.rmtree(damaged / "checkpoints" / "2" / "meta")
    with pytest.raises(CheckpointError, match=r"cannot restore checkpoint step 2 .* Fix or move that step"):
        api.restore(damaged)

    def deleting(self, step, **items):
        if step == 2 and (self.directory / "2" / "meta").exists():
            shutil.rmtree(self.directory / "2" / "meta")  # its first files gone, the folder soon after
            threading.Timer(0.2, shutil.rmtree, [self.directory / "2"]).start()
        return restore(self, step, **items)

    monkeypatch.setattr(CheckpointStore, "_restore", deleting)
    assert api.restore(run_copy)[2] == 4
    assert "note: checkpoint step 2 in" in capsys.readouterr().err


def test_a_step_vanishing_while_orbax_lists_the_folder_is_listed_again():
    """Making or reloading a manager stats each step folder it listed: one deleted in between raises."""
    from boost_jax.model.checkpoint import listed

    errors = iter([FileNotFoundError(2, "No such file or directory"), NotADirectoryError(20, "Not a directory")])

    def listing():
        if (e := next(errors, None)) is not None:
            raise e
        return [4]

    assert listed(listing) == [4]
