"""The results page's section 10 (decoupled RoPE, bench/absorbed_section.py): rendered from small saved
bench outputs with the numbers they hold, kept in results.json for --rerender, and a wrong file refused by name."""

import json
import re
from pathlib import Path

import pytest

from boost_jax.bench import absorbed_section, report
from boost_jax.config import ConfigError
from boost_jax.runtime.units import MIB

DOCS = Path(__file__).parents[1] / "docs"


def decode_run(tp: int, dr: int) -> dict:
    """A `bench decode --vary` run of tp devices and d_r rotary dims, tokens/s made up so that each cell is its own."""
    rows = []
    for cache, per_token, floor in (("full", 4096 // tp, 2.0), ("latent", (1024 + 16 * dr) // tp, 3.0 if dr else 9.0)):
        for b in (1, 32):
            rows.append({"cache": cache, "batch": b, "cache_bytes_per_token_per_device": per_token,
                         "step_over_floor": floor + b / 32, "decode_tokens_per_s": 100.0 * tp + b + (dr if cache == "latent" else 0)})
    return {"variant": f"model.attn_rope_dims={dr}", "model": "llama-tiny", "arch": "cola",
            "dtype": "float32", "tp": tp, "attn_latent_heads": 4, "prompt_len": 512, "new_tokens": 64, "rows": rows}


# One `bench decode parallel.tp=T --vary model.attn_rope_dims=0,16` per tp, each with its own measured bandwidth.
DECODE = [{"device": "cpu", "read_bandwidth_bytes_per_s": 3e10 * tp, "runs": [decode_run(tp, dr) for dr in (0, 16)]}
          for tp in (1, 4)]


def gpu(cache: str, batch: int, step_mib: float) -> dict:
    """A `compile --only prefill,decode --json` whose decode step moves `step_mib` MiB: a quarter through GEMMs."""
    work = {"flops": 2e9 * batch, "gemm_read_bytes": step_mib * MIB / 4, "memory_bound_bytes": step_mib * MIB * 3 / 4}
    return {"hardware": "h100-80gb", "devices": 8, "mesh": {"tp": 8}, "model": "llama-7b", "n_layers": 4, "arch": "cola",
            "dtype": "bfloat16", "cache": cache, "attn_latent_heads": 8, "attn_rope_dims": 64, "batch": batch, "seq": 4096,
            "programs": [{"name": "prefill"}, {"name": "decode", "step_work": work}]}


QUALITY = {"command": "python -m boost_jax.bench quality --tokens 4096 --eval-tokens 2048 --seeds 3 --vary model.attn_rope_dims=0,16",
           "rope_dims": {"key": "model.attn_rope_dims", "tokens": 4096, "steps": 10, "eval_tokens": 2048,
                         "evaluated_tokens": 1024, "rows": [
               {"attn_rope_dims": dr, "params": 3.35e6 + 100 * dr, "seed_losses": [5.0 + d + dr / 1000 for d in (0.0, 0.02, 0.01)],
                "mean_loss": 5.01 + dr / 1000, "spread": 0.02, "minutes": 1.0} for dr in (0, 16)]}}


def test_section_10_shows_each_saved_outputs_numbers():
    lines = absorbed_section.absorbed_section({"decode": DECODE, "gpu": [gpu("full", 32, 100), gpu("latent", 32, 35)],
                                               "quality": QUALITY})
    page = "\n".join(lines)
    assert lines[0] == "## 10. Decoupled RoPE: decoding on the latents"
    assert ("- `python -m boost_jax.bench decode model.preset=llama-tiny model.arch=cola model.dtype=float32 "
            "model.attn_latent_heads=4 parallel.tp=4 --vary model.attn_rope_dims=0,16 --caches full,latent "
            "--batches 1,32 --prompt-len 512 --new-tokens 64 --json`") in lines
    assert "read bandwidth 30.0 and 120.0 GB/s" in page
    # (a) per (cache, d_r, batch), each tp's bytes per token per device, tokens/s, step over floor
    assert "| latent, absorbed | 16 | 32 | 1,280 | 148.0 | 4.0 | 320 | 448.0 | 4.0 |" in lines
    assert "| latent, keys rebuilt | 0 | 32 | 1,024 | 132.0 | 10.0 | 256 | 432.0 | 10.0 |" in lines
    assert (f"- tp=4, batch 32: absorbed **{448 / 432:.2f}x** the plain model's full cache's tokens/s "
            f"({448 / 432:.2f}x its own model's full cache; the rebuilding latent cache 1.00x), at 320 bytes per token "
            "per device against 1,024; a step 4.0x its read floor against the full cache's 3.0x (rebuilt: 10.0x).") in lines
    # (b) per batch and cache, the step's work and its bytes over the full cache's
    assert "| 32 | latent | 64.0 | 8.8 | 26.2 | 35.0 | 0.35 |" in lines and "| 32 | full | 64.0 | 25.0 | 75.0 | 100.0 | 1.00 |" in lines
    assert "model.preset=llama-7b model.n_layers=4 model.arch=cola" in page and "llama-7b cola with 4 layers" in page
    assert "--cache CACHE --json`, B and CACHE as the rows say" in page
    # (c) the seeds' table and the paired difference with its t-interval (differences all 0.016: no width)
    assert "| 16 | 3.35M | 5.0160 / 5.0360 / 5.0260 | 5.0260 | 0.0200 | 1.0 |" in lines
    assert "d_r = 16: +0.0160 (95% interval +0.0160 to +0.0160; each seed's spread up to 0.0200)" in page
    assert "seeds 0, 1 and 2" in page and not re.search(r"\$\w", page)  # every slot filled


def test_a_tp_measured_over_other_batches_in_files_of_its_own_fills_its_cells_and_dashes_the_rest():
    """tp=1 at batches 1 and 32 in one file and at 8 in another; tp=4 at 1 and 32 only: each row from
    the file that measured it, a dash where a tp has no run, the targets at each tp's largest batch."""
    eight = {"device": "cpu", "read_bandwidth_bytes_per_s": 2e10, "runs": [
        {**decode_run(1, dr), "rows": [{**row, "batch": 8, "decode_tokens_per_s": row["decode_tokens_per_s"] + 0.5}
                                       for row in decode_run(1, dr)["rows"] if row["batch"] == 1]} for dr in (0, 16)]}
    runs = absorbed_section._runs([*DECODE, eight])  # noqa: SLF001
    table = absorbed_section.decode_table(runs)
    assert [line.split(" | ")[2] for line in table[2:6]] == ["1", "8", "32", "1"]  # every batch, then the next kind
    assert "| full | 0 | 8 | 4,096 | 101.5 | 2.0 | - | - | - |" in table  # from the second file
    assert "| full | 0 | 32 | 4,096 | 132.0 | 3.0 | 1,024 | 432.0 | 3.0 |" in table
    assert [t.split(":")[0] for t in absorbed_section.decode_targets(runs)] == ["- tp=1, batch 32", "- tp=4, batch 32"]


def test_report_keeps_section_10_in_results_json_and_refuses_a_wrong_file_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "measure_all", lambda *a: pytest.fail("measured despite --rerender"))
    monkeypatch.setattr(report, "plot", lambda result, out: out.mkdir(parents=True) or [])  # the text is what is checked
    files = {"tp1": DECODE[0], "tp4": DECODE[1], "quality": QUALITY, "full": gpu("full", 1, 10), "latent": gpu("latent", 1, 8)}
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    saved = lambda name: str(tmp_path / f"{name}.json")
    flags = ["--absorbed-decode-json", saved("tp1"), saved("tp4"), "--absorbed-gpu-json", saved("full"), saved("latent"),
             "--absorbed-quality-json", saved("quality")]
    report.main(["--rerender", str(DOCS / "results.json"), *flags, "--out", str(tmp_path / "page")])
    result = json.loads((tmp_path / "page" / "results.json").read_text())
    assert result["absorbed"] == {"decode": DECODE, "gpu": [files["full"], files["latent"]], "quality": QUALITY}
    assert QUALITY["command"] in result["commands"]
    page = (tmp_path / "page" / "results.md").read_text()
    assert "## 10. Decoupled RoPE" in page and "| 1 | latent | 2.0 | 2.0 | 6.0 | 8.0 | 0.80 |" in page
    report.main(["--rerender", str(tmp_path / "page" / "results.json"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "results.md").read_text() == page
    # A part given again replaces its commands in the page's list too: the 4-layer compile's leaves with it.
    (tmp_path / "deep.json").write_text(json.dumps(gpu("full", 1, 10) | {"n_layers": 32}))
    report.main(["--rerender", str(tmp_path / "page" / "results.json"), "--absorbed-gpu-json", saved("deep"),
                 "--out", str(tmp_path / "deeper")])
    compiles = [c for c in json.loads((tmp_path / "deeper" / "results.json").read_text())["commands"]
                if c.startswith("python -m boost_jax.compile model.preset=llama-7b")]
    assert [re.search(r"n_layers=(\d+)", c)[1] for c in compiles] == ["32"], compiles

    (tmp_path / "other.json").write_text(json.dumps(gpu("latent", 1, 8) | {"attn_rope_dims": 32}))
    (tmp_path / "no_decode.json").write_text(json.dumps(gpu("latent", 1, 8) | {"programs": [{"name": "prefill"}]}))
    for args, needle in [
        (["--absorbed-quality-json", saved("tp1")], f"--absorbed-quality-json {saved('tp1')}: not the JSON this "
                                                       "flag reads (missing rope_dims, command)"),
        (["--absorbed-gpu-json", saved("full"), saved("other")],
         f"--absorbed-gpu-json {saved('other')}: attn_rope_dims=32 differs from {saved('full')}'s attn_rope_dims=64"),
        (["--absorbed-gpu-json", saved("no_decode")], f"--absorbed-gpu-json {saved('no_decode')}: no decode program's step_work"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            report.main(["--rerender", str(DOCS / "results.json"), *args, "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad" / "results.md").exists()
