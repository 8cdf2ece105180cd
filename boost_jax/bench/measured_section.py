"""The results page's sections 4 and 5, measured on this machine: the TP=4 step compare and one device
against the matmul peak, where the step's time goes (`bench profile`), and decoding (`bench decode`,
beside Hugging Face's generate and api.generate where measured)."""

from __future__ import annotations

from boost_jax.bench.page import phrase, render
from boost_jax.bench.paper import COLUMNS as TRIO
from boost_jax.runtime.units import MIB


def measured_section(sc: dict, sd: dict) -> list[str]:
    """Section 4: the TP=4 step compare and the single-device steps against the matmul peak."""
    med = {v: sc["rows"][v]["median_step_s"] for v in TRIO}
    compare = [f"| {v} | {1e3 * r['median_step_s']:.0f} | {', '.join(f'{1e3 * t:.0f}' for t in r['step_times_s'])} | "
               f"{r['tokens_per_s']:,.0f} | {r['model_flops_per_s'] / 1e12:.3f} | {r['peak_bytes_per_device'] / MIB:.0f} |"
               for v, r in ((v, sc["rows"][v]) for v in TRIO)]
    single = [f"| {r['model']} | {r['arch']} | {1e3 * r['median_step_s']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_flops_per_s'] / 1e9:.1f} | {100 * r['fraction_of_matmul_peak']:.0f}% |" for r in sd["rows"]]
    return render("measured", model=sc["model"], batch=sc["batch"], seq=sc["seq"], tp=sc["tp"], reps=sc["reps"],
                  steps=sc["steps"], compare_rows=compare, btp_over_vanilla=f"{med['cola/vanilla'] / med['cola/btp']:.2f}",
                  btp_over_dense=f"{med['dense/megatron'] / med['cola/btp']:.2f}",
                  vanilla_over_dense=f"{med['dense/megatron'] / med['cola/vanilla']:.2f}",
                  dense_of_peak=f"{sc['rows']['dense/megatron']['model_flops_per_s'] / sd['matmul_peak_flops']:.0%}",
                  single_batch=sd["batch"], single_seq=sd["seq"], peak_gflops=f"{sd['matmul_peak_flops'] / 1e9:.1f}",
                  single_rows=single)


def profile_section(rows: list[dict]) -> list[str]:
    """Markdown: `bench profile`'s time by category per variant, and the first variant's top ops."""
    r0 = rows[0]
    share = lambda r, s: f"{1e3 * s:,.0f} ({100 * s / r['step_s']:.1f}%)"
    per_variant = lambda cell: " | ".join(cell(r) for r in rows)
    return render("profile", model=r0["model"], batch=r0["batch"], seq=r0["seq"], steps=r0["steps"],
                  variants=per_variant(lambda r: f"{r['arch']}/{r['scheme']} tp={r['tp']}"), rule="---|" * len(rows),
                  categories=[f"| {k} | {per_variant(lambda r: share(r, r['categories'][k]))} |" for k in r0["categories"]],
                  traced=per_variant(lambda r: f"{1e3 * r['step_s']:,.0f}"),
                  untraced=per_variant(lambda r: f"{1e3 * r['untraced_step_s']:,.0f}"),
                  ops=per_variant(lambda r: f"{100 * r['ops_fraction']:.1f}%"),
                  accounted=per_variant(lambda r: f"{100 * r['accounted_fraction']:.1f}%"),
                  arch=r0["arch"], scheme=r0["scheme"], tp=r0["tp"],
                  top_ops=[f"| {o['name']} | {o['category']} | {1e3 * o['s_per_step']:,.0f} | {100 * o['fraction']:.1f}% "
                           f"| `{o['op_name'].removeprefix('jit(train_step)/')[-60:]}` |" for o in r0["top_ops"]])


def decode_section(dec: dict) -> list[str]:
    """Markdown: `bench decode` per model, cache kind and batch size, against the memory-bound floor;
    then Hugging Face's generate and api.generate beside it where measured."""
    runs = dec["runs"]
    rows = [f"| {run['model']} {run['arch']} | {r['cache']} | {r['cache_bytes_per_token']:,} | {r['batch']} | "
            f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | {1e3 * r['step_s']:.2f} | "
            f"{1e3 * r['floor_s']:.2f} | {r['step_over_floor']:.2f}x |" for run in runs for r in run["rows"]]
    lines = render("decode", prompt_len=runs[0]["prompt_len"], new_tokens=runs[0]["new_tokens"],
                   bandwidth=f"{dec['read_bandwidth_bytes_per_s'] / 1e9:.1f}", rows=rows)
    lines += [line for run in runs if run.get("hf") for line in hf_generate_lines(run)]
    return lines + [line for run in runs for line in api_generate_lines(run)]


def hf_generate_lines(run: dict) -> list[str]:
    """Hugging Face's generate on `run`'s model beside boost_jax's decoder, end to end and matmuls alone."""
    hf = run["hf"]
    gemms = "step_gemms" in hf  # results measured before the matmul columns have none
    rows = []
    for h in hf["rows"]:
        mine = next(r for r in run["rows"] if r["batch"] == h["batch"] and r["cache"] == "full")
        rows.append(f"| {h['batch']} | {h['end_to_end_tokens_per_s']:,.1f} | {mine['end_to_end_tokens_per_s']:,.1f} "
                    f"| {mine['end_to_end_tokens_per_s'] / h['end_to_end_tokens_per_s']:.2f}x |"
                    + (f" {1e3 * h['step_gemms_s']:.2f} | {1e3 * h['xla_step_gemms_s']:.2f} | "
                       f"{h['xla_step_gemms_s'] / h['step_gemms_s']:.2f}x | {1e3 * mine['step_s']:.2f} |" if gemms else ""))
    return render("decode_hf", model=run["model"], arch=run["arch"], transformers=hf["transformers"], torch=hf["torch"],
                  threads=hf["threads"], matmuls=phrase("decode_hf_matmuls", count=hf["step_gemms"]) if gemms else ":",
                  matmul_columns=phrase("decode_hf_matmul_columns") if gemms else "",
                  matmul_rule="---|" * 4 if gemms else "", rows=rows)


def api_generate_lines(run: dict) -> list[str]:
    """`api.generate` called in a loop beside the kept Decoder (and Hugging Face's generate); none
    where `run` did not time it."""
    timed = [r for r in run["rows"] if "api_call_s" in r]
    if not timed:
        return []
    hf = {h["batch"]: h["end_to_end_tokens_per_s"] for h in run.get("hf", {}).get("rows", [])}
    rows = [f"| {r['batch']} | {r['call_s']:.3f} | {r['api_call_s']:.3f} | {r['api_call_s'] / r['call_s']:.2f}x | "
            f"{r['api_tokens_per_s']:,.1f} |" + (f" {hf[r['batch']]:,.1f} | {r['api_tokens_per_s'] / hf[r['batch']]:.2f}x |"
                                                 if hf else "") for r in timed]
    return render("decode_api", model=run["model"], arch=run["arch"], beside_hf=phrase("decode_api_beside_hf") if hf else "",
                  hf_columns=phrase("decode_api_hf_columns") if hf else "", hf_rule="---|" * 2 if hf else "", rows=rows)
