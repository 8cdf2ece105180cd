"""`pip install .` ships everything the commands read: a wheel built from the checkout, installed
alone into a folder, plans a layout and trains a step from a directory outside the checkout."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow  # a wheel build and three processes: ~40 s
def test_a_wheel_plans_and_trains_outside_the_checkout(tmp_path, cache_dir):
    dist, site, work = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)], check=True,
                   capture_output=True, cwd=tmp_path)
    (wheel,) = dist.glob("boost_jax-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    assert (site / "boost_jax" / "configs" / "hardware.yaml").is_file()
    assert (site / "boost_jax" / "configs" / "chatml.jinja").is_file()  # data.chat_template=chatml
    # The wheel's package, not the checkout's: the installed folder comes first on the path.
    env = {**os.environ, "PYTHONPATH": str(site), "BOOST_JAX_CACHE": str(tmp_path / "cache")}
    run = lambda *args: subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=work, env=env)
    where = run("-c", "import boost_jax; print(boost_jax.__file__)")
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr

    tiny = ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=4", "train.seq_len=32"]
    plan = run("-m", "boost_jax.plan", *tiny, "--gpus", "2", "--schemes", "btp", "--tp", "1", "--pp", "1",
               "--remat", "none", "--out", "recipe.yaml")
    assert plan.returncode == 0, plan.stderr
    assert "wrote recipe.yaml" in plan.stdout and (work / "recipe.yaml").is_file()
    trained = run("-m", "boost_jax.train", "recipe.yaml", "train.steps=1", "train.eval_every=0", "checkpoint.every=0",
                  "data.max_bytes=300000", f"data.cache_dir={cache_dir}", "log.progress=false", "log.tensorboard=false",
                  "parallel.cpu_devices=2", "run_dir=run")
    assert trained.returncode == 0, trained.stderr
    assert "step 1/1" in trained.stderr and (work / "run" / "metrics.jsonl").is_file()
