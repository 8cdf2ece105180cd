"""The results page's section 9 (latent heads, bench/latent_section.py): rendered from small saved bench
outputs with the numbers they hold, kept in results.json for --rerender, and a wrong file refused by name."""

import json
import re
from pathlib import Path

import pytest

from boost_jax.bench import latent_section, report
from boost_jax.config import ConfigError
from boost_jax.runtime.units import MIB

DOCS = Path(__file__).parents[1] / "docs"


def decode_run(tp: int, g: int) -> dict:
    """A `bench decode --vary` run of tp devices and g latent heads: the latent cache split over tp only
    with latent heads; tokens/s made up so that each cell is its own number."""
    rows = []
    split = tp if g > 1 else 1
    for cache, per_token, extra in (("full", 4096 // tp, 0.0), ("latent_v", 2048 // tp + 512 // split, 0.25),
                                    ("latent", 1024 // split, 0.5)):
        for b in (1, 8):
            rows.append({"cache": cache, "batch": b, "cache_bytes_per_token_per_device": per_token,
                         "cache_bytes_per_device": b * 128 * per_token, "step_over_floor": 2.0 + extra * b,
                         "decode_tokens_per_s": 100.0 * tp + 10 * g + b + extra})
    return {"variant": f"parallel.tp={tp} model.attn_latent_heads={g}", "model": "llama-tiny", "arch": "cola",
            "dtype": "float32", "tp": tp, "attn_latent_heads": g, "prompt_len": 64, "new_tokens": 64, "rows": rows}


DECODE = {"device": "cpu", "read_bandwidth_bytes_per_s": 1e10,
          "runs": [decode_run(tp, g) for tp in (1, 2) for g in (1, 2)]}


def comm(tp: int, split: bool) -> dict:
    """A `bench comm --json` of llama-7b btp: 64 MiB of k/v latents (+0.5 MiB of statistic where split),
    160 MiB of other latents, whole or split over tp by latent heads."""
    kv, rest, extra = 64 * MIB, 160 * MIB, MIB // 2
    ring = lambda kind, n: n * (tp - 1) / tp * (2 if kind == "all-reduce" else 1)
    forward = {"all-reduce": {"count": 4, "bytes": rest}, "reduce-scatter": {"count": 1, "bytes": kv + extra}} if split \
        else {"all-reduce": {"count": 4, "bytes": rest + kv}}
    backward = {"all-reduce": {"count": 4, "bytes": rest}, "all-gather": {"count": 1, "bytes": kv + extra}} if split \
        else {"all-reduce": {"count": 4, "bytes": rest + kv}}
    return {"model": "llama-7b", "arch": "cola", "scheme": "btp", "dtype": "bfloat16", "batch": 8, "seq": 2048, "tp": tp,
            "by_kind": {"forward": forward, "backward": backward},
            "layer_forward_bytes": rest + kv + (extra if split else 0), "layer_backward_bytes": rest + kv + (extra if split else 0),
            "analytic_layer_forward_bytes": rest + kv, "analytic_layer_backward_bytes": rest + kv,
            "analytic_layer_forward_by_kind": {"all-reduce": rest, "reduce-scatter": kv} if split else {"all-reduce": rest + kv},
            "analytic_layer_backward_all_reduces": [32 * MIB] * 3 + [64 * MIB] if split else [32 * MIB] * 2 + [64 * MIB] * 2,
            "analytic_layer_backward_all_gathers": [kv] if split else [],
            "layer_forward_reduce_scatter_parts": [kv + extra] if split else [],
            "layer_forward_ring_bytes": sum(ring(k, v["bytes"]) for k, v in forward.items()),
            "layer_backward_ring_bytes": sum(ring(k, v["bytes"]) for k, v in backward.items()),
            "analytic_layer_forward_ring_bytes": ring("all-reduce", rest) + (ring("reduce-scatter", kv) if split
                                                                            else ring("all-reduce", kv))}


QUALITY = {"command": "python -m boost_jax.bench quality --tokens 4096 --vary model.attn_latent_heads=1,2,4",
           "latent_heads": {"tokens": 4096, "steps": 10, "eval_tokens": 2048, "evaluated_tokens": 1024, "rows": [
               {"attn_latent_heads": g, "params": 3.35e6 - 1000 * g, "seed_losses": [5.0 + 0.01 * g, 5.02 + 0.01 * g],
                "mean_loss": 5.01 + 0.01 * g, "spread": 0.02, "minutes": 1.0} for g in (1, 2, 4)]}}


def test_section_9_shows_each_saved_outputs_numbers():
    lines = latent_section.latent_heads_section({"decode": DECODE, "comm": [comm(8, True), comm(8, False)], "quality": QUALITY})
    page = "\n".join(lines)
    assert lines[0] == "## 9. Latent heads: a latent cache that tensor parallelism splits"
    # (a) one row per (cache, g, batch), each tp's MiB per device and tokens/s; tp=2, g=2: the latent cache halved
    assert ("`python -m boost_jax.bench decode model.preset=llama-tiny model.arch=cola model.dtype=float32 --vary "
            "parallel.tp=1,2 --vary model.attn_latent_heads=1,2 --caches full,latent_v,latent --batches 1,8 --prompt-len 64 "
            "--new-tokens 64 --json`") in page
    assert "| latent | 2 | 8 | 1.00 | 128.5 | 0.50 | 228.5 |" in lines
    assert "| full | 1 | 1 | 0.50 | 111.0 | 0.25 | 211.0 |" in lines and "| latent | 1 | 1 |" in page
    assert "| latent_v | 2 | 8 | 2.50 | 128.2 | 1.25 | 228.2 |" in lines
    assert ("At tp=2 the latent cache with g = 2 holds 512 bytes per cached token per device against the full cache's "
            f"2,048 (0.25x), and decodes at batch 8 {228.5 / 218:.2f}x the full cache's tokens/s (batch 8 "
            f"{228.5 / 228:.2f}x of the same model's full cache") in page
    assert ("The latent_v cache of that model (keys cached whole, v's latents split) holds 1,280 bytes per token per "
            f"device (0.62x) and decodes at batch 8 {228.25 / 218:.2f}x the full cache's. At batch 8 a latent step is "
            "6.0x its read floor against the full cache's 2.0x") in page
    # (b) HLO beside formula per layout, and the k/v latents' forward: same payload, half the ring's bytes
    assert "| 8 | whole (g = 1) | all-reduce x4 | 224.00 / 224.00 | 392.00 / 392.00 | all-reduce x4 | 224.00 / 224.00 |" in page
    assert "| 8 | split over tp | all-reduce x4, reduce-scatter x1 | 224.50 / 224.00 | 336.44 / 336.00 |" in page
    (kv,) = [line for line in lines if line.startswith("- tp=8:")]
    assert "payload 64.00 MiB all-reduced whole, 64.50 MiB reduce-scattered split (formula 64.00 MiB both; 1.01x)" in kv
    assert f"a ring sends 112.00 MiB against 56.44 MiB per device (formula 112.00 against 56.00): **{56.4375 / 112:.2f}x**" in kv
    # (c) bench quality's own table, and each g against g = 1 beside the spread
    assert "| 4 | 3.35M | 5.0400 / 5.0600 | 5.0500 | 0.0200 | 1.0 |" in lines
    assert "g = 2: +0.0100 (spread up to 0.0200); g = 4: +0.0300 (spread up to 0.0200)" in page
    assert not re.search(r"\$\w", page)  # every slot filled


def test_section_9_holds_only_the_parts_given():
    lines = latent_section.latent_heads_section({"quality": QUALITY})
    assert not any(line.startswith(("### Decoding", "### Collectives")) for line in lines)
    assert any(line.startswith("### What the restriction costs") for line in lines)


def test_report_keeps_section_9_in_results_json_and_refuses_a_wrong_file_by_name(tmp_path, monkeypatch):
    """The saved outputs, read before anything is measured, go into results.json beside a rerendered
    page's measurements, so that --rerender of it draws the same page."""
    monkeypatch.setattr(report, "measure_all", lambda *a: pytest.fail("measured despite --rerender"))
    monkeypatch.setattr(report, "plot", lambda result, out: out.mkdir(parents=True) or [])  # the text is what is checked
    files = {"decode": DECODE, "quality": QUALITY, "tp4": comm(4, False), "tp4g4": comm(4, True)}
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    saved = lambda name: str(tmp_path / f"{name}.json")
    flags = ["--latent-decode-json", saved("decode"), "--latent-comm-json", saved("tp4"), saved("tp4g4"),
             "--latent-quality-json", saved("quality")]
    report.main(["--rerender", str(DOCS / "results.json"), *flags, "--out", str(tmp_path / "page")])
    result = json.loads((tmp_path / "page" / "results.json").read_text())
    assert result["latent_heads"] == {"decode": DECODE, "comm": [files["tp4"], files["tp4g4"]], "quality": QUALITY}
    assert QUALITY["command"] in result["commands"]
    page = (tmp_path / "page" / "results.md").read_text()
    assert "## 9. Latent heads" in page and "- tp=4: payload 64.00 MiB" in page
    report.main(["--rerender", str(tmp_path / "page" / "results.json"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "results.md").read_text() == page

    other = comm(8, True) | {"model": "llama-1b"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    for args, needle in [
        (["--latent-comm-json", saved("decode")], f"--latent-comm-json {saved('decode')}: not the JSON this flag reads "
                                                  "(missing tp, by_kind, analytic_layer_forward_by_kind"),
        (["--latent-quality-json", saved("tp4")], f"--latent-quality-json {saved('tp4')}: not the JSON this flag reads "
                                                  "(missing latent_heads, command)"),
        (["--latent-decode-json", str(tmp_path / "none.json")], f"--latent-decode-json {tmp_path / 'none.json'}: cannot read"),
        (["--latent-comm-json", saved("tp4"), str(tmp_path / "other.json")],
         f"--latent-comm-json {tmp_path / 'other.json'}: model=llama-1b differs from {saved('tp4')}'s model=llama-7b"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            report.main(["--rerender", str(DOCS / "results.json"), *args, "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad" / "results.md").exists()

