"""Bad inputs and faults against every command and the Python API, as a new user would make them:
each case runs in a fresh process and ends cleanly or not.

    python scripts/fault_battery.py [--only SUBSTRING] [--jobs 2] [--json]

Clean: a case that must fail exits 1 (argparse's usage errors: 2) with a message on stderr and no
Python traceback or asyncio/Orbax noise; one that must work exits 0. Anything else (a traceback, a
crash by signal, a hang past the timeout, exit 0 where an error was due, a message that does not
name what it must) is not. Prints every case and the share that ended cleanly (--json: also the argv
and stderr tail of each case that did not); exits 1 below 95%. Fixtures (a trained llama-tiny run
dir, its Hugging Face export and an svd import of it, two prepared datasets of different tokenizers,
damaged and binary files) are made under a temporary folder first (about a minute on 2 cores).
The faults of a cluster (`faults_of_a_cluster`) are cases too: a peer of a two-process run killed,
stopped or never joining; a checkpoint, metrics row, TensorBoard event, prepare or export on a full
size-limited tmpfs (mounting needs root: elsewhere those cases end unclean, saying why).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

TINY = ["model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "data.max_bytes=300000",
        "log.progress=false", "log.tensorboard=false", "train.eval_every=0", "parallel.dp=1"]
NOISE = ("Traceback", "Event loop is closed", "Exception ignored", "Fatal Python error", "Check failure")


@dataclass
class Case:
    name: str
    argv: list[str]  # after `python`
    fails: bool = True  # the case must end in an error message
    needle: str = ""  # the message must contain this (the key, flag or file it is about)
    timeout: float = 240.0
    stdin: str | None = None


def run(case: Case, env: dict) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *case.argv], capture_output=True, text=True, timeout=case.timeout,
                           env=env, input=case.stdin)
        code, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        code, err = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    noisy = [n for n in NOISE if n in err]
    if code is None:
        why = f"hung past {case.timeout:.0f} s"
    elif noisy:
        why = f"stderr shows {noisy[0]!r}"
    elif case.fails and code not in (1, 2):
        why = f"exit {code}, an error was due"
    elif case.fails and case.needle and case.needle not in err:
        why = f"the message does not name {case.needle!r}"
    elif not case.fails and code != 0:
        why = f"exit {code}"
    else:
        why = ""
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("(rerun with")]
    return {"case": case.name, "clean": not why, "why": why, "exit": code, "seconds": time.perf_counter() - t0,
            "message": (lines[-1] if lines else "")[:200],
            **({"argv": case.argv, "stderr_tail": lines[-25:]} if why else {})}


def fixtures(root: Path, env: dict) -> dict[str, Path]:
    """A trained run dir, a prepared dataset and files that are not what they claim to be."""
    f = {name: root / name for name in (
        "run", "data", "binary.yaml", "not_mapping.yaml", "damaged.jsonl.zst", "damaged.jsonl.gz", "empty_dir",
        "a_file", "prompts.bin", "tokens.txt", "data2", "hf", "svd_run", "config_only_run", "list_cfg_run",
        "empty.yaml", "extras.yaml", "bad_syntax.yaml", "scalar.yaml", "section_list.yaml", "dotted.yaml",
        "typed.yaml", "empty.txt", "nul.txt", "prompts.txt", "blank_line.txt", "bad.jsonl", "good.jsonl",
        "binary.jsonl", "bad.parquet", "num_text.jsonl", "hw_missing.yaml", "hw_string.yaml", "hw_tile.yaml",
        "empty.json", "paper.json", "planner.json", "results.json")}
    py = lambda *a: subprocess.run([sys.executable, *map(str, a)], check=True, env=env, capture_output=True)
    py("-m", "boost_jax.train", *TINY, "model.arch=dense", "train.steps=4", "checkpoint.every=4", f"run_dir={f['run']}")
    texts = root / "texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + {i * i}\n" * 30)
    py("-m", "boost_jax.data", "prepare", texts, "--out", f["data"], "--vocab-size", "300", "--no-progress")
    # another tokenizer over the same texts; the run exported (Hugging Face layout: dense SwiGLU); a low-rank run
    py("-m", "boost_jax.data", "prepare", texts, "--out", f["data2"], "--vocab-size", "300", "--tokenizer-kind",
       "byte_bpe", "--no-progress")
    py("-m", "boost_jax.export", f["run"], f["hf"])
    py("-m", "boost_jax.convert", "import", f["run"], f["svd_run"], "--to", "svd", "--rank", "8")
    f["binary.yaml"].write_bytes(bytes(range(256)) * 4)
    f["not_mapping.yaml"].write_text("- just\n- a list\n")
    f["damaged.jsonl.zst"].write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(200))
    f["damaged.jsonl.gz"].write_bytes(gzip.compress(b'{"text": "hello"}\n' * 50)[:-20])
    f["empty_dir"].mkdir()
    f["a_file"].write_text("not a folder\n")
    f["prompts.bin"].write_bytes(b"\xff\xfe\x00" * 50)
    for name in ("config_only_run", "list_cfg_run"):
        f[name].mkdir()
    shutil.copyfile(f["run"] / "config.yaml", f["config_only_run"] / "config.yaml")
    (f["list_cfg_run"] / "config.yaml").write_text("- model\n- train\n")
    lines = "".join(json.dumps({"text": f"def f_{i}(x):\n    return x + {i}\n" * 20}) + "\n" for i in range(60))
    for name, text in [("empty.yaml", ""), ("extras.yaml", "train:\n  lr: 0.001\nextras:\n  x: 1\n"),
                       ("bad_syntax.yaml", "train:\n  lr: [0.1\n  steps: 2\n"), ("scalar.yaml", "42\n"),
                       ("section_list.yaml", "train:\n  - 1\n  - 2\n"), ("dotted.yaml", "train.lr: 0.1\n"),
                       ("typed.yaml", "train:\n  lr: fast\n"), ("empty.txt", ""), ("nul.txt", "def\x00main\n"),
                       ("prompts.txt", "def main(\nimport os\n"), ("blank_line.txt", "def main(\n\n   \nclass A:\n"),
                       ("good.jsonl", lines), ("bad.jsonl", lines + "this line is not JSON\n" + lines),
                       ("num_text.jsonl", '{"text": 5}\n' * 20), ("empty.json", "{}")]:
        f[name].write_text(text)
    f["binary.jsonl"].write_bytes(os.urandom(4000))
    f["bad.parquet"].write_bytes(b"PAR1" + os.urandom(500) + b"PAR1")
    import yaml  # the battery runs in the project's environment

    hardware = yaml.safe_load((Path(__file__).resolve().parents[1] / "boost_jax/configs/hardware.yaml").read_text())
    a100 = hardware["a100-80gb"]
    for name, spec in [("hw_missing.yaml", {k: v for k, v in a100.items() if k != "peak_flops"}),
                       ("hw_string.yaml", {**a100, "peak_flops": "fast"}), ("hw_tile.yaml", {**a100, "gemm_tile": 128})]:
        f[name].write_text(yaml.safe_dump({"a100-80gb": spec}))
    results = Path(__file__).resolve().parents[1] / "docs/results.json"
    if results.is_file():  # a saved `bench report`: its page redrawn, its paper and planner sections reused
        saved = json.loads(results.read_text())
        f["results.json"].write_text(json.dumps(saved))
        f["paper.json"].write_text(json.dumps(saved["paper"]))
        f["planner.json"].write_text(json.dumps(saved["planner"]))
    return f


def cases(f: dict[str, Path], tmp: Path) -> list[Case]:
    run_dir, data = str(f["run"]), str(f["data"])
    train = lambda *a, **kw: ["-m", "boost_jax.train", *TINY, "train.steps=2", *a]
    fresh = lambda name: f"run_dir={tmp / name}"
    out: list[Case] = []
    add = lambda name, argv, **kw: out.append(Case(name.replace(f"{tmp}/", ""), argv, **kw))
    own = lambda: fresh(f"case{len(out)}")  # a run dir of the case's own

    def copy_of(src: Path | str, name: str, edit=None) -> str:
        """A copy of a fixture (run dir, dataset, model folder) that one case may change; `edit` damages it."""
        dst = tmp / name
        shutil.copytree(src, dst)
        if edit:
            edit(dst)
        return str(dst)

    # --- train: config values
    for bad, needle in [("model.d_modle=5", "model.d_modle"), ("train.steps=abc", "train.steps"),
                        ("train.lr=-1", "train.lr"), ("train.batch_size=0", "train.batch_size"),
                        ("model.arch=foo", "model.arch"), ("parallel.tp=3", "parallel"),
                        ("parallel.cp=3", "parallel"), ("parallel.cp=2 train.seq_len=66", "parallel.cp"),
                        ("train.remat=some", "train.remat"), ("log.every=0", "log.every"),
                        ("checkpoint.keep=0", "checkpoint.keep"), ("checkpoint.every=-1", "checkpoint.every"),
                        ("train.microbatches=3", "train.microbatches"), ("model.vocab_size=10", "vocab"),
                        ("data.source=prepared", "data.path"), ("data.val_fraction=1.5", "data.val_fraction"),
                        ("train.z_loss=-1", "train.z_loss"), ("train.spike_skip=-1", "train.spike_skip"),
                        ("checkpoint.every_minutes=-1", "checkpoint.every_minutes"),
                        ("data.source=mixture", "data.mixture"), ("parallel.pp=3", "parallel"),
                        ("model.n_heads=5", "model"), ("train.eval_batches=0", "train.eval_batches"),
                        ("log.profile_start=-1", "log.profile_start"), ("parallel.dp=0", "parallel.dp"),
                        ("model.dtype=float8", "model.dtype"), ("train.grad_clip=-1", "train.grad_clip"),
                        ("model", "model"), ("=5", "override")]:
        add(f"train {bad}", train(*bad.split(), fresh("bad")), needle=needle)
    add("train run_dir=", train("run_dir="), needle="run_dir")
    # --- train: more values (each case in a run dir of its own), valid ones, recipes, mixtures
    for bad, needle in [("model.preset=llama-nope", "model.preset"), ("model.d_model=abc", "model.d_model"),
                        ("model.n_kv_heads=3", "model.n_kv_heads"), ("model.attention=cudnn", "model.attention"),
                        ("model.arch=dense model.kernels=pallas", "model.kernels"), ("train.lr=abc", "train.lr"),
                        ("train.lr=[0.1,0.2]", "train.lr"), ("train.lr=.inf", "train.lr"), ("train.steps=1.5", "train.steps"),
                        ("train.on_nonfinite=ignore", "train.on_nonfinite"), ("train.warmup_steps=-1", "train.warmup_steps"),
                        ("train=5", "train"), ("Train.lr=0.1", "Train"), ("data.source=files", "data.paths"),
                        ("data.val_fraction=0 train.eval_every=1", "data.val_fraction"),
                        ("checkpoint.keep=abc", "checkpoint.keep"), ("parallel.tp=2.5", "parallel.tp"),
                        ("parallel.pp_repeats=2", "parallel.pp_repeats"), ("parallel.scheme=megatron", "parallel.scheme"),
                        ("model.arch=dense parallel.cp=2 parallel.cp_attention=latent", "parallel.cp_attention"),
                        ("parallel.cpu_devices=2 parallel.pp=2", "train.microbatches"),
                        ("log.progress=maybe", "log.progress"), ("log.bogus=true", "log.bogus"), ("run_dir=[a,b]", "run_dir")]:
        add(f"train {bad}", train(own(), *bad.split()), needle=needle)
    add("train lr in YAML 1.1 notation (3e-4)", train("train.lr=3e-4", own()), fails=False)
    add("train on a prepared dataset", train("data.source=prepared", f"data.path={data}", own()), fails=False)
    recipe = lambda path, *a: ["-m", "boost_jax.train", str(path), *TINY, "train.steps=2", *a]
    for name, needle in [("extras.yaml", "extras"), ("bad_syntax.yaml", "bad_syntax.yaml"),
                         ("section_list.yaml", "train"), ("dotted.yaml", "train.lr")]:
        add(f"train recipe: {name}", recipe(f[name], own()), needle=needle)
    add("train recipe: empty", recipe(f["empty.yaml"], own()), fails=False)
    mix = lambda *entries: "data.mixture=[" + ", ".join(entries) + "]"
    entry = lambda path, weight=1, more="": f"{{path: {path}, weight: {weight}{more}}}"
    for name, value, needle in [("a negative weight", mix(entry(data, -1)), "data.mixture[0].weight"),
                                ("an entry without a path", mix("{weight: 1}"), "data.mixture[0].path"),
                                ("an entry that is not a mapping", mix(data), "data.mixture[0]"),
                                ("two tokenizers", mix(entry(data), entry(f["data2"])), "tokenizer"),
                                ("one dataset twice, unnamed", mix(entry(data), entry(data, 2)), "name")]:
        add(f"train mixture: {name}", train("data.source=mixture", value, own()), needle=needle)
    add("train mixture: one dataset twice, named", train("data.source=mixture", mix(
        entry(data, 1, ", name: a"), entry(data, 3, ", name: b")), own()), fails=False)
    # --- train: files and dirs
    add("train recipe: binary YAML", ["-m", "boost_jax.train", str(f["binary.yaml"])], needle=str(f["binary.yaml"]))
    add("train recipe: a YAML list", ["-m", "boost_jax.train", str(f["not_mapping.yaml"])], needle="not_mapping.yaml")
    add("train recipe: missing", ["-m", "boost_jax.train", str(tmp / "nope.yaml")], needle="nope.yaml")
    add("train run_dir is a file", train(f"run_dir={f['a_file']}"), needle="a_file")
    add("train run_dir under /proc", train("run_dir=/proc/boost_jax_run"), needle="/proc")
    add("train data.path missing", train("data.source=prepared", f"data.path={tmp / 'nodata'}", fresh("d1")),
        needle="nodata")
    add("train data.path not a dataset", train("data.source=prepared", f"data.path={f['empty_dir']}", fresh("d2")),
        needle="empty_dir")
    add("train damaged .jsonl.zst", train("data.source=files", f"data.paths=[{f['damaged.jsonl.zst']}]", fresh("d3")),
        needle="damaged.jsonl.zst")
    add("train damaged .jsonl.gz", train("data.source=files", f"data.paths=[{f['damaged.jsonl.gz']}]", fresh("d4")),
        needle="damaged.jsonl.gz")
    add("train binary text file", train("data.source=files", f"data.paths=[{f['prompts.bin']}]", fresh("d5")),
        needle="prompts.bin")
    add("train tokenizer_path binary", train(f"data.tokenizer_path={f['binary.yaml']}", fresh("d6")),
        needle="binary.yaml")
    damaged_cfg = tmp / "damaged_cfg_run"
    damaged_cfg.mkdir()
    (damaged_cfg / "config.yaml").write_bytes(bytes(range(256)))
    add("train resume: binary config.yaml", train(f"run_dir={damaged_cfg}"), needle="config.yaml")
    extra_cfg = tmp / "extra_section_run"
    extra_cfg.mkdir()
    (extra_cfg / "config.yaml").write_text((f["run"] / "config.yaml").read_text() + "\nextras:\n  x: 1\n")
    add("eval: unknown section in config.yaml", ["-m", "boost_jax.eval", str(extra_cfg)], needle="extras")
    add("train resume: another seed", ["-m", "boost_jax.train", *TINY, "train.steps=6", "train.seed=3",
                                       f"run_dir={run_dir}"], needle="train.seed")
    # --- train: more files, resumes of a copy of the trained run
    files = lambda path, *a: train("data.source=files", f"data.paths=[{path}]", *a, own())
    for name, path, more, needle in [("a missing file", tmp / "none.txt", (), "none.txt"),
                                     ("a glob matching nothing", tmp / "*.nothing", (), "*.nothing"),
                                     ("a malformed .jsonl line", f["bad.jsonl"], (), "bad.jsonl"),
                                     ("a garbage .parquet", f["bad.parquet"], (), "bad.parquet"),
                                     ("a text_key the .jsonl lacks", f["good.jsonl"], ("data.text_key=body",), "body")]:
        add(f"train data.paths: {name}", files(path, *more), needle=needle)
    add("train data.cache_dir is a file", train(f"data.cache_dir={f['a_file']}", own()), needle="a_file")

    def damage_checkpoints(run: Path) -> None:
        for p in (run / "checkpoints").rglob("*"):
            if p.is_file():
                p.write_bytes(os.urandom(64))

    resume = lambda name, *a, edit=None: train("model.arch=dense", "train.steps=6", *a,
                                               f"run_dir={copy_of(f['run'], name, edit)}")
    add("train resume: another arch", resume("resume_arch", "model.arch=cola"), needle="model.arch")
    add("train resume: damaged checkpoints", resume("resume_damaged", edit=damage_checkpoints), needle="checkpoint")
    add("train resume: config.yaml a list", train(f"run_dir={f['list_cfg_run']}"), needle="config.yaml")
    add("train resume: to step 6", resume("resume_ok"), fails=False)
    # --- multi-process settings
    two = "parallel.num_processes=2 parallel.process_id=1"
    for bad, needle in [(f"parallel.coordinator=localhost {two}", "host:port"),
                        (f"parallel.coordinator=localhost:99999 {two}", "host:port"),
                        (f"parallel.coordinator=:4321 {two}", "host:port"),
                        ("parallel.coordinator=:::", "parallel.coordinator"),
                        ("parallel.coordinator=localhost:1234 parallel.num_processes=2 parallel.process_id=5",
                         "parallel.process_id"),
                        ("parallel.coordinator=localhost:1234 parallel.num_processes=0", "parallel.num_processes")]:
        add(f"train {bad}", train(*bad.split(), fresh("mp")), needle=needle, timeout=120)
    add("train coordinator that never answers", train("parallel.coordinator=10.255.255.1:4321",
                                                      "parallel.num_processes=2", "parallel.process_id=1",
                                                      "parallel.coordinator_timeout_s=10", fresh("mp2")),
        needle="did not join within 10 s", timeout=120)
    add("train the other processes never join", train("parallel.coordinator=localhost:23456",
                                                      "parallel.num_processes=2", "parallel.process_id=0",
                                                      "parallel.coordinator_timeout_s=10", fresh("mp3")),
        needle="did not join within 10 s", timeout=120)
    # --- data prepare
    prep = lambda *a: ["-m", "boost_jax.data", "prepare", *a]
    src = str(f["data"].parent / "texts")
    for bad, needle in [("--workers 0", "--workers"), ("--workers -2", "--workers"), ("--shard-mb 0", "--shard-mb"),
                        ("--sample-mb 0", "--sample-mb"), ("--vocab-size 10", "vocab"),
                        ("--val-fraction 1.5", "--val-fraction"), ("--max-bytes -1", "--max-bytes"),
                        ("--tokenizer-kind foo", "--tokenizer-kind")]:
        add(f"prepare {bad}", prep(src, "--out", str(tmp / "p_bad"), *bad.split()), needle=needle)
    add("prepare empty corpus", prep(str(f["empty_dir"]), "--out", str(tmp / "p_empty")), needle="empty_dir")
    add("prepare missing source", prep(str(tmp / "nosrc"), "--out", str(tmp / "p_missing")), needle="nosrc")
    add("prepare out is a file", prep(src, "--out", str(f["a_file"])), needle="a_file")
    add("prepare out under /proc", prep(src, "--out", "/proc/boost_jax_data"), needle="/proc")
    add("prepare damaged .jsonl.zst", prep(str(f["damaged.jsonl.zst"]), "--out", str(tmp / "p_zst")),
        needle="damaged.jsonl.zst")
    add("prepare binary file", prep(str(f["prompts.bin"]), "--out", str(tmp / "p_bin")), needle="prompts.bin")
    add("prepare --tokenizer binary", prep(src, "--out", str(tmp / "p_tok"), "--tokenizer", str(f["binary.yaml"])),
        needle="binary.yaml")
    add("prepare an existing dataset again", prep(src, "--out", data, "--vocab-size", "300"), fails=False)
    for bad, needle in [("--vocab-size 99999999999", "--vocab-size"),
                        (f"--tokenizer {tmp / 'none.json'}", "none.json")]:
        add(f"prepare {bad}", prep(src, "--out", str(tmp / f"p{len(out)}"), *bad.split()), needle=needle)
    for name in ("damaged.jsonl.gz", "binary.jsonl", "bad.parquet", "bad.jsonl"):
        add(f"prepare {name}", prep(str(f[name]), "--out", str(tmp / f"p{len(out)}"), "--vocab-size", "300"), needle=name)
    add("prepare bad.jsonl --skip-bad-lines", prep(str(f["bad.jsonl"]), "--out", str(tmp / "p_skip"), "--vocab-size",
                                                   "300", "--skip-bad-lines", "--no-progress"), fails=False)
    add("prepare out under a file", prep(src, "--out", f"{f['a_file']}/sub"), needle="a_file")
    add("prepare again with another --vocab-size", prep(src, "--out", copy_of(data, "data_again"), "--vocab-size", "280"),
        needle="data_again")
    # --- eval / generate / export / convert
    for mod in ("eval", "generate", "export"):
        extra = {"eval": [], "generate": ["--prompt", "x"], "export": [str(tmp / f"exp_{mod}")]}[mod]
        add(f"{mod} missing run dir", ["-m", f"boost_jax.{mod}", str(tmp / "norun"), *extra], needle="norun")
        add(f"{mod} not a run dir", ["-m", f"boost_jax.{mod}", str(f["empty_dir"]), *extra], needle="empty_dir")
        add(f"{mod} binary config.yaml", ["-m", f"boost_jax.{mod}", str(damaged_cfg), *extra], needle="config.yaml")
        add(f"{mod} --step 999", ["-m", f"boost_jax.{mod}", run_dir, *extra, "--step", "999"], needle="999")
    add("eval --max-tokens -1", ["-m", "boost_jax.eval", run_dir, "--max-tokens", "-1"], needle="--max-tokens")
    add("eval --step -1", ["-m", "boost_jax.eval", run_dir, "--step", "-1"], needle="--step")
    add("eval --split bogus", ["-m", "boost_jax.eval", run_dir, "--split", "bogus"], needle="--split")
    add("eval on another dataset", ["-m", "boost_jax.eval", run_dir, "data.source=prepared", f"data.path={data}"],
        needle=data)
    gen = lambda *a: ["-m", "boost_jax.generate", run_dir, *a]
    for bad, needle in [("--max-new-tokens 0", "--max-new-tokens"), ("--temperature -1", "temperature"),
                        ("--top-k -1", "top_k"), ("--top-p 0", "top_p"), ("--top-p 1.5", "top_p"),
                        ("--cache bogus", "--cache")]:
        add(f"generate {bad}", gen("--prompt", "def", *bad.split()), needle=needle)
    add("generate empty prompt", gen("--prompt", ""), needle="empty")
    add("generate --prompts-file missing", gen("--prompts-file", str(tmp / "none.txt")), needle="none.txt")
    add("generate --prompts-file binary", gen("--prompts-file", str(f["prompts.bin"])), needle="prompts.bin")
    add("generate cache latent on a cp run", gen("--prompt", "x", "parallel.cp=2"), needle="parallel.cp")
    add("generate ok", gen("--prompt", "def", "--max-new-tokens", "4"), fails=False)
    add("export out is a file", ["-m", "boost_jax.export", run_dir, str(f["a_file"])], needle="a_file")
    add("export out not empty", ["-m", "boost_jax.export", run_dir, str(f["data"])], needle="--force")
    add("export out under /proc", ["-m", "boost_jax.export", run_dir, "/proc/boost_jax_export"], needle="/proc")
    conv = lambda *a: ["-m", "boost_jax.convert", "import", *a]
    add("convert missing source", conv(str(tmp / "nosrc"), str(tmp / "c1")), needle="nosrc")
    add("convert source not a model", conv(str(f["empty_dir"]), str(tmp / "c2")), needle="empty_dir")
    add("convert into an existing run", conv(run_dir, run_dir), needle=run_dir)
    add("convert --to svd --rank 0", conv(run_dir, str(tmp / "c3"), "--to", "svd", "--rank", "0"), needle="--rank")
    add("convert --to bogus", conv(run_dir, str(tmp / "c4"), "--to", "bogus"), needle="--to")
    add("convert --samples 0", conv(run_dir, str(tmp / "c5"), "--to", "svd", "--rank", "8", "--method", "whiten",
                                    "--calibration", data, "--samples", "0"), needle="--samples")
    add("convert --calibration not a dataset", conv(run_dir, str(tmp / "c6"), "--to", "svd", "--rank", "8",
                                                    "--method", "whiten", "--calibration", str(f["empty_dir"])),
        needle="empty_dir")
    add("convert into /proc", conv(run_dir, "/proc/boost_jax_conv"), needle="/proc")
    # --- plan
    plan = lambda *a: ["-m", "boost_jax.plan", "model.preset=llama-tiny", "model.arch=cola", "train.batch_size=8",
                       "train.seq_len=64", *a]
    add("convert ok", conv(run_dir, str(tmp / "c7"), "--to", "svd", "--rank", "8"), fails=False)
    # --- eval, generate, export, convert: more
    ev = lambda *a: ["-m", "boost_jax.eval", *a]
    for name, argv, needle in [
                               ("a model key", ev(run_dir, "model.d_model=8"), "model.d_model"),
                               ("an argument that is not an override", ev(run_dir, "notanoverride"), "notanoverride"),
                               ("a missing dataset", ev(run_dir, "data.source=prepared", f"data.path={tmp / 'nodata'}"),
                                "nodata"),
                               ("a run dir without checkpoints", ev(str(f["config_only_run"])), "checkpoint"),
                               ("config.yaml a list", ev(str(f["list_cfg_run"])), "config.yaml")]:
        add(f"eval {name}", argv, needle=needle)
    add("eval --json", ev(run_dir, "--json"), fails=False)
    for bad, needle in [("--temperature nan", "temperature"), ("--step 2", "step 2"),
                        ("--cache latent", "latent"), ("--max-new-tokens 100000", "max_new_tokens")]:
        add(f"generate {bad}", gen("--prompt", "def", *bad.split()), needle=needle)
    for name, needle in [("empty.txt", "empty.txt"), ("empty_dir", "empty_dir")]:
        add(f"generate --prompts-file {name}", gen("--prompts-file", str(f[name])), needle=needle)
    add("generate --prompts-file with blank lines", gen("--prompts-file", str(f["blank_line.txt"]), "--max-new-tokens",
                                                        "4"), fails=False)
    add("generate sampled --json", gen("--prompts-file", str(f["prompts.txt"]), "--max-new-tokens", "4", "--temperature",
                                       "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "3", "--json"), fails=False)
    add("generate a low-rank run, latent cache", ["-m", "boost_jax.generate", str(f["svd_run"]), "--prompt", "def",
                                                  "--max-new-tokens", "4", "--cache", "latent"], fails=False)
    exp = lambda *a: ["-m", "boost_jax.export", *a]
    for name, argv, needle in [("--step -1", exp(run_dir, str(tmp / "e1"), "--step", "-1"), "--step"),
                               ("out under a file", exp(run_dir, f"{f['a_file']}/sub"), "a_file"),
                               ("a run dir without checkpoints", exp(str(f["config_only_run"]), str(tmp / "e2")),
                                "checkpoint")]:
        add(f"export {name}", argv, needle=needle)
    (tmp / "e_force").mkdir()
    (tmp / "e_force" / "notes.txt").write_text("kept\n")
    add("export --force into a non-empty folder", exp(run_dir, str(tmp / "e_force"), "--force"), fails=False)
    add("export a low-rank run (boost layout)", exp(str(f["svd_run"]), str(tmp / "e_svd")), fails=False)
    # convert import of a Hugging Face folder (the fixture run exported), one fault each
    hf = f["hf"]
    hf_config = json.loads((hf / "config.json").read_text())

    def config_json(**change):  # config.json with fields changed (None: removed)
        c = {k: v for k, v in {**hf_config, **change}.items() if v is not None}
        return lambda d: (d / "config.json").write_text(json.dumps(c))

    def write(name: str, content: str | bytes):
        return lambda d: (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    def missing_shard(d: Path) -> None:
        (d / "model.safetensors").unlink()
        write("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))(d)

    def truncate(d: Path) -> None:
        weights = d / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])

    def tensors(change):  # model.safetensors with its tensors changed
        def edit(d: Path) -> None:
            from safetensors.numpy import load_file, save_file

            t = load_file(d / "model.safetensors")
            change(t)
            save_file(t, d / "model.safetensors")
        return edit

    for name, edit, needle in [
            ("no config.json", lambda d: (d / "config.json").unlink(), "config.json"),
            ("config.json not JSON", write("config.json", '{"hidden_size": 64,'), "config.json"),
            ("config.json binary", write("config.json", bytes(range(256))), "config.json"),
            ("config.json a list", write("config.json", "[1, 2]"), "config.json"),
            ("an index naming a missing shard", missing_shard, "model-00001-of-00002.safetensors"),
            ("an index that is not JSON", write("model.safetensors.index.json", "not json"),
             "model.safetensors.index.json"),
            ("rope_scaling", config_json(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
            ("model_type mistral", config_json(model_type="mistral"), "model_type"),
            ("hidden_size a string", config_json(hidden_size="sixty-four"), "config.json"),
            ("intermediate_size not the tensors'", config_json(intermediate_size=128), "shape"),
            ("no model.safetensors", lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
            ("model.safetensors random bytes", write("model.safetensors", os.urandom(300)), "model.safetensors"),
            ("model.safetensors truncated", truncate, "model.safetensors"),
            ("a tensor missing", tensors(lambda t: t.pop("lm_head.weight")), "lm_head.weight"),
            ("no tokenizer.json", lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
            ("tokenizer.json binary", write("tokenizer.json", bytes(range(256))), "tokenizer.json")]:
        add(f"convert HF folder: {name}", conv(copy_of(hf, f"hf{len(out)}", edit), str(tmp / f"c{len(out)}")),
            needle=needle)
    add("convert HF folder ok", conv(str(hf), str(tmp / "c_hf")), fails=False)
    add("convert HF folder --to svd ok", conv(str(hf), str(tmp / "c_hf_svd"), "--to", "svd", "--rank", "8"), fails=False)
    for name, args, needle in [("--to svd without --rank", [run_dir, "--to", "svd"], "--rank"),
                               ("--rank bigger than the matrices", [run_dir, "--to", "svd", "--rank", "100000"], "--rank"),
                               ("--calibration missing", [run_dir, "--to", "svd", "--rank", "8", "--calibration",
                                                          str(tmp / "nocal")], "nocal"),
                               ("--calibration of another tokenizer", [run_dir, "--to", "svd", "--rank", "8",
                                                                       "--calibration", data], "tokenizer"),
                               ("--step of a HF folder", [str(hf), "--step", "4"], "--step"),
                               ("--to svd of a low-rank run", [str(f["svd_run"]), "--to", "svd", "--rank", "4"], "dense")]:
        add(f"convert {name}", conv(args[0], str(tmp / f"c{len(out)}"), *args[1:]), needle=needle)
    add("convert an unknown subcommand", ["-m", "boost_jax.convert", "export", run_dir, str(tmp / "c_x")], needle="export")
    for bad, needle in [("--gpus 4 --tp 3", "--tp"), ("--gpus 4 --pp 5", "--pp"), ("--gpus 0", "--gpus"),
                        ("--gpus 4 --schemes megatron", "megatron"), ("--gpus 4 --remat bogus", "--remat"),
                        ("--gpus 4 --top 0", "--top"), ("--gpus 4 --hardware nope", "nope"),
                        ("--gpus 4 --pp 1 --pp-repeats 2", "--pp-repeats"), ("--gpus 4 --cp 3", "--cp"),
                        ("--gpus 3 --tp 1 --pp 1 --cp 1", "train.batch_size=8"),
                        ("--gpus 4 --headroom 1.5", "--headroom")]:
        add(f"plan {bad}", plan(*bad.split()), needle=needle, timeout=300)
    add("plan --hardware-file binary", plan("--gpus", "4", "--hardware-file", str(f["binary.yaml"])),
        needle="binary.yaml")
    add("plan --hardware-file missing", plan("--gpus", "4", "--hardware-file", str(tmp / "hw.yaml")), needle="hw.yaml")
    add("plan with a layout key", plan("--gpus", "4", "parallel.tp=2"), needle="parallel.tp")
    add("plan --out is a folder", plan("--gpus", "2", "--tp", "2", "--pp", "1", "--remat", "none", "--out",
                                       str(f["empty_dir"])), needle="empty_dir", timeout=300)
    add("plan --out under /proc", plan("--gpus", "2", "--tp", "2", "--pp", "1", "--remat", "none", "--out",
                                       "/proc/recipe.yaml"), needle="/proc", timeout=300)
    for bad, needle in [("--gpus abc", "--gpus"), ("--gpus 4 --headroom -0.1", "--headroom"),
                        ("--gpus 4 --schemes bogus", "bogus"), ("--gpus 4 --tp 0", "--tp"),
                        ("--gpus 4 --pp 2 --pp-repeats 0", "--pp-repeats"), 
                        ("--gpus 4 --remat none,bogus", "bogus"), 
                        (f"--gpus 4 --hardware-file {f['hw_missing.yaml']}", "peak_flops"),
                        (f"--gpus 4 --hardware-file {f['hw_tile.yaml']}", "gemm_tile"),
                        (f"--gpus 4 --out {f['a_file']}/recipe.yaml", "a_file"),
                        ("--gpus 1 model.preset=llama-30b", "no layout")]:
        add(f"plan {bad}", plan(*bad.split()), needle=needle, timeout=300)
    add("plan without --gpus", plan(), needle="--gpus")
    add("plan ok --out recipe.yaml", plan("--gpus", "2", "--tp", "2", "--pp", "1", "--remat", "none", "--out",
                                          str(tmp / "recipe.yaml")), fails=False, timeout=300)
    # --- bench
    bench = lambda cmd, *a: ["-m", "boost_jax.bench", cmd, "model.preset=llama-tiny", "train.batch_size=8",
                             "train.seq_len=64", "parallel.dp=1", *a]
    for cmd, bad, needle in [("step", "--steps 0", "--steps"), ("step", "--reps -1", "--reps"),
                             ("step", "--vary parallel.cp", "--vary"), ("step", "--compare --vary parallel.cp=1,2", "--vary"),
                             ("step", "model.arch=bogus", "model.arch"), ("memory", "--budget-gib -1", "--budget-gib"),
                             ("memory", "--microbatch-sweep 2,x", "--microbatch-sweep"),
                             ("decode", "--batch 0", "--batch"), ("decode", "--new-tokens 0", "--new-tokens"),
                             ("quality", "--tokens 0", "--tokens"), ("checkpoint", "--every 0", "--every"),
                             ("profile", "--steps 0", "--steps"), ("comm", "parallel.tp=3", "parallel"),
                             ("kernels", "--reps 0", "--reps")]:
        add(f"bench {cmd} {bad}", bench(cmd, *bad.split()), needle=needle, timeout=300)
    add("bench unknown command", ["-m", "boost_jax.bench", "bogus"], needle="bogus")
    bare = lambda cmd, *a: ["-m", "boost_jax.bench", cmd, *a]  # the paper's rows, or no config
    (tmp / "bench_data_tmp").mkdir()
    saved = f["results.json"].is_file()  # docs/results.json: a saved `bench report`
    P, Q, R = (str(f[n]) for n in ("paper.json", "planner.json", "results.json"))
    for name, argv, needle in [
            ("comm train.seq_len=abc", bench("comm", "train.seq_len=abc"), "train.seq_len"),
            ("comm megatron on cola", bench("comm", "model.arch=cola", "parallel.scheme=megatron"), "parallel.scheme"),
            ("comm recipe a YAML list", bare("comm", str(f["not_mapping.yaml"])), "not_mapping.yaml"),
            ("comm ok", bench("comm"), None),
            ("step --reps 0", bench("step", "--reps", "0"), "--reps"),
            ("step --vary an unknown key", bench("step", "--vary", "train.bogus=1,2"), "train.bogus"),
            ("step --compare of a dense model", bench("step", "--compare", "model.arch=dense"), "--compare"),
            ("step ok", bench("step", "--steps", "1", "--reps", "1"), None),
            ("memory --remat bogus", bench("memory", "--remat", "bogus"), "--remat"),
            ("memory --reps 0", bench("memory", "--reps", "0"), "--reps"),
            ("memory --microbatch-sweep 0,2", bench("memory", "--microbatch-sweep", "0,2"), "--microbatch-sweep"),
            ("memory --budget-gib without --vary", bench("memory", "--budget-gib", "1"), "--budget-gib"),
            ("memory ok", bench("memory", "--remat", "none"), None),
            ("profile --top -1", bench("profile", "--top", "-1"), "--top"),
            ("profile --trace-dir a file", bench("profile", "--trace-dir", str(f["a_file"])), "a_file"),
            ("profile --trace-dir under /proc", bench("profile", "--trace-dir", "/proc/boost_jax_trace"), "/proc"),
            ("profile train.microbatches=2", bench("profile", "train.microbatches=2"), "microbatches"),
            ("profile ok", bench("profile", "--steps", "1", "--trace-dir", str(tmp / "trace")), None),
            ("decode --caches bogus", bench("decode", "--caches", "bogus"), "--caches"),
            ("decode latent cache of a dense model", bench("decode", "--caches", "latent", "model.arch=dense"), "latent"),
            ("decode --prompt-len 0", bench("decode", "--prompt-len", "0"), "--prompt-len"),
            ("decode --new-tokens 1", bench("decode", "--new-tokens", "1"), "--new-tokens"),
            ("decode ok", bench("decode", "--caches", "full", "--batches", "1", "--prompt-len", "8", "--new-tokens", "4",
                                "--reps", "1"), None),
            ("quality --recover-steps 0", bench("quality", "--recover-steps", "0"), "--recover-steps"),
            ("quality --eval-tokens -1", bench("quality", "--eval-tokens", "-1"), "--eval-tokens"),
            ("quality --work a file", bench("quality", "--work", str(f["a_file"])), "a_file"),
            ("quality model.arch=dense", bench("quality", "model.arch=dense"), "model.arch"),
            ("quality run_dir=x", bench("quality", "run_dir=x"), "run_dir"),
            ("kernels --kernel bogus", bench("kernels", "--kernel", "bogus"), "--kernel"),
            ("kernels --small and a config", bench("kernels", "--small"), "--small"),
            ("kernels parallel.tp=3", bench("kernels", "parallel.tp=3"), "parallel.tp"),
            ("kernels --k -1", bare("kernels", "--k", "-1"), "--k"),
            ("kernels ok --small", bare("kernels", "--small", "--reps", "1", "--kernel", "norm_down"), None),
            ("paper --models llama-99b", bare("paper", "--models", "llama-99b"), "llama-99b"),
            ("paper --variants cola/zero", bare("paper", "--variants", "cola/zero"), "cola/zero"),
            ("paper --hardware nope", bare("paper", "--hardware", "nope"), "nope"),
            ("paper --hardware-file binary", bare("paper", "--hardware-file", str(f["binary.yaml"])), "binary.yaml"),
            ("paper --hardware-file missing a key", bare("paper", "--hardware-file", str(f["hw_missing.yaml"])),
             "peak_flops"),
            ("planner --models bogus", bare("planner", "--models", "bogus"), "bogus"),
            ("planner --headroom 1", bare("planner", "--headroom", "1"), "--headroom"),
            ("planner --hardware of two machines", bare("planner", "--hardware", "a100-80gb,h100-80gb"), "--hardware"),
            ("planner --pp-repeats 0", bare("planner", "--pp-repeats", "0"), "--pp-repeats"),
            ("planner --hardware-file not a mapping", bare("planner", "--hardware-file", str(f["not_mapping.yaml"])),
             "not_mapping.yaml"),
            ("report --reps 0", bare("report", "--reps", "0"), "--reps"),
            ("report --rerender missing", bare("report", "--rerender", str(tmp / "none.json")), "none.json"),
            ("report --paper-json a YAML list", bare("report", "--paper-json", str(f["not_mapping.yaml"])),
             "not_mapping.yaml"),
            ("report --planner-json {}", bare("report", "--planner-json", str(f["empty.json"])), "--planner-json"),
            *([("report --out a file", bare("report", "--rerender", R, "--out", str(f["a_file"])), "a_file"),
               ("report --step-model llama-nope", bare("report", "--paper-json", P, "--planner-json", Q, "--step-model",
                                                       "llama-nope"), "llama-nope"),
               ("report --single-models llama-nope", bare("report", "--paper-json", P, "--planner-json", Q,
                                                          "--single-models", "llama-nope"), "llama-nope"),
               ("report ok --rerender", bare("report", "--rerender", R, "--out", str(tmp / "report")), None)]
              if saved else []),
            ("checkpoint --steps 0", bench("checkpoint", "--steps", "0"), "--steps"),
            ("checkpoint --every abc", bench("checkpoint", "--every", "abc"), "--every"),
            ("checkpoint train.steps=5", bench("checkpoint", "train.steps=5"), "train.steps"),
            ("checkpoint run_dir=x", bench("checkpoint", "run_dir=x"), "run_dir"),
            ("checkpoint ok", bench("checkpoint", "--steps", "2", "--every", "1", "--reps", "1"), None),
            ("data --only bogus", bench("data", "--only", "bogus"), "--only"),
            ("data --corpus-mb 0", bench("data", "--corpus-mb", "0"), "--corpus-mb"),
            ("data --workers 0", bench("data", "--workers", "0"), "--workers"),
            ("data --tmp a file", bench("data", "--only", "prepare", "--corpus-mb", "1", "--tmp", str(f["a_file"])),
             "a_file"),
            ("data --tmp missing (made)", bench("data", "--only", "prepare", "--corpus-mb", "1", "--workers", "1",
                                                "--tmp", str(tmp / "no_tmp")), None),
            ("data ok --only prepare", bench("data", "--only", "prepare", "--corpus-mb", "1", "--workers", "1", "--tmp",
                                             str(tmp / "bench_data_tmp")), None),
            ("--help", ["-m", "boost_jax.bench", "--help"], None),
            ("without a command", ["-m", "boost_jax.bench"], "usage")]:
        add(f"bench {name}", argv, fails=needle is not None, needle=needle or "", timeout=150)
    # --- the Python API: an error is an exception, clean when it is the project's (BoostJaxError)
    model = "cfg = api.config('llama-tiny')\nmodel = api.build_model(cfg)\n"
    for name, code, needle in [
        ("api.config unknown preset", "api.config('llama-nope')", "llama-nope"),
        ("api.config bad override", "api.config('llama-tiny', 'model.d_modle=3')", "model.d_modle"),
        ("api.config override not a string", "api.config('llama-tiny', 5)", "override"),
        ("api.build_model not a config", "api.build_model('llama-tiny')", "Config"),
        ("api.forward ids past the vocabulary", model + "api.forward(model, jnp.array([[1, 600]]))", "vocab"),
        ("api.forward negative ids", model + "api.forward(model, jnp.array([[1, -3]]))", "vocab"),
        ("api.forward float tokens", model + "api.forward(model, jnp.ones((1, 4)))", "integer"),
        ("api.forward 1-D tokens", model + "api.forward(model, jnp.array([1, 2, 3]))", "[batch, seq]"),
        ("api.forward not a model", "api.forward('model', jnp.array([[1]]))", "Model"),
        ("api.generate max_new_tokens=0", model + "api.generate(model, [[1, 2]], max_new_tokens=0)", "max_new_tokens"),
        ("api.generate a bare list of ints", model + "api.generate(model, [1, 2], max_new_tokens=2)", "prompts"),
        ("api.generate_text not strings", model + "api.generate_text(model, None, [1], max_new_tokens=2)", "prompts"),
        ("api.restore missing", f"api.restore('{tmp / 'norun'}')", "norun"),
        ("api.restore step not an int", f"api.restore('{run_dir}', step='last')", "step"),
        ("api.restore bad override", f"api.restore('{run_dir}', overrides=['model.d_model=8'])", "model.d_model"),
        ("api.config overrides as one list", "api.config('llama-tiny', ['model.arch=cola'])", "override"),
        ("api.forward tokens a string", model + "api.forward(model, 'def main():')", "tokens"),
        ("api.forward an empty sequence", model + "api.forward(model, jnp.zeros((1, 0), jnp.int32))", "tokens"),
        ("api.forward plan not a Plan", model + "api.forward(model, jnp.array([[1, 2]]), plan='tp')", "plan"),
        ("api.forward nested lists", model + "api.forward(model, [[1, 2, 3]])", None),
        ("api.restore run_dir an int", "api.restore(5)", "run_dir"),
        ("api.restore step True", f"api.restore('{run_dir}', step=True)", "step"),
        ("api.restore step missing", f"api.restore('{run_dir}', step=2)", "step 2"),
        ("api.restore overrides one string", f"api.restore('{run_dir}', overrides='model.dtype=bfloat16')", "overrides"),
        ("api.generate an id that is a string", model + "api.generate(model, [[1, 'a']], max_new_tokens=2)", "prompts"),
        ("api.generate an empty prompt", model + "api.generate(model, [[]], max_new_tokens=2)", "prompt"),
        ("api.generate ids past the vocabulary", model + "api.generate(model, [[1, 9999]], max_new_tokens=2)", "vocab"),
        ("api.generate max_new_tokens a string", model + "api.generate(model, [[1, 2]], max_new_tokens='5')",
         "max_new_tokens"),
        ("api.generate temperature a string", model + "api.generate(model, [[1, 2]], max_new_tokens=2, temperature='hot')",
         "temperature"),
        ("api.generate cache bogus", model + "api.generate(model, [[1, 2]], max_new_tokens=2, cache='bogus')", "cache"),
        ("api.generate max_new_tokens=10**9", model + "api.generate(model, [[1, 2]], max_new_tokens=10**9)", "max_len"),
        ("train.train with a dict", "from boost_jax.train import train\ntrain({'model': {}})", "train.train takes a Config"),
        ("api.generate_text no tokenizer", model + "api.generate_text(model, None, ['def'], max_new_tokens=2)",
         "tokenizer"),
        ("api.generate_text of a restored run", f"from tokenizers import Tokenizer\ncfg, model, step = api.restore('{run_dir}')\n"
         f"print(api.generate_text(model, Tokenizer.from_file('{run_dir}/tokenizer.json'), ['def'], max_new_tokens=4))",
         None),
    ]:
        body = "\n".join("    " + line for line in code.splitlines())
        add(name, ["-c", "import sys\nfrom boost_jax import api\nfrom boost_jax.runtime.errors import BoostJaxError\n"
                         "import jax.numpy as jnp\ntry:\n" + body + "\nexcept Exception as e:\n"
                         "    print(f'{type(e).__name__}: {e}', file=sys.stderr)\n"
                         "    sys.exit(1 if isinstance(e, BoostJaxError) else 3)\n"], fails=needle is not None,
            needle=needle or "")
    # --- one writer per run dir
    add("second train in a running run dir", ["-c", (
        "import subprocess, sys, time, pathlib\n"
        f"args = [sys.executable, '-m', 'boost_jax.train', *{TINY!r}, 'train.steps=100000', 'checkpoint.every=50',"
        f" 'run_dir={tmp / 'locked'}']\n"
        "first = subprocess.Popen(args, stderr=subprocess.DEVNULL)\n"
        f"while not pathlib.Path('{tmp / 'locked' / 'metrics.jsonl'}').exists(): time.sleep(0.2)\n"
        "second = subprocess.run(args, capture_output=True, text=True)\n"
        "first.kill()\n"
        "sys.stderr.write(second.stderr)\n"
        "sys.exit(second.returncode)\n")], needle="in use", timeout=300)
    return out


# Two training processes on 127.0.0.1; process 1 is killed or stopped once 6 steps are logged (or, "never
# joins", never started): the survivor's stderr and exit status are the case's, a wait past 60 s is 124.
LOST_PEER = """
import pathlib, signal, socket, subprocess, sys, time
mode, run, tiny = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
args = lambda i: [sys.executable, "-m", "boost_jax.train", *tiny, "train.steps=400", "checkpoint.every=4", "log.every=1",
                  "parallel.dp=2", "parallel.cpu_devices=1", "parallel.heartbeat_timeout_s=10", "parallel.num_processes=2",
                  "parallel.coordinator_timeout_s=20", f"parallel.coordinator=127.0.0.1:{port}", f"parallel.process_id={i}",
                  f"run_dir={run}"]
procs = [subprocess.Popen(args(i), stderr=subprocess.PIPE, text=True) for i in range(1 if mode == "never" else 2)]
metrics = run / "metrics.jsonl"
while mode != "never" and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
    if procs[0].poll() is not None:
        break
    time.sleep(0.2)
if mode != "never":
    procs[1].send_signal(signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
t0 = time.time()
try:
    err = procs[0].communicate(timeout=60 if mode != "never" else 120)[1]
except subprocess.TimeoutExpired:
    err, procs[0].returncode = "", 124
for p in procs:
    p.kill()
    p.wait()
sys.stderr.write(err + f"(ended {time.time() - t0:.1f} s after the fault)\\n")
sys.exit(procs[0].returncode)
"""

# A command whose output folder is a size-limited tmpfs (unmounted after): its stderr and exit status.
DISK_FULL = """
import pathlib, subprocess, sys
where, size, argv = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
where.mkdir(parents=True, exist_ok=True)
mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
if mount.returncode:
    sys.exit(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
try:
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
finally:
    subprocess.run(["umount", "-l", str(where)])
sys.stderr.write(p.stderr)
sys.exit(p.returncode)
"""


def faults_of_a_cluster(f: dict[str, Path], tmp: Path) -> list[Case]:
    """A lost peer, a full disk, and the last inputs that slipped through (issue 50)."""
    run_dir, out = str(f["run"]), []
    train = lambda *a: ["-m", "boost_jax.train", *TINY, "train.steps=2", *a]
    add = lambda name, argv, **kw: out.append(Case(name, argv, **kw))
    for mode, needle in [("kill", "lost peer: process 1"), ("stop", "lost peer: process 1"), ("never", "did not join")]:
        add(f"lost peer: process 1 {mode}", ["-c", LOST_PEER, mode, str(tmp / f"peer_{mode}"), *TINY], needle=needle,
            timeout=300)
    big = tmp / "big.txt"
    big.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * 7}\n\n" for i in range(20000)))
    for name, where, size, argv, needle in [
        ("a checkpoint save", tmp / "df_ckpt" / "checkpoints", "2500k",
         train("train.steps=6", "checkpoint.every=2", f"run_dir={tmp / 'df_ckpt'}"), "writing a checkpoint"),
        ("a metrics row", tmp / "df_metrics", "40k", train("train.steps=200", "log.every=1", "checkpoint.every=0",
                                                          f"run_dir={tmp / 'df_metrics'}"), "writing metrics rows"),
        ("a TensorBoard event", tmp / "df_tb" / "tensorboard", "8k",
         train("train.steps=200", "log.every=1", "checkpoint.every=0", "log.tensorboard=true",
               f"run_dir={tmp / 'df_tb'}"), "writing TensorBoard events"),
        ("data prepare", tmp / "df_prep", "64k", ["-m", "boost_jax.data", "prepare", str(big), "--out",
                                                  str(tmp / "df_prep"), "--vocab-size", "300", "--workers", "1"],
         "writing the prepared dataset"),
        ("export", tmp / "df_export", "256k", ["-m", "boost_jax.export", run_dir, str(tmp / "df_export")],
         "writing the export")]:
        add(f"full disk: {name}", ["-c", DISK_FULL, str(where), size, *argv], needle=needle, timeout=300)
    add("train checkpoint.every=0 with every_minutes", train("checkpoint.every=0", "checkpoint.every_minutes=0.0001",
                                                             f"run_dir={tmp / 'by_time'}"), fails=False)
    rerun = tmp / "rerun_over_metrics"
    shutil.copytree(f["run"], rerun)
    shutil.rmtree(rerun / "checkpoints")
    add("train rerun over metrics it did not resume from", train("model.arch=dense", f"run_dir={rerun}"), fails=False)
    add("data prepare of an empty file", ["-m", "boost_jax.data", "prepare", str(f["empty.txt"]), "--out",
                                          str(tmp / "empty_prep")], needle="holds no documents")
    add("eval --max-tokens 1e12", ["-m", "boost_jax.eval", run_dir, "--max-tokens", "1000000000000"], fails=False)
    int_weights = tmp / "int_weights"
    shutil.copytree(f["hf"], int_weights)
    from safetensors.numpy import load_file, save_file  # the battery runs in the project's environment

    tensors = load_file(int_weights / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype("int32")
    save_file(tensors, int_weights / "model.safetensors", metadata={"format": "pt"})
    conv = lambda *a: ["-m", "boost_jax.convert", "import", *a]
    add("convert int32 safetensors weights", conv(str(int_weights), str(tmp / "c_int")), needle="model.norm.weight")
    own_data = next(p for p in (tmp / "cache" / "prepared").iterdir() if (p / "index.json").is_file())  # its tokenizer
    add("convert whiten on 4 samples", conv(run_dir, str(tmp / "c_white"), "--to", "svd", "--rank", "8", "--method",
                                           "whiten", "--calibration", str(own_data), "--samples", "4"), fails=False)
    add("generate --temperature inf", ["-m", "boost_jax.generate", run_dir, "--prompt", "def", "--temperature", "inf"],
        needle="temperature")
    for name in ("metrics.jsonl", ".boost_jax.lock"):
        (tmp / f"folder_{name}" / name).mkdir(parents=True)
        add(f"train {name} is a folder", train(f"run_dir={tmp / f'folder_{name}'}"), needle=name)
    extra = tmp / "resume_extra_section"
    shutil.copytree(f["run"], extra)
    (extra / "config.yaml").write_text((extra / "config.yaml").read_text() + "extras:\n  x: 1\n")
    add("train resume: unknown section in config.yaml", train("model.arch=dense", "train.steps=6", f"run_dir={extra}"),
        needle="extras")
    live = tmp / "live"  # evals of a run whose retention (keep 1, a save every step) deletes what they chose
    add("eval while a live run's retention deletes steps", ["-c", (
        "import subprocess, sys, pathlib\n"
        f"args = [sys.executable, '-m', 'boost_jax.train', *{TINY!r}, 'checkpoint.every=1', 'checkpoint.keep=1',"
        f" 'run_dir={live}']\n"
        "subprocess.run([*args, 'train.steps=1'], check=True, capture_output=True)  # a first checkpoint\n"
        "run = subprocess.Popen([*args, 'train.steps=60'], stderr=subprocess.DEVNULL)\n"
        "codes = []\n"
        "while run.poll() is None:\n"
        f"    e = subprocess.run([sys.executable, '-m', 'boost_jax.eval', '{live}'], capture_output=True, text=True)\n"
        "    codes.append(e.returncode)\n"
        "    if e.returncode or 'damaged' in e.stderr or 'Fix or move' in e.stderr:\n"
        "        sys.stderr.write(e.stderr)\n"
        "        run.kill()\n"
        "        sys.exit(1)\n"
        "print(codes)\n")], fails=False, timeout=400)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("BOOST_JAX_DEBUG", None)
    with tempfile.TemporaryDirectory(prefix="boost_jax_faults_") as tmp:
        tmp = Path(tmp)
        env["BOOST_JAX_CACHE"] = str(tmp / "cache")
        f = fixtures(tmp, env)
        todo = [c for c in cases(f, tmp) + faults_of_a_cluster(f, tmp) if a.only in c.name]
        with ThreadPoolExecutor(a.jobs) as pool:
            results = list(pool.map(lambda c: run(c, env), todo))
    clean = sum(r["clean"] for r in results)
    if a.json:
        print(json.dumps({"cases": len(results), "clean": clean, "results": results}, indent=1))
    else:
        for r in results:
            print(f"{'ok ' if r['clean'] else 'BAD'} {r['case']:55s} exit {r['exit']!s:4s} {r['why'] or r['message']}")
        print(f"{clean} of {len(results)} cases ended cleanly ({100 * clean / max(1, len(results)):.0f}%)")
    sys.exit(0 if clean >= 0.95 * len(results) else 1)


if __name__ == "__main__":
    main()
