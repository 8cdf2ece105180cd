"""`python -m boost_jax.study`: refusals, the learning-rate search, the fit, and a micro study that
pins grid extension, seeds and resume (llama-tiny, a handful of steps)."""

import json
import math
import shutil

import numpy as np
import pytest

from boost_jax.comparison import fit
from boost_jax.comparison.grid import search
from boost_jax.comparison.report import analyse
from boost_jax.study import main, study


@pytest.fixture
def micro(tiny_overrides, tmp_path):
    """A study of seconds: llama-tiny cola under adamw, 4 steps of 4 x 32 tokens, checkpoints every 2
    steps, rates 1e-3 and 3e-3 (too low for 4 steps: the search must climb, one extension at most), 2 seeds."""
    keep = [o for o in tiny_overrides if o.split("=")[0] not in ("model.preset", "train.lr", "train.warmup_steps",
                                                                  "train.batch_size", "train.seq_len")]
    return [*keep, "train.batch_size=4", "train.seq_len=32", "checkpoint.every=2", "study.presets=[llama-tiny]",
            "study.archs=[cola]", "study.optimizers=[adamw]", "study.tokens=[512]", "study.tokens_unit=absolute",
            "study.lrs=[1e-3,3e-3]", "study.max_extensions=1", "study.seeds=2", "study.eval_tokens=1024",
            "study.early_below=0", "study.bootstrap=50", f"study.dir={tmp_path / 'study'}"]


def test_search_extends_the_grid_until_the_best_is_interior():
    calls = []
    loss = lambda lr: calls.append(lr) or (math.log(lr) - math.log(0.05)) ** 2
    s = search([1e-3, 3e-3], loss, max_extensions=5)
    # x3 upward while the top rate is best; 0.081 beats 0.027 (closer to 0.05 in log), 0.243 does not
    assert calls == [1e-3, 3e-3, 9e-3, 2.7e-2, 8.1e-2, 0.243]
    assert s.best == 8.1e-2 and s.bracketed and s.extensions == 4
    assert s.lrs == tuple(sorted(calls)) and s.losses == tuple(loss(lr) for lr in s.lrs)
    capped = search([1e-3, 3e-3], loss, max_extensions=1)
    assert capped.best == 9e-3 and not capped.bracketed and capped.extensions == 1
    # a diverged run (None) is the worst loss: the search goes down, by the grid's ratio at that end
    down = search([0.1, 0.3], lambda lr: None if lr > 0.2 else (math.log(lr) - math.log(0.05)) ** 2, 3)
    assert down.lrs == (0.0111111, 0.0333333, 0.1, 0.3) and down.best == 0.0333333 and down.bracketed
    assert down.losses[-1] == math.inf


def synthetic_rows(rng: np.random.Generator, multiplier: float) -> list[dict]:
    """dense on L = E + A C^-alpha, cola on the same law at `multiplier` x its compute (it reaches dense's
    loss at 1/multiplier of dense's compute), 6 budgets, 3 seeds each with noise of sd 0.004."""
    compute = np.geomspace(1e12, 1e15, 6)
    law = lambda c: 2.0 + 40.0 * c ** -0.12
    rows = []
    for arch, k in (("dense", 1.0), ("cola", multiplier)):
        for c in compute:
            seeds = [law(k * c) + rng.normal(0, 0.004) for _ in range(3)]
            rows.append({"arch": arch, "optimizer": "adamw", "train_flops": float(c), "seeds": seeds,
                         "mean": float(np.mean(seeds)), "early": False})
    return rows


def test_fit_recovers_a_known_compute_multiplier():
    covered = 0
    for draw in range(10):
        fits, mults = analyse(synthetic_rows(np.random.default_rng(draw), 2.5), n=100, coverage=0.9)
        assert {f["curve"]: f["form"] for f in fits} == {"dense/adamw": fit.SATURATING, "cola/adamw": fit.SATURATING}
        (m,) = mults
        assert (m["of"], m["against"]) == ("cola/adamw", "dense/adamw") and abs(m["value"] - 2.5) < 0.25
        covered += m["interval"][0] <= 2.5 <= m["interval"][1]
    # A 90% interval from 3 seeds per cell covers the truth in 8 of these 10 draws (80% in 40 draws)
    assert covered >= 8


def test_fit_takes_the_simplest_form_the_points_support():
    assert fit.fit([1e12, 1e13], [4.0, 3.0]).form == fit.POWER
    assert fit.fit([1e12], [4.0]) is None
    c = np.geomspace(1e12, 1e15, 5)
    f = fit.fit(c, 2.0 + 40.0 * c ** -0.12)
    assert f.form == fit.SATURATING and abs(f.E - 2.0) < 0.05 and abs(f.alpha - 0.12) < 0.02


@pytest.mark.parametrize("override,message", [
    ("study.archs=[dense,conv]", "study.archs: unknown arch 'conv'"),
    ("study.optimizers=[adamw,sgd]", "study.optimizers: unknown optimizer 'sgd'"),
    ("study.presets=[llama-huge]", "study.presets: unknown preset 'llama-huge'"),
    ("study.archs=[]", "study.archs: empty axis"),
    ("study.tokens=[0]", "study.tokens: budget 0.0 is not positive"),
    ("study.seeds=0", "study.seeds: must be >= 1"),
    ("study.lrs=[1e-3]", "study.lrs: [0.001] is one value"),
    ("study.eval_tokens=100000000", "study.eval_tokens=100,000,000: the validation split of"),
    ("train.lr=1e-3", "train.lr: the study sets it for each run"),
])
def test_bad_input_is_refused_with_one_message_and_nothing_written(micro, tmp_path, capsys, override, message):
    with pytest.raises(SystemExit) as e:
        main([*micro, override])
    assert message in str(e.value) and str(e.value).count("\n") == 1  # the message, then the --debug hint
    assert not (tmp_path / "study").exists()


def test_a_study_dir_of_another_spec_is_refused_by_name(micro, tmp_path):
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "study.json").write_text(json.dumps({"study": {"seeds": 5}, "run": {}}))
    with pytest.raises(SystemExit, match="holds the runs of another spec .*study.seeds"):
        main(micro)
    assert sorted(p.name for p in (tmp_path / "study").iterdir()) == ["study.json"]


def test_micro_study_extends_the_grid_runs_every_seed_and_resumes_exactly(micro, tmp_path, monkeypatch):
    out = study(micro, log=lambda line: None)
    cells = out["cells"]
    assert [(c["arch"], c["optimizer"]) for c in cells] == [("cola", "adamw")]
    for c in cells:
        # 1e-3 and 3e-3 are too low for 4 steps: the grid grows upward by x3, once (the cap)
        assert c["lr_grid"] == [1e-3, 3e-3, 9e-3] and c["extensions"] == 1
        assert c["bracketed"] == (c["lr_grid"][0] < c["best_lr"] < c["lr_grid"][-1])
        assert c["lr_losses"][c["lr_grid"].index(c["best_lr"])] == min(c["lr_losses"]) == c["seeds"][0]
        assert len(c["seeds"]) == 2 and c["seeds"][0] != c["seeds"][1]  # another init and data order
        assert c["tokens"] == 512 and all(b is not None and 0 < b < 20 for b in c["bits_per_byte"])
        runs = tmp_path / "study" / "llama-tiny" / f"{c['arch']}-adamw" / "budget512"
        assert sorted(p.name for p in runs.iterdir()) == sorted(
            [f"lr{lr:g}-seed0" for lr in c["lr_grid"]] + [f"lr{c['best_lr']:g}-seed1"])
    assert json.loads(json.dumps(out))["cells"][0]["seeds"] == cells[0]["seeds"]

    # A kill after step 2's checkpoint of the last run: its result and its step-4 checkpoint gone.
    last = tmp_path / "study" / "llama-tiny" / "cola-adamw" / "budget512" / f"lr{cells[0]['best_lr']:g}-seed1"
    (last / "study_result.json").unlink()
    shutil.rmtree(last / "checkpoints" / "4")
    import boost_jax.train

    trained = []
    real = boost_jax.train.train
    monkeypatch.setattr(boost_jax.train, "train", lambda cfg, *a, **k: trained.append(cfg.run_dir) or real(cfg, *a, **k))
    again = study(micro, log=lambda line: None)
    assert trained == [str(last)]  # every finished run is read back, not recomputed
    assert again["cells"] == cells  # the resumed run ends bit for bit where the uninterrupted one did
    assert '"step": 2' in (last / "metrics.jsonl").read_text()


def product_update(name: str, a, b, g_w, c: float):
    """The first step's update of the product A B (to first order, dA B + A dB) under `name`, for the
    pair rescaled to (cA, B/c): the same function, with the chain rule's gradients G_W B^T / c and c A^T G_W."""
    import jax.numpy as jnp

    from boost_jax.config import TrainConfig
    from boost_jax.training.optimizers import make_optimizer

    a, b = c * a, b / c
    params = {"layers": {"q": {"a": a, "b": b}}}
    grads = {"layers": {"q": {"a": jnp.einsum("lio,lro->lir", g_w, b), "b": jnp.einsum("lir,lio->lro", a, g_w)}}}
    opt = make_optimizer(TrainConfig(optimizer=name, grad_clip=0.0, weight_decay=0.0, warmup_steps=0), params)
    u, _ = opt.update(grads, opt.init(params), params)
    da, db = u["layers"]["q"]["a"], u["layers"]["q"]["b"]
    return jnp.einsum("lir,lro->lio", da, b) + jnp.einsum("lir,lro->lio", a, db)


@pytest.mark.parametrize("name,invariant", [("muon", False), ("spectron", False), ("invariant_muon", True)])
def test_only_the_invariant_update_ignores_how_a_pair_splits_its_scale(name, invariant):
    """(cA, B/c) is the same function as (A, B): invariant_muon moves the product the same way at every
    c; muon and spectron do not (their steps depend on the split)."""
    import jax

    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    a, b = jax.random.normal(ka, (2, 48, 12)) * 0.2, jax.random.normal(kb, (2, 12, 40)) * 0.2
    g_w = jax.random.normal(kg, (2, 48, 40))
    base = product_update(name, a, b, g_w, 1.0)
    for c in (0.1, 5.0):
        moved = product_update(name, a, b, g_w, c)
        rel = float(np.linalg.norm(moved - base) / np.linalg.norm(base))
        assert (rel < 1e-3) if invariant else (rel > 0.1), (name, c, rel)
    if invariant:  # and the product moves no more than Muon moves a dense 48 x 40 matrix (lr x 0.2 sqrt(48))
        top = max(float(np.linalg.norm(np.asarray(base[i]), 2)) for i in range(2))
        assert top <= 1.25 * 3e-3 * 0.2 * 48 ** 0.5


@pytest.mark.slow
def test_a_study_killed_mid_run_and_rerun_ends_with_the_uninterrupted_numbers(micro, tmp_path):
    """kill -9 while a run is between its checkpoints; the rerun reads back the finished runs, resumes
    the cut one and ends with the numbers of a study that was never killed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    killed = [o for o in micro if not o.startswith("study.dir=")] + [f"study.dir={tmp_path / 'killed'}"]
    command = [sys.executable, "-m", "boost_jax.study", *killed, "--json"]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = tmp_path / "killed" / "llama-tiny" / "cola-adamw" / "budget512"
    cut = lambda: [r for r in runs.glob("*") if (r / "checkpoints" / "2").is_dir() and not (r / "study_result.json").exists()
                   and len(list(runs.glob("*/study_result.json"))) >= 1]
    deadline = time.monotonic() + 600
    while not cut() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None, "the study ended before a run was caught between checkpoints"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    finished = {r.name: (r / "study_result.json").stat().st_mtime_ns for r in runs.glob("*") if (r / "study_result.json").exists()}
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    again = json.loads(out.stdout)
    assert {r: (runs / r / "study_result.json").stat().st_mtime_ns for r in finished} == finished  # not recomputed
    assert again["cells"] == study(micro, log=lambda line: None)["cells"]


def test_a_runs_final_factor_spectra_come_from_its_last_health_row(tmp_path):
    from boost_jax.comparison.runs import final_spectra
    from boost_jax.config import load_config

    cfg = load_config(None, ["model.preset=llama-tiny", "train.steps=20", f"run_dir={tmp_path}"])
    rows = [{"step": 10, "loss": 5.0, "stable_rank/attn": 3.0},
            {"step": 20, "loss": 4.0, "spectral_a/attn": 1.5, "spectral_b/mlp": 2.5, "stable_rank/attn": 2.0,
             "update_spectral_a/attn": 0.1, "grad_norm/attn": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert final_spectra(cfg) == {"spectral_a/attn": 1.5, "spectral_b/mlp": 2.5, "stable_rank/attn": 2.0}
