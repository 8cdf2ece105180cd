"""Hugging Face transformers + PyTorch on the same dense LLaMA as boost_jax (its weights written by
`boost_jax/model/hf.py`, as `export` writes them), for the benchmarks' `--hf` figures: what a user would otherwise run on
this machine, side by side. Needs torch and transformers (neither is a dependency)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from boost_jax.bench.common import seconds
from boost_jax.config import Config, ConfigError
from boost_jax.model import Model
from boost_jax.model.counts import count
from boost_jax.model.hf import export_model, is_hf_llama
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.runtime.errors import PackageError
from boost_jax.training.step import lr_schedule

NAME = "transformers+torch"
# Where a step's time goes, in rows both frameworks can be split into (bench profile --hf)
PROFILE_ROWS = ("gemm", "attention", "optimizer", "rest")


def check_llama(cfg: Config) -> None:
    """Hugging Face runs the dense LLaMA (what `export` writes in its layout), nothing else, and
    only where torch and transformers are installed: both checked before any work."""
    if not is_hf_llama(cfg.model):
        raise ConfigError(f"--hf needs a model Hugging Face calls a LLaMA (model.arch=dense with the gate SiLU), "
                          f"not model.arch={cfg.model.arch}")
    if missing := [p for p in ("torch", "transformers") if importlib.util.find_spec(p) is None]:
        raise PackageError(f"--hf needs torch and transformers; not installed: {', '.join(missing)} "
                           "(pip install torch transformers)")


def check_train(cfg: Config) -> None:
    """What `TrainStep` needs of cfg, checked before anything is compiled (the config before the
    packages)."""
    devices = len(mesh_devices(cfg.parallel))
    if devices > 1 or cfg.train.microbatches > 1:
        raise ConfigError(f"--hf times one device without accumulation, not {devices} devices and "
                          f"train.microbatches={cfg.train.microbatches}: give parallel.dp=1 (and tp, pp, cp, fsdp 1)")
    check_llama(cfg)


def load_llama(cfg: Config):
    """cfg's model at its seed's initial weights (those `weights.init_params` makes), as a
    `transformers.LlamaForCausalLM` in fp32 on the CPU, with torch using every core here."""
    check_llama(cfg)
    import torch  # optional: torch
    from transformers import LlamaForCausalLM  # optional: transformers

    torch.set_num_threads(jax.local_device_count() if jax.devices()[0].platform != "cpu" else cores())
    model = Model(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
    with tempfile.TemporaryDirectory() as tmp:
        export_model(cfg, model, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        for p in hf.parameters():  # own the weights: the exported file goes with the directory
            p.data = p.data.clone()
    return hf


def step_weights(hf_model) -> list[np.ndarray]:
    """The weight of every matmul a decode step runs, in its order ([out, in], as torch's Linear
    keeps it): each layer's q, k, v, o, gate, up and down projections, then the LM head."""
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    linears = [layer.get_submodule(n) for layer in hf_model.model.layers for n in names] + [hf_model.lm_head]
    return [lin.weight.detach().numpy() for lin in linears]


def gemm_chain_seconds(weights: list[np.ndarray], batch: int, reps: int) -> float:
    """Seconds PyTorch takes for `weights`' matmuls of `batch` rows one after another (each waits for
    the last, as a step's do), as torch's Linear runs them: the median of `reps`."""
    import torch  # optional: torch

    chain = [torch.from_numpy(w) for w in weights]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], generator=torch.Generator().manual_seed(0)) for w in weights}

    def run():
        s = torch.zeros(())
        for w in chain:
            s = torch.nn.functional.linear(inputs[w.shape[1]] + s, w)[0, 0] * 1e-30
        return float(s)

    with torch.inference_mode():
        run()
        return statistics.median(seconds(run) for _ in range(reps))


def cores() -> int:
    """The cores this process may run on (torch's threads, as JAX's CPU client uses them all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def versions() -> dict:
    import torch  # optional: torch
    import transformers  # optional: transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()}


class TrainStep:
    """The training step a PyTorch user writes for cfg (one device, no accumulation): eager
    transformers LLaMA, cross-entropy over every position against the batch's targets, global-norm
    clipping, `torch.optim.AdamW` with cfg's betas and weight decay (none on the norm scales) on
    boost_jax's learning-rate schedule; under model.dtype=bfloat16, CPU autocast to bf16 over fp32
    weights. Times like `bench.step.Runner`: `steps(n)`, `times`, `result()`."""

    def __init__(self, cfg: Config, inputs: np.ndarray, targets: np.ndarray):
        check_train(cfg)
        import torch  # optional: torch

        t, m = cfg.train, cfg.model
        self.torch, self.cfg, self.mesh_shape = torch, cfg, {}
        self.model = load_llama(cfg).train()
        params = [q for q in self.model.parameters() if q.requires_grad]
        groups = [{"params": [q for q in params if q.ndim > 1], "weight_decay": t.weight_decay},
                  {"params": [q for q in params if q.ndim <= 1], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.b1, t.b2))
        schedule = lr_schedule(t)
        self.lr = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: float(schedule(s)) / t.lr)
        self.inputs, self.targets = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=m.dtype == "bfloat16")
        self.tokens, self.times = inputs.size, []
        self.first_loss = self._step()
        self.steps(1)  # warm up

    def _step(self) -> float:
        torch, t = self.torch, self.cfg.train
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            logits = self.model(input_ids=self.inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten())
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        self.lr.step()
        return float(loss.detach())

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.loss = self._step()
        return (time.perf_counter() - t0) / n

    def profile(self, steps: int) -> dict:
        """Seconds per step of `steps` steps under torch's profiler, in `PROFILE_ROWS`: the GEMMs
        (aten::mm/addmm/bmm, the LM head's included), attention (the SDPA kernels, forward and
        backward), the optimizer (AdamW's step and zero_grad, inclusive) and the rest (the step's wall
        time less those: elementwise ops, the loss, the clip, autograd and eager dispatch)."""
        torch = self.torch
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step_s = self.steps(steps)
        rows = dict.fromkeys(PROFILE_ROWS, 0.0)
        for e in prof.key_averages():
            if e.key in ("aten::mm", "aten::addmm", "aten::bmm"):
                rows["gemm"] += e.self_cpu_time_total
            elif "scaled_dot_product" in e.key:
                rows["attention"] += e.self_cpu_time_total
            elif e.key.startswith("Optimizer."):
                rows["optimizer"] += e.cpu_time_total
        rows = {k: v / 1e6 / steps for k, v in rows.items()}
        rows["rest"] = step_s - sum(rows.values())
        return {"step_s": step_s, "rows": rows, **versions()}

    def result(self) -> dict:
        med = statistics.median(self.times)
        m, t = self.cfg.model, self.cfg.train
        flops = count(m, t.seq_len).train_flops_per_token * self.tokens
        return {"model": m.preset, "arch": m.arch, "scheme": NAME, "tp": 1, "dp": 1, "fsdp": 1, "pp": 1, "cp": 1,
                "batch": t.batch_size, "seq": t.seq_len, "dtype": m.dtype, "median_step_s": med,
                "step_times_s": self.times, "tokens_per_s": self.tokens / med, "model_flops_per_s": flops / med,
                "peak_bytes_per_device": None, "first_loss": self.first_loss, "last_loss": self.loss, **versions()}
