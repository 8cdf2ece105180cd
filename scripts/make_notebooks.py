"""Writes notebooks/*.ipynb from the cells below (the notebooks are generated, so they stay
reviewable as code). Run: python scripts/make_notebooks.py"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SETUP = """\
import jax
jax.config.update("jax_num_cpu_devices", 8)  # 8 simulated devices; must run before JAX starts
import matplotlib.pyplot as plt
from boost_jax import api"""


def parameters(source: str):
    """The notebook's knobs, in a cell tagged "parameters" (papermill's convention): tests/test_notebooks.py
    runs the notebook with a cell of smaller values put right after this one."""
    return new_code_cell(source, metadata={"tags": ["parameters"]})


QUICKSTART = [
    new_markdown_cell("# boost_jax quickstart\n\nBuild a low-rank (CoLA) model on a simulated 8-device "
                      "mesh, look at how its weights are sharded under bottleneck-aware tensor parallelism "
                      "(btp), list the collectives XLA compiled, train a few steps and plot the loss."),
    new_code_cell(SETUP),
    new_markdown_cell("## A config and a model\n`api.config` takes a preset (or a YAML path) and dotted "
                      "overrides, exactly like `python -m boost_jax.train`."),
    new_code_cell("""\
cfg = api.config("llama-tiny", "model.arch=cola", "parallel.tp=4", "parallel.scheme=btp",
                 "train.batch_size=8", "train.seq_len=64", "train.steps=30", "train.lr=1e-2",
                 "train.warmup_steps=2", "data.max_bytes=300000", "checkpoint.every=0",
                 "log.progress=false", "log.tensorboard=false", "log.every=10", "run_dir=runs/notebook")
model = api.build_model(cfg)
tokens = jax.numpy.zeros((2, 16), jax.numpy.int32)
api.forward(model, tokens).shape"""),
    new_markdown_cell("## Sharding\nEvery weight names its dimensions; the btp rules map them onto the "
                      "`(dp, fsdp, tp)` mesh: A factors are split on their input (row-parallel), B factors "
                      "on their output (column-parallel), r is never split."),
    new_code_cell("""\
from boost_jax.analysis.program import build
prog = build(cfg)
for path, p in jax.tree_util.tree_flatten_with_path(prog.params)[0]:
    if "attn" in jax.tree_util.keystr(path) or "embed" in jax.tree_util.keystr(path):
        print(f"{jax.tree_util.keystr(path):40s} {str(p.shape):16s} {p.sharding.spec}")"""),
    new_markdown_cell("## The collectives, from the compiled HLO\nPer decoder layer, btp all-reduces only "
                      "rank-r latents (the RMSNorm statistic rides along as one more column)."),
    new_code_cell("""\
from boost_jax.analysis.comm import measure
report = measure(prog)
for op in report["layer_forward_ops"]:
    print("forward:", op)
print("issued by the program per layer:", report["layer_forward_issued"])"""),
    new_markdown_cell("## Train a few steps"),
    new_code_cell("""\
from boost_jax.training.run import train
summary = train(cfg)
plt.plot(range(1, len(summary["losses"]) + 1), summary["losses"])
plt.xlabel("step"); plt.ylabel("loss"); plt.title("llama-tiny cola, btp tp=4 x dp=2")
assert summary["losses"][-1] < summary["losses"][0]"""),
]

SCHEMES = [
    new_markdown_cell("# Tensor-parallel schemes side by side\n\nFull-rank Megatron TP (dense), vanilla "
                      "low-rank TP and BOOST's bottleneck-aware TP (btp): communication per decoder layer "
                      "from the compiled HLO, and measured step time on this machine."),
    new_code_cell(SETUP),
    parameters('model = "llama-60m"  # whose communication is measured (a cell tagged parameters: tests/test_notebooks.py '
               'sets smaller values)\nreps, steps = 3, 2  # the step times: interleaved repetitions, steps in each'),
    new_code_cell("""\
from boost_jax.analysis.comm import measure
from boost_jax.analysis.program import build

def config(model, arch, scheme, *overrides):  # the train command's keys: tp=4 on 4 of the 8 devices
    return api.config(model, f"model.arch={arch}", f"parallel.scheme={scheme}", "parallel.tp=4", "parallel.dp=1",
                      *overrides)

variants = [("dense", "megatron"), ("cola", "vanilla"), ("cola", "btp")]
reports = {f"{a}/{s}": measure(build(config(model, a, s, "train.batch_size=4", "train.seq_len=256",
                                            "model.dtype=bfloat16")))
           for a, s in variants}
for name, r in reports.items():
    print(f"{name:16s} forward {r['layer_forward_bytes'] / 2**20:7.2f} MiB in {r['layer_forward_collectives']} ops, "
          f"backward {r['layer_backward_bytes'] / 2**20:7.2f} MiB (analytic forward {r['analytic_layer_forward_bytes'] / 2**20:.2f})")"""),
    new_code_cell("""\
names = list(reports)
plt.bar(names, [reports[n]["layer_forward_bytes"] / 2**20 for n in names])
plt.ylabel("MiB per layer, forward, per device"); plt.title(f"{model}, b=4, s=256, tp=4, bf16")
assert reports["cola/btp"]["layer_forward_bytes"] < reports["cola/vanilla"]["layer_forward_bytes"] / 4"""),
    new_markdown_cell("## Step time on this machine\nInterleaved repetitions, so machine noise hits all three "
                      "alike; on simulated CPU devices communication is nearly free, so read the ratios, "
                      "not the absolute times."),
    new_code_cell("""\
from boost_jax.bench.step import measure as measure_steps
cfgs = [config("llama-tiny", a, s, "train.batch_size=8", "train.seq_len=64", "log.health=false")  # health: compile only
        for a, s in variants]
for (a, s), r in zip(variants, measure_steps(cfgs, reps=reps, steps=steps)):
    print(f"{a}/{s:9s} {1e3 * r['median_step_s']:7.1f} ms  {r['tokens_per_s']:9,.0f} tokens/s  "
          f"peak {r['peak_bytes_per_device'] / 2**20:.1f} MiB/device")"""),
]

FINE_TUNING = [
    new_markdown_cell("""# Fine-tuning a model to answer in turns

Start a new run from a trained model's weights, train it on chat rows with the loss on the replies alone, and talk to it: the path of [the Fine-tuning guide](../docs/guides/fine-tuning.md), in Python, on the embedded corpus, offline, in a minute on a CPU. The same config keys as `python -m boost_jax.train`."""),
    new_code_cell("""import json, random
import matplotlib.pyplot as plt
from boost_jax import api
from boost_jax.training.run import train

SMALL = ["model.preset=llama-tiny", "model.arch=dense", "train.batch_size=8", "log.progress=false",
         "log.tensorboard=false", "log.every=10"]"""),
    new_markdown_cell("""## 1. A model to start from
A dense llama-tiny trained for a moment on the embedded corpus (the default `data.source`). With a Hugging Face model, `train.init_from` below takes its folder instead."""),
    new_code_cell("""base = train(api.config(None, *SMALL, "run_dir=runs/base", "train.steps=30", "train.seq_len=64",
                        "data.max_bytes=300000", "train.lr=1e-2", "train.warmup_steps=2", "train.eval_every=0",
                        "checkpoint.every=30"))
base["losses"][-1]"""),
    new_markdown_cell("""## 2. Chat rows and what is trained on
One conversation per line of a `.jsonl`. This model's tokenizer has no chat template of its own, so the run names the shipped ChatML one (`data.chat_template=chatml`). Under `train.loss_on=completion` (the default for chat rows) only the assistant's tokens and the end-of-turn token are targets: below, in brackets."""),
    new_code_cell("""rng = random.Random(0)
rows = []
for _ in range(400):
    a, b = rng.randrange(100), rng.randrange(100)
    rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                              {"role": "assistant", "content": str(a + b)}]})
with open("chat.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\\n" for r in rows)

from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file("runs/base/tokenizer.json")
chat = api.chat_template(tokenizer, template="chatml")
ids, targets = chat.encode_turns(rows[0]["messages"])
print("".join(f"[{tokenizer.decode([i])}]" if t else tokenizer.decode([i]) for i, t in zip(ids, targets)))"""),
    new_markdown_cell("""## 3. The fine-tune
`train.init_from` reads the base run's parameters (any mesh: here one device); the optimizer and the learning-rate schedule start fresh at step 0 in a new run dir. Rows are packed whole into windows, each attending only to itself; the log's data line says how full the windows are."""),
    new_code_cell("""ft = train(api.config(None, *SMALL, "run_dir=runs/chat", "train.init_from=runs/base", "data.source=files",
                      "data.paths=[chat.jsonl]", "data.format=chat", "data.chat_template=chatml",
                      "train.seq_len=128", "train.steps=30", "train.lr=3e-3", "train.eval_every=30",
                      "checkpoint.every=30"))
plt.plot(ft["losses"])
plt.xlabel("fine-tune step"); plt.ylabel("loss over the replies' tokens")
assert ft["losses"][-1] < ft["losses"][0]"""),
    new_markdown_cell("""## 4. Talk to it
`api.restore_chat` reads the run's template with its tokenizer, as `python -m boost_jax.generate runs/chat --chat` does; each reply stops at the template's end-of-turn token. Thirty steps of a 0.15M-parameter model teach the shape of a reply, not sums."""),
    new_code_cell("""cfg, model, step = api.restore("runs/chat")
replies = api.generate_chat(model, api.restore_chat("runs/chat"), ["What is 2 + 3?", "What is 40 + 2?"],
                            max_new_tokens=8)
step, replies"""),
    new_markdown_cell("""## Next
- A Hugging Face model: `train.init_from=path/to/SmolLM2-135M-Instruct` (its own chat template is used).
- A low-rank fine-tune of a dense model: `python -m boost_jax.convert import SRC runs/svd --to svd --rank R`, then `train.init_from=runs/svd`.
- Serve it: `python -m boost_jax.serve runs/chat` (OpenAI's `/v1/chat/completions`); take it out: `python -m boost_jax.export runs/chat out/`."""),
]


def main() -> None:
    out = Path(__file__).parents[1] / "notebooks"
    out.mkdir(exist_ok=True)
    for name, cells in (("quickstart", QUICKSTART), ("schemes", SCHEMES), ("fine-tuning", FINE_TUNING)):
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                 "language": "python"}})
        nbformat.write(nb, out / f"{name}.ipynb")


if __name__ == "__main__":
    main()
