"""`bench report --latent-decode-json / --latent-comm-json / --latent-quality-json`: the numbers of the
results page's section 9, latent heads (docs/design.md section 11): the per-device cache and decode
speed of each cache kind over tp (`bench decode --vary`), the collectives per layer with and without
latent heads, compiled HLO beside the formula (`bench comm`), and what the restriction costs in loss
(`bench quality --vary model.attn_latent_heads`): the tables computed and the template's `latent_*` parts
rendered here."""

from __future__ import annotations

from dataclasses import dataclass

from boost_jax.bench import quality
from boost_jax.bench.page import phrase, render
from boost_jax.config import ConfigError
from boost_jax.config.hardware import ring_bytes
from boost_jax.runtime.units import MIB


@dataclass(frozen=True)
class SavedInput:
    """A `bench report` flag that reads saved bench output for a part of section 9."""

    flag: str
    part: str  # its key under results.json's "latent_heads"
    keys: tuple[str, ...]  # what a file of it must hold (bench report's read_saved)
    several: bool  # one file per tp and g (bench comm compiles one layout)
    help: str


INPUTS = (
    SavedInput("--latent-decode-json", "decode", ("device", "read_bandwidth_bytes_per_s", "runs"), False,
               "a saved `bench decode --vary parallel.tp=... --vary model.attn_latent_heads=... --json` for section 9"),
    SavedInput("--latent-comm-json", "comm", ("tp", "by_kind", "analytic_layer_forward_by_kind",
                                              "analytic_layer_backward_all_gathers", "layer_forward_ring_bytes"), True,
               "saved `bench comm ... model.attn_latent_heads=G --json`, one per tp and G, for section 9"),
    SavedInput("--latent-quality-json", "quality", ("latent_heads", "command"), False,
               "a saved `bench quality --vary model.attn_latent_heads=... --json` for section 9"),
)
SETTING = ("model", "arch", "scheme", "dtype", "batch", "seq")  # what every bench comm file of the section shares


def check_comm(comms: list[dict], paths: list[str]) -> None:
    """One ConfigError naming the file whose setting differs from the first's (the table compares layouts
    of one setting only)."""
    for c, path in zip(comms[1:], paths[1:]):
        if diff := [k for k in SETTING if c[k] != comms[0][k]]:
            raise ConfigError(f"--latent-comm-json {path}: {', '.join(f'{k}={c[k]}' for k in diff)} differs from "
                              f"{paths[0]}'s {', '.join(f'{k}={comms[0][k]}' for k in diff)}: one setting per page")


def split(c: dict) -> bool:
    """Whether a bench comm's layout splits the k/v latents over tp (latent heads that tp divides)."""
    return "reduce-scatter" in c["analytic_layer_forward_by_kind"]


# ----------------------------------------------------------------------------- (a) decoding


def _variant(run: dict) -> tuple[int, int]:
    return run["tp"], run["attn_latent_heads"]


def decode_command(dec: dict) -> str:
    """The `bench decode` command of a saved --vary run: its varied keys' values as its variants name them."""
    runs = dec["runs"]
    varied: dict[str, list[str]] = {}
    for run in runs:
        for pair in run["variant"].split():
            key, _, value = pair.partition("=")
            if value not in (values := varied.setdefault(key, [])):
                values.append(value)
    first = runs[0]
    fixed = [f"{key}={first[field]}" for key, field in (("parallel.tp", "tp"), ("model.attn_latent_heads", "attn_latent_heads"))
             if key not in varied]
    batches = list(dict.fromkeys(r["batch"] for r in first["rows"]))
    caches = list(dict.fromkeys(r["cache"] for r in first["rows"]))
    return " ".join(["python -m boost_jax.bench decode", f"model.preset={first['model']}", f"model.arch={first['arch']}",
                     f"model.dtype={first['dtype']}", *fixed, *(f"--vary {k}={','.join(v)}" for k, v in varied.items()),
                     f"--caches {','.join(caches)} --batches {','.join(map(str, batches))}",
                     f"--prompt-len {first['prompt_len']} --new-tokens {first['new_tokens']} --json"])


LATENT_KINDS = ("latent_v", "latent")  # the caches that keep latents, in the order the table shows them


def decode_kinds(dec: dict) -> list[tuple[str, int]]:
    """The (cache, g) rows of the table: the full cache without latent heads, then each latent kind the
    run measured at every g."""
    gs = sorted({run["attn_latent_heads"] for run in dec["runs"]})
    measured = {r["cache"] for r in dec["runs"][0]["rows"]}
    return [("full", gs[0]), *((cache, g) for cache in LATENT_KINDS if cache in measured for g in gs)]


def decode_table(dec: dict) -> list[str]:
    """Markdown: per (cache, g, batch), each tp's cache MiB per device and decode tokens/s."""
    runs = {_variant(run): run for run in dec["runs"]}
    tps = sorted({tp for tp, _ in runs})
    head = "| cache | g | batch | " + " | ".join(f"tp={tp} cache MiB/device | tp={tp} tok/s" for tp in tps) + " |"
    lines = [head, "|---|---|---|" + "---|---|" * len(tps)]
    for cache, g in decode_kinds(dec):
        for b in dict.fromkeys(r["batch"] for r in runs[tps[0], g]["rows"]):
            cells = [_decode_row(runs[tp, g], cache, b) for tp in tps]
            lines.append(f"| {cache} | {g} | {b} | " + " | ".join(f"{r['cache_bytes_per_device'] / MIB:,.2f} | "
                                                                  f"{r['decode_tokens_per_s']:,.1f}" for r in cells) + " |")
    return lines


def _decode_row(run: dict, cache: str, batch: int) -> dict:
    return next(r for r in run["rows"] if r["cache"] == cache and r["batch"] == batch)


def decode_target(dec: dict) -> dict:
    """At the largest tp, the latent caches of the most latent heads: bytes per device against the full
    cache of one, and decode tokens/s at every batch above 1 against it and against the same model's
    full cache (issue 60's target: the latent cache at least 1x at batch 8 and 32)."""
    runs = {_variant(run): run for run in dec["runs"]}
    tp = max(t for t, _ in runs)
    g_full, g = min(gs := [x for t, x in runs if t == tp]), max(gs)
    full, heads = runs[tp, g_full], runs[tp, g]
    per_token = lambda run, cache: next(r for r in run["rows"] if r["cache"] == cache)["cache_bytes_per_token_per_device"]
    speed = lambda cache, b, base: (_decode_row(heads, cache, b)["decode_tokens_per_s"]
                                    / _decode_row(base, "full", b)["decode_tokens_per_s"])
    batches = [r["batch"] for r in heads["rows"] if r["cache"] == "latent" and r["batch"] > 1]
    ratios = lambda cache, base: ", ".join(f"batch {b} {speed(cache, b, base):.2f}x" for b in batches) or "no batch above 1"
    out = {"tp": tp, "g": g, "bytes_ratio": f"{per_token(heads, 'latent') / per_token(full, 'full'):.2f}",
           "latent_bytes": f"{per_token(heads, 'latent'):,}", "full_bytes": f"{per_token(full, 'full'):,}",
           "speed": ratios("latent", full), "speed_same": ratios("latent", heads), "value_latent": None}
    if any(r["cache"] == "latent_v" for r in heads["rows"]) and batches:  # the slots of results_page.md's phrase
        floor = lambda cache: f"{_decode_row(heads, cache, batches[-1])['step_over_floor']:.1f}"
        out["value_latent"] = {"bytes": f"{per_token(heads, 'latent_v'):,}", "speed": ratios("latent_v", full),
                               "bytes_ratio": f"{per_token(heads, 'latent_v') / per_token(full, 'full'):.2f}",
                               "batch": batches[-1], "latent_floor": floor("latent"), "full_floor": floor("full")}
    return out


# ----------------------------------------------------------------------------- (b) collectives


def comm_command(comms: list[dict]) -> str:
    """The one `bench comm` command of the files, T and G standing for their layouts (below)."""
    c = comms[0]
    return (f"python -m boost_jax.bench comm model.preset={c['model']} model.arch={c['arch']} parallel.scheme={c['scheme']} "
            f"parallel.tp=T model.attn_latent_heads=G model.dtype={c['dtype']} train.batch_size={c['batch']} "
            f"train.seq_len={c['seq']} --json")


def _kinds(by_kind: dict) -> str:
    return ", ".join(f"{k} x{v['count']}" for k, v in sorted(by_kind.items()))


def _backward_ring_formula(c: dict) -> float:
    """What a ring sends per device for the formula's backward collectives (all-reduces, latent heads' all-gathers)."""
    return (sum(ring_bytes("all-reduce", c["tp"], n) for n in c["analytic_layer_backward_all_reduces"])
            + sum(ring_bytes("all-gather", c["tp"], n) for n in c["analytic_layer_backward_all_gathers"]))


def comm_table(comms: list[dict]) -> list[str]:
    """Markdown: per layout (tp, k/v latents whole or split), the layer's forward and backward collectives,
    their payload and what a ring sends per device, compiled HLO / formula, MiB."""
    lines = ["| tp | k/v latents | forward (HLO) | forward MiB, HLO / formula | ring sends fwd MiB, HLO / formula "
             "| backward (HLO) | backward MiB, HLO / formula | ring sends bwd MiB, HLO / formula |",
             "|---|---|---|---|---|---|---|---|"]
    for c in sorted(comms, key=lambda c: (c["tp"], split(c))):
        pair = lambda hlo, formula: f"{hlo / MIB:,.2f} / {formula / MIB:,.2f}"
        lines.append(f"| {c['tp']} | {'split over tp' if split(c) else 'whole (g = 1)'} | {_kinds(c['by_kind']['forward'])} | "
                     f"{pair(c['layer_forward_bytes'], c['analytic_layer_forward_bytes'])} | "
                     f"{pair(c['layer_forward_ring_bytes'], c['analytic_layer_forward_ring_bytes'])} | "
                     f"{_kinds(c['by_kind']['backward'])} | "
                     f"{pair(c['layer_backward_bytes'], c['analytic_layer_backward_bytes'])} | "
                     f"{pair(c['layer_backward_ring_bytes'], _backward_ring_formula(c))} |")
    return lines


def kv_forward(comms: list[dict]) -> list[dict]:
    """Per tp with both layouts: the k/v latents' forward collective per layer. Split, the reduce-scatter
    (HLO: its parts; formula: the scheme's); whole, XLA fuses them into q's all-reduce, so the HLO's
    share is the layer's forward less the all-reduces of the split layout (q, o and the MLP's, the same
    tensors), the formula's the same elements all-reduced. Payload and ring sends, each split over whole."""
    out = []
    for tp in sorted({c["tp"] for c in comms}):
        whole = next((c for c in comms if c["tp"] == tp and not split(c)), None)
        cut = next((c for c in comms if c["tp"] == tp and split(c)), None)
        if whole is None or cut is None:
            continue
        hlo_whole = whole["layer_forward_bytes"] - cut["by_kind"]["forward"]["all-reduce"]["bytes"]
        hlo_split, formula = sum(cut["layer_forward_reduce_scatter_parts"]), cut["analytic_layer_forward_by_kind"]["reduce-scatter"]
        ring = {"hlo": (ring_bytes("all-reduce", tp, hlo_whole), ring_bytes("reduce-scatter", tp, hlo_split)),
                "formula": (ring_bytes("all-reduce", tp, formula), ring_bytes("reduce-scatter", tp, formula))}
        out.append({"tp": tp, "whole_mib": f"{hlo_whole / MIB:.2f}", "split_mib": f"{hlo_split / MIB:.2f}",
                    "formula_mib": f"{formula / MIB:.2f}", "payload_ratio": f"{hlo_split / hlo_whole:.2f}",
                    "ring_whole_mib": f"{ring['hlo'][0] / MIB:.2f}", "ring_split_mib": f"{ring['hlo'][1] / MIB:.2f}",
                    "ring_formula_whole_mib": f"{ring['formula'][0] / MIB:.2f}",
                    "ring_formula_split_mib": f"{ring['formula'][1] / MIB:.2f}",
                    "ring_ratio": f"{ring['hlo'][1] / ring['hlo'][0]:.2f}",
                    "ring_formula_ratio": f"{ring['formula'][1] / ring['formula'][0]:.2f}"})
    return out


# ----------------------------------------------------------------------------- (c) quality


def quality_table(q: dict) -> list[str]:
    """Markdown: bench quality's own table of each g's seeds, mean and spread."""
    return quality.model_values_table(q["latent_heads"])


def quality_costs(q: dict) -> str:
    """Each g's mean loss against the first's (g = 1), beside the larger of the two spreads: a difference
    within it is not a result."""
    first, *rest = q["latent_heads"]["rows"]
    return "; ".join(f"g = {r['attn_latent_heads']}: {r['mean_loss'] - first['mean_loss']:+.4f} (spread up to "
                     f"{max(r['spread'], first['spread']):.4f})" for r in rest)


def latent_heads_section(lh: dict) -> list[str]:
    """Section 9: latent heads, from the saved bench outputs it holds (bench/py)."""
    lines = render("latent_heads")
    if "decode" in lh:
        dec, first = lh["decode"], lh["decode"]["runs"][0]
        target = decode_target(dec)
        value = target.pop("value_latent")  # latent_v beside the latent cache, where the run measured it
        lines += render("latent_decode", command=decode_command(dec), device=dec["device"],
                        model=first["model"], arch=first["arch"], dtype=first["dtype"], prompt_len=first["prompt_len"],
                        new_tokens=first["new_tokens"], positions=first["prompt_len"] + first["new_tokens"],
                        table=decode_table(dec), **target,
                        value_latent=phrase("latent_decode_value", **value) if value else "")
    if "comm" in lh:
        comms = lh["comm"]
        lines += render("latent_comm", command=comm_command(comms),
                        tps=", ".join(map(str, sorted({c["tp"] for c in comms}))), table=comm_table(comms))
        if kv := kv_forward(comms):  # a tp with both layouts
            lines += render("latent_comm_kv", rows=[phrase("latent_comm_kv_row", **row) for row in kv])
    if "quality" in lh:
        q, o = lh["quality"], lh["quality"]["latent_heads"]
        lines += render("latent_quality", command=q["command"], tokens=f"{o['tokens']:,}", steps=o["steps"],
                        evaluated=f"{o['evaluated_tokens']:,}", table=quality_table(q),
                        costs=quality_costs(q))
    return lines


def latent_heads_commands(lh: dict) -> list[str]:
    """The commands of section 9's saved inputs, as the section states them."""
    return [*([decode_command(lh["decode"])] if "decode" in lh else []),
            *([comm_command(lh["comm"])] if "comm" in lh else []),
            *([lh["quality"]["command"]] if "quality" in lh else [])]
