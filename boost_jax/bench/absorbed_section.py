"""`bench report --absorbed-decode-json / --absorbed-gpu-json / --absorbed-quality-json`: the numbers of the
results page's section 10, decoupled RoPE and the absorbed latent cache (docs/design/absorbed-attention.md):
the full, rebuilding and absorbed caches decoding side by side over tp (`bench decode --vary`), the
XLA:GPU decode program's work per step, full against absorbed (`python -m boost_jax.compile --json`), and
what decoupling costs in loss (`bench quality --vary model.attn_rope_dims`): the tables computed and the
template's `absorbed_*` parts rendered here."""

from __future__ import annotations

import math
import statistics

from boost_jax.bench import quality
from boost_jax.bench.latent_section import SavedInput
from boost_jax.bench.page import render
from boost_jax.config import ConfigError
from boost_jax.runtime.units import MIB

INPUTS = (
    SavedInput("--absorbed-decode-json", "decode", ("device", "read_bandwidth_bytes_per_s", "runs"), True,
               "saved `bench decode ... --vary model.attn_rope_dims=0,D --json`, one per tp (or one varying "
               "parallel.tp too), for section 10"),
    SavedInput("--absorbed-gpu-json", "gpu", ("hardware", "cache", "n_layers", "attn_rope_dims", "programs"), True,
               "saved `python -m boost_jax.compile ... --only prefill,decode --json`, one per cache and batch, "
               "for section 10"),
    SavedInput("--absorbed-quality-json", "quality", ("rope_dims", "command"), False,
               "a saved `bench quality --vary model.attn_rope_dims=... --json` for section 10"),
)
GPU_SETTING = ("hardware", "model", "n_layers", "arch", "dtype", "seq", "attn_latent_heads", "attn_rope_dims", "mesh")


def check_gpu(compiles: list[dict], paths: list[str]) -> None:
    """One ConfigError naming the file whose setting differs from the first's, or that has no decode program."""
    for c, path in zip(compiles, paths):
        if diff := [k for k in GPU_SETTING if c[k] != compiles[0][k]]:
            raise ConfigError(f"--absorbed-gpu-json {path}: {', '.join(f'{k}={c[k]}' for k in diff)} differs from "
                              f"{paths[0]}'s {', '.join(f'{k}={compiles[0][k]}' for k in diff)}: one setting per page")
        if not any("step_work" in p for p in c["programs"]):
            raise ConfigError(f"--absorbed-gpu-json {path}: no decode program's step_work (compile with "
                              "--only prefill,decode)")


# ----------------------------------------------------------------------------- (a) decoding


def _setting(run: dict) -> dict[str, str]:
    """A --vary run's varied keys and values, from its label."""
    return dict(pair.partition("=")[::2] for pair in run["variant"].split())


def _rope(run: dict) -> int:
    return int(_setting(run).get("model.attn_rope_dims", 0))


# The rows of the table: (label, the cache kind, whether its model decouples RoPE).
KINDS = (("full", "full", False), ("latent, keys rebuilt", "latent", False), ("full", "full", True),
         ("latent, absorbed", "latent", True))


def _runs(decs: list[dict]) -> list[dict]:
    """Every run of the saved files, each with its file's read bandwidth."""
    return [{**run, "bandwidth": dec["read_bandwidth_bytes_per_s"]} for dec in decs for run in dec["runs"]]


def _row(runs: list[dict], tp: int, decoupled: bool, cache: str, batch: int) -> dict | None:
    """The row of (tp, d_r > 0, cache, batch) from the first file that measured it (a file per tp, or
    several at one tp over other batches: each row's ratios are within its own file's run), or None."""
    return next((row for r in runs if r["tp"] == tp and bool(_rope(r)) == decoupled
                 for row in r["rows"] if row["cache"] == cache and row["batch"] == batch), None)


def _batches(runs: list[dict], tp: int | None = None) -> list[int]:
    """The batches measured (at `tp`, or at any), in order."""
    return sorted({row["batch"] for r in runs if tp in (None, r["tp"]) for row in r["rows"]})


def decode_command(dec: dict) -> str:
    """One saved file's `bench decode` command."""
    first = dec["runs"][0]
    varied: dict[str, list[str]] = {}
    for run in dec["runs"]:
        for key, value in _setting(run).items():
            if value not in (values := varied.setdefault(key, [])):
                values.append(value)
    batches = list(dict.fromkeys(r["batch"] for r in first["rows"]))
    caches = list(dict.fromkeys(r["cache"] for r in first["rows"]))
    return " ".join(["python -m boost_jax.bench decode", f"model.preset={first['model']}", f"model.arch={first['arch']}",
                     f"model.dtype={first['dtype']}", f"model.attn_latent_heads={first['attn_latent_heads']}",
                     *([f"parallel.tp={first['tp']}"] if "parallel.tp" not in varied else []),
                     *(f"--vary {k}={','.join(v)}" for k, v in varied.items()),
                     f"--caches {','.join(caches)} --batches {','.join(map(str, batches))}",
                     f"--prompt-len {first['prompt_len']} --new-tokens {first['new_tokens']} --json"])


def decode_table(runs: list[dict]) -> list[str]:
    """Markdown: per (cache, d_r, batch), each tp's bytes per cached token per device, tokens/s and step over floor."""
    tps = sorted({r["tp"] for r in runs})
    dr = max(_rope(r) for r in runs)
    head = "| cache | d_r | batch | " + " | ".join(f"tp={t} B/token/device | tp={t} tok/s | tp={t} step / floor"
                                                 for t in tps) + " |"
    lines = [head, "|---|---|---|" + "---|---|---|" * len(tps)]
    for label, cache, decoupled in KINDS:
        for b in _batches(runs):
            cells = [_row(runs, t, decoupled, cache, b) for t in tps]
            lines.append(f"| {label} | {dr if decoupled else 0} | {b} | " + " | ".join(
                "- | - | -" if r is None else
                f"{r['cache_bytes_per_token_per_device']:,} | {r['decode_tokens_per_s']:,.1f} | {r['step_over_floor']:.1f}"
                for r in cells) + " |")
    return lines


def decode_targets(runs: list[dict]) -> list[str]:
    """Per tp, at its largest batch: the absorbed cache's tokens/s over the plain model's full cache's
    (issue 74's targets: >= 1.0x on one device, >= 1.2x at tp=4) and over its own model's full cache, and
    each one's step over its read floor."""
    out = []
    for t in sorted({r["tp"] for r in runs}):
        b = _batches(runs, t)[-1]
        absorbed, full, same, rebuilt = (_row(runs, t, d, c, b) for d, c in ((True, "latent"), (False, "full"),
                                                                           (True, "full"), (False, "latent")))
        speed = lambda r: r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        out.append(f"- tp={t}, batch {b}: absorbed **{speed(absorbed):.2f}x** the plain model's full cache's tokens/s "
                   f"({absorbed['decode_tokens_per_s'] / same['decode_tokens_per_s']:.2f}x its own model's full cache; "
                   f"the rebuilding latent cache {speed(rebuilt):.2f}x), at {absorbed['cache_bytes_per_token_per_device']:,} "
                   f"bytes per token per device against {full['cache_bytes_per_token_per_device']:,}; a step "
                   f"{absorbed['step_over_floor']:.1f}x its read floor against the full cache's "
                   f"{full['step_over_floor']:.1f}x (rebuilt: {rebuilt['step_over_floor']:.1f}x).")
    return out


# ----------------------------------------------------------------------------- (b) XLA:GPU's decode program


def gpu_command(c: dict) -> str:
    return (f"python -m boost_jax.compile model.preset={c['model']} model.n_layers={c['n_layers']} model.arch={c['arch']} "
            f"model.attn_latent_heads={c['attn_latent_heads']} model.attn_rope_dims={c['attn_rope_dims']} "
            f"parallel.tp={c['mesh'].get('tp', 1)} model.dtype={c['dtype']} train.batch_size=B train.seq_len={c['seq']} "
            f"--hardware {c['hardware']} --only prefill,decode --cache CACHE --json")


def _step(c: dict) -> dict:
    work = next(p["step_work"] for p in c["programs"] if "step_work" in p)
    return {**work, "bytes": work["gemm_read_bytes"] + work["memory_bound_bytes"]}


def gpu_table(compiles: list[dict]) -> list[str]:
    """Markdown: per batch and cache, a decode step's GFLOP and bytes per device, and the bytes over the full cache's."""
    lines = ["| batch | cache | GFLOP per step | GEMMs read MiB | memory-bound MiB | bytes per step MiB | x full's bytes |",
             "|---|---|---|---|---|---|---|"]
    full = {c["batch"]: _step(c) for c in compiles if c["cache"] == "full"}
    for c in sorted(compiles, key=lambda c: (c["batch"], c["cache"] != "full")):
        s = _step(c)
        ratio = f"{s['bytes'] / full[c['batch']]['bytes']:.2f}" if c["batch"] in full else "-"
        lines.append(f"| {c['batch']} | {c['cache']} | {s['flops'] / 1e9:,.1f} | {s['gemm_read_bytes'] / MIB:,.1f} | "
                     f"{s['memory_bound_bytes'] / MIB:,.1f} | {s['bytes'] / MIB:,.1f} | {ratio} |")
    return lines


# ----------------------------------------------------------------------------- (c) quality


T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student's t, two-sided 95%, by degrees of freedom


def quality_costs(q: dict) -> str:
    """Each d_r's mean loss against d_r = 0's, paired by seed (a seed sets the initialisation and the batch
    order, the same for every d_r), with the differences' 95% t-interval."""
    first, *rest = q["rope_dims"]["rows"]
    out = []
    for r in rest:
        diffs = [a - b for a, b in zip(r["seed_losses"], first["seed_losses"])]
        mean, n = statistics.fmean(diffs), len(diffs)
        half = T_975[n - 1] * statistics.stdev(diffs) / math.sqrt(n) if n - 1 in T_975 else math.nan
        out.append(f"d_r = {r['attn_rope_dims']}: {mean:+.4f} (95% interval {mean - half:+.4f} to {mean + half:+.4f}; "
                   f"each seed's spread up to {max(r['spread'], first['spread']):.4f})")
    return "; ".join(out)


def _listed(items) -> str:
    *head, last = map(str, items)
    return f"{', '.join(head)} and {last}" if head else last


def absorbed_section(ab: dict) -> list[str]:
    """Section 10: decoupled RoPE, from the saved bench outputs it holds (bench/report.py)."""
    lines = render("absorbed")
    if "decode" in ab:
        runs, first = _runs(ab["decode"]), ab["decode"][0]["runs"][0]
        lines += render("absorbed_decode", commands=[f"- `{decode_command(d)}`" for d in ab["decode"]],
                        device=ab["decode"][0]["device"], model=first["model"], arch=first["arch"], dtype=first["dtype"],
                        g=first["attn_latent_heads"], prompt_len=first["prompt_len"], new_tokens=first["new_tokens"],
                        bandwidth=_listed(f"{d['read_bandwidth_bytes_per_s'] / 1e9:.1f}" for d in ab["decode"]),
                        table=decode_table(runs), targets=decode_targets(runs))
    if "gpu" in ab:
        c = ab["gpu"][0]
        lines += render("absorbed_gpu", command=gpu_command(c), hw=c["hardware"], devices=c["devices"], model=c["model"],
                        n_layers=c["n_layers"],
                        arch=c["arch"], dtype=c["dtype"], g=c["attn_latent_heads"], dr=c["attn_rope_dims"],
                        seq=c["seq"], table=gpu_table(ab["gpu"]))
    if "quality" in ab:
        q, o = ab["quality"], ab["quality"]["rope_dims"]
        lines += render("absorbed_quality", command=q["command"], tokens=f"{o['tokens']:,}", steps=o["steps"],
                        seeds=_listed(range(len(o["rows"][0]["seed_losses"]))), evaluated=f"{o['evaluated_tokens']:,}",
                        table=quality.model_values_table(o), costs=quality_costs(q))
    return lines


def absorbed_commands(ab: dict) -> list[str]:
    """The commands of section 10's saved inputs, as the section states them."""
    return [*(decode_command(d) for d in ab.get("decode", ())),
            *([gpu_command(ab["gpu"][0])] if "gpu" in ab else []),
            *([ab["quality"]["command"]] if "quality" in ab else [])]
