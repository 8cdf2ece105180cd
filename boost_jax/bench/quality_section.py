"""The results page's section 6 without a study (`--quality-json`: the archs at equal tokens and FLOPs;
`--optimizers-json`: each optimizer at its best rate), and beside a study its 6b (the factored dense
model's recovery) and 6c (the optimizers' step times)."""

from __future__ import annotations

from boost_jax.bench import quality
from boost_jax.bench.page import phrase, render


def quality_section(q: dict) -> list[str]:
    """Markdown: `bench quality`: dense against the low-rank archs at equal tokens and equal FLOPs,
    beside CoLA's claim, and the compressed dense model's recovery."""
    r = quality.ratios(q)
    dense, cola = protocol_run(q, "dense"), protocol_run(q, "cola")
    ratios = [phrase("quality_ratio", label=label, ratio=f"{r[name]:.3f}", verdict=_verdict(r[name]))
              for name, label in (("cola/tokens", "cola at equal tokens"), ("cola/flops", "cola at dense's FLOPs"),
                                  ("svd/tokens", "svd at equal tokens"), ("svd/flops", "svd at dense's FLOPs"),
                                  ("lax/tokens", "lax at equal tokens")) if name in r]
    return [*render("quality", **quality_slots(q), rank=q["rank"], table=quality.table(q), ratios="; ".join(ratios),
                    dense_millions=f"{dense['params'] / 1e6:.1f}", cola_millions=f"{cola['params'] / 1e6:.1f}",
                    token_millions=f"{q['tokens'] / 1e6:.1f}"),
            *recovery_lines(q)]


def factored_section(q: dict) -> list[str]:
    """Markdown beside a study (section 6b): of `bench quality`, the compressed dense model's recovery alone."""
    return [*render("factored", **quality_slots(q)), *recovery_lines(q)]


def quality_slots(q: dict) -> dict:
    """The slots the quality protocol's run fills wherever the page states it."""
    dense = protocol_run(q, "dense")
    return dict(command=q["command"], model=q["model"], d_model=q["d_model"], n_layers=q["n_layers"],
                corpus=q["corpus"], seq_len=q["seq_len"], batch_size=q["batch_size"], eval_tokens=f"{q['eval_tokens']:,}",
                tokens=f"{q['tokens']:,}", tokens_per_parameter=f"{q['tokens'] / dense['params']:.2f}")


def protocol_run(q: dict, arch: str) -> dict:
    """The quality protocol's run of `arch` at the protocol's tokens."""
    return next(x for x in q["runs"] if (x["arch"], x["budget"]) == (arch, "tokens"))


def recovery_lines(q: dict) -> list[str]:
    """Markdown: the dense model factored into svd, as factored and after continued training."""
    dense = protocol_run(q, "dense")
    return render("recovery", recovery=[
        f"| {c['method']} | {c['rank']} | {dense['final']['perplexity']:.2f} | {c['compressed']['perplexity']:.2f} "
        f"| {c['recovered']['perplexity']:.2f} | {c['steps']} ({c['tokens']:,}) |" for c in q["recovery"]])


def _verdict(ratio: float) -> str:
    """A perplexity ratio against dense's in words: within 2% is a match."""
    if ratio < 0.98:
        return f"beats dense by {100 * (1 - ratio):.1f}%"
    return "matches dense" if ratio <= 1.02 else f"lags dense by {100 * (ratio - 1):.1f}%"


def optimizers_section(q: dict) -> list[str]:
    """Markdown: `bench quality --vary train.optimizer=...`: each optimizer at its best learning rate."""
    o = q["optimizers"]
    fewer = phrase("split_fewer", asked=f"{o['eval_tokens']:,}") if o["evaluated_tokens"] < o["eval_tokens"] else ""
    return [*render("optimizers", command=q["command"], tokens=f"{o['tokens']:,}", steps=o["steps"],
                    evaluated=f"{o['evaluated_tokens']:,}", fewer=fewer, table=quality.optimizer_table(o)),
            *(optimizer_step_lines(q["step"]) if "step" in q else [])]


def optimizer_costs_section(q: dict) -> list[str]:
    """Markdown beside a study (section 6c): of the optimizers' saved runs, their step times alone."""
    return [*render("optimizer_costs"), *optimizer_step_lines(q["step"])] if "step" in q else []


def optimizer_step_lines(s: dict) -> list[str]:
    """Markdown: `bench step --vary train.optimizer=...`: each optimizer's step time and what its
    Newton-Schulz adds, measured beside its FLOPs at adamw's own step rate."""
    base = s["results"][0]
    rows = []
    for r in s["results"]:
        if "optimizer_overhead_s" not in r:
            rows.append(f"| {r['optimizer']} | {1e3 * r['median_step_s']:.1f} | - | 0 | - | - |")
            continue
        added, predicted = r["optimizer_overhead_s"], r["predicted_optimizer_overhead_s"]
        rows.append(f"| {r['optimizer']} | {1e3 * r['median_step_s']:.1f} | {1e3 * added:.1f} "
                    f"({100 * added / r['median_step_s']:.0f}%) | {r['newton_schulz_flops'] / 1e9:.2f} | "
                    f"{1e3 * predicted:.1f} | {added / predicted:.2f} |")
    return render("optimizer_steps", command=s["command"], arch=base["arch"], dtype=base["dtype"], batch=base["batch"],
                  seq=base["seq"], peak_gflops=f"{s['matmul_peak_flops_per_s'] / 1e9:.1f}", rows=rows)
