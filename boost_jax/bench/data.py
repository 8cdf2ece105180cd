"""`bench data [CONFIG.yaml] [section.key=value ...]`: the data pipeline's cost.

  prepare   MB/s and tokens/s of `prepare` on a generated .jsonl corpus
  loader    time to read one batch against the train step's time (the config's model and batch,
            e.g. model.preset=llama-60m train.batch_size=16 train.seq_len=256)
  memory    resident memory of a process reading a 10^9-token synthetic dataset vs a 10^7 one,
            and of whole training runs on 10^8 vs 10^6 tokens (each in a fresh process)

Synthetic datasets are written under --tmp and deleted afterwards (10^9 tokens = 2 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from boost_jax.bench.common import parse, parser, train_to_end
from boost_jax.config import ConfigError, from_args
from boost_jax.data.build import build_data
from boost_jax.data.corpus import files_corpus
from boost_jax.data.prepare import PrepareConfig, prepare
from boost_jax.data.synthetic import write_synthetic
from boost_jax.runtime.paths import check_writable_dir
from boost_jax.runtime.units import MIB

_SHARD = 1 << 27  # tokens per synthetic shard (256 MB of uint16)

# Run in a fresh interpreter so its RSS holds only what reading the dataset costs.
_READ = """
import json, sys, time, psutil
from boost_jax.config import DataConfig
from boost_jax.data.build import build_data
rss = lambda: psutil.Process().memory_info().rss / 2**20
before = rss(); t0 = time.perf_counter()
data = build_data(DataConfig(source="prepared", path=sys.argv[1]), vocab_size=32000, seq_len=256, seed=0)
opened = time.perf_counter() - t0; after_open = rss()
it = data.train.batches(0, 16)
t0 = time.perf_counter()
for _ in range(int(sys.argv[2])): next(it)
read = (time.perf_counter() - t0) / int(sys.argv[2])
print(json.dumps({"tokens": data.stats["train_tokens"], "open_s": opened, "rss_before_mb": before,
                  "rss_open_mb": after_open, "rss_read_mb": rss(), "batch_ms": 1e3 * read}))
"""
_TRAIN = """
import json, resource, sys, time
from boost_jax.train import main
t0 = time.perf_counter(); main(sys.argv[1:])
print(json.dumps({"wall_s": time.perf_counter() - t0,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench data", __doc__)
    p.add_argument("--only", choices=["prepare", "loader", "memory"], help="one part (default: all)")
    p.add_argument("--corpus-mb", type=int, default=16, help="generated corpus for the prepare part")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=6, help="train steps timed for the loader part")
    p.add_argument("--big", type=float, default=1e9, help="tokens of the large dataset of the memory part")
    p.add_argument("--train-big", type=float, default=1e8, help="tokens of the large training run")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where synthetic data goes (and is deleted)")
    a = parse(p, argv)
    if a.corpus_mb < 1 or a.workers < 1 or a.steps < 2 or a.big < 1 or a.train_big < 1:
        raise ConfigError("--corpus-mb, --workers, --big and --train-big must be at least 1 and --steps at least 2")
    from_args(a.config)  # a bad config fails before any data is written
    check_writable_dir(a.tmp, "--tmp")
    Path(a.tmp).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.tmp, prefix="boost_jax_bench_data.") as tmp:
        parts = {"prepare": _prepare, "loader": _loader, "memory": _memory}
        for name, part in parts.items():
            if a.only in (None, name):
                print(json.dumps({name: part(a, Path(tmp))}), flush=True)


def _prepare(a: argparse.Namespace, tmp: Path) -> dict:
    rng = np.random.default_rng(0)
    # 20k made-up words drawn Zipf-like, as in natural text: enough merges to fill the vocab.
    words = ["".join(rng.choice(list("etaoinshrdlucmfwypvbgkjqxz"), rng.integers(2, 10))) for _ in range(20000)]
    weights = 1 / np.arange(1, len(words) + 1)
    src = tmp / "corpus.jsonl"
    with src.open("w") as f:
        while f.tell() < a.corpus_mb << 20:
            doc = rng.choice(words, rng.integers(50, 2000), p=weights / weights.sum())
            f.write(json.dumps({"text": " ".join(doc)}) + "\n")
    t0 = time.perf_counter()
    done = prepare(files_corpus([str(src)]), tmp / "prepared",
                   PrepareConfig(vocab_size=4096, workers=a.workers, chunk_bytes=4 << 20, sample_bytes=4 << 20))
    seconds = time.perf_counter() - t0
    shutil.rmtree(tmp / "prepared")
    return {"text_mb": done.encoded_bytes / MIB, "seconds": seconds, "workers": a.workers,
            "mb_per_s": done.encoded_bytes / MIB / seconds, "tokens_per_s": done.encoded_tokens / seconds}


def _loader(a: argparse.Namespace, tmp: Path) -> dict:
    """Step time from a real training run; loader time as the synchronous read of a batch (the
    prefetch thread hides it behind the step, so this is an upper bound on what the step waits)."""
    cfg = from_args([*a.config, f"train.steps={a.steps}", "train.eval_every=0", "checkpoint.every=0",
                     f"log.every={a.steps // 2}", "log.progress=false", "log.tensorboard=false",
                     "data.source=prepared", f"data.path={tmp / 'loader'}", f"run_dir={tmp / 'run'}"])
    t = cfg.train
    write_synthetic(tmp / "loader", [10**7], cfg.model.vocab_size)
    summary = train_to_end(cfg)
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=0)
    t0 = time.perf_counter()
    n = 200
    for step in range(n):
        data.train.batch(step, t.batch_size)
    batch_s = (time.perf_counter() - t0) / n
    shutil.rmtree(tmp / "loader")
    return {"model": cfg.model.preset, "batch": t.batch_size, "seq": t.seq_len, "step_ms": 1e3 * summary["step_time_s"],
            "batch_read_ms": 1e3 * batch_s, "loader_share_pct": 100 * batch_s / summary["step_time_s"]}


def _memory(a: argparse.Namespace, tmp: Path) -> dict:
    out = {}
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    for tokens in (10**7, int(a.big)):
        d = tmp / f"read{tokens:.0e}"
        t0 = time.perf_counter()
        write_synthetic(d, _sizes(tokens), 32000)
        written = time.perf_counter() - t0
        r = subprocess.run([sys.executable, "-c", _READ, str(d), "300"], capture_output=True, text=True, env=env)
        shutil.rmtree(d)
        if r.returncode:
            raise RuntimeError(r.stderr)
        out[f"read_{tokens:.0e}"] = {**json.loads(r.stdout.splitlines()[-1]), "write_s": written}
    for tokens in (10**6, int(a.train_big)):
        d = tmp / f"train{tokens:.0e}"
        write_synthetic(d, _sizes(tokens), 4096)
        args = ["model.preset=llama-mini", "train.batch_size=16", "train.seq_len=256", "train.steps=20",
                "train.eval_every=0", "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
                "data.source=prepared", f"data.path={d}", f"run_dir={tmp / f'run{tokens:.0e}'}"]
        r = subprocess.run([sys.executable, "-c", _TRAIN, *args], capture_output=True, text=True, env=env)
        shutil.rmtree(d)
        if r.returncode:
            raise RuntimeError(r.stderr)
        out[f"train_{tokens:.0e}"] = json.loads(r.stdout.splitlines()[-1])
    return out


def _sizes(tokens: int) -> list[int]:
    return [_SHARD] * (tokens // _SHARD) + ([tokens % _SHARD] if tokens % _SHARD else [])
