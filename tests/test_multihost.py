"""`python -m boost_jax.train` as two processes on JAX's distributed runtime (CPU, gloo, 127.0.0.1)."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from boost_jax.config import load_config
from boost_jax.training.run import train


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_reproduce_one(tmp_path, tiny_overrides):
    common = [*tiny_overrides, "train.steps=4", "checkpoint.every=0", "train.eval_every=0", "log.every=1",
              "parallel.tp=4", "parallel.scheme=btp"]
    run_dir, port = tmp_path / "two", free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "boost_jax.train", *common, f"run_dir={run_dir}", "parallel.cpu_devices=4",
             f"parallel.coordinator=127.0.0.1:{port}", "parallel.num_processes=2", f"parallel.process_id={i}"],
            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "of 8 x cpu" in outputs[0]  # one mesh over both processes' devices (dp=2 x tp=4)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    one = train(load_config(None, [*common, f"run_dir={tmp_path / 'one'}"]))  # one process, 8 devices
    assert jax.device_count() == 8
    np.testing.assert_allclose(losses, one["losses"], rtol=1e-5)
