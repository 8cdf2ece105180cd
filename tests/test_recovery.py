"""Two checkpoint tiers (checkpoint.local_dir: boost_jax/training/local_tier.py), the restart on fewer
processes with the same trajectory, and what a restart cost in the metrics (training/recovery.py)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from boost_jax.analysis.memory_model import breakdown, layer_bytes
from boost_jax.bench import recovery as bench
from boost_jax.config import ConfigError, load_config
from boost_jax.train import train
from boost_jax.training.microbatch_fit import GIB, device_limit, fewest_microbatches, size
from boost_jax.training.recovery import Recovery


def tiers(tmp_path, tiny_overrides, *extra):
    return load_config(None, [*tiny_overrides, "log.every=1", "train.eval_every=0", "train.schedule_steps=400",
                              f"run_dir={tmp_path / 'run'}", *extra])


@pytest.mark.parametrize("overrides, needle", [
    (["checkpoint.local_every=5"], "checkpoint.local_every: 5 needs checkpoint.local_dir"),
    (["checkpoint.local_dir=/tmp/x"], "checkpoint.local_dir: needs checkpoint.local_every > 0"),
    (["checkpoint.local_dir=/tmp/x", "checkpoint.local_every=2", "checkpoint.every=0"],
     "checkpoint.local_dir: is the frequent tier beside the persistent checkpoints"),
    (["checkpoint.local_every=-1"], "checkpoint.local_every: must be >= 0"),
])
def test_the_local_tier_keys_are_checked(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


@pytest.mark.parametrize("where, needle", [
    ("file", r"checkpoint.local_dir: .*file/0 cannot be a folder: .*file is a file"),
    ("/proc/local", r"checkpoint.local_dir: cannot write in /proc \(.*\), so not /proc/local/0"),  # root too
])
def test_a_local_dir_that_is_a_file_or_unwritable_is_one_message_before_any_work(tmp_path, tiny_overrides, where,
                                                                                  needle):
    (tmp_path / "file").write_text("x")
    cfg = tiers(tmp_path, tiny_overrides, "train.steps=2", "checkpoint.local_every=1",
                f"checkpoint.local_dir={tmp_path / where}/{{process}}")
    with pytest.raises(ConfigError, match=needle):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_takes_the_newer_local_step_and_continues_the_same_run(tmp_path, tiny_overrides, capfd):
    """Persistent steps 4 and 6 (the end), local step 5; step 6 lost from the persistent tier: the
    resume takes local step 5, says so in one line, and steps 6-8 equal an uninterrupted run's; the
    first row after the restart says what it cost."""
    two = ["checkpoint.every=4", "checkpoint.local_every=5", f"checkpoint.local_dir={tmp_path / 'local'}/{{process}}"]
    train(tiers(tmp_path, tiny_overrides, "train.steps=6", *two))
    assert sorted(p.name for p in (tmp_path / "local" / "0").iterdir() if p.name.isdigit()) == ["5"]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    capfd.readouterr()
    resumed = train(tiers(tmp_path, tiny_overrides, "train.steps=8", *two))
    err = capfd.readouterr().err
    assert resumed["start_step"] == 5
    assert f"resumed from step 5 (local tier of process 0, {tmp_path / 'local' / '0'}" in err
    whole = train(tiers(tmp_path / "whole", tiny_overrides, "train.steps=8", "checkpoint.every=0"))
    np.testing.assert_allclose(resumed["losses"], whole["losses"][5:], rtol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    restart = rows[5]
    assert (restart["restart_from"], restart["steps_recomputed"]) == (5, 1)  # the lost run had logged step 6
    assert restart["seconds_lost"] > 0 and 0 < restart["goodput"] < 1
    assert "restart from step 5: 1 steps recomputed" in err


def test_a_damaged_local_step_gives_way_to_the_persistent_tier(tmp_path, tiny_overrides, capfd):
    two = ["checkpoint.every=4", "checkpoint.local_every=5", f"checkpoint.local_dir={tmp_path / 'local'}/{{process}}"]
    train(tiers(tmp_path, tiny_overrides, "train.steps=6", *two))
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    for f in (tmp_path / "local" / "0" / "5" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    capfd.readouterr()
    resumed = train(tiers(tmp_path, tiny_overrides, "train.steps=7", *two))
    err = capfd.readouterr().err
    assert resumed["start_step"] == 4
    assert "note: local checkpoint step 5 of process 0 cannot be read" in err and "Traceback" not in err
    assert f"resumed from step 4 ({tmp_path / 'run' / 'checkpoints'}" in err
    saved = json.loads((tmp_path / "local" / "0" / "5" / "meta" / "metadata").read_text())  # written anew
    assert saved["loss"] == pytest.approx(resumed["losses"][0], rel=1e-6)


@pytest.mark.parametrize("argv, needle", [
    (["--kill-between", "50", "70"], "--kill-between 50 70 must be steps 1 <= FIRST <= LAST < --steps=60"),
    (["--survivors", "4"], "--survivors=4 fewer than --processes=4"),
    (["--processes", "1"], "--processes"),
    (["checkpoint.local_every=3"], "checkpoint.local_every: bench recovery sets it"),
])
def test_bench_recovery_refuses_bad_flags_before_any_run(argv, needle, monkeypatch):
    monkeypatch.setattr(bench, "recovery", lambda *a: pytest.fail("a run started"))
    with pytest.raises(ConfigError, match=needle):
        bench.main(argv)


def test_restart_fields_from_the_rows_the_lost_run_left():
    """Rows 1-4 logged at t = 11..14 (1 s a step), resumed from step 2, first row after it at t = 20."""
    recovery = Recovery(Path("/nonexistent"), 2, primary=True)
    recovery.before = [{"step": s, "time": 10.0 + s, "step_time_s": 1.0} for s in range(1, 5)]
    got = recovery.fields({"step": 3, "time": 20.0, "step_time_s": 1.0})
    assert got == {"restart_from": 2, "steps_recomputed": 2, "seconds_lost": 6.0, "goodput": 3.0 / 10.0}
    assert Recovery(Path("/nonexistent"), 0, primary=True).fields({"step": 1, "time": 1.0, "step_time_s": 1.0}) == {}


@pytest.mark.slow  # four training processes, then three, then two, then four again (the reference)
def test_a_host_lost_the_run_continues_on_fewer_processes(tmp_path, tiny_overrides):
    """4 processes, local tier every 5 steps, persistent every 50: process 3 killed with SIGKILL after
    a step drawn from 12..18 and its local dir deleted. A restart on 3 processes cannot split the global
    batch of 8: one message, exit 1, nothing lost. On 2 it resumes from a local step no more than 5
    behind the kill, and its losses to step 24 equal an uninterrupted 4-process run's within 1e-5."""
    config = [*tiny_overrides, *bench.FIXED, "train.schedule_steps=400", "train.eval_every=0"]
    kill_at = int(np.random.default_rng().integers(12, 19))
    work = tmp_path / "two_tiers"
    argv = bench.command(config, 24, 50, 5, work / "run", work / "local")
    three = None

    def refused_on_three():  # between the loss and the restart that works
        nonlocal three
        launch = bench.Launch(argv, 3, work / "logs-three")
        three = (launch.wait(timeout=300), launch.stderr())

    r = bench.trial(config, 4, 2, 24, kill_at, 50, 5, work, before_restart=refused_on_three)
    codes, err = three
    assert codes == [1, 1, 1], err
    assert "config error: parallel: train.batch_size=8 must divide by dp x fsdp = 3" in err
    assert "Traceback" not in err
    assert r["killed_at"] - 5 <= r["resumed_from"] <= r["killed_at"] and r["resumed_from"] % 5 == 0
    assert r["resumed_line"].startswith(f"resumed from step {r['resumed_from']} (local tier of process 0")
    assert r["steps_recomputed"] == r["killed_at"] - r["resumed_from"] and r["seconds_lost"] > 0
    reference = bench.uninterrupted(config, 4, 24, 50, tmp_path)
    assert sorted(r["losses"]) == list(range(1, 25))
    assert bench.max_rel_diff(r["losses"], reference, r["resumed_from"]) < 1e-5


@pytest.mark.slow  # two training processes
def test_a_local_dir_shared_by_two_processes_is_one_message(tmp_path, tiny_overrides):
    shared = tmp_path / "local"
    argv = [*tiny_overrides, *bench.FIXED, "train.steps=2", "checkpoint.every=2", "checkpoint.local_every=1",
            f"checkpoint.local_dir={shared}", f"run_dir={tmp_path / 'run'}"]
    launch = bench.Launch(argv, 2, tmp_path / "logs")
    assert launch.wait(timeout=300) == [1, 1]
    for i in range(2):
        err = launch.stderr(i)
        assert (f"checkpoint.local_dir: {shared} is seen by processes [0, 1]: each process needs a folder of its own; "
                "put {process}") in err and "Traceback" not in err, err
    assert not [p for p in shared.iterdir()]  # the markers are gone, nothing was saved


def mesh(dp: int) -> dict[str, int]:
    return {"pp": 1, "dp": dp, "fsdp": 1, "cp": 1, "tp": 1}


def test_a_resume_on_fewer_devices_takes_the_fewest_microbatches_that_fit_and_split_the_batch(tiny_overrides):
    """A global batch of 12 rows, 3 a device on 4 devices, 6 on the 2 left. Under what 3 micro-batches
    need there, 1, 2 and 3 do not fit and 4 and 5 do not split the batch into rows for 2 devices: 6.
    Under what 6 need, none does (12 would leave one row for two devices): one message."""
    measured = {}

    def layer(c):  # one compile per micro-batch size
        if c.train.batch_size not in measured:
            measured[c.train.batch_size] = layer_bytes(c)
        return measured[c.train.batch_size]

    cfg = load_config(None, [*tiny_overrides, "train.batch_size=12"])
    need = lambda dp, m: breakdown(load_config(None, [*tiny_overrides, "train.batch_size=12", f"parallel.dp={dp}",
                                                      f"train.microbatches={m}"]), layer)["total"]
    assert need(4, 1) < need(2, 1) and need(2, 6) < need(2, 3) < need(2, 2) < need(2, 1)
    src = "parallel.device_memory_gib"
    assert fewest_microbatches(cfg, mesh(4), need(4, 1), src, layer) == (1, need(4, 1), need(4, 1))
    assert fewest_microbatches(cfg, mesh(2), need(2, 3), src, layer) == (3, need(2, 3), need(2, 3))
    assert fewest_microbatches(cfg, mesh(2), need(2, 3) - 1, src, layer) == (6, need(2, 6), need(2, 3) - 1)
    with pytest.raises(ConfigError) as e:
        fewest_microbatches(cfg, mesh(2), need(2, 6) - 1, src, layer)
    assert str(e.value) == (
        f"parallel: 2 devices (mesh {mesh(2)}) cannot hold the train step of train.batch_size=12: "
        f"{size(need(2, 6))} ({need(2, 6):,} bytes) per device even at train.microbatches=6, the most that split the "
        f"batch over dp x fsdp = 2; {size(need(2, 6) - 1)} ({need(2, 6) - 1:,} bytes) is available per device "
        "(parallel.device_memory_gib). Resume on more devices "
        "(or set parallel.device_memory_gib to what they hold); the checkpoints are untouched")


def test_the_memory_limit_is_the_key_and_none_on_a_cpu_without_it(tiny_overrides):
    import jax

    cpu = jax.devices("cpu")[0]
    assert device_limit(load_config(None, tiny_overrides), cpu) == (None, "")
    assert device_limit(load_config(None, [*tiny_overrides, "parallel.device_memory_gib=0.5"]), cpu) == (
        GIB // 2, "parallel.device_memory_gib")
    with pytest.raises(ConfigError, match="parallel.device_memory_gib: must be >= 0 GiB"):
        load_config(None, [*tiny_overrides, "parallel.device_memory_gib=-1"])


@pytest.mark.slow  # two training processes, one refused restart, then one, then two again (the reference)
def test_a_restart_whose_device_cannot_hold_its_share_adds_microbatches(tmp_path, tiny_overrides):
    """2 processes fit parallel.device_memory_gib with the whole batch; one killed after a step of 7..9,
    the restart on 1 cannot hold 8 rows: it resumes with 2 micro-batches, says so in its resume line, and
    its losses equal an uninterrupted 2-process run's within 1e-5. A limit no count fits is one message,
    exit 1, and the run resumes after it."""
    base = [*tiny_overrides, *bench.FIXED, "train.schedule_steps=400", "train.eval_every=0"]
    need = lambda dp, m: breakdown(load_config(None, [*base, f"parallel.dp={dp}", f"train.microbatches={m}",
                                                      "parallel.cpu_devices=0"]))["total"]
    limit = (need(1, 1) + need(1, 2)) / 2
    assert need(2, 1) < limit and need(1, 2) < limit < need(1, 1)
    config = [*base, f"parallel.device_memory_gib={limit / GIB}"]
    work = tmp_path / "fit"
    refused = None

    def refused_below_any_count():
        nonlocal refused
        small = [*base, f"parallel.device_memory_gib={need(1, 8) / 2 / GIB}"]
        launch = bench.Launch(bench.command(small, 14, 50, 5, work / "run", work / "local"), 1, work / "logs-small")
        refused = (launch.wait(timeout=300), launch.stderr())

    kill_at = int(np.random.default_rng().integers(7, 10))
    r = bench.trial(config, 2, 1, 14, kill_at, 50, 5, work, before_restart=refused_below_any_count)
    codes, err = refused
    assert codes == [1], err
    assert "config error: parallel: 1 device (mesh" in err and "Traceback" not in err
    assert "is available per device (parallel.device_memory_gib)" in err
    assert r["resumed_from"] == 5 and r["resumed_line"].startswith("resumed from step 5 (local tier of process 0")
    assert "; train.microbatches 1 -> 2 to fit 1 device: " in r["resumed_line"], r["resumed_line"]
    assert r["resumed_line"].endswith("MiB per device (parallel.device_memory_gib)")
    reference = bench.uninterrupted(config, 2, 14, 50, tmp_path)
    assert sorted(r["losses"]) == list(range(1, 15))
    assert bench.max_rel_diff(r["losses"], reference, r["resumed_from"]) < 1e-5
