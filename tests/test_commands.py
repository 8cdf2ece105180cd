"""One vocabulary: every command reads the train config (an optional YAML file, then
`section.key=value`), `train.batch_size` is global everywhere, and the flags that once spelled a
config key are refused with the key to write."""

import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
import yaml

from boost_jax.bench import comm, step
from boost_jax.config import ConfigError, from_args
from boost_jax.launch.startup import PHASES, Startup
from boost_jax.plan import parse as parse_plan

TINY = ["model.preset=llama-tiny", "model.arch=cola", "train.seq_len=32"]


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_comm_reads_the_train_config(capsys):
    comm.main([*TINY, "parallel.tp=2", "parallel.dp=2", "train.batch_size=8", "model.dtype=bfloat16", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert (r["tp"], r["dp"], r["batch"], r["dtype"]) == (2, 2, 8, "bfloat16")  # batch: global, as in train
    # 4 rows per replica: the latents of 4 x 32 tokens, 7 x 16 wide, bf16 (+ the norm's statistic column).
    assert r["analytic_layer_forward_bytes"] == 4 * 32 * 7 * 16 * 2


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_step_runs_a_recipe_as_is(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"preset": "llama-tiny", "arch": "cola"},
                                      "train": {"batch_size": 8, "seq_len": 32, "remat": "lowrank"},
                                      "parallel": {"scheme": "btp", "tp": 2, "dp": 2, "fsdp": 1},
                                      "log": {"health": False}}))  # most of the step's compile, no part of the test
    step.main([str(recipe), "--reps", "1", "--steps", "1", "--json"])
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert (r["tp"], r["dp"], r["fsdp"], r["batch"], r["seq"]) == (2, 2, 1, 8, 32)
    assert r["median_step_s"] > 0 and r["peak_bytes_per_device"] > 0


@pytest.mark.slow  # a narrow planner search, then its recipe timed
def test_bench_step_runs_the_planners_own_recipe(tmp_path, cache_dir, capsys):
    """In this process (the commands' own processes are no part of the claim; one worker: no pool to start)."""
    from boost_jax import plan

    recipe = tmp_path / "recipe.yaml"
    plan.main([*TINY, "train.batch_size=8", f"data.cache_dir={cache_dir}", "--gpus", "4", "--tp", "2", "--pp", "1",
               "--cp", "1", "--remat", "none", "--schemes", "btp", "--hardware", "a100-80gb", "--workers", "1",
               "--out", str(recipe)])
    assert f"wrote {recipe}" in capsys.readouterr().out
    layout = yaml.safe_load(recipe.read_text())["parallel"]
    step.main([str(recipe), "log.health=false", "--reps", "1", "--steps", "1", "--json"])  # health: compile, no part of it
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert (r["tp"], r["dp"], r["fsdp"]) == (layout["tp"], layout["dp"], layout["fsdp"]) and r["tp"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-7b"], "--model is not a flag any more: write model.preset=NAME"),
    (["--batch=4"], "--batch is not a flag any more: write train.batch_size=N (global"),
    (["--dtype", "bf16"], "--dtype is not a flag any more: write model.dtype=float32|bfloat16"),
])
def test_flags_that_spelled_a_config_key_name_the_key(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("|", r"\|")):
        comm.main(argv)


def test_the_planner_chooses_the_layout_keys_itself(tmp_path):
    recipe = tmp_path / "base.yaml"
    recipe.write_text("train:\n  remat: full\n")
    for config in (["parallel.tp=2"], [str(recipe)]):
        with pytest.raises(ConfigError, match="the planner chooses the layout keys"):
            parse_plan([*config, "--gpus", "4"])
    a = parse_plan(["model.preset=llama-tiny", "train.batch_size=8", "--gpus", "4", "--tp", "1,2"])
    assert a.tp == (1, 2) and from_args(a.config).train.batch_size == 8


@pytest.mark.slow  # a process compiling llama-7b on abstract inputs: ~5 s
def test_bench_comm_of_the_paper_model_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "boost_jax.bench", "comm", "model.preset=llama-7b", "model.arch=cola",
                          "parallel.tp=4", "parallel.scheme=btp", "train.seq_len=4096", "train.batch_size=4",
                          "model.dtype=bfloat16", "--json"], capture_output=True, text=True, check=True, cwd=tmp_path)
    r = json.loads(out.stdout)
    # The BOOST paper's per-layer forward volume at LLaMA-7B, b=4, s=4096, p=4, bf16: b*s*7r elements.
    assert r["analytic_layer_forward_bytes"] == 4 * 4096 * 7 * 1024 * 2
    assert r["layer_forward_collectives"] == 4 and r["forward_over_analytic"] == pytest.approx(1.0003, abs=1e-4)


def test_bench_step_hf_is_refused_early_for_what_hugging_face_cannot_run():
    with pytest.raises(ConfigError, match="--hf needs a model Hugging Face calls a LLaMA"):
        step.main([*TINY, "parallel.dp=1", "--hf"])  # cola
    with pytest.raises(ConfigError, match="--hf times one device without accumulation"):
        step.main(["model.preset=llama-tiny", "model.arch=dense", "train.seq_len=32", "parallel.dp=2", "--hf"])


def test_bench_hf_without_torch_names_the_packages_before_any_work(monkeypatch):
    import importlib.util

    from boost_jax.bench import decode
    from boost_jax.runtime.errors import PackageError

    find = importlib.util.find_spec  # neither installed, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "transformers") else find(name, *a))
    dense = ["model.preset=llama-tiny", "model.arch=dense", "train.seq_len=32", "parallel.dp=1", "--hf"]
    for command in (step, decode):
        with pytest.raises(PackageError, match=r"--hf needs torch and transformers; not installed: torch, transformers "
                                               r"\(pip install torch transformers\)"):
            command.main(dense)


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_step_hf_trains_the_same_model_on_the_same_batch(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    step.main(["model.preset=llama-tiny", "model.arch=dense", "train.seq_len=32", "train.batch_size=2",
               "parallel.dp=1", "model.dtype=float32", "log.health=false", "--hf", "--reps", "1", "--steps", "1", "--json"])
    ours, theirs = json.loads(capsys.readouterr().out)["results"]
    assert theirs["variant"] == "transformers+torch" and theirs["median_step_s"] > 0
    # The same initial weights (exported), batch, optimizer and schedule: the same losses, before and
    # after the updates (3 steps each).
    assert theirs["first_loss"] == pytest.approx(ours["first_loss"], rel=1e-5)
    assert theirs["last_loss"] == pytest.approx(ours["last_loss"], rel=1e-4) and ours["last_loss"] < ours["first_loss"]


# Run in this process, the command's module is already imported (by other tests): runpy says so.
@pytest.mark.filterwarnings("ignore:'boost_jax.eval' found in sys.modules:RuntimeWarning")
def test_python_m_boost_jax_lists_every_command_in_one_line_each(capsys, monkeypatch):
    """`python -m boost_jax` lists the commands (every module run as a program, and nothing else);
    `python -m boost_jax COMMAND ...` runs that command."""
    from pathlib import Path

    from boost_jax import __main__ as commands

    root = Path(commands.__file__).parent
    runnable = {p.stem for p in root.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()} - {"__main__"}
    runnable |= {p.parent.name for p in root.glob("*/__main__.py")}
    assert set(commands.COMMANDS) == runnable
    out = subprocess.run([sys.executable, "-m", "boost_jax"], capture_output=True, text=True, check=True, cwd=root.parent)
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(commands.COMMANDS)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command runs with its own
    with pytest.raises(SystemExit) as e:
        commands.main(["eval", "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m boost_jax.eval ")
    with pytest.raises(SystemExit, match="unknown command 'config.yaml': choose one of train, data"):
        commands.main(["config.yaml"])


def test_train_answers_help_and_a_config_error_without_jax():
    """`train` is a thin command: its help and a config error come before JAX (or the loop) is imported."""
    code = ("import sys\nfrom boost_jax.train import main\nmain(['--help'])\n"
            "try:\n    main(['train.lr=[1,'])\nexcept SystemExit as e:\n    print(e.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax', 'orbax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Every key is documented in" in out.stdout
    assert "config error: override 'train.lr=[1,': not valid YAML" in out.stdout
    assert out.stdout.splitlines()[-1] == "[]"


def test_the_start_up_splits_its_seconds_into_phases():
    startup = Startup()
    time.sleep(0.05)
    startup.lap("data")
    jax.jit(lambda x: x * 3 - 1)(jnp.arange(7.0)).block_until_ready()  # a program of its own: traced and compiled here
    startup.lap("run")
    took = startup.seconds()
    assert took["data"] >= 0.05 and 0 <= took["run"] < took["compile"] and took["restore"] == 0
    assert took["total"] == pytest.approx(sum(took[k] for k in PHASES), abs=0.01)
    with pytest.raises(ValueError, match="unknown start-up phase 'load'"):
        startup.lap("load")


def test_a_start_up_line_reads_back():
    from boost_jax.launch.startup import PHASES, line, parse_line

    seconds = {"import": 2.5, "data": 0.25, "restore": 0.5, "compile": 1.75, "run": 0.125, "total": 5.125}
    text = f"noise\n{line({k: 9.0 for k in seconds}, 'first step')}\n{line(seconds, 'first step')}\nstep 1/2 | loss 6.5\n"
    assert parse_line(text) == {k: round(v, 2) for k, v in seconds.items()}  # the last line, at its 2 decimals
    assert list(parse_line(text)) == [*PHASES, "total"] and parse_line("no line") is None


@pytest.mark.slow  # three fresh processes of the commands (all three commands: seven, 65 s)
def test_bench_startup_times_each_command_cold_then_warm(tmp_path, tiny_overrides, monkeypatch):
    """The bench's rows are self-consistent, and its warm run is warm: it reads every program the cold
    run compiled into the command's cache folder and compiles none of its own. (Which is faster is the
    results page's measurement: on a loaded machine a warm run's seconds can exceed a cold one's.)
    `generate` alone: it reads the run the bench trains first, and compiles the most programs."""
    from boost_jax.bench import startup

    cached, timed = [], startup.timed  # each run's cache folder as the run left it
    monkeypatch.setattr(startup, "timed", lambda argv, cache, log: (
        timed(argv, cache, log), cached.append(sorted(p.name for p in cache.iterdir())))[0])
    r = startup.measure(list(tiny_overrides), 2, tmp_path, log=lambda s: None, names=("generate",))
    assert [row["command"] for row in r["rows"]] == ["generate"]
    for row, (cold, warm) in zip(r["rows"], zip(cached[1::2], cached[2::2])):  # after the run the others read
        for run in (row["cold"], row["warm"]):
            assert run["wall_s"] > run["startup_s"]["total"] > 0 and run["startup_s"]["compile"] >= 0
            # each phase and the total are printed to 0.01 s: their rounding adds up to half a step each
            assert run["startup_s"]["total"] == pytest.approx(sum(run["startup_s"][k] for k in PHASES),
                                                              abs=0.005 * (len(PHASES) + 1))
        assert cold and warm == cold, row["command"]  # programs cached by the cold run, none added by the warm one
        assert row["warm_over_cold"] == row["warm"]["wall_s"] / row["cold"]["wall_s"]
    assert startup.table(r)[2].startswith("| generate | ")


@pytest.mark.parametrize("argv, needle", [
    (["soak", "--every-s", "nan"], "--every-s must be a finite number above 0, got nan"),
    (["soak", "--rss-bound", "-1"], "--rss-bound must be a finite number above 0, got -1.0"),
    (["soak", "--rss-bound", "nan"], "--rss-bound must be a finite number above 0, got nan"),
    (["soak", "--warmup", "nan"], "--warmup must be a share of the steps"),
    (["startup", "--work", "FILE"], "is a file: name a folder"),
    (["startup", "--commands", "train,serve"], "--commands train,serve: unknown command 'serve'; choose from train, eval"),
    (["startup", "--commands", "eval,eval"], "--commands eval,eval: a command named twice"),
])
def test_bench_soak_and_startup_refuse_bad_flags_before_any_run(tmp_path, argv, needle):
    from importlib import import_module

    (tmp_path / "file").write_text("")
    argv = [str(tmp_path / "file") if a == "FILE" else a for a in argv]
    with pytest.raises(ConfigError, match=needle):
        import_module(f"boost_jax.bench.{argv[0]}").main(argv[1:])
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_benchmarks_child_passes_its_own_message_through():
    from boost_jax.bench.common import child_failed
    from boost_jax.runtime.errors import BoostJaxError

    message = "config error: run_dir: x cannot be a folder"
    stderr = f"{message}\n(rerun with --debug or BOOST_JAX_DEBUG=1 for the traceback)\n"
    clean = child_failed("bench startup: python -m boost_jax.train", 1, stderr)
    assert isinstance(clean, BoostJaxError) and str(clean).endswith(f"stopped:\n{message}")
    bug = child_failed("bench startup: python -m boost_jax.train", 1, "Traceback (most recent call last):\nKeyError: 3")
    assert type(bug) is RuntimeError and "KeyError: 3" in str(bug)


def test_bench_soak_stops_its_training_run_when_the_watch_fails(monkeypatch):
    """An error while the run is watched (Ctrl-C, a sampling bug) ends the training process too."""
    from boost_jax.bench import soak

    started = []

    def fail(proc, *args):
        started.append(proc)
        raise KeyboardInterrupt

    monkeypatch.setattr(soak, "watch", fail)
    with pytest.raises(KeyboardInterrupt):
        soak.soak([], 10, 1, 1, 1.0, 0.1, 0.05)
    assert started[0].poll() is not None
