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


def main() -> None:
    out = Path(__file__).parents[1] / "notebooks"
    out.mkdir(exist_ok=True)
    for name, cells in (("quickstart", QUICKSTART), ("schemes", SCHEMES)):
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                 "language": "python"}})
        nbformat.write(nb, out / f"{name}.ipynb")


if __name__ == "__main__":
    main()
