"""A full disk (a size-limited tmpfs mounted where a run, dataset or export writes): a checkpoint
save, a metrics row, a TensorBoard event, `data prepare` and `export` that hit ENOSPC each end with
one message naming the path, the space free and needed; nothing committed before is damaged, and
after space is freed the same command goes on. A checkpoint folder made read-only mid-run is named
likewise. Skipped, with the reason, where mounting is not allowed."""

import contextlib
import subprocess
import sys

import jax
import pytest
from conftest import train_tiny

from boost_jax import api
from boost_jax.config import load_config
from boost_jax.runtime.errors import DiskFullError
from boost_jax.training.run import train


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` at `path`; `grow(size)` frees space by remounting it larger."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                           text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mount.stderr.strip() or mount.returncode}")
    try:
        yield lambda bigger: subprocess.run(["mount", "-o", f"remount,size={bigger}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)])


def config(run_dir, tiny_overrides, *extra):
    return load_config(None, [*tiny_overrides, f"run_dir={run_dir}", "train.eval_every=0", "parallel.dp=1", *extra])


def steps_in(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow  # a training process and a rerun
def test_a_checkpoint_save_on_a_full_disk(tmp_path, tiny_overrides):
    """llama-tiny's checkpoint is ~1.2 MB: two fit in 2.5 MB, the third does not."""
    run_dir = tmp_path / "run"
    args = [*tiny_overrides, f"run_dir={run_dir}", "train.eval_every=0", "parallel.dp=1", "parallel.cpu_devices=1",
            "train.steps=6", "checkpoint.every=2"]
    with small_disk(run_dir / "checkpoints", "2500k") as grow:
        proc = subprocess.run([sys.executable, "-m", "boost_jax.train", *args], capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-2]  # then the --debug hint
        assert last.startswith(f"disk full: no space left writing a checkpoint to {run_dir / 'checkpoints'}: "), last
        assert "MB free on its device, about 1.2 MB needed; the committed checkpoints (steps [2, 4])" in last, last
        assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr
        assert steps_in(run_dir) == [2, 4]
        grow("16m")
        resumed = train(config(run_dir, tiny_overrides, "train.steps=6", "checkpoint.every=2"), jax.devices()[:1])
        assert resumed["start_step"] == 4 and len(resumed["losses"]) == 2 and steps_in(run_dir) == [2, 4, 6]


@pytest.mark.slow  # a run until the disk is full, and a rerun
@pytest.mark.parametrize("where, what, extra", [
    ("", "metrics rows", ["log.tensorboard=false", "checkpoint.every=0"]),
    ("tensorboard", "TensorBoard events", ["log.tensorboard=true", "checkpoint.every=0"]),
])
def test_a_metrics_row_or_event_on_a_full_disk(where, what, extra, tmp_path, tiny_overrides, capfd):
    run_dir = tmp_path / "run"
    size = "40k" if not where else "8k"  # the run dir holds config.yaml and tokenizer.json (~20 kB) too
    with small_disk(run_dir / where if where else run_dir, size) as grow:
        with pytest.raises(DiskFullError, match=rf"no space left writing {what} to {run_dir / where}"):
            train(config(run_dir, tiny_overrides, "train.steps=200", "log.every=1", "log.health=true", *extra),
                  jax.devices()[:1])
        assert "Exception in thread" not in capfd.readouterr().err
        grow("16m")
        again = train(config(run_dir, tiny_overrides, "train.steps=3", "log.every=1", *extra), jax.devices()[:1])
    assert again["start_step"] == 0 and len(again["losses"]) == 3


@pytest.mark.slow  # a prepare and a run, each twice
def test_prepare_and_export_on_a_full_disk(tmp_path, tiny_overrides):
    from boost_jax.data.__main__ import main as data_main
    from boost_jax.export import export
    from boost_jax.model.run_dir import open_run

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * 7}\n\n" for i in range(20000)))
    out = tmp_path / "prepared"
    one_doc = ["--val-fraction", "0"]  # one text file is one document: none to hold out
    with small_disk(out, "64k") as grow:
        with pytest.raises(SystemExit, match=rf"disk full: no space left writing the prepared dataset to {out}"):
            data_main(["prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--workers", "1", *one_doc])
        grow("32m")
        data_main(["prepare", str(corpus), "--out", str(out), "--vocab-size", "300", "--workers", "1", *one_doc])
        assert (out / "index.json").is_file()
    run = train_tiny(tmp_path / "run", tiny_overrides)
    with small_disk(tmp_path / "export", "256k") as grow:
        with pytest.raises(DiskFullError, match=r"no space left writing the export to .*export: .* MB needed; no part"):
            export(open_run(run), tmp_path / "export")
        assert not any((tmp_path / "export").iterdir())
        grow("32m")
        assert export(open_run(run), tmp_path / "export") == 4
    assert api.restore(run)[2] == 4  # the run dir was only read


@pytest.mark.slow  # a training process and a rerun: ~40 s
def test_a_checkpoint_folder_made_read_only_mid_run(tmp_path, tiny_overrides):
    """Remounted read-only while saves are in flight (4 devices: many writer tasks, each failing): one
    message naming the folder and the committed steps, exit 1 within seconds, no traceback; made
    writable again, the same command resumes from the newest committed step. The step folder is made
    in `save` (model/checkpoint.py): made by Orbax's background thread, a refused one left its
    writer threads waiting 300 s for it, and the process with them, in 2 of 6 runs."""
    from test_long_runs import run_cli, wait_for_step

    run_dir = tmp_path / "run"
    args = ["parallel.cpu_devices=4", "parallel.dp=4", "train.steps=40", "checkpoint.every=1", "checkpoint.keep=2"]
    with small_disk(run_dir / "checkpoints", "64m"):
        proc = run_cli(run_dir, tiny_overrides, *args)
        wait_for_step(run_dir, 3, proc)
        subprocess.run(["mount", "-o", "remount,ro", str(run_dir / "checkpoints")], check=True)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"still running 60 s after its folder was made read-only: {proc.communicate()[1]}")
        assert proc.returncode == 1, err
        committed = steps_in(run_dir)
        assert committed and err.strip().splitlines()[-2] == (
            f"checkpoint error: cannot write a checkpoint in {run_dir / 'checkpoints'}: Read-only file system; the "
            f"committed checkpoints (steps {committed}) are untouched. Make the folder writable and rerun the same "
            f"command to resume from step {committed[-1]}"), err
        assert "Traceback" not in err and "ERROR" not in err, err
        subprocess.run(["mount", "-o", "remount,rw", str(run_dir / "checkpoints")], check=True)
        resumed = train(config(run_dir, tiny_overrides, "train.steps=8", "checkpoint.every=4"), jax.devices()[:1])
        assert resumed["start_step"] == committed[-1]
