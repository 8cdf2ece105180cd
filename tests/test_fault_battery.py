"""The fault battery: bad inputs and faults against every command and the Python API, as a new user
would make them, each case in a fresh process (issue 62 item 6; it was scripts/fault_battery.py).

A case is a row of CASES: (name, argv after `python`, the exit status due, a fragment its stderr
must hold[, timeout s[, environment]]). Due 1: one message naming what it is about (2: argparse's
usage error); due 0: the command works. No case may show a traceback or asyncio/Orbax noise, crash
by a signal or hang. `{name}` in an argument stands for a fixture (FIXTURES: a trained llama-tiny
run dir, its Hugging Face export and an svd import of it, prepared datasets of two tokenizers,
files that are not what they claim to be; made once, when a case first names it) or for a damaged
copy made for the case alone (COPIES); `{tmp}` is the case's own folder. FAST, six that take a few
seconds and need no fixture, run in the default tier; the rest (about 45 min on 2 cores) are slow and
marked `battery`, which the default run leaves out: `python -m pytest tests/test_fault_battery.py -m battery`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "Event loop is closed", "Exception ignored", "Fatal Python error", "Check failure")
TINY = ["model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "data.max_bytes=300000",
        "log.progress=false", "log.tensorboard=false", "train.eval_every=0", "parallel.dp=1"]
TINY_TRAIN = ["-m", "boost_jax.train", *TINY]
TRAIN = [*TINY_TRAIN, "train.steps=2"]
PLAN = ["-m", "boost_jax.plan", "model.preset=llama-tiny", "model.arch=cola", "train.batch_size=8", "train.seq_len=64"]
# A study of two 4-step runs (llama-tiny cola under adamw at two rates, one seed); study.dir= is the case's.
STUDY = ["-m", "boost_jax.study", "train.batch_size=4", "train.seq_len=32", "data.max_bytes=300000", "log.progress=false",
         "log.tensorboard=false", "log.health=false", "train.eval_batches=2", "checkpoint.every=2",
         "study.presets=[llama-tiny]", "study.archs=[cola]", "study.optimizers=[adamw]", "study.tokens=[512]",
         "study.tokens_unit=absolute", "study.lrs=[1e-3,3e-3]", "study.max_extensions=0", "study.seeds=1",
         "study.eval_tokens=1024", "study.early_below=0", "study.bootstrap=50"]


def chat_data(path: str) -> list[str]:
    """data.format=chat on one file, with the shipped ChatML template and the texts' tokenizer (the last item)."""
    return ["data.source=files", f"data.paths=[{path}]", "data.format=chat", "data.chat_template=chatml",
            "data.tokenizer_path={data}/tokenizer.json"]


def cmd(name: str, *args: str) -> list[str]:
    return ["-m", f"boost_jax.{name}", *args]


def bench(name: str, *args: str) -> list[str]:
    return cmd("bench", name, "model.preset=llama-tiny", "train.batch_size=8", "train.seq_len=64", "parallel.dp=1",
               *args)


def bare(name: str, *args: str) -> list[str]:
    """A benchmark without a config (the paper's rows, or none)."""
    return cmd("bench", name, *args)


def api(code: str) -> list[str]:
    """Python API calls: exit 1 for the project's error (BoostJaxError), 3 for any other exception."""
    body = "".join(f"    {line}\n" for line in code.splitlines())
    return ["-c", "import sys\nfrom boost_jax import api\nfrom boost_jax.runtime.errors import BoostJaxError\n"
                  "import jax.numpy as jnp\ntry:\n" + body + "except Exception as e:\n"
                  "    print(f'{{type(e).__name__}}: {{e}}', file=sys.stderr)\n"
                  "    sys.exit(1 if isinstance(e, BoostJaxError) else 3)\n"]


MODEL = "cfg = api.config('llama-tiny')\nmodel = api.build_model(cfg)\n"  # an untrained model for API cases


def script(text: str, *args: str) -> list[str]:
    """A driver script (LOST_PEER, DISK_FULL, ...) with its arguments."""
    return ["-c", text.replace("{", "{{").replace("}", "}}"), *args]


class Case(NamedTuple):
    name: str
    argv: list[str]
    code: int  # the exit status due
    needle: str  # a fragment stderr must hold ("": none)
    timeout: float = 240.0
    env: dict | None = None


# ----------------------------------------------------------------------------- fixtures


def _py(env: dict, *args) -> None:
    proc = subprocess.run([sys.executable, *map(str, args)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"making a fixture: python {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"


def _made(w: World, name: str, *args) -> Path:
    """The fixture `name` that `python *args` makes at w.root / name."""
    _py(w.env, *args)
    return w.root / name


def _texts(w: World) -> Path:
    texts = w.root / "texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + {i * i}\n" * 30)
    return texts


def _file(name: str, content: str | bytes):
    def make(w: World) -> Path:
        path = w.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path
    return make


def _hardware(name: str, change: dict):
    def make(w: World) -> Path:
        import yaml

        a100 = yaml.safe_load((ROOT / "boost_jax/configs/hardware.yaml").read_text())["a100-80gb"]
        spec = {k: v for k, v in {**a100, **change}.items() if v is not None}
        return _file(name, yaml.safe_dump({"a100-80gb": spec}))(w)
    return make


def _results(part: str | None):
    """docs/results.json (a saved `bench report`), or one section of it."""
    def make(w: World) -> Path:
        saved = ROOT / "docs/results.json"
        if not saved.is_file():
            pytest.skip("no docs/results.json (a saved `bench report`) to redraw")
        data = json.loads(saved.read_text())
        return _file(f"{part or 'results'}.json", json.dumps(data[part] if part else data))(w)
    return make


def _run_dir(name: str, config: str | None = None):
    """A folder with only a config.yaml: the trained run's (None) or `config`'s text."""
    def make(w: World) -> Path:
        path = w.root / name
        path.mkdir()
        (path / "config.yaml").write_text(config if config is not None else (w["run"] / "config.yaml").read_text())
        return path
    return make


def _damaged_xla(w: World) -> Path:
    """A compilation cache of a 1-step run, every entry overwritten with garbage."""
    xla = w.root / "xla_damaged"
    _py({**w.env, "JAX_COMPILATION_CACHE_DIR": str(xla)}, *TRAIN, "train.steps=1", f"run_dir={w.root / 'xla_run'}")
    entries = [p for p in xla.rglob("*") if p.is_file()]
    assert entries, "the run wrote no compilation cache entries"
    for p in entries:
        p.write_bytes(os.urandom(256))
    return xla


def _docs30(w: World) -> Path:
    from test_data import _docs  # 30 documents none of which the default val fraction holds out

    return _file("docs30.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in _docs(30, seed=5)))(w)


CHAT = "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                        {"role": "assistant", "content": str(i + 1)}]}) + "\n" for i in range(3))
def _saved_study(w: World, name: str, change) -> Path:
    """docs/results.json's saved study, changed."""
    saved = ROOT / "docs/results.json"
    if not saved.is_file() or "study" not in (data := json.loads(saved.read_text())):
        pytest.skip("no saved study in docs/results.json")
    change(data["study"])
    return _file(name, json.dumps(data["study"]))(w)


def _probe_tasks(w: World) -> Path:
    """A folder with one local lm-eval task (boost_probe, two multiple-choice documents; no network)."""
    docs = [{"question": "def main(", "choices": [" return 1", " pass"], "answer": 1},
            {"question": "import", "choices": [" os", " sys"], "answer": 0}]
    data = _file("probe_docs.json", json.dumps(docs))(w)
    return _file("probe_tasks/boost_probe.yaml", (
        f"task: boost_probe\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list: [{metric: acc}]\n"))(w).parent


LINES = "".join(json.dumps({"text": f"def f_{i}(x):\n    return x + {i}\n" * 20}) + "\n" for i in range(60))
FIXTURES = {  # name -> maker(world) -> path, made on first use
    "run": lambda w: _made(w, "run", *TINY_TRAIN, "model.arch=dense", "train.steps=4", "checkpoint.every=4",
                           f"run_dir={w.root / 'run'}"),
    "cache": lambda w: w["run"].parent / "cache",  # the data cache, holding the run's prepared corpus
    "own_data": lambda w: next(p for p in (w["cache"] / "prepared").iterdir() if (p / "index.json").is_file()),
    "texts": _texts,
    "data": lambda w: _made(w, "data", "-m", "boost_jax.data", "prepare", w["texts"], "--out", w.root / "data",
                            "--vocab-size", "300", "--no-progress"),
    # another tokenizer over the same texts
    "data2": lambda w: _made(w, "data2", "-m", "boost_jax.data", "prepare", w["texts"], "--out", w.root / "data2",
                             "--vocab-size", "300", "--tokenizer-kind", "byte_bpe", "--no-progress"),
    "hf": lambda w: _made(w, "hf", "-m", "boost_jax.export", w["run"], w.root / "hf"),
    "svd_run": lambda w: _made(w, "svd_run", "-m", "boost_jax.convert", "import", w["run"], w.root / "svd_run",
                               "--to", "svd", "--rank", "8"),
    "config_only_run": _run_dir("config_only_run"),
    "list_cfg_run": _run_dir("list_cfg_run", "- model\n- train\n"),
    "damaged_cfg_run": lambda w: _file("damaged_cfg_run/config.yaml", bytes(range(256)))(w).parent,
    "extra_section_run": lambda w: _run_dir("extra_section_run", (w["run"] / "config.yaml").read_text()
                                            + "\nextras:\n  x: 1\n")(w),
    "empty_dir": lambda w: (w.root / "empty_dir").mkdir() or w.root / "empty_dir",
    "a_file": _file("a_file", "not a folder\n"),
    "binary_yaml": _file("binary.yaml", bytes(range(256)) * 4),
    "not_mapping_yaml": _file("not_mapping.yaml", "- just\n- a list\n"),
    "damaged_jsonl_zst": _file("damaged.jsonl.zst", b"\x28\xb5\x2f\xfd" + os.urandom(200)),
    "damaged_jsonl_gz": _file("damaged.jsonl.gz", gzip.compress(b'{"text": "hello"}\n' * 50)[:-20]),
    "prompts_bin": _file("prompts.bin", b"\xff\xfe\x00" * 50),
    "empty_yaml": _file("empty.yaml", ""),
    "extras_yaml": _file("extras.yaml", "train:\n  lr: 0.001\nextras:\n  x: 1\n"),
    "bad_syntax_yaml": _file("bad_syntax.yaml", "train:\n  lr: [0.1\n  steps: 2\n"),
    "section_list_yaml": _file("section_list.yaml", "train:\n  - 1\n  - 2\n"),
    "dotted_yaml": _file("dotted.yaml", "train.lr: 0.1\n"),
    "empty_txt": _file("empty.txt", ""),
    "prompts_txt": _file("prompts.txt", "def main(\nimport os\n"),
    "blank_line_txt": _file("blank_line.txt", "def main(\n\n   \nclass A:\n"),
    "good_jsonl": _file("good.jsonl", LINES),
    "bad_jsonl": _file("bad.jsonl", LINES + "this line is not JSON\n" + LINES),
    "binary_jsonl": _file("binary.jsonl", os.urandom(4000)),
    "bad_parquet": _file("bad.parquet", b"PAR1" + os.urandom(500) + b"PAR1"),
    "empty_json": _file("empty.json", "{}"),
    "hw_missing_yaml": _hardware("hw_missing.yaml", {"peak_flops": None}),
    "hw_tile_yaml": _hardware("hw_tile.yaml", {"gemm_tile": 128}),
    "results_json": _results(None),
    "paper_json": _results("paper"),
    "planner_json": _results("planner"),
    "big_txt": _file("big.txt", "".join(f"def f{i}(x):\n    return x * {i} + {i * 7}\n\n" for i in range(20000))),
    "docs30_jsonl": _docs30,
    "xla_damaged": _damaged_xla,
    # instruction data (data.format=chat / prompt_completion; issue 72)
    "chat_no_messages_jsonl": _file("chat_no_messages.jsonl", CHAT + '{"text": "hi"}\n'),
    "chat_robot_jsonl": _file("chat_robot.jsonl", CHAT + json.dumps({"messages": [
        {"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]}) + "\n"),
    "chat_empty_jsonl": _file("chat_empty.jsonl", CHAT + json.dumps({"messages": [
        {"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}]}) + "\n"),
    "chat_long_jsonl": _file("chat_long.jsonl", CHAT + json.dumps({"messages": [
        {"role": "user", "content": "def f(x): return x " * 60}, {"role": "assistant", "content": "ok"}]}) + "\n"),
    "pc_no_completion_jsonl": _file("pc_no_completion.jsonl", '{"prompt": "1 + 1 ="}\n'),
    "broken_jinja": _file("broken.jinja", "{% for m in messages %}{{ m.content }}"),
    "study": lambda w: _made(w, "study", *STUDY, f"study.dir={w.root / 'study'}"),
    "study_empty_cells_json": lambda w: _saved_study(w, "study_empty_cells.json", lambda r: r.update(cells=[])),
    "study_string_mean_json": lambda w: _saved_study(w, "study_string_mean.json",
                                                     lambda r: r["cells"][0].update(mean="abc")),
    "probe_tasks": _probe_tasks,
    # export --format hf (issue 73): a model the transformers custom code does not compute
    "rope_cfg_run": _run_dir("rope_cfg_run", "model:\n  preset: llama-tiny\n  arch: cola\n  attn_rope_dims: 4\n"),
    # decoupled RoPE with 2 latent heads: an absorbed latent cache that only some layouts split
    "rope_heads_cfg_run": _run_dir("rope_heads_cfg_run", "model:\n  preset: llama-tiny\n  arch: cola\n  attn_rope_dims: 4\n"
                                                         "  attn_latent_heads: 2\n"),
}


def _write(name: str, content: str | bytes):
    return lambda d: (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())


def _config_json(**change):  # the export's config.json with fields changed (None: removed)
    def edit(d: Path) -> None:
        c = {k: v for k, v in {**json.loads((d / "config.json").read_text()), **change}.items() if v is not None}
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _missing_shard(d: Path) -> None:
    (d / "model.safetensors").unlink()
    _write("model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))(d)


def _truncate(d: Path) -> None:
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])


def _tensors(change):  # model.safetensors with its tensors changed
    def edit(d: Path) -> None:
        from safetensors.numpy import load_file, save_file

        t = load_file(d / "model.safetensors")
        change(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return edit


def _damage_checkpoints(run: Path) -> None:
    for p in (run / "checkpoints").rglob("*"):
        if p.is_file():
            p.write_bytes(os.urandom(64))


def _int32(name: str):
    return _tensors(lambda t: t.update({name: t[name].astype("int32")}))


RESULT = "llama-tiny/cola-adamw/budget512/lr0.001-seed0/study_result.json"  # the study fixture's first run's
COPIES = {  # name -> (the fixture copied for one case, how the copy is changed)
    "run_copy": ("run", None),
    "run_damaged": ("run", _damage_checkpoints),
    "run_no_checkpoints": ("run", lambda d: shutil.rmtree(d / "checkpoints")),
    "run_extra_section": ("run", lambda d: (d / "config.yaml").write_text((d / "config.yaml").read_text()
                                                                          + "extras:\n  x: 1\n")),
    "data_copy": ("data", None),
    "cache_without_index": ("cache", lambda d: [p.unlink() for p in d.glob("prepared/*/index.json")]),
    "hf_no_config": ("hf", lambda d: (d / "config.json").unlink()),
    "hf_config_not_json": ("hf", _write("config.json", '{"hidden_size": 64,')),
    "hf_config_binary": ("hf", _write("config.json", bytes(range(256)))),
    "hf_config_list": ("hf", _write("config.json", "[1, 2]")),
    "hf_missing_shard": ("hf", _missing_shard),
    "hf_index_not_json": ("hf", _write("model.safetensors.index.json", "not json")),
    "hf_rope_scaling": ("hf", _config_json(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "hf_mistral": ("hf", _config_json(model_type="mistral")),
    "hf_sliding_window": ("hf", _config_json(use_sliding_window=True)),
    "hf_hidden_size_string": ("hf", _config_json(hidden_size="sixty-four")),
    "hf_intermediate_size": ("hf", _config_json(intermediate_size=128)),
    "hf_no_weights": ("hf", lambda d: (d / "model.safetensors").unlink()),
    "hf_weights_random": ("hf", _write("model.safetensors", os.urandom(300))),
    "hf_weights_truncated": ("hf", _truncate),
    "hf_tensor_missing": ("hf", _tensors(lambda t: t.pop("lm_head.weight"))),
    "hf_no_tokenizer": ("hf", lambda d: (d / "tokenizer.json").unlink()),
    "hf_tokenizer_binary": ("hf", _write("tokenizer.json", bytes(range(256)))),
    "hf_int_norm": ("hf", _int32("model.norm.weight")),
    "study_json_truncated": ("study", lambda d: _write("study.json", (d / "study.json").read_bytes()[:100])(d)),
    "study_json_garbage": ("study", _write("study.json", os.urandom(300))),
    "study_json_empty": ("study", _write("study.json", "")),
    "study_result_truncated": ("study", lambda d: _write(RESULT, (d / RESULT).read_bytes()[:30])(d)),
    "study_result_string_loss": ("study", _write(RESULT, '{"loss": "abc"}')),
}
EMPTY_FOLDERS = {  # name -> a run dir holding a folder where a file belongs
    "run_metrics_folder": "metrics.jsonl", "run_lock_folder": ".boost_jax.lock"}


class World(dict):
    """The fixtures of a test session, each made when first named."""

    def __init__(self, root: Path, env: dict):
        super().__init__()
        self.root, self.env = root, env

    def __missing__(self, name: str) -> Path:
        if name not in FIXTURES:
            raise KeyError(f"no fixture {name!r}")
        self[name] = path = Path(FIXTURES[name](self))
        return path


class Paths(dict):
    """What a case's `{name}`s stand for: the world's fixtures, its own copies, and `{tmp}`."""

    def __init__(self, world: World, tmp: Path):
        super().__init__(tmp=str(tmp))
        self.world, self.tmp = world, tmp

    def __missing__(self, name: str) -> str:
        if name in COPIES:
            source, edit = COPIES[name]
            path = self.tmp / name
            shutil.copytree(self.world[source], path)
            if edit:
                edit(path)
        elif name in EMPTY_FOLDERS:
            path = self.tmp / name
            (path / EMPTY_FOLDERS[name]).mkdir(parents=True)
        else:
            path = self.world[name]
        self[name] = str(path)
        return self[name]


# ----------------------------------------------------------------------------- drivers of faults over time

# Two training processes on 127.0.0.1; process 1 is killed or stopped once 6 steps are logged (or, "never
# joins", never started): the survivor's stderr and exit status are the case's, a wait past 60 s is 124.
LOST_PEER = """
import pathlib, signal, socket, subprocess, sys, time
mode, run, tiny = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
args = lambda i: [sys.executable, "-m", "boost_jax.train", *tiny, "train.steps=400", "checkpoint.every=4",
                  "log.every=1", "parallel.dp=2", "parallel.cpu_devices=1", "parallel.heartbeat_timeout_s=10",
                  "parallel.num_processes=2", "parallel.coordinator_timeout_s=20",
                  f"parallel.coordinator=127.0.0.1:{port}", f"parallel.process_id={i}", f"run_dir={run}"]
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
mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
if mount.returncode:
    sys.exit(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
try:
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
finally:
    subprocess.run(["umount", "-l", str(where)])
sys.stderr.write(p.stderr)
sys.exit(p.returncode)
"""

# A second `train` in the run dir of a running one: the second's stderr and exit status.
SECOND_WRITER = """
import pathlib, subprocess, sys, time
run, tiny = pathlib.Path(sys.argv[1]), sys.argv[2:]
args = [sys.executable, "-m", "boost_jax.train", *tiny, "train.steps=100000", "checkpoint.every=50", f"run_dir={run}"]
first = subprocess.Popen(args, stderr=subprocess.DEVNULL)
while not (run / "metrics.jsonl").exists():
    time.sleep(0.2)
second = subprocess.run(args, capture_output=True, text=True)
first.kill()
sys.stderr.write(second.stderr)
sys.exit(second.returncode)
"""

# A reader (eval, generate or export), again and again, of a run whose retention (keep 1, a save every
# step) deletes the steps it chose: exit 1 with the reader's stderr at its first failure or damage report.
LIVE_READER = """
import pathlib, subprocess, sys
live, reader, tiny = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
args = [sys.executable, "-m", "boost_jax.train", *tiny, "checkpoint.every=1", "checkpoint.keep=1", f"run_dir={live}"]
subprocess.run([*args, "train.steps=1"], check=True, capture_output=True)  # a first checkpoint
run = subprocess.Popen([*args, "train.steps=60"], stderr=subprocess.DEVNULL)
more = {"eval": [], "generate": ["--prompt", "def", "--max-new-tokens", "2"], "export": []}[reader]
reads = 0
while run.poll() is None:
    out = [f"{live}_export{reads}"] if reader == "export" else []
    e = subprocess.run([sys.executable, "-m", f"boost_jax.{reader}", str(live), *out, *more], capture_output=True,
                       text=True)
    reads += 1
    if e.returncode or "damaged" in e.stderr or "Fix or move" in e.stderr:
        sys.stderr.write(e.stderr)
        run.kill()
        sys.exit(1)
print(reads, "reads")
"""


# A command whose folder is a read-only mount (unmounted after): its stderr and exit status.
READ_ONLY = """
import pathlib, subprocess, sys
where, argv = pathlib.Path(sys.argv[1]), sys.argv[2:]
where.mkdir(parents=True, exist_ok=True)
mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], capture_output=True, text=True)
if mount.returncode:
    sys.exit(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
try:
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
finally:
    subprocess.run(["umount", "-l", str(where)])
sys.stderr.write(p.stderr)
sys.exit(p.returncode)
"""

# A study sent SIGTERM as its first run's result appears (between runs, or early in the next), then rerun: the
# first's stderr and exit status, or 9 if the rerun failed or computed a finished run again.
STUDY_SIGTERM = """
import pathlib, signal, subprocess, sys, time
where, argv = pathlib.Path(sys.argv[1]), [sys.executable, *sys.argv[2:], f"study.dir={sys.argv[1]}"]
first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
while not list(where.glob("**/study_result.json")) and first.poll() is None:
    time.sleep(0.05)
first.send_signal(signal.SIGTERM)
err = first.communicate()[1]
finished = {p: p.stat().st_mtime_ns for p in where.glob("**/study_result.json")}
again = subprocess.run(argv, capture_output=True, text=True)
kept = again.returncode == 0 and all(p.stat().st_mtime_ns == t for p, t in finished.items())
sys.stderr.write(err + ("" if kept else "the rerun failed or computed a finished run again: " + again.stderr))
sys.exit(first.returncode if kept else 9)
"""


# ----------------------------------------------------------------------------- the table

# `serve` on a port another socket holds: the command's exit status and stderr are this script's.
SERVE_ON_A_PORT_IN_USE = """
import socket, subprocess, sys
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen(1)
done = subprocess.run([sys.executable, "-m", "boost_jax.serve", sys.argv[1], "--port", str(held.getsockname()[1])])
sys.exit(done.returncode)
"""

CASES = [  # (name, argv, exit status due, a fragment of stderr[, timeout s[, environment]])
    ('train model.d_modle=5', [*TRAIN, 'model.d_modle=5', 'run_dir={tmp}/run'], 1, 'model.d_modle'),
    ('train train.steps=abc', [*TRAIN, 'train.steps=abc', 'run_dir={tmp}/run'], 1, 'train.steps'),
    ('train train.lr=-1', [*TRAIN, 'train.lr=-1', 'run_dir={tmp}/run'], 1, 'train.lr'),
    ('train train.batch_size=0', [*TRAIN, 'train.batch_size=0', 'run_dir={tmp}/run'], 1, 'train.batch_size'),
    ('train model.arch=foo', [*TRAIN, 'model.arch=foo', 'run_dir={tmp}/run'], 1, 'model.arch'),
    ('train parallel.tp=3', [*TRAIN, 'parallel.tp=3', 'run_dir={tmp}/run'], 1, 'parallel'),
    ('train parallel.cp=3', [*TRAIN, 'parallel.cp=3', 'run_dir={tmp}/run'], 1, 'parallel'),
    ('train parallel.cp=2 train.seq_len=66', [*TRAIN, 'parallel.cp=2', 'train.seq_len=66', 'run_dir={tmp}/run'], 1,
     'parallel.cp'),
    ('train train.remat=some', [*TRAIN, 'train.remat=some', 'run_dir={tmp}/run'], 1, 'train.remat'),
    ('train log.every=0', [*TRAIN, 'log.every=0', 'run_dir={tmp}/run'], 1, 'log.every'),
    ('train checkpoint.keep=0', [*TRAIN, 'checkpoint.keep=0', 'run_dir={tmp}/run'], 1, 'checkpoint.keep'),
    ('train checkpoint.every=-1', [*TRAIN, 'checkpoint.every=-1', 'run_dir={tmp}/run'], 1, 'checkpoint.every'),
    ('train train.microbatches=3', [*TRAIN, 'train.microbatches=3', 'run_dir={tmp}/run'], 1, 'train.microbatches'),
    ('train model.vocab_size=10', [*TRAIN, 'model.vocab_size=10', 'run_dir={tmp}/run'], 1, 'vocab'),
    ('train data.source=prepared', [*TRAIN, 'data.source=prepared', 'run_dir={tmp}/run'], 1, 'data.path'),
    ('train data.val_fraction=1.5', [*TRAIN, 'data.val_fraction=1.5', 'run_dir={tmp}/run'], 1, 'data.val_fraction'),
    ('train train.z_loss=-1', [*TRAIN, 'train.z_loss=-1', 'run_dir={tmp}/run'], 1, 'train.z_loss'),
    ('train train.spike_skip=-1', [*TRAIN, 'train.spike_skip=-1', 'run_dir={tmp}/run'], 1, 'train.spike_skip'),
    ('train checkpoint.every_minutes=-1', [*TRAIN, 'checkpoint.every_minutes=-1', 'run_dir={tmp}/run'], 1,
     'checkpoint.every_minutes'),
    ('train data.source=mixture', [*TRAIN, 'data.source=mixture', 'run_dir={tmp}/run'], 1, 'data.mixture'),
    ('train parallel.pp=3', [*TRAIN, 'parallel.pp=3', 'run_dir={tmp}/run'], 1, 'parallel'),
    ('train model.n_heads=5', [*TRAIN, 'model.n_heads=5', 'run_dir={tmp}/run'], 1, 'model'),
    ('train train.eval_batches=0', [*TRAIN, 'train.eval_batches=0', 'run_dir={tmp}/run'], 1, 'train.eval_batches'),
    ('train log.profile_start=-1', [*TRAIN, 'log.profile_start=-1', 'run_dir={tmp}/run'], 1, 'log.profile_start'),
    ('train parallel.dp=0', [*TRAIN, 'parallel.dp=0', 'run_dir={tmp}/run'], 1, 'parallel.dp'),
    ('train model.dtype=float8', [*TRAIN, 'model.dtype=float8', 'run_dir={tmp}/run'], 1, 'model.dtype'),
    ('train train.grad_clip=-1', [*TRAIN, 'train.grad_clip=-1', 'run_dir={tmp}/run'], 1, 'train.grad_clip'),
    ('train model', [*TRAIN, 'model', 'run_dir={tmp}/run'], 1, 'model'),
    ('train =5', [*TRAIN, '=5', 'run_dir={tmp}/run'], 1, 'override'),
    ('train run_dir=', [*TRAIN, 'run_dir='], 1, 'run_dir'),
    ('train model.preset=llama-nope', [*TRAIN, 'run_dir={tmp}/run', 'model.preset=llama-nope'], 1, 'model.preset'),
    ('train model.d_model=abc', [*TRAIN, 'run_dir={tmp}/run', 'model.d_model=abc'], 1, 'model.d_model'),
    ('train model.n_kv_heads=3', [*TRAIN, 'run_dir={tmp}/run', 'model.n_kv_heads=3'], 1, 'model.n_kv_heads'),
    ('train model.attention=cudnn', [*TRAIN, 'run_dir={tmp}/run', 'model.attention=cudnn'], 1, 'model.attention'),
    ('train model.arch=dense model.kernels=pallas', [*TRAIN, 'run_dir={tmp}/run', 'model.arch=dense',
     'model.kernels=pallas'], 1, 'model.kernels'),
    ('train train.lr=abc', [*TRAIN, 'run_dir={tmp}/run', 'train.lr=abc'], 1, 'train.lr'),
    ('train train.lr=[0.1,0.2]', [*TRAIN, 'run_dir={tmp}/run', 'train.lr=[0.1,0.2]'], 1, 'train.lr'),
    ('train train.lr=.inf', [*TRAIN, 'run_dir={tmp}/run', 'train.lr=.inf'], 1, 'train.lr'),
    ('train train.steps=1.5', [*TRAIN, 'run_dir={tmp}/run', 'train.steps=1.5'], 1, 'train.steps'),
    ('train train.on_nonfinite=ignore', [*TRAIN, 'run_dir={tmp}/run', 'train.on_nonfinite=ignore'], 1,
     'train.on_nonfinite'),
    ('train train.warmup_steps=-1', [*TRAIN, 'run_dir={tmp}/run', 'train.warmup_steps=-1'], 1, 'train.warmup_steps'),
    ('train train=5', [*TRAIN, 'run_dir={tmp}/run', 'train=5'], 1, 'train'),
    ('train Train.lr=0.1', [*TRAIN, 'run_dir={tmp}/run', 'Train.lr=0.1'], 1, 'Train'),
    ('train data.source=files', [*TRAIN, 'run_dir={tmp}/run', 'data.source=files'], 1, 'data.paths'),
    ('train data.val_fraction=0 train.eval_every=1', [*TRAIN, 'run_dir={tmp}/run', 'data.val_fraction=0',
     'train.eval_every=1'], 1, 'data.val_fraction'),
    ('train checkpoint.keep=abc', [*TRAIN, 'run_dir={tmp}/run', 'checkpoint.keep=abc'], 1, 'checkpoint.keep'),
    ('train parallel.tp=2.5', [*TRAIN, 'run_dir={tmp}/run', 'parallel.tp=2.5'], 1, 'parallel.tp'),
    ('train parallel.pp_repeats=2', [*TRAIN, 'run_dir={tmp}/run', 'parallel.pp_repeats=2'], 1, 'parallel.pp_repeats'),
    ('train parallel.scheme=megatron', [*TRAIN, 'run_dir={tmp}/run', 'parallel.scheme=megatron'], 1, 'parallel.scheme'),
    ('train model.arch=dense parallel.cp=2 parallel.cp_attention=latent', [*TRAIN, 'run_dir={tmp}/run',
     'model.arch=dense', 'parallel.cp=2', 'parallel.cp_attention=latent'], 1, 'parallel.cp_attention'),
    ('train parallel.cpu_devices=2 parallel.pp=2', [*TRAIN, 'run_dir={tmp}/run', 'parallel.cpu_devices=2',
     'parallel.pp=2'], 1, 'train.microbatches'),
    ('train log.progress=maybe', [*TRAIN, 'run_dir={tmp}/run', 'log.progress=maybe'], 1, 'log.progress'),
    ('train log.bogus=true', [*TRAIN, 'run_dir={tmp}/run', 'log.bogus=true'], 1, 'log.bogus'),
    ('train run_dir=[a,b]', [*TRAIN, 'run_dir={tmp}/run', 'run_dir=[a,b]'], 1, 'run_dir'),
    ('train lr in YAML 1.1 notation (3e-4)', [*TRAIN, 'train.lr=3e-4', 'run_dir={tmp}/run'], 0, ''),
    ('train on a prepared dataset', [*TRAIN, 'data.source=prepared', 'data.path={data}', 'run_dir={tmp}/run'], 0, ''),
    ('train recipe: extras.yaml', cmd('train', '{extras_yaml}', 'model.preset=llama-tiny', 'train.batch_size=8',
     'train.seq_len=64', 'data.max_bytes=300000', 'log.progress=false', 'log.tensorboard=false', 'train.eval_every=0',
     'parallel.dp=1', 'train.steps=2', 'run_dir={tmp}/run'), 1, 'extras'),
    ('train recipe: bad_syntax.yaml', cmd('train', '{bad_syntax_yaml}', 'model.preset=llama-tiny', 'train.batch_size=8',
     'train.seq_len=64', 'data.max_bytes=300000', 'log.progress=false', 'log.tensorboard=false', 'train.eval_every=0',
     'parallel.dp=1', 'train.steps=2', 'run_dir={tmp}/run'), 1, 'bad_syntax.yaml'),
    ('train recipe: section_list.yaml', cmd('train', '{section_list_yaml}', 'model.preset=llama-tiny',
     'train.batch_size=8', 'train.seq_len=64', 'data.max_bytes=300000', 'log.progress=false', 'log.tensorboard=false',
     'train.eval_every=0', 'parallel.dp=1', 'train.steps=2', 'run_dir={tmp}/run'), 1, 'train'),
    ('train recipe: dotted.yaml', cmd('train', '{dotted_yaml}', 'model.preset=llama-tiny', 'train.batch_size=8',
     'train.seq_len=64', 'data.max_bytes=300000', 'log.progress=false', 'log.tensorboard=false', 'train.eval_every=0',
     'parallel.dp=1', 'train.steps=2', 'run_dir={tmp}/run'), 1, 'train.lr'),
    ('train recipe: empty', cmd('train', '{empty_yaml}', 'model.preset=llama-tiny', 'train.batch_size=8',
     'train.seq_len=64', 'data.max_bytes=300000', 'log.progress=false', 'log.tensorboard=false', 'train.eval_every=0',
     'parallel.dp=1', 'train.steps=2', 'run_dir={tmp}/run'), 0, ''),
    ('train mixture: a negative weight', [*TRAIN, 'data.source=mixture', 'data.mixture=[{{path: {data}, weight: -1}}]',
     'run_dir={tmp}/run'], 1, 'data.mixture[0].weight'),
    ('train mixture: an entry without a path', [*TRAIN, 'data.source=mixture', 'data.mixture=[{{weight: 1}}]',
     'run_dir={tmp}/run'], 1, 'data.mixture[0].path'),
    ('train mixture: an entry that is not a mapping', [*TRAIN, 'data.source=mixture', 'data.mixture=[{data}]',
     'run_dir={tmp}/run'], 1, 'data.mixture[0]'),
    ('train mixture: two tokenizers', [*TRAIN, 'data.source=mixture',
     'data.mixture=[{{path: {data}, weight: 1}}, {{path: {data2}, weight: 1}}]', 'run_dir={tmp}/run'], 1, 'tokenizer'),
    ('train mixture: one dataset twice, unnamed', [*TRAIN, 'data.source=mixture',
     'data.mixture=[{{path: {data}, weight: 1}}, {{path: {data}, weight: 2}}]', 'run_dir={tmp}/run'], 1, 'name'),
    ('train mixture: one dataset twice, named', [*TRAIN, 'data.source=mixture',
     'data.mixture=[{{path: {data}, weight: 1, name: a}}, {{path: {data}, weight: 3, name: b}}]', 'run_dir={tmp}/run'],
     0, ''),
    ('train recipe: binary YAML', cmd('train', '{binary_yaml}'), 1, '{binary_yaml}'),
    ('train recipe: a YAML list', cmd('train', '{not_mapping_yaml}'), 1, 'not_mapping.yaml'),
    ('train recipe: missing', cmd('train', '{tmp}/nope.yaml'), 1, 'nope.yaml'),
    ('train run_dir is a file', [*TRAIN, 'run_dir={a_file}'], 1, 'a_file'),
    ('train run_dir under /proc', [*TRAIN, 'run_dir=/proc/boost_jax_run'], 1, '/proc'),
    ('train data.path missing', [*TRAIN, 'data.source=prepared', 'data.path={tmp}/nodata', 'run_dir={tmp}/d1'], 1,
     'nodata'),
    ('train data.path not a dataset', [*TRAIN, 'data.source=prepared', 'data.path={empty_dir}', 'run_dir={tmp}/d2'], 1,
     'empty_dir'),
    ('train damaged .jsonl.zst', [*TRAIN, 'data.source=files', 'data.paths=[{damaged_jsonl_zst}]', 'run_dir={tmp}/d3'],
     1, 'damaged.jsonl.zst'),
    ('train damaged .jsonl.gz', [*TRAIN, 'data.source=files', 'data.paths=[{damaged_jsonl_gz}]', 'run_dir={tmp}/d4'], 1,
     'damaged.jsonl.gz'),
    ('train binary text file', [*TRAIN, 'data.source=files', 'data.paths=[{prompts_bin}]', 'run_dir={tmp}/d5'], 1,
     'prompts.bin'),
    ('train tokenizer_path binary', [*TRAIN, 'data.tokenizer_path={binary_yaml}', 'run_dir={tmp}/d6'], 1,
     'binary.yaml'),
    ('train resume: binary config.yaml', [*TRAIN, 'run_dir={damaged_cfg_run}'], 1, 'config.yaml'),
    ('eval: unknown section in config.yaml', cmd('eval', '{extra_section_run}'), 1, 'extras'),
    ('train resume: another seed', [*TINY_TRAIN, 'train.steps=6', 'train.seed=3', 'run_dir={run}'], 1, 'train.seed'),
    ('train data.paths: a missing file', [*TRAIN, 'data.source=files', 'data.paths=[{tmp}/none.txt]',
     'run_dir={tmp}/run'], 1, 'none.txt'),
    ('train data.paths: a glob matching nothing', [*TRAIN, 'data.source=files', 'data.paths=[{tmp}/*.nothing]',
     'run_dir={tmp}/run'], 1, '*.nothing'),
    ('train data.paths: a malformed .jsonl line', [*TRAIN, 'data.source=files', 'data.paths=[{bad_jsonl}]',
     'run_dir={tmp}/run'], 1, 'bad.jsonl'),
    ('train data.paths: a garbage .parquet', [*TRAIN, 'data.source=files', 'data.paths=[{bad_parquet}]',
     'run_dir={tmp}/run'], 1, 'bad.parquet'),
    ('train data.paths: a text_key the .jsonl lacks', [*TRAIN, 'data.source=files', 'data.paths=[{good_jsonl}]',
     'data.text_key=body', 'run_dir={tmp}/run'], 1, 'body'),
    ('train data.cache_dir is a file', [*TRAIN, 'data.cache_dir={a_file}', 'run_dir={tmp}/run'], 1, 'a_file'),
    ('train resume: another arch', [*TRAIN, 'model.arch=dense', 'train.steps=6', 'model.arch=cola',
     'run_dir={run_copy}'], 1, 'model.arch'),
    ('train resume: damaged checkpoints', [*TRAIN, 'model.arch=dense', 'train.steps=6', 'run_dir={run_damaged}'], 1,
     'checkpoint'),
    ('train resume: config.yaml a list', [*TRAIN, 'run_dir={list_cfg_run}'], 1, 'config.yaml'),
    ('train resume: to step 6', [*TRAIN, 'model.arch=dense', 'train.steps=6', 'run_dir={run_copy}'], 0, ''),
    ('train parallel.coordinator=localhost parallel.num_processes=2 parallel.process_id=1', [*TRAIN,
     'parallel.coordinator=localhost', 'parallel.num_processes=2', 'parallel.process_id=1', 'run_dir={tmp}/mp'], 1,
     'host:port', 120),
    ('train parallel.coordinator=localhost:99999 parallel.num_processes=2 parallel.process_id=1', [*TRAIN,
     'parallel.coordinator=localhost:99999', 'parallel.num_processes=2', 'parallel.process_id=1', 'run_dir={tmp}/mp'],
     1, 'host:port', 120),
    ('train parallel.coordinator=:4321 parallel.num_processes=2 parallel.process_id=1', [*TRAIN,
     'parallel.coordinator=:4321', 'parallel.num_processes=2', 'parallel.process_id=1', 'run_dir={tmp}/mp'], 1,
     'host:port', 120),
    ('train parallel.coordinator=:::', [*TRAIN, 'parallel.coordinator=:::', 'run_dir={tmp}/mp'], 1,
     'parallel.coordinator', 120),
    ('train parallel.coordinator=localhost:1234 parallel.num_processes=2 parallel.process_id=5', [*TRAIN,
     'parallel.coordinator=localhost:1234', 'parallel.num_processes=2', 'parallel.process_id=5', 'run_dir={tmp}/mp'], 1,
     'parallel.process_id', 120),
    ('train parallel.coordinator=localhost:1234 parallel.num_processes=0', [*TRAIN,
     'parallel.coordinator=localhost:1234', 'parallel.num_processes=0', 'run_dir={tmp}/mp'], 1,
     'parallel.num_processes', 120),
    ('train coordinator that never answers', [*TRAIN, 'parallel.coordinator=10.255.255.1:4321',
     'parallel.num_processes=2', 'parallel.process_id=1', 'parallel.coordinator_timeout_s=10', 'run_dir={tmp}/mp2'], 1,
     'did not join within 10 s', 120),
    ('train the other processes never join', [*TRAIN, 'parallel.coordinator=localhost:23456',
     'parallel.num_processes=2', 'parallel.process_id=0', 'parallel.coordinator_timeout_s=10', 'run_dir={tmp}/mp3'], 1,
     'did not join within 10 s', 120),
    ('prepare --workers 0', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--workers', '0'), 1,
     '--workers'),
    ('prepare --workers -2', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--workers', '-2'), 1,
     '--workers'),
    ('prepare --shard-mb 0', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--shard-mb', '0'), 1,
     '--shard-mb'),
    ('prepare --sample-mb 0', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--sample-mb', '0'), 1,
     '--sample-mb'),
    ('prepare --vocab-size 10', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--vocab-size', '10'), 1,
     'vocab'),
    ('prepare --val-fraction 1.5', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--val-fraction', '1.5'),
     1, '--val-fraction'),
    ('prepare --max-bytes -1', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--max-bytes', '-1'), 1,
     '--max-bytes'),
    ('prepare --tokenizer-kind foo', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_bad', '--tokenizer-kind',
     'foo'), 2, '--tokenizer-kind'),
    ('prepare empty corpus', cmd('data', 'prepare', '{empty_dir}', '--out', '{tmp}/p_empty'), 1, 'empty_dir'),
    ('prepare missing source', cmd('data', 'prepare', '{tmp}/nosrc', '--out', '{tmp}/p_missing'), 1, 'nosrc'),
    ('prepare out is a file', cmd('data', 'prepare', '{texts}', '--out', '{a_file}'), 1, 'a_file'),
    ('prepare out under /proc', cmd('data', 'prepare', '{texts}', '--out', '/proc/boost_jax_data'), 1, '/proc'),
    ('prepare damaged .jsonl.zst', cmd('data', 'prepare', '{damaged_jsonl_zst}', '--out', '{tmp}/p_zst'), 1,
     'damaged.jsonl.zst'),
    ('prepare binary file', cmd('data', 'prepare', '{prompts_bin}', '--out', '{tmp}/p_bin'), 1, 'prompts.bin'),
    ('prepare --tokenizer binary', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p_tok', '--tokenizer',
     '{binary_yaml}'), 1, 'binary.yaml'),
    ('prepare an existing dataset again', cmd('data', 'prepare', '{texts}', '--out', '{data}', '--vocab-size', '300'),
     0, ''),
    ('prepare --vocab-size 99999999999', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p115', '--vocab-size',
     '99999999999'), 1, '--vocab-size'),
    ('prepare --tokenizer none.json', cmd('data', 'prepare', '{texts}', '--out', '{tmp}/p116', '--tokenizer',
     '{tmp}/none.json'), 1, 'none.json'),
    ('prepare damaged.jsonl.gz', cmd('data', 'prepare', '{damaged_jsonl_gz}', '--out', '{tmp}/p117', '--vocab-size',
     '300'), 1, 'damaged.jsonl.gz'),
    ('prepare binary.jsonl', cmd('data', 'prepare', '{binary_jsonl}', '--out', '{tmp}/p118', '--vocab-size', '300'), 1,
     'binary.jsonl'),
    ('prepare bad.parquet', cmd('data', 'prepare', '{bad_parquet}', '--out', '{tmp}/p119', '--vocab-size', '300'), 1,
     'bad.parquet'),
    ('prepare bad.jsonl', cmd('data', 'prepare', '{bad_jsonl}', '--out', '{tmp}/p120', '--vocab-size', '300'), 1,
     'bad.jsonl'),
    ('prepare bad.jsonl --skip-bad-lines', cmd('data', 'prepare', '{bad_jsonl}', '--out', '{tmp}/p_skip',
     '--vocab-size', '300', '--skip-bad-lines', '--no-progress', '--val-fraction', '0.05'), 0, ''),
    ('prepare out under a file', cmd('data', 'prepare', '{texts}', '--out', '{a_file}/sub'), 1, 'a_file'),
    ('prepare again with another --vocab-size', cmd('data', 'prepare', '{texts}', '--out', '{data_copy}',
     '--vocab-size', '280'), 1, '{data_copy}'),
    ('eval missing run dir', cmd('eval', '{tmp}/norun'), 1, 'norun'),
    ('eval not a run dir', cmd('eval', '{empty_dir}'), 1, 'empty_dir'),
    ('eval binary config.yaml', cmd('eval', '{damaged_cfg_run}'), 1, 'config.yaml'),
    ('eval --step 999', cmd('eval', '{run}', '--step', '999'), 1, '999'),
    ('generate missing run dir', cmd('generate', '{tmp}/norun', '--prompt', 'x'), 1, 'norun'),
    ('generate not a run dir', cmd('generate', '{empty_dir}', '--prompt', 'x'), 1, 'empty_dir'),
    ('generate binary config.yaml', cmd('generate', '{damaged_cfg_run}', '--prompt', 'x'), 1, 'config.yaml'),
    ('generate --step 999', cmd('generate', '{run}', '--prompt', 'x', '--step', '999'), 1, '999'),
    ('export missing run dir', cmd('export', '{tmp}/norun', '{tmp}/exp_export'), 1, 'norun'),
    ('export not a run dir', cmd('export', '{empty_dir}', '{tmp}/exp_export'), 1, 'empty_dir'),
    ('export binary config.yaml', cmd('export', '{damaged_cfg_run}', '{tmp}/exp_export'), 1, 'config.yaml'),
    ('export --step 999', cmd('export', '{run}', '{tmp}/exp_export', '--step', '999'), 1, '999'),
    ('eval --max-tokens -1', cmd('eval', '{run}', '--max-tokens', '-1'), 1, '--max-tokens'),
    ('eval --step -1', cmd('eval', '{run}', '--step', '-1'), 1, '--step'),
    ('eval --split bogus', cmd('eval', '{run}', '--split', 'bogus'), 2, '--split'),
    ('eval on another dataset', cmd('eval', '{run}', 'data.source=prepared', 'data.path={data}'), 1, '{data}'),
    ('generate --max-new-tokens 0', cmd('generate', '{run}', '--prompt', 'def', '--max-new-tokens', '0'), 1,
     '--max-new-tokens'),
    ('generate --temperature -1', cmd('generate', '{run}', '--prompt', 'def', '--temperature', '-1'), 1, 'temperature'),
    ('generate --top-k -1', cmd('generate', '{run}', '--prompt', 'def', '--top-k', '-1'), 1, 'top_k'),
    ('generate --top-p 0', cmd('generate', '{run}', '--prompt', 'def', '--top-p', '0'), 1, 'top_p'),
    ('generate --top-p 1.5', cmd('generate', '{run}', '--prompt', 'def', '--top-p', '1.5'), 1, 'top_p'),
    ('generate --cache bogus', cmd('generate', '{run}', '--prompt', 'def', '--cache', 'bogus'), 2, '--cache'),
    ('generate empty prompt', cmd('generate', '{run}', '--prompt', ''), 1, 'empty'),
    ('generate --prompts-file missing', cmd('generate', '{run}', '--prompts-file', '{tmp}/none.txt'), 1, 'none.txt'),
    ('generate --prompts-file binary', cmd('generate', '{run}', '--prompts-file', '{prompts_bin}'), 1, 'prompts.bin'),
    ('generate cache latent on a cp run', cmd('generate', '{run}', '--prompt', 'x', 'parallel.cp=2'), 1, 'parallel.cp'),
    ('generate ok', cmd('generate', '{run}', '--prompt', 'def', '--max-new-tokens', '4'), 0, ''),
    ('export out is a file', cmd('export', '{run}', '{a_file}'), 1, 'a_file'),
    ('export out not empty', cmd('export', '{run}', '{data}'), 1, '--force'),
    ('export out under /proc', cmd('export', '{run}', '/proc/boost_jax_export'), 1, '/proc'),
    ('convert missing source', cmd('convert', 'import', '{tmp}/nosrc', '{tmp}/c1'), 1, 'nosrc'),
    ('convert source not a model', cmd('convert', 'import', '{empty_dir}', '{tmp}/c2'), 1, 'empty_dir'),
    ('convert into an existing run', cmd('convert', 'import', '{run}', '{run}'), 1, '{run}'),
    ('convert --to svd --rank 0', cmd('convert', 'import', '{run}', '{tmp}/c3', '--to', 'svd', '--rank', '0'), 1,
     '--rank'),
    ('convert --to bogus', cmd('convert', 'import', '{run}', '{tmp}/c4', '--to', 'bogus'), 2, '--to'),
    ('convert --samples 0', cmd('convert', 'import', '{run}', '{tmp}/c5', '--to', 'svd', '--rank', '8', '--method',
     'whiten', '--calibration', '{data}', '--samples', '0'), 1, '--samples'),
    ('convert --calibration not a dataset', cmd('convert', 'import', '{run}', '{tmp}/c6', '--to', 'svd', '--rank', '8',
     '--method', 'whiten', '--calibration', '{empty_dir}'), 1, 'empty_dir'),
    ('convert into /proc', cmd('convert', 'import', '{run}', '/proc/boost_jax_conv'), 1, '/proc'),
    ('convert ok', cmd('convert', 'import', '{run}', '{tmp}/c7', '--to', 'svd', '--rank', '8'), 0, ''),
    ('eval a model key', cmd('eval', '{run}', 'model.d_model=8'), 1, 'model.d_model'),
    ('eval an argument that is not an override', cmd('eval', '{run}', 'notanoverride'), 1, 'notanoverride'),
    ('eval a missing dataset', cmd('eval', '{run}', 'data.source=prepared', 'data.path={tmp}/nodata'), 1, 'nodata'),
    ('eval a run dir without checkpoints', cmd('eval', '{config_only_run}'), 1, 'checkpoint'),
    ('eval config.yaml a list', cmd('eval', '{list_cfg_run}'), 1, 'config.yaml'),
    ('eval --json', cmd('eval', '{run}', '--json'), 0, ''),
    ('generate --temperature nan', cmd('generate', '{run}', '--prompt', 'def', '--temperature', 'nan'), 1,
     'temperature'),
    ('generate --step 2', cmd('generate', '{run}', '--prompt', 'def', '--step', '2'), 1, 'step 2'),
    ('generate --cache latent', cmd('generate', '{run}', '--prompt', 'def', '--cache', 'latent'), 1, 'latent'),
    ('generate --max-new-tokens 100000', cmd('generate', '{run}', '--prompt', 'def', '--max-new-tokens', '100000'), 1,
     'max_new_tokens'),
    ('generate --prompts-file empty.txt', cmd('generate', '{run}', '--prompts-file', '{empty_txt}'), 1, 'empty.txt'),
    ('generate --prompts-file empty_dir', cmd('generate', '{run}', '--prompts-file', '{empty_dir}'), 1, 'empty_dir'),
    ('generate --prompts-file with blank lines', cmd('generate', '{run}', '--prompts-file', '{blank_line_txt}',
     '--max-new-tokens', '4'), 0, ''),
    ('generate sampled --json', cmd('generate', '{run}', '--prompts-file', '{prompts_txt}', '--max-new-tokens', '4',
     '--temperature', '0.8', '--top-k', '5', '--top-p', '0.9', '--seed', '3', '--json'), 0, ''),
    ('generate a low-rank run, latent cache', cmd('generate', '{svd_run}', '--prompt', 'def', '--max-new-tokens', '4',
     '--cache', 'latent'), 0, ''),
    ('export --step -1', cmd('export', '{run}', '{tmp}/e1', '--step', '-1'), 1, '--step'),
    ('export out under a file', cmd('export', '{run}', '{a_file}/sub'), 1, 'a_file'),
    ('export a run dir without checkpoints', cmd('export', '{config_only_run}', '{tmp}/e2'), 1, 'checkpoint'),
    ('export --force into a non-empty folder', cmd('export', '{run}', '{tmp}/e_force', '--force'), 0, ''),
    ('export a low-rank run (boost layout)', cmd('export', '{svd_run}', '{tmp}/e_svd'), 0, ''),
    ('convert HF folder: no config.json', cmd('convert', 'import', '{hf_no_config}', '{tmp}/c183'), 1, 'config.json'),
    ('convert HF folder: config.json not JSON', cmd('convert', 'import', '{hf_config_not_json}', '{tmp}/c184'), 1,
     'config.json'),
    ('convert HF folder: config.json binary', cmd('convert', 'import', '{hf_config_binary}', '{tmp}/c185'), 1,
     'config.json'),
    ('convert HF folder: config.json a list', cmd('convert', 'import', '{hf_config_list}', '{tmp}/c186'), 1,
     'config.json'),
    ('convert HF folder: an index naming a missing shard', cmd('convert', 'import', '{hf_missing_shard}', '{tmp}/c187'),
     1, 'model-00001-of-00002.safetensors'),
    ('convert HF folder: an index that is not JSON', cmd('convert', 'import', '{hf_index_not_json}', '{tmp}/c188'), 1,
     'model.safetensors.index.json'),
    ('convert HF folder: rope_scaling', cmd('convert', 'import', '{hf_rope_scaling}', '{tmp}/c189'), 1, 'rope_scaling'),
    ('convert HF folder: model_type mistral', cmd('convert', 'import', '{hf_mistral}', '{tmp}/c190'), 1, 'model_type'),
    ('convert HF folder: hidden_size a string', cmd('convert', 'import', '{hf_hidden_size_string}', '{tmp}/c191'), 1,
     'config.json'),
    ("convert HF folder: intermediate_size not the tensors'", cmd('convert', 'import', '{hf_intermediate_size}',
     '{tmp}/c192'), 1, 'shape'),
    ('convert HF folder: no model.safetensors', cmd('convert', 'import', '{hf_no_weights}', '{tmp}/c193'), 1,
     'model.safetensors'),
    ('convert HF folder: model.safetensors random bytes', cmd('convert', 'import', '{hf_weights_random}', '{tmp}/c194'),
     1, 'model.safetensors'),
    ('convert HF folder: model.safetensors truncated', cmd('convert', 'import', '{hf_weights_truncated}', '{tmp}/c195'),
     1, 'model.safetensors'),
    ('convert HF folder: a tensor missing', cmd('convert', 'import', '{hf_tensor_missing}', '{tmp}/c196'), 1,
     'lm_head.weight'),
    ('convert HF folder: no tokenizer.json', cmd('convert', 'import', '{hf_no_tokenizer}', '{tmp}/c197'), 1,
     'tokenizer.json'),
    ('convert HF folder: tokenizer.json binary', cmd('convert', 'import', '{hf_tokenizer_binary}', '{tmp}/c198'), 1,
     'tokenizer.json'),
    ('convert HF folder ok', cmd('convert', 'import', '{hf}', '{tmp}/c_hf'), 0, ''),
    ('convert HF folder --to svd ok', cmd('convert', 'import', '{hf}', '{tmp}/c_hf_svd', '--to', 'svd', '--rank', '8'),
     0, ''),
    ('convert --to svd without --rank', cmd('convert', 'import', '{run}', '{tmp}/c201', '--to', 'svd'), 1, '--rank'),
    ('convert --rank bigger than the matrices', cmd('convert', 'import', '{run}', '{tmp}/c202', '--to', 'svd', '--rank',
     '100000'), 1, '--rank'),
    ('convert --calibration missing', cmd('convert', 'import', '{run}', '{tmp}/c203', '--to', 'svd', '--rank', '8',
     '--calibration', '{tmp}/nocal'), 1, 'nocal'),
    ('convert --calibration of another tokenizer', cmd('convert', 'import', '{run}', '{tmp}/c204', '--to', 'svd',
     '--rank', '8', '--calibration', '{data}'), 1, 'tokenizer'),
    ('convert --step of a HF folder', cmd('convert', 'import', '{hf}', '{tmp}/c205', '--step', '4'), 1, '--step'),
    ('convert --to svd of a low-rank run', cmd('convert', 'import', '{svd_run}', '{tmp}/c206', '--to', 'svd', '--rank',
     '4'), 1, 'dense'),
    ('convert an unknown subcommand', cmd('convert', 'export', '{run}', '{tmp}/c_x'), 2, 'export'),
    ('plan --gpus 4 --tp 3', [*PLAN, '--gpus', '4', '--tp', '3'], 1, '--tp', 300),
    ('plan --gpus 4 --pp 5', [*PLAN, '--gpus', '4', '--pp', '5'], 1, '--pp', 300),
    ('plan --gpus 0', [*PLAN, '--gpus', '0'], 1, '--gpus', 300),
    ('plan --gpus 4 --schemes megatron', [*PLAN, '--gpus', '4', '--schemes', 'megatron'], 1, 'megatron', 300),
    ('plan --gpus 4 --remat bogus', [*PLAN, '--gpus', '4', '--remat', 'bogus'], 1, '--remat', 300),
    ('plan --gpus 4 --top 0', [*PLAN, '--gpus', '4', '--top', '0'], 1, '--top', 300),
    ('plan --gpus 4 --hardware nope', [*PLAN, '--gpus', '4', '--hardware', 'nope'], 1, 'nope', 300),
    ('plan --gpus 4 --pp 1 --pp-repeats 2', [*PLAN, '--gpus', '4', '--pp', '1', '--pp-repeats', '2'], 1, '--pp-repeats',
     300),
    ('plan --gpus 4 --cp 3', [*PLAN, '--gpus', '4', '--cp', '3'], 1, '--cp', 300),
    ('plan --gpus 3 --tp 1 --pp 1 --cp 1', [*PLAN, '--gpus', '3', '--tp', '1', '--pp', '1', '--cp', '1'], 1,
     'train.batch_size=8', 300),
    ('plan --gpus 4 --headroom 1.5', [*PLAN, '--gpus', '4', '--headroom', '1.5'], 1, '--headroom', 300),
    ('plan --hardware-file binary', [*PLAN, '--gpus', '4', '--hardware-file', '{binary_yaml}'], 1, 'binary.yaml'),
    ('plan --hardware-file missing', [*PLAN, '--gpus', '4', '--hardware-file', '{tmp}/hw.yaml'], 1, 'hw.yaml'),
    ('plan with a layout key', [*PLAN, '--gpus', '4', 'parallel.tp=2'], 1, 'parallel.tp'),
    ('plan --out is a folder', [*PLAN, '--gpus', '2', '--tp', '2', '--pp', '1', '--remat', 'none', '--out',
     '{empty_dir}'], 1, 'empty_dir', 300),
    ('plan --out under /proc', [*PLAN, '--gpus', '2', '--tp', '2', '--pp', '1', '--remat', 'none', '--out',
     '/proc/recipe.yaml'], 1, '/proc', 300),
    ('plan --gpus abc', [*PLAN, '--gpus', 'abc'], 2, '--gpus', 300),
    ('plan --gpus 4 --headroom -0.1', [*PLAN, '--gpus', '4', '--headroom', '-0.1'], 1, '--headroom', 300),
    ('plan --gpus 4 --schemes bogus', [*PLAN, '--gpus', '4', '--schemes', 'bogus'], 1, 'bogus', 300),
    ('plan --gpus 4 --tp 0', [*PLAN, '--gpus', '4', '--tp', '0'], 1, '--tp', 300),
    ('plan --gpus 4 --pp 2 --pp-repeats 0', [*PLAN, '--gpus', '4', '--pp', '2', '--pp-repeats', '0'], 1, '--pp-repeats',
     300),
    ('plan --gpus 4 --remat none,bogus', [*PLAN, '--gpus', '4', '--remat', 'none,bogus'], 1, 'bogus', 300),
    ('plan --gpus 4 --hardware-file hw_missing.yaml', [*PLAN, '--gpus', '4', '--hardware-file', '{hw_missing_yaml}'], 1,
     'peak_flops', 300),
    ('plan --gpus 4 --hardware-file hw_tile.yaml', [*PLAN, '--gpus', '4', '--hardware-file', '{hw_tile_yaml}'], 1,
     'gemm_tile', 300),
    ('plan --gpus 4 --out a_file/recipe.yaml', [*PLAN, '--gpus', '4', '--out', '{a_file}/recipe.yaml'], 1, 'a_file',
     300),
    ('plan --gpus 1 model.preset=llama-30b', [*PLAN, '--gpus', '1', 'model.preset=llama-30b'], 1, 'no layout', 300),
    ('plan without --gpus', PLAN, 2, '--gpus'),
    ('plan ok --out recipe.yaml', [*PLAN, '--gpus', '2', '--tp', '2', '--pp', '1', '--remat', 'none', '--out',
     '{tmp}/recipe.yaml'], 0, '', 300),
    ('bench step --steps 0', bench('step', '--steps', '0'), 1, '--steps', 300),
    ('bench step --reps -1', bench('step', '--reps', '-1'), 1, '--reps', 300),
    ('bench step --vary parallel.cp', bench('step', '--vary', 'parallel.cp'), 1, '--vary', 300),
    ('bench step --compare --vary parallel.cp=1,2', bench('step', '--compare', '--vary', 'parallel.cp=1,2'), 1,
     '--vary', 300),
    ('bench step model.arch=bogus', bench('step', 'model.arch=bogus'), 1, 'model.arch', 300),
    ('bench memory --budget-gib -1', bench('memory', '--budget-gib', '-1'), 1, '--budget-gib', 300),
    ('bench memory --microbatch-sweep 2,x', bench('memory', '--microbatch-sweep', '2,x'), 1, '--microbatch-sweep', 300),
    ('bench decode --batch 0', bench('decode', '--batch', '0'), 1, '--batch', 300),
    ('bench decode --new-tokens 0', bench('decode', '--new-tokens', '0'), 1, '--new-tokens', 300),
    ('bench quality --tokens 0', bench('quality', '--tokens', '0'), 1, '--tokens', 300),
    ('bench checkpoint --every 0', bench('checkpoint', '--every', '0'), 1, '--every', 300),
    ('bench profile --steps 0', bench('profile', '--steps', '0'), 1, '--steps', 300),
    ('bench comm parallel.tp=3', bench('comm', 'parallel.tp=3'), 1, 'parallel', 300),
    ('bench kernels --reps 0', bench('kernels', '--reps', '0'), 1, '--reps', 300),
    ('bench unknown command', cmd('bench', 'bogus'), 1, 'bogus'),
    ('bench comm train.seq_len=abc', bench('comm', 'train.seq_len=abc'), 1, 'train.seq_len', 150),
    ('bench comm megatron on cola', bench('comm', 'model.arch=cola', 'parallel.scheme=megatron'), 1, 'parallel.scheme',
     150),
    ('bench comm recipe a YAML list', cmd('bench', 'comm', '{not_mapping_yaml}'), 1, 'not_mapping.yaml', 150),
    ('bench comm ok', bench('comm'), 0, '', 150),
    ('bench step --reps 0', bench('step', '--reps', '0'), 1, '--reps', 150),
    ('bench step --vary an unknown key', bench('step', '--vary', 'train.bogus=1,2'), 1, 'train.bogus', 150),
    ('bench step --compare of a dense model', bench('step', '--compare', 'model.arch=dense'), 1, '--compare', 150),
    ('bench step ok', bench('step', '--steps', '1', '--reps', '1'), 0, '', 150),
    ('bench memory --remat bogus', bench('memory', '--remat', 'bogus'), 2, '--remat', 150),
    ('bench memory --reps 0', bench('memory', '--reps', '0'), 1, '--reps', 150),
    ('bench memory --microbatch-sweep 0,2', bench('memory', '--microbatch-sweep', '0,2'), 1, '--microbatch-sweep', 150),
    ('bench memory --budget-gib without --vary', bench('memory', '--budget-gib', '1'), 1, '--budget-gib', 150),
    ('bench memory ok', bench('memory', '--remat', 'none'), 0, '', 150),
    ('bench profile --top -1', bench('profile', '--top', '-1'), 1, '--top', 150),
    ('bench profile --trace-dir a file', bench('profile', '--trace-dir', '{a_file}'), 1, 'a_file', 150),
    ('bench profile --trace-dir under /proc', bench('profile', '--trace-dir', '/proc/boost_jax_trace'), 1, '/proc',
     150),
    ('bench profile train.microbatches=2', bench('profile', 'train.microbatches=2'), 1, 'microbatches', 150),
    ('bench profile ok', bench('profile', '--steps', '1', '--trace-dir', '{tmp}/trace'), 0, '', 150),
    ('bench decode --caches bogus', bench('decode', '--caches', 'bogus'), 1, '--caches', 150),
    ('bench decode latent cache of a dense model', bench('decode', '--caches', 'latent', 'model.arch=dense'), 1,
     'latent', 150),
    ('bench decode --prompt-len 0', bench('decode', '--prompt-len', '0'), 1, '--prompt-len', 150),
    ('bench decode --new-tokens 1', bench('decode', '--new-tokens', '1'), 1, '--new-tokens', 150),
    ('bench decode ok', bench('decode', '--caches', 'full', '--batches', '1', '--prompt-len', '8', '--new-tokens', '4',
     '--reps', '1'), 0, '', 150),
    ('bench quality --recover-steps 0', bench('quality', '--recover-steps', '0'), 1, '--recover-steps', 150),
    ('bench quality --eval-tokens -1', bench('quality', '--eval-tokens', '-1'), 1, '--eval-tokens', 150),
    ('bench quality --work a file', bench('quality', '--work', '{a_file}'), 1, 'a_file', 150),
    ('bench quality model.arch=dense', bench('quality', 'model.arch=dense'), 1, 'model.arch', 150),
    ('bench quality run_dir=x', bench('quality', 'run_dir=x'), 1, 'run_dir', 150),
    ('bench kernels --kernel bogus', bench('kernels', '--kernel', 'bogus'), 2, '--kernel', 150),
    ('bench kernels --small and a config', bench('kernels', '--small'), 1, '--small', 150),
    ('bench kernels parallel.tp=3', bench('kernels', 'parallel.tp=3'), 1, 'parallel.tp', 150),
    ('bench kernels --k -1', cmd('bench', 'kernels', '--k', '-1'), 1, '--k', 150),
    ('bench kernels ok --small', cmd('bench', 'kernels', '--small', '--reps', '1', '--kernel', 'norm_down'), 0, '',
     150),
    ('bench paper --models llama-99b', cmd('bench', 'paper', '--models', 'llama-99b'), 1, 'llama-99b', 150),
    ('bench paper --variants cola/zero', cmd('bench', 'paper', '--variants', 'cola/zero'), 1, 'cola/zero', 150),
    ('bench paper --hardware nope', cmd('bench', 'paper', '--hardware', 'nope'), 1, 'nope', 150),
    ('bench paper --hardware-file binary', cmd('bench', 'paper', '--hardware-file', '{binary_yaml}'), 1, 'binary.yaml',
     150),
    ('bench paper --hardware-file missing a key', cmd('bench', 'paper', '--hardware-file', '{hw_missing_yaml}'), 1,
     'peak_flops', 150),
    ('bench planner --models bogus', cmd('bench', 'planner', '--models', 'bogus'), 1, 'bogus', 150),
    ('bench planner --headroom 1', cmd('bench', 'planner', '--headroom', '1'), 1, '--headroom', 150),
    ('bench planner --hardware of two machines', cmd('bench', 'planner', '--hardware', 'a100-80gb,h100-80gb'), 1,
     '--hardware', 150),
    ('bench planner --pp-repeats 0', cmd('bench', 'planner', '--pp-repeats', '0'), 1, '--pp-repeats', 150),
    ('bench planner --hardware-file not a mapping', cmd('bench', 'planner', '--hardware-file', '{not_mapping_yaml}'), 1,
     'not_mapping.yaml', 150),
    ('bench report --reps 0', cmd('bench', 'report', '--reps', '0'), 1, '--reps', 150),
    ('bench report --rerender missing', cmd('bench', 'report', '--rerender', '{tmp}/none.json'), 1, 'none.json', 150),
    ('bench report --paper-json a YAML list', cmd('bench', 'report', '--paper-json', '{not_mapping_yaml}'), 1,
     'not_mapping.yaml', 150),
    ('bench report --planner-json {}', cmd('bench', 'report', '--planner-json', '{empty_json}'), 1, '--planner-json',
     150),
    ('bench report --out a file', cmd('bench', 'report', '--rerender', '{results_json}', '--out', '{a_file}'), 1,
     'a_file', 150),
    ('bench report --step-model llama-nope', cmd('bench', 'report', '--paper-json', '{paper_json}', '--planner-json',
     '{planner_json}', '--step-model', 'llama-nope'), 1, 'llama-nope', 150),
    ('bench report --single-models llama-nope', cmd('bench', 'report', '--paper-json', '{paper_json}', '--planner-json',
     '{planner_json}', '--single-models', 'llama-nope'), 1, 'llama-nope', 150),
    ('bench report ok --rerender', cmd('bench', 'report', '--rerender', '{results_json}', '--out', '{tmp}/report'), 0,
     '', 150),
    ('bench checkpoint --steps 0', bench('checkpoint', '--steps', '0'), 1, '--steps', 150),
    ('bench checkpoint --every abc', bench('checkpoint', '--every', 'abc'), 2, '--every', 150),
    ('bench checkpoint train.steps=5', bench('checkpoint', 'train.steps=5'), 1, 'train.steps', 150),
    ('bench checkpoint run_dir=x', bench('checkpoint', 'run_dir=x'), 1, 'run_dir', 150),
    ('bench checkpoint ok', bench('checkpoint', '--steps', '2', '--every', '1', '--reps', '1'), 0, '', 150),
    ('bench data --only bogus', bench('data', '--only', 'bogus'), 2, '--only', 150),
    ('bench data --corpus-mb 0', bench('data', '--corpus-mb', '0'), 1, '--corpus-mb', 150),
    ('bench data --workers 0', bench('data', '--workers', '0'), 1, '--workers', 150),
    ('bench data --tmp a file', bench('data', '--only', 'prepare', '--corpus-mb', '1', '--tmp', '{a_file}'), 1,
     'a_file', 150),
    ('bench data --tmp missing (made)', bench('data', '--only', 'prepare', '--corpus-mb', '1', '--workers', '1',
     '--tmp', '{tmp}/no_tmp'), 0, '', 150),
    ('bench data ok --only prepare', bench('data', '--only', 'prepare', '--corpus-mb', '1', '--workers', '1', '--tmp',
     '{tmp}/bench_data_tmp'), 0, '', 150),
    ('bench --help', cmd('bench', '--help'), 0, '', 150),
    ('bench without a command', cmd('bench'), 1, 'usage', 150),
    ('api.config unknown preset', api("api.config('llama-nope')"), 1, 'llama-nope'),
    ('api.config bad override', api("api.config('llama-tiny', 'model.d_modle=3')"), 1, 'model.d_modle'),
    ('api.config override not a string', api("api.config('llama-tiny', 5)"), 1, 'override'),
    ('api.build_model not a config', api("api.build_model('llama-tiny')"), 1, 'Config'),
    ('api.forward ids past the vocabulary',
     api(MODEL + "api.forward(model, jnp.array([[1, 600]]))"), 1,
     'vocab'),
    ('api.forward negative ids',
     api(MODEL + "api.forward(model, jnp.array([[1, -3]]))"), 1,
     'vocab'),
    ('api.forward float tokens',
     api(MODEL + "api.forward(model, jnp.ones((1, 4)))"), 1,
     'integer'),
    ('api.forward 1-D tokens',
     api(MODEL + "api.forward(model, jnp.array([1, 2, 3]))"), 1,
     '[batch, seq]'),
    ('api.forward not a model', api("api.forward('model', jnp.array([[1]]))"), 1, 'Model'),
    ('api.generate max_new_tokens=0',
     api(MODEL + "api.generate(model, [[1, 2]], max_new_tokens=0)"),
     1, 'max_new_tokens'),
    ('api.generate a bare list of ints',
     api(MODEL + "api.generate(model, [1, 2], max_new_tokens=2)"),
     1, 'prompts'),
    ('api.generate_text not strings',
     api(MODEL + "api.generate_text(model, None, [1], max_new_tokens=2)"),
     1, 'prompts'),
    ('api.restore missing', api("api.restore('{tmp}/norun')"), 1, 'norun'),
    ('api.restore step not an int', api("api.restore('{run}', step='last')"), 1, 'step'),
    ('api.restore bad override', api("api.restore('{run}', overrides=['model.d_model=8'])"), 1, 'model.d_model'),
    ('api.config overrides as one list', api("api.config('llama-tiny', ['model.arch=cola'])"), 1, 'override'),
    ('api.forward tokens a string',
     api(MODEL + "api.forward(model, 'def main():')"), 1,
     'tokens'),
    ('api.forward an empty sequence',
     api(MODEL + "api.forward(model, jnp.zeros((1, 0), jnp.int32))"),
     1, 'tokens'),
    ('api.forward plan not a Plan',
     api(MODEL + "api.forward(model, jnp.array([[1, 2]]), plan='tp')"),
     1, 'plan'),
    ('api.forward nested lists',
     api(MODEL + "api.forward(model, [[1, 2, 3]])"), 0, ''),
    ('api.restore run_dir an int', api('api.restore(5)'), 1, 'run_dir'),
    ('api.restore step True', api("api.restore('{run}', step=True)"), 1, 'step'),
    ('api.restore step missing', api("api.restore('{run}', step=2)"), 1, 'step 2'),
    ('api.restore overrides one string', api("api.restore('{run}', overrides='model.dtype=bfloat16')"), 1, 'overrides'),
    ('api.generate an id that is a string',
     api(MODEL + "api.generate(model, [[1, 'a']], max_new_tokens=2)"),
     1, 'prompts'),
    ('api.generate an empty prompt',
     api(MODEL + "api.generate(model, [[]], max_new_tokens=2)"),
     1, 'prompt'),
    ('api.generate ids past the vocabulary',
     api(MODEL + "api.generate(model, [[1, 9999]], max_new_tokens=2)"),
     1, 'vocab'),
    ('api.generate max_new_tokens a string',
     api(MODEL + "api.generate(model, [[1, 2]], max_new_tokens='5')"),
     1, 'max_new_tokens'),
    ('api.generate temperature a string',
     api(MODEL + "api.generate(model, [[1, 2]], max_new_tokens=2, temperature='hot')"),
     1, 'temperature'),
    ('api.generate cache bogus',
     api(MODEL + "api.generate(model, [[1, 2]], max_new_tokens=2, cache='bogus')"),
     1, 'cache'),
    ('api.generate max_new_tokens=10**9',
     api(MODEL + "api.generate(model, [[1, 2]], max_new_tokens=10**9)"),
     1, 'max_len'),
    ('training.run.train with a dict', api("from boost_jax.training.run import train\ntrain({{'model': {{}}}})"), 1,
     'training.run.train takes a Config'),
    ('api.generate_text no tokenizer',
     api(MODEL + "api.generate_text(model, None, ['def'], max_new_tokens=2)"),
     1, 'tokenizer'),
    ('api.generate_text of a restored run',
     api("from tokenizers import Tokenizer\ncfg, model, step = api.restore('{run}')\n"
         "print(api.generate_text(model, Tokenizer.from_file('{run}/tokenizer.json'), ['def'], max_new_tokens=4))"),
     0, ''),
    # --- the faults of a cluster: a lost peer, a full disk, one writer, readers of a live run
    ("lost peer: process 1 kill", script(LOST_PEER, "kill", "{tmp}/peer", *TINY), 1, "lost peer: process 1", 300),
    ("lost peer: process 1 stop", script(LOST_PEER, "stop", "{tmp}/peer", *TINY), 1, "lost peer: process 1", 300),
    ("lost peer: process 1 never joins", script(LOST_PEER, "never", "{tmp}/peer", *TINY), 1, "did not join", 300),
    ("full disk: a checkpoint save", script(DISK_FULL, "{tmp}/run/checkpoints", "2500k", *TRAIN, "train.steps=6",
                                            "checkpoint.every=2", "run_dir={tmp}/run"), 1, "writing a checkpoint", 300),
    ("full disk: a metrics row", script(DISK_FULL, "{tmp}/run", "40k", *TRAIN, "train.steps=200", "log.every=1",
                                        "checkpoint.every=0", "run_dir={tmp}/run"), 1, "writing metrics rows", 300),
    ("full disk: a TensorBoard event", script(DISK_FULL, "{tmp}/run/tensorboard", "8k", *TRAIN, "train.steps=200",
                                              "log.every=1", "checkpoint.every=0", "log.tensorboard=true",
                                              "run_dir={tmp}/run"), 1, "writing TensorBoard events", 300),
    ("full disk: data prepare", script(DISK_FULL, "{tmp}/prep", "64k", "-m", "boost_jax.data", "prepare", "{big_txt}",
                                       "--out", "{tmp}/prep", "--vocab-size", "300", "--workers", "1",
                                       "--val-fraction", "0"), 1,  # one text file is one document: none to hold out
     "writing the prepared dataset", 300),
    ("full disk: export", script(DISK_FULL, "{tmp}/export", "256k", *cmd("export", "{run}", "{tmp}/export")), 1,
     "writing the export", 300),
    ("second train in a running run dir", script(SECOND_WRITER, "{tmp}/locked", *TINY), 1, "in use", 300),
    ("eval while a live run's retention deletes steps", script(LIVE_READER, "{tmp}/live", "eval", *TINY), 0, "", 400),
    ("generate while a live run's retention deletes steps", script(LIVE_READER, "{tmp}/live", "generate", *TINY), 0, "",
     400),
    ("export while a live run's retention deletes steps", script(LIVE_READER, "{tmp}/live", "export", *TINY), 0, "",
     400),
    # --- the inputs that slipped through before (issues 50 and 62)
    ("train checkpoint.every=0 with every_minutes", [*TRAIN, "checkpoint.every=0", "checkpoint.every_minutes=0.0001",
                                                     "run_dir={tmp}/run"], 0, ""),
    ("train rerun over metrics it did not resume from", [*TRAIN, "model.arch=dense", "run_dir={run_no_checkpoints}"], 0,
     ""),
    ("data prepare of an empty file", cmd("data", "prepare", "{empty_txt}", "--out", "{tmp}/out"), 1,
     "holds no documents"),
    ("eval --max-tokens 1e12", cmd("eval", "{run}", "--max-tokens", "1000000000000"), 0, ""),
    ("convert int32 safetensors weights", cmd("convert", "import", "{hf_int_norm}", "{tmp}/c"), 1, "model.norm.weight"),
    ("convert whiten on 4 samples", cmd("convert", "import", "{run}", "{tmp}/c", "--to", "svd", "--rank", "8",
     "--method",
                                        "whiten", "--calibration", "{own_data}", "--samples", "4"), 0, ""),
    ("generate --temperature inf", cmd("generate", "{run}", "--prompt", "def", "--temperature", "inf"), 1,
     "temperature"),
    ("train metrics.jsonl is a folder", [*TRAIN, "run_dir={run_metrics_folder}"], 1, "metrics.jsonl"),
    ("train .boost_jax.lock is a folder", [*TRAIN, "run_dir={run_lock_folder}"], 1, ".boost_jax.lock"),
    ("train resume: unknown section in config.yaml", [*TRAIN, "model.arch=dense", "train.steps=6",
                                                      "run_dir={run_extra_section}"], 1, "extras"),
    ("lm_eval without --tasks", cmd("lm_eval", "{run}"), 1, "--tasks is missing"),
    ("lm_eval --tasks no_such_task", cmd("lm_eval", "{run}", "--tasks", "no_such_task"), 1,
     "--tasks: lm-eval has no task no_such_task", 300),
    ("lm_eval --include_path missing", cmd("lm_eval", "{run}", "--tasks", "x", "--include_path", "{tmp}/none"), 1,
     "--include_path {tmp}/none: no such folder"),
    ("lm_eval --limit -1", cmd("lm_eval", "{run}", "--tasks", "x", "--limit", "-1"), 1, "--limit must be a count"),
    ("lm_eval --batch_size 0", cmd("lm_eval", "{run}", "--tasks", "x", "--batch_size", "0"), 1,
     "--batch_size must be a whole number of rows"),
    ("lm_eval --batch_size many", cmd("lm_eval", "{run}", "--tasks", "x", "--batch_size", "many"), 1,
     "--batch_size must be a whole number of rows"),
    ("lm_eval parallel.pp=2", cmd("lm_eval", "{run}", "--tasks", "x", "parallel.pp=2"), 1,
     "decoding runs without pipeline stages"),
    ("generate parallel.pp=2", cmd("generate", "{run}", "--prompt", "def", "parallel.pp=2"), 1,
     "decoding runs without pipeline stages"),
    ("bench startup --work a file", bare("startup", "--work", "{a_file}"), 1, "is a file: name a folder"),
    ("bench soak --every-s nan", bare("soak", "--every-s", "nan"), 1, "--every-s must be a finite number above 0"),
    ("bench soak --rss-bound -1", bare("soak", "--rss-bound", "-1"), 1, "--rss-bound must be a finite number above 0"),
    ("bench soak --rss-bound nan", bare("soak", "--rss-bound", "nan"), 1,
     "--rss-bound must be a finite number above 0"),
    ("train on a data cache missing its index.json", [*TRAIN, "data.cache_dir={cache_without_index}",
                                                      "run_dir={tmp}/run"], 0, ""),
    ("data prepare of 30 documents at the default val fraction", cmd("data", "prepare", "{docs30_jsonl}", "--out",
                                                                     "{tmp}/out", "--vocab-size", "300"), 1,
     "holds out none of the corpus's 30 documents"),
    ("train on a compilation cache of damaged entries", [*TRAIN, "run_dir={tmp}/run"], 0, "could not be read back", 240,
     {"JAX_COMPILATION_CACHE_DIR": "{xla_damaged}"}),
    ("train with $JAX_COMPILATION_CACHE_DIR a file", [*TRAIN, "run_dir={tmp}/run"], 0,
     "warning: $JAX_COMPILATION_CACHE_DIR: {a_file} is a file", 240, {"JAX_COMPILATION_CACHE_DIR": "{a_file}"}),
    # issue 70 item 1: cuDNN's attention at float32 is refused by name while the plan is made, before any compile
    ("compile model.attention=cudnn at float32", cmd("compile", "--hardware", "h100-80gb", "model.attention=cudnn"), 1,
     "model.attention=cudnn: cuDNN's fused attention takes float16 or bfloat16 only, not model.dtype=float32"),
    # serve: each refused before the port is bound (issue 73)
    ("serve missing run dir", cmd("serve", "{tmp}/norun"), 1, "norun"),
    ("serve not a run dir", cmd("serve", "{empty_dir}"), 1, "empty_dir"),
    ("serve serve.page_tokens=0", cmd("serve", "{run}", "serve.page_tokens=0"), 1, "serve.page_tokens"),
    ("serve serve.slots=-1", cmd("serve", "{run}", "serve.slots=-1"), 1, "serve.slots"),
    ("serve serve.cache_gib=-1", cmd("serve", "{run}", "serve.cache_gib=-1"), 1, "serve.cache_gib"),
    ("serve a pool too small for one request", cmd("serve", "{run}", "serve.cache_gib=1e-9"), 1,
     "less than one request at the context"),
    ("serve --port 0", cmd("serve", "{run}", "--port", "0"), 1, "--port must be in 1..65535"),
    ("serve a port in use", script(SERVE_ON_A_PORT_IN_USE, "{run}"), 1, "cannot listen on 127.0.0.1"),
    ("serve parallel.dp=2", cmd("serve", "{run}", "parallel.dp=2", "parallel.cpu_devices=2"), 1,
     "serving runs one data-parallel replica"),
    # instruction data (issue 72): one message naming the row, key or file; nothing written
    ("train train.loss_on=completion on text", [*TRAIN, "train.loss_on=completion", "run_dir={tmp}/run"], 1,
     "train.loss_on: completion needs instruction data"),
    ("train format=chat without a tokenizer", [*TRAIN, *chat_data("{chat_robot_jsonl}")[:-1], "run_dir={tmp}/run"], 1,
     "data.tokenizer_path: data.format=chat fine-tunes a model"),
    ("train format=chat, a row without messages", [*TRAIN, *chat_data("{chat_no_messages_jsonl}"),
                                                   "run_dir={tmp}/run"], 1, "chat_no_messages.jsonl:4: no 'messages'"),
    ("train format=chat, an unknown role", [*TRAIN, *chat_data("{chat_robot_jsonl}"), "run_dir={tmp}/run"], 1,
     "chat_robot.jsonl:4: message 0 has the unknown role 'robot'"),
    ("train format=chat, empty content", [*TRAIN, *chat_data("{chat_empty_jsonl}"), "run_dir={tmp}/run"], 1,
     "chat_empty.jsonl:4: message 0 (user) has empty content"),
    ("train format=chat, a row longer than a window", [*TRAIN, *chat_data("{chat_long_jsonl}"), "run_dir={tmp}/run"],
     1, "chat_long.jsonl:4: "),
    ("train format=chat, a template that does not parse", [*TRAIN, *chat_data("{chat_robot_jsonl}"),
                                                           "data.chat_template={broken_jinja}", "run_dir={tmp}/run"],
     1, "broken.jinja does not parse"),
    ("train format=chat, a tokenizer without a template",
     [*TRAIN, "data.source=files", "data.paths=[{chat_robot_jsonl}]", "data.format=chat",
      "data.tokenizer_path={data}/tokenizer.json", "run_dir={tmp}/run"], 1, "a chat needs a chat template"),
    ("train format=prompt_completion, a row without completion",
     [*TRAIN, "data.source=files", "data.paths=[{pc_no_completion_jsonl}]", "data.format=prompt_completion",
      "data.tokenizer_path={data}/tokenizer.json", "run_dir={tmp}/run"], 1, "pc_no_completion.jsonl:1: no 'completion'"),
    ("generate --chat, no template", cmd("generate", "{run}", "--chat", "--prompt", "hi"), 1,
     "a chat needs a chat template"),
    ("data prepare --format chat without --seq-len", cmd("data", "prepare", "{chat_robot_jsonl}", "--out", "{tmp}/out",
                                                        "--format", "chat", "--tokenizer", "{data}/tokenizer.json"), 1,
     "--seq-len (train.seq_len) is needed"),
    # --- what the new commands read back, and checked too late (issue 70)
    ("study study.dir a file", [*STUDY, "study.dir={a_file}"], 1, "study.dir: {a_file} cannot be a folder"),
    ("study study.dir under a file", [*STUDY, "study.dir={a_file}/s"], 1, "{a_file} is a file"),
    ("study study.dir read-only", script(READ_ONLY, "{tmp}/ro", *STUDY, "study.dir={tmp}/ro/s"), 1,
     "study.dir: cannot write in {tmp}/ro (Read-only file system)"),
    ("study study.json truncated", [*STUDY, "study.dir={study_json_truncated}"], 1,
     "{study_json_truncated}/study.json is damaged (JSONDecodeError"),
    ("study study.json garbage bytes", [*STUDY, "study.dir={study_json_garbage}"], 1,
     "{study_json_garbage}/study.json is damaged"),
    ("study study.json empty", [*STUDY, "study.dir={study_json_empty}"], 1, "{study_json_empty}/study.json is damaged"),
    ("study study_result.json truncated", [*STUDY, "study.dir={study_result_truncated}"], 0,
     f"{{study_result_truncated}}/{RESULT} is damaged (JSONDecodeError"),
    ('study study_result.json {"loss": "abc"}', [*STUDY, "study.dir={study_result_string_loss}"], 0,
     f"{{study_result_string_loss}}/{RESULT} is damaged (loss: 'abc'): computing the run's result again"),
    ("study SIGTERM after its first run", script(STUDY_SIGTERM, "{tmp}/s", *STUDY), 1,
     "rerun the same command to resume the study", 400),
    ("study study.lrs=[]", [*STUDY, "study.lrs=[]", "study.dir={tmp}/s"], 1, "study.lrs: empty grid"),
    ("train checkpoint.local_dir with {{proc}}", [*TRAIN, "checkpoint.local_dir={tmp}/{{proc}}",
                                                  "checkpoint.local_every=1", "run_dir={tmp}/run"], 1,
     "{{proc}} is not a placeholder; the one it takes is {{process}}"),
    ("bench report --study-json of no cells", cmd("bench", "report", "--study-json", "{study_empty_cells_json}",
                                                  "--out", "{tmp}/page"), 1, "cells: [] (a study has at least one cell)"),
    ("bench report --study-json a string mean", cmd("bench", "report", "--study-json", "{study_string_mean_json}",
                                                    "--out", "{tmp}/page"), 1, "cells[0].mean: 'abc'"),
    ("compile --save a non-empty folder", cmd("compile", "--hardware", "h100-80gb", "--save", "{texts}"), 1,
     "--save {texts}: the folder is not empty; pass --force"),
    ("compile --save a file", cmd("compile", "--hardware", "h100-80gb", "--save", "{a_file}"), 1,
     "--save: {a_file} cannot be a folder"),
    ("compile --save read-only", script(READ_ONLY, "{tmp}/ro", *cmd("compile", "--hardware", "h100-80gb", "--save",
                                                                     "{tmp}/ro/exe")), 1, "Read-only file system"),
    ("lm_eval --config missing", cmd("lm_eval", "{run}", "--config", "{tmp}/none.yaml"), 1,
     "--config {tmp}/none.yaml: no such file"),
    ('lm_eval --tasks ""', cmd("lm_eval", "{run}", "--tasks", ""), 1, "--tasks '': names no task"),
    ("lm_eval --num_fewshot -1", cmd("lm_eval", "{run}", "--tasks", "x", "--num_fewshot", "-1"), 1,
     "--num_fewshot must be a count"),
    ("lm_eval --output_path a file", cmd("lm_eval", "{run}", "--tasks", "x", "--output_path", "{a_file}"), 1,
     "--output_path: {a_file} cannot be a folder"),
    ("lm_eval --config a YAML list", cmd("lm_eval", "{run}", "--config", "{not_mapping_yaml}"), 1,
     "lm-eval refused its flags: TypeError: YAML root must be a mapping", 300),
    ("full disk: lm_eval --output_path", script(DISK_FULL, "{tmp}/out", "4k", *cmd(
        "lm_eval", "{run}", "--tasks", "boost_probe", "--include_path", "{probe_tasks}", "--output_path", "{tmp}/out")),
     1, "--output_path {tmp}/out: lm-eval could not save the results there", 400),
    # train.init_from (issue 72): a bad source is one message naming it, nothing written
    ("train init_from missing", [*TRAIN, "train.init_from={tmp}/nowhere", "run_dir={tmp}/run"], 1,
     "train.init_from: {tmp}/nowhere does not exist"),
    ("train init_from a file", [*TRAIN, "train.init_from={a_file}", "run_dir={tmp}/run"], 1, "is not a folder"),
    ("train init_from a step it lacks", [*TRAIN, "train.init_from={run}@3", "run_dir={tmp}/run"], 1,
     "has no checkpoint of step 3"),
    ("train init_from damaged checkpoints", [*TRAIN, "train.init_from={run_damaged}", "run_dir={tmp}/run"], 1,
     "checkpoint"),
    ("train init_from a run dir without checkpoints", [*TRAIN, "train.init_from={run_no_checkpoints}",
                                                       "run_dir={tmp}/run"], 1, "has no checkpoint"),
    ("train init_from a damaged config.yaml", [*TRAIN, "train.init_from={damaged_cfg_run}", "run_dir={tmp}/run"], 1,
     "config.yaml"),
    ("train init_from an HF config.json not JSON", [*TRAIN, "train.init_from={hf_config_not_json}",
                                                    "run_dir={tmp}/run"], 1, "config.json is not a JSON file"),
    ("train init_from HF weights truncated", [*TRAIN, "train.init_from={hf_weights_truncated}", "run_dir={tmp}/run"],
     1, "model.safetensors"),
    ("train init_from an HF sliding window", [*TRAIN, "train.init_from={hf_sliding_window}", "run_dir={tmp}/run"], 1,
     "use_sliding_window=True cannot be imported"),
    ("train init_from another arch", [*TRAIN, "train.init_from={run}", "model.arch=cola", "run_dir={tmp}/run"], 1,
     "model.arch='cola' contradicts"),
    ("train init_from another shape", [*TRAIN, "train.init_from={hf}", "model.d_model=128", "run_dir={tmp}/run"], 1,
     "model.d_model=128 contradicts"),
    ("train init_from a run dir ok", [*TRAIN, "train.init_from={run}", "run_dir={tmp}/run"], 0, ""),
    ("train init_from an HF folder ok", [*TRAIN, "train.init_from={hf}", "run_dir={tmp}/run"], 0, ""),
    # decoupled RoPE (model.attn_rope_dims): shapes it cannot take, and a plain model it cannot come from
    ("train model.attn_rope_dims odd", [*TRAIN, "model.attn_rope_dims=3", "run_dir={tmp}/run"], 1,
     "model.attn_rope_dims: RoPE rotates pairs of dimensions: 3 is odd"),
    ("train model.attn_rope_dims on dense", [*TRAIN, "model.arch=dense", "model.attn_rope_dims=2", "run_dir={tmp}/run"], 1,
     "model.attn_rope_dims: 2 decouples the rotary keys from B_k"),
    ("convert into decoupled RoPE", cmd("convert", "import", "{run}", "{tmp}/c_rope", "model.attn_rope_dims=4"), 1,
     "model.attn_rope_dims=4: a plain model cannot become one with decoupled RoPE exactly"),
    ("generate --cache latent, latent heads tp cannot split", cmd("generate", "{rope_heads_cfg_run}", "--cache", "latent",
                                                                  "--prompt", "def", "parallel.tp=4"), 1,
     "model.attn_latent_heads: 2 must divide by parallel.tp=4"),
    ("generate --cache latent, latent heads under vanilla", cmd("generate", "{rope_heads_cfg_run}", "--cache", "latent",
                                                                "--prompt", "def", "parallel.tp=2", "parallel.scheme=vanilla"),
     1, "model.attn_latent_heads: 2 needs a scheme that lays the latent heads out over tp (btp)"),
    # export --format hf (issue 73): a layout the transformers custom code does not compute, refused by name
    ("export --format hf of decoupled RoPE", cmd("export", "{rope_cfg_run}", "{tmp}/e_hf", "--format", "hf"), 1,
     "model.attn_rope_dims=4 (decoupled RoPE) is not in the transformers model"),
]
# Rows that run lm-eval itself: skipped where it is not installed (the eval extra).
NEEDS_LM_EVAL = {"lm_eval --tasks no_such_task", "lm_eval --config a YAML list", "full disk: lm_eval --output_path"}

# The default tier's few: a few seconds each (5 s together, warm), no fixture.
FAST = {"train model.d_modle=5", "bench unknown command", "bench without a command", "plan without --gpus",
        "api.config unknown preset", "train train.loss_on=completion on text"}
assert FAST <= {row[0] for row in CASES} and len({row[0] for row in CASES}) == len(CASES)
assert NEEDS_LM_EVAL <= {row[0] for row in CASES}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("faults")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "BOOST_JAX_CACHE": str(root / "cache")}
    env.pop("BOOST_JAX_DEBUG", None)
    return World(root, env)


@pytest.mark.parametrize("case", [pytest.param(Case(*row), id=row[0], marks=() if row[0] in FAST else (pytest.mark.slow, pytest.mark.battery))
                                  for row in CASES])
def test_a_bad_input_or_fault_ends_cleanly(case: Case, world: World, tmp_path):
    if case.name in NEEDS_LM_EVAL and importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (pip install -e '.[eval]')")
    paths = Paths(world, tmp_path)
    argv = [a.format_map(paths) for a in case.argv]
    env = {**world.env, **{k: v.format_map(paths) for k, v in (case.env or {}).items()}}
    try:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=case.timeout, env=env,
                              cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"hung past {case.timeout:.0f} s: {e.stderr}") from None
    err = proc.stderr
    assert not [n for n in NOISE if n in err], err[-3000:]
    assert proc.returncode == case.code, err[-3000:]
    assert case.needle.format_map(paths) in err, err[-3000:]
