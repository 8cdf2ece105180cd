"""The results page's sections 1-3: the paper's rows compiled here (`bench paper`), the performance model
beside the paper on each GPU, where the two differ, and the planner on the paper's rows (`bench planner`)."""

from __future__ import annotations

from boost_jax.bench import paper, planner
from boost_jax.bench.page import phrase, render
from boost_jax.bench.paper import COLUMNS as TRIO
from boost_jax.launch.peaks import PEAK_BF16_FLOPS
from boost_jax.model.counts import count
from boost_jax.runtime.units import GIB

A100_PEAK = PEAK_BF16_FLOPS["A100"]


def paper_sections(pr: dict) -> list[str]:
    """Sections 1 and 2: the paper's rows compiled here, then the performance model beside the paper."""
    hw_names = list(pr["hardware"])
    first, s = hw_names[0], pr["settings"]
    theirs = ", ".join(f"{m.removeprefix('llama-').upper()} {a.rows} x {a.accumulation}" for m, a in paper.AUTHORS.items())
    lines = [*render("paper", dtype=s["dtype"], seq=s["seq"], batch=s["batch"], table=paper.measured_table(pr)),
             *render("perf_model", hardware=" | ".join(hw_names), rule="---|" * len(hw_names),
                     constants=constants_rows(pr), theirs=theirs)]
    for hw in hw_names:
        protocols = [line for protocol in s["protocols"]
                     for line in render("protocol", title=paper.PROTOCOL_TITLES[protocol].capitalize(),
                                        table=paper.prediction_table(pr, hw, protocol))]
        lines += render("hardware", hw=hw, description=pr["hardware"][hw]["description"], protocols=protocols)
    lines += render("fit", hw=first, table=paper.fit_table(pr, first))
    if pipe := paper.pipeline_table(pr, first):
        lines += render("pipeline", hw=first, table=pipe)
    if breakdown := paper.breakdown_table(pr, first):
        lines += render("breakdown", hw=first, table=breakdown, layer_comm=paper.layer_comm_table(pr, first))
    return lines + differences(pr)


def constants_rows(pr: dict) -> list[str]:
    """The performance model's constants, one table row per constant, one column per GPU."""
    hw_names = list(pr["hardware"])
    return [f"| {k} | " + " | ".join(_fmt(pr["hardware"][h][k]) for h in hw_names) + " |"
            for k in pr["hardware"][hw_names[0]] if k not in ("name", "description", "compile_target")]


def _fmt(v) -> str:
    if isinstance(v, float) and (v >= 1e4 or v < 1e-2):
        return f"{v:.3g}"
    return "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def differences(pr: dict) -> list[str]:
    """Rows where the model is more than 15% from the paper, and the model's known blind spots."""
    hw = next(iter(pr["hardware"]))
    misses = []
    for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in pr["rows"]):
        best = paper.best_reading(pr, model, variant, hw)
        if best and abs(best[1] - 1) > 0.15:
            misses += render("miss", model=model, variant=variant, reading=best[0], ratio=f"{best[1]:.2f}")
    return render("differences", misses=misses or render("no_miss", hw=hw), pp_requirements=_pp_requirements(pr))


def _pp_requirements(pr: dict) -> list[str]:
    """For each pipelined paper row: the fraction of A100 peak its time needs if it were one micro-batch
    of `batch` sequences through the stages in sequence."""
    out = []
    for r in pr["rows"]:
        if r["pp"] > 1 and r["paper_seconds"] and r["variant"] in TRIO and r["protocol"] == "micro":
            cfg = paper.row_config(r["model"], r["variant"])
            flops = count(cfg.model, r["seq"]).train_flops_per_token * r["batch"] * r["seq"]
            need = flops / r["tp"] / (r["paper_seconds"] * A100_PEAK)
            out += render("pp_requirement", model=r["model"], variant=r["variant"], pp=r["pp"],
                          seconds=f"{r['paper_seconds']:.2f}", need=f"{100 * need:.0f}")
    return out


def planner_section(pl: dict) -> list[str]:
    """Section 3: `bench planner`'s table (the planner's choice beside the paper's layout, per paper row)."""
    st = pl["settings"]
    workers = (phrase("planner_workers", workers=st["workers"], cache="an empty" if st["cold_cache"] else "a warm")
               if "workers" in st else ".")
    return render("planner", hardware=st["hardware"], arch=st["arch"], dtype=st["dtype"], seq=st["seq"], batch=st["batch"],
                  budget=f"{st['hbm_bytes'] * (1 - st['headroom']) / GIB:.1f}", headroom=f"{100 * st['headroom']:.0f}",
                  max_priced=st["max_priced"] or "all", schemes=", ".join(st["schemes"]),
                  pp_repeats=", ".join(map(str, st["pp_repeats"])), workers=workers, table=planner.table(pl),
                  paper_layouts=planner.paper_layout_lines(pl))
