"""Two checkpoint tiers (checkpoint.local_dir: boost_jax/training/local_tier.py), the restart on fewer
processes with the same trajectory, and what a restart cost in the metrics (training/recovery.py)."""

import json
import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

import jax
import numpy as np
import pytest

from boost_jax.analysis.memory_model import breakdown, layer_bytes
from boost_jax.analysis.microbatch_fit import GIB, device_limit, fewest_microbatches, size
from boost_jax.bench import recovery as bench
from boost_jax.config import ConfigError, load_config
from boost_jax.training.recovery import Recovery
from boost_jax.training.run import train


def tiers(tmp_path, tiny_overrides, *extra):
    return load_config(None, [*tiny_overrides, "log.every=1", "train.eval_every=0", "train.schedule_steps=400",
                              f"run_dir={tmp_path / 'run'}", *extra])


@pytest.mark.parametrize("overrides, needle", [
    (["checkpoint.local_every=5"], "checkpoint.local_every: 5 needs checkpoint.local_dir"),
    (["checkpoint.local_dir=/tmp/x"], "checkpoint.local_dir: needs checkpoint.local_every > 0"),
    (["checkpoint.local_dir=/tmp/x", "checkpoint.local_every=2", "checkpoint.every=0"],
     "checkpoint.local_dir: is the frequent tier beside the persistent checkpoints"),
    (["checkpoint.local_every=-1"], "checkpoint.local_every: must be >= 0"),
    (["checkpoint.local_dir=/tmp/{proc}", "checkpoint.local_every=2"],
     r"checkpoint.local_dir: '/tmp/\{proc\}': \{proc\} is not a placeholder; the one it takes is \{process\}"),
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


def losses_of(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def reference(config: list[str], devices: int, steps: int, work: Path) -> dict[int, float]:
    """The losses by step of the run never lost, trained in this process on `devices` simulated devices:
    the mesh of that many processes of one device each, without their start-ups."""
    run_dir = work / "reference"
    train(load_config(None, bench.command(config, steps, 50, 0, run_dir, work)), jax.devices()[:devices])
    return losses_of(run_dir)


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def cut_short(step_dir: Path) -> None:
    """A local step whose state files lost their second half (a disk that failed mid-write)."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 1:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def half_written(local: Path, step: int) -> Path:
    """What kill -9 mid-save leaves: Orbax's temporary folder of `step`, never renamed to a step."""
    tmp = local / f"{step}.orbax-checkpoint-tmp-1765000000000000"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "_METADATA").write_text('{"tree_metadata": {')
    return tmp


def two_tiers(work: Path, local_every: int) -> list[str]:
    return ["checkpoint.every=4", f"checkpoint.local_every={local_every}",
            f"checkpoint.local_dir={work / 'local'}/{{process}}"]


def tier_run(tmp_path_factory, tiny_overrides, steps: int, local_every: int) -> tuple[Path, dict[int, float]]:
    """(a folder, the losses): its `run` (persistent tier every 4 steps) and `local` tier trained `steps`
    steps, and their untouched copy in `pristine` beside them. Each test damages them after put_back."""
    work = tmp_path_factory.mktemp("tiers")
    train(tiers(work, tiny_overrides, f"train.steps={steps}", *two_tiers(work, local_every)))
    for name in ("run", "local"):
        shutil.copytree(work / name, work / "pristine" / name)
    return work, losses_of(work / "run")


def put_back(work: Path, pristine: Path) -> None:
    """The run and local tier as trained, at the paths they record (a local step records its run dir)."""
    for name in ("run", "local"):
        shutil.rmtree(work / name)
        shutil.copytree(pristine / name, work / name)


@pytest.fixture(scope="module")
def local_5(tmp_path_factory, tiny_overrides):
    """6 steps: persistent steps 4 and 6 (the end), local step 5."""
    work, losses = tier_run(tmp_path_factory, tiny_overrides, 6, 5)
    assert sorted(p.name for p in (work / "local" / "0").iterdir() if p.name.isdigit()) == ["5"]
    return work, losses


@pytest.fixture(scope="module")
def local_3(tmp_path_factory, tiny_overrides):
    """10 steps: persistent steps 4, 8 and 10, local steps 6 and 9 (retention 2). Its losses are every
    run's of this setup (the tiers do not change them): the reference of the others."""
    work, losses = tier_run(tmp_path_factory, tiny_overrides, 10, 3)
    assert sorted(p.name for p in (work / "local" / "0").iterdir() if p.name.isdigit()) == ["6", "9"]
    return work, losses


def test_resume_takes_the_newer_local_step_and_continues_the_same_run(local_5, tiny_overrides, capfd):
    """Persistent steps 4 and 6 (the end), local step 5; step 6 lost from the persistent tier: the
    resume takes local step 5, says so in one line, and its step 6 equals the lost run's; the first
    row after the restart says what it cost."""
    work, lost = local_5
    put_back(work, work / "pristine")
    shutil.rmtree(work / "run" / "checkpoints" / "6")
    capfd.readouterr()
    resumed = train(tiers(work, tiny_overrides, "train.steps=6", *two_tiers(work, 5)))
    err = capfd.readouterr().err
    assert resumed["start_step"] == 5
    assert f"resumed from step 5 (local tier of process 0, {work / 'local' / '0'}" in err
    np.testing.assert_allclose(resumed["losses"], [lost[6]], rtol=1e-6)
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    restart = rows[5]
    assert (restart["restart_from"], restart["steps_recomputed"]) == (5, 1)  # the lost run had logged step 6
    assert restart["seconds_lost"] > 0 and 0 < restart["goodput"] < 1
    assert "restart from step 5: 1 steps recomputed" in err


def test_a_damaged_local_step_gives_way_to_the_persistent_tier(local_5, tiny_overrides, capfd):
    work, _ = local_5
    put_back(work, work / "pristine")
    shutil.rmtree(work / "run" / "checkpoints" / "6")
    for f in (work / "local" / "0" / "5" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    capfd.readouterr()
    resumed = train(tiers(work, tiny_overrides, "train.steps=7", *two_tiers(work, 5)))
    err = capfd.readouterr().err
    assert resumed["start_step"] == 4
    assert "note: local checkpoint step 5 of process 0 cannot be read" in err and "Traceback" not in err
    assert f"resumed from step 4 ({work / 'run' / 'checkpoints'}" in err
    saved = json.loads((work / "local" / "0" / "5" / "meta" / "metadata").read_text())  # written anew
    assert saved["loss"] == pytest.approx(resumed["losses"][0], rel=1e-6)


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_damaged_newest_local_step_gives_way_to_an_older_local_step(local_3, tiny_overrides, capfd):
    """Local steps 6 and 9 (retention 2), persistent 4 (8 and 10 lost), a half-written step 12 left by
    a kill -9: local step 9 cut short gives way, in one note, to local step 6 (newer than the
    persistent 4); steps 7-10 equal the first run's, and the persistent step and the temporary folder
    are left as they were."""
    work, first = local_3
    put_back(work, work / "pristine")
    local, ckpts = work / "local" / "0", work / "run" / "checkpoints"
    for step in ("8", "10"):
        shutil.rmtree(ckpts / step)
    cut_short(local / "9")
    tmp = half_written(local, 12)
    persistent = files_of(ckpts / "4")
    capfd.readouterr()
    resumed = train(tiers(work, tiny_overrides, "train.steps=10", *two_tiers(work, 3)))
    err = capfd.readouterr().err
    assert resumed["start_step"] == 6, err
    notes = [line for line in err.splitlines() if line.startswith("note: local checkpoint")]
    assert len(notes) == 1 and notes[0].startswith("note: local checkpoint step 9 of process 0 cannot be read (")
    assert notes[0].endswith("): trying step 6 of process 0") and "Traceback" not in err
    assert f"resumed from step 6 (local tier of process 0, {local}" in err
    np.testing.assert_allclose(resumed["losses"], [first[s] for s in range(7, 11)], rtol=1e-6)
    assert files_of(ckpts / "4") == persistent
    assert files_of(tmp) == {"state/_METADATA": b'{"tree_metadata": {'}


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_step_both_tiers_hold_resumes_from_the_persistent_one(local_3, local_5, tiny_overrides, capfd):
    """The loop saves a step to one tier only, so the tie is made by hand: persistent step 6 from a run
    of the same setup beside local step 6 (local step 9 and persistent 8 and 10 gone). The persistent
    copy is read (a run dir's own checkpoints are the ones `eval`, `export` and a person see), and the
    resume line names it."""
    work, first = local_3
    put_back(work, work / "pristine")
    ckpts = work / "run" / "checkpoints"
    for step in ("8", "10"):
        shutil.rmtree(ckpts / step)
    shutil.rmtree(work / "local" / "0" / "9")
    shutil.copytree(local_5[0] / "pristine" / "run" / "checkpoints" / "6", ckpts / "6")
    assert (work / "local" / "0" / "6").is_dir()
    capfd.readouterr()
    resumed = train(tiers(work, tiny_overrides, "train.steps=8", *two_tiers(work, 3)))
    err = capfd.readouterr().err
    assert resumed["start_step"] == 6
    assert next(line for line in err.splitlines() if line.startswith("resumed from")).startswith(
        f"resumed from step 6 ({ckpts}, loss "), err
    assert "note:" not in err and "local tier" not in err
    np.testing.assert_allclose(resumed["losses"], [first[7], first[8]], rtol=1e-6)


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


@pytest.mark.slow  # four training processes, then three, then two (the reference: 4 devices in this process)
@pytest.mark.long  # 80 s; in the default run: a lost process resumed from a local tier (the fsdp story below)
def test_a_host_lost_the_run_continues_on_fewer_processes(tmp_path, tiny_overrides):
    """4 processes, local tier every 5 steps, persistent every 50: process 3 killed with SIGKILL after
    a step drawn from 12..18 and its local dir deleted. A restart on 3 processes cannot split the global
    batch of 8: one message, exit 1, nothing lost. On 2 it resumes from a local step no more than 5
    behind the kill, and its losses to step 24 equal an uninterrupted run's on 4 devices within 1e-5."""
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
    # Any survivor's copy: process 0's save of the newest step may still be in flight when the peers stop.
    assert re.match(rf"resumed from step {r['resumed_from']} \(local tier of process [012]\b", r["resumed_line"])
    assert r["steps_recomputed"] == r["killed_at"] - r["resumed_from"] and r["seconds_lost"] > 0
    whole = reference(config, 4, 24, tmp_path)
    assert sorted(r["losses"]) == list(range(1, 25))
    assert bench.max_rel_diff(r["losses"], whole, r["resumed_from"]) < 1e-5


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, tiny_overrides):
    """(where it runs, its untouched copy, its config, its losses): 2 processes, 8 steps, local tier every
    2 (steps 4 and 6 kept), the persistent step 8 (the end, its only one) deleted. Each case damages a
    copy of it put back at the same paths: a local step records its run dir."""
    work = tmp_path_factory.mktemp("two_process_run")
    config = [*tiny_overrides, *bench.FIXED, "train.schedule_steps=400", "train.eval_every=0"]
    argv = bench.command(config, 8, 8, 2, work / "run", work / "local")
    launch = bench.Launch(argv, 2, work / "logs")
    assert launch.wait(timeout=600) == [0, 0], launch.stderr()
    shutil.rmtree(work / "run" / "checkpoints" / "8")
    assert [sorted(p.name for p in (work / "local" / str(i)).iterdir() if p.name.isdigit()) for i in (0, 1)] == [
        ["4", "6"], ["4", "6"]]
    pristine = tmp_path_factory.mktemp("pristine")
    for name in ("run", "local"):
        shutil.copytree(work / name, pristine / name)
    return work, pristine, argv, losses_of(work / "run")


@pytest.mark.slow  # two training processes per case, after the two of the run they resume
@pytest.mark.parametrize("damage, resumed, notes", [
    # A kill -9 mid-save's temporary folder is passed over without a note: the same notes as without it.
    ("process 0's copy of step 6 cut short, a half-written step 8 in both folders (kill -9 mid-save)",
     "step 6 (local tier of process 1", ["step 6 of process 0 cannot be read (*): trying step 6 of process 1"]),
    pytest.param("process 0's folder lacks step 6", "step 6 (local tier of process 1", [],  # the first case's fallback
                 marks=pytest.mark.long),
    ("both copies of step 6 cut short", "step 4 (local tier of process 0",
     ["step 6 of process 0 cannot be read (*): trying step 6 of process 1",
      "step 6 of process 1 cannot be read (*): trying step 4 of process 0"]),
])
def test_resume_takes_the_newest_step_some_process_restores_whole(two_process_run, damage, resumed, notes):
    work, pristine, argv, first = two_process_run
    put_back(work, pristine)
    local = [work / "local" / str(i) for i in (0, 1)]
    if "cut short" in damage:
        for folder in local[: 2 if damage.startswith("both") else 1]:
            cut_short(folder / "6")
    if "half-written" in damage:
        for folder in local:
            half_written(folder, 8)
    if "lacks" in damage:
        shutil.rmtree(local[0] / "6")
    untouched = {i: files_of(local[i] / "4") for i in (0, 1)}
    launch = bench.Launch(argv, 2, work / f"logs-{len(list(work.glob('logs*')))}")
    assert launch.wait(timeout=600) == [0, 0], launch.stderr()
    err = launch.stderr(0)
    assert f"resumed from {resumed}" in err and "Traceback" not in err, err
    got = [line.removeprefix("note: local checkpoint ") for line in err.splitlines() if line.startswith("note: local")]
    assert len(got) == len(notes) and all(fnmatch(g, n) for g, n in zip(got, notes)), got
    start = int(resumed.split()[1])
    after = losses_of(work / "run")
    np.testing.assert_allclose([after[s] for s in range(start + 1, 9)], [first[s] for s in range(start + 1, 9)],
                               rtol=1e-5)
    assert {i: files_of(local[i] / "4") for i in (0, 1)} == untouched


@pytest.mark.slow  # two training processes, then one (the reference: 2 devices in this process)
def test_fsdp_over_processes_a_lost_process_resumes_from_a_survivors_whole_copy(tmp_path, tiny_overrides):
    """parallel.fsdp=2 over 2 processes of one device each: each process's local step holds the whole
    state (gathered from both processes' shards), so process 1 killed after a step of 7..9 with its
    local dir deleted resumes on process 0 alone (fsdp=1: one device) from process 0's local step 5,
    and its losses equal an uninterrupted fsdp=2 run's on 2 devices within 1e-5."""
    config = [*tiny_overrides, *bench.FIXED, "train.schedule_steps=400", "train.eval_every=0", "parallel.fsdp=2"]
    kill_at = int(np.random.default_rng().integers(7, 10))
    work = tmp_path / "fsdp"
    r = bench.trial(config, 2, 1, 14, kill_at, 50, 5, work, restart_overrides=("parallel.fsdp=1",))
    assert r["resumed_from"] == 5 and r["resumed_line"].startswith("resumed from step 5 (local tier of process 0")
    assert "Traceback" not in (work / "logs-after" / "process-0.stderr").read_text()
    whole = reference(config, 2, 14, tmp_path)
    assert sorted(r["losses"]) == list(range(1, 15))
    assert bench.max_rel_diff(r["losses"], whole, r["resumed_from"]) < 1e-5


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


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
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


@pytest.mark.slow  # two training processes, one refused restart, then one (the reference: 2 devices in this process)
@pytest.mark.long  # 65 s; in the default run: the choice of micro-batches (above) and a lost process resumed (fsdp)
def test_a_restart_whose_device_cannot_hold_its_share_adds_microbatches(tmp_path, tiny_overrides):
    """2 processes fit parallel.device_memory_gib with the whole batch; one killed after a step of 7..9,
    the restart on 1 cannot hold 8 rows: it resumes with 2 micro-batches, says so in its resume line, and
    its losses equal an uninterrupted run's on 2 devices within 1e-5. A limit no count fits is one message,
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
    whole = reference(config, 2, 14, tmp_path)
    assert sorted(r["losses"]) == list(range(1, 15))
    assert bench.max_rel_diff(r["losses"], whole, r["resumed_from"]) < 1e-5
