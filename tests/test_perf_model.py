"""The work analysis of compiled programs, the performance model, and `bench paper` / `bench report`."""

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import pytest

from boost_jax.analysis.hlo import Collective
from boost_jax.analysis.perf_model import Work, collective_seconds, gemm_seconds, predict
from boost_jax.analysis.program import config_for
from boost_jax.analysis.work import Gemm, Traffic
from boost_jax.bench import page as results_page, paper, report
from boost_jax.config import ConfigError
from boost_jax.config.hardware import HARDWARE_FILE, load_hardware

SEQ = 40  # unlike every model dimension of llama-tiny, so attention matmuls are told apart by shape


@pytest.fixture(scope="module")
def a100():
    return load_hardware()["a100-80gb"]


TINY = ("model.n_kv_heads=8", "model.n_layers=4")


@pytest.fixture(scope="module")
def measured():
    """llama-tiny variants at TP=2, four layers, fp32, each compiled when a test first asks for it
    (the inner loop needs two of the three)."""
    return functools.cache(lambda variant: measure(variant, *TINY))


def measure(variant, *overrides, pp=1, microbatches=1, dtype="float32"):
    """`bench paper`'s measurement of llama-tiny at TP=2, 2 sequences per iteration."""
    arch, scheme = variant.split("/")
    cfg = config_for("llama-tiny", arch, scheme, tp=2, pp=pp, microbatches=microbatches, batch_size=2, seq=SEQ,
                     dtype=dtype, overrides=overrides)
    return paper.measure(cfg, variant)


@pytest.mark.parametrize("variant", ["dense/megatron", "cola/vanilla", "cola/btp"])
@pytest.mark.slow
def test_compiled_gemm_flops_equal_the_analytic_count(measured, variant):
    row, work, _ = measured(variant)
    assert row["layers_per_stage"] == 4
    assert row["gemm_flops_hlo"] == row["gemm_flops_analytic"] > 0
    attention = [g for g in work.gemms if g.attention]
    assert attention and all(g.in_loop for g in attention)
    # Full S x S matmuls, 7 of them (2 forward, 5 backward with the score recompute), against the causal count.
    heads = 8 if variant == "cola/vanilla" else 4  # vanilla replicates attention on every TP rank
    per_matmul = 2 * 2 * heads * SEQ * SEQ * 8
    assert row["attention_flops_hlo"] == 4 * 7 * per_matmul  # 4 layers
    assert row["attention_flops_analytic_causal"] == 4 * 3 * 2 * 8 * 8 * SEQ * (2 * SEQ) / 2  # 3 x 2 H dh s per token / TP


@pytest.mark.slow
def test_attention_in_query_blocks_is_priced_as_one_block(measured, a100):
    """Attention as a loop over query blocks (4 x 10 of the 40 positions; off GPU at s > 512 by
    default): the GEMM and attention FLOPs of one block, the score-shaped values still left out of
    the traffic, and the same predicted attention time."""
    row, work, _ = measure("cola/btp", *TINY, "model.attention_query_block=10")
    ref_row, ref_work, _ = measured("cola/btp")
    for key in ("gemm_flops_hlo", "attention_flops_hlo"):
        assert row[key] == ref_row[key], key
    attention = [g for g in work.gemms if g.attention]
    assert attention and all(10 in (g.m, g.n, g.k) and g.trip_count == 4 * 4 for g in attention)  # 4 layers x 4 blocks
    pred, ref = predict(work, a100), predict(ref_work, a100)
    assert pred["parts"]["attention"] == pytest.approx(ref["parts"]["attention"])
    assert pred["seconds"] == pytest.approx(ref["seconds"], rel=0.05)


def test_a_model_dimension_equal_to_the_sequence_is_not_taken_for_attention_scores():
    """llama-tiny at seq = d_model = 64: the residual's [.., 64, 64] values are memory traffic; only
    [.., 64, 64] values made under attention's name scope are its scores, left to the flash kernel
    (a shape-only rule once dropped the residual and MLP traffic of llama-3b and llama-7b at s=4096)."""
    import re

    import jax

    from boost_jax.analysis import work
    from boost_jax.analysis.hlo import op_name, parse_module
    from boost_jax.analysis.program import build, config_for

    prog = build(config_for("llama-tiny", "cola", "btp", tp=1, batch_size=2, seq=64, dtype="float32"))
    comps, _, _ = parse_module(jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).compile().as_text())
    square = [i for c in comps.values() for i in c.instrs.values() if re.search(r"\b64,64\]", i.shape)]
    scores = [i for i in square if work.ATTENTION_SCOPE.search(op_name(i.attrs))]
    others = [i for i in square if not work.ATTENTION_SCOPE.search(op_name(i.attrs))]
    assert scores and others
    blocks = work.attention_blocks(64, query_block=512)
    assert all(work._scaled_bytes(i, 4, blocks) is None for i in scores)
    assert all(work._scaled_bytes(i, 4, blocks) > 0 for i in others)


def test_causal_blocks_are_attention_priced_as_one_causal_kernel(a100):
    """Causal attention in 2 blocks of 128 queries (s = 256, one query block): every score and value
    matmul of its forward and backward is attention, and the model charges what it charges one
    masked S x S block (a flash kernel's causal half) although the blocks compute 3/4 of it."""
    import jax
    import jax.numpy as jnp

    from boost_jax.analysis.perf_model import attention_seconds
    from boost_jax.analysis.work import analyze
    from boost_jax.ops.attention import causal_attention

    q = jax.ShapeDtypeStruct((2, 256, 4, 16), jnp.float32)
    def whole(q, k, v):  # one masked S x S block, under the name scope the analysis reads
        with jax.named_scope("attention"):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    blocks = lambda q, k, v: causal_attention(q, k, v, impl="xla", query_block=512)
    work = {}
    for name, f in (("whole", whole), ("blocks", blocks)):
        text = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))).lower(q, q, q).compile().as_text()
        work[name] = analyze(text, seq=256, itemsize=4, query_block=512)[0]
    assert all(g.attention for g in work["whole"]) and {g.causal_share for g in work["whole"]} == {0.5}
    assert all(g.attention for g in work["blocks"]) and {g.causal_share for g in work["blocks"]} == {0.5, 0.75}
    flops = {name: sum(g.flops * g.trip_count for g in gemms) for name, gemms in work.items()}
    assert flops["blocks"] == 3 / 4 * flops["whole"]
    seconds = {name: sum(attention_seconds(g, a100) * g.trip_count for g in gemms) for name, gemms in work.items()}
    assert seconds["blocks"] == pytest.approx(seconds["whole"], rel=1e-12)


def _attention_work(*overrides: str) -> tuple[int, float, int]:
    """(attention dots, their causal-priced FLOPs, FLOPs of every dot) of llama-tiny's compiled
    loss and gradient (dense, 2 sequences, fp32, 8 query heads of 16), as the planner analyzes it."""
    import jax

    from boost_jax.analysis.memory_model import ANALYSIS_COMPILER_OPTIONS
    from boost_jax.analysis.program import build
    from boost_jax.analysis.work import analyze
    from boost_jax.config import from_args
    from boost_jax.parallel.context import query_group

    cfg = from_args(["model.preset=llama-tiny", "model.arch=dense", "model.n_heads=8", "model.d_model=128",
                     "parallel.dp=1", "train.batch_size=2", "model.dtype=float32", *overrides])  # later keys win
    prog = build(cfg)
    text = jax.jit(jax.value_and_grad(prog.loss)).lower(prog.params, prog.batch).compile(
        ANALYSIS_COMPILER_OPTIONS).as_text()
    gemms = analyze(text, seq=cfg.train.seq_len, itemsize=4, query_block=cfg.model.attention_query_block,
                    cp=cfg.parallel.cp, group=query_group(prog.plan, cfg.model))[0]
    attention = [g for g in gemms if g.attention]
    return (len(attention), sum(g.flops * g.trip_count * g.causal_share for g in attention),
            sum(g.flops * g.trip_count for g in gemms))


@pytest.mark.parametrize("layout, twice", [
    (("train.seq_len=256",), 1),  # causal blocks of 128 queries, 4 query heads per kv head folded into their rows
    pytest.param(("train.seq_len=1024", "model.attention_query_block=256"), 1, marks=pytest.mark.slow),  # the loop
    pytest.param(("train.seq_len=256", "parallel.tp=4"), 1, marks=pytest.mark.slow),  # kv heads replicated: 2 per device
    pytest.param(("train.seq_len=256", "parallel.tp=2", "parallel.cp=2"), 1, marks=pytest.mark.slow),  # over cp, kv split
    pytest.param(("train.seq_len=256", "parallel.tp=4", "parallel.cp=2"), 1, marks=pytest.mark.slow),  # cp's kv slice
    # 12 heads, 6 kv heads over tp = 4: GSPMD splits the kv heads 2 ways only and keeps each one's 2
    # query heads whole, so every device computes 6 heads' attention, twice its 3: priced as run.
    pytest.param(("train.seq_len=256", "parallel.tp=4", "model.n_heads=12", "model.d_model=192"), 2,
                 marks=pytest.mark.slow),
])
def test_grouped_query_attention_is_priced_as_its_heads(layout, twice):
    """GQA (a quarter or half as many kv heads as query heads) does the score and value matmuls of
    MHA over the same query heads, which XLA lays out with each kv head's query heads folded into
    the rows: the analysis finds every one of them (as many dots as MHA's) at MHA's causal FLOPs
    (`twice` that where the partitioner duplicates heads). Before the query group was passed in, a
    folded block went unrecognised (priced as a GEMM, whole-square) or matched another block's shape
    and causal share."""
    heads = next((int(o.split("=")[1]) for o in layout if o.startswith("model.n_heads=")), 8)
    gqa = _attention_work(*layout, f"model.n_kv_heads={heads // 2 if twice > 1 else 2}")
    mha = _attention_work(*layout, f"model.n_kv_heads={heads}")
    assert gqa[0] == mha[0] > 0
    assert gqa[1] == pytest.approx(twice * mha[1], rel=1e-12)


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_btp_moves_less_and_sends_a_residual_shard(measured):
    btp, vanilla = measured("cola/btp")[0], measured("cola/vanilla")[0]
    assert btp["layer_forward_bytes"] < vanilla["layer_forward_bytes"] / 3


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_pipeline_is_priced_as_compiled(measured, a100):
    """pp=2, M=2 on the same model: each device runs 2 of the 4 layers in M + S - 1 = 3 iterations of
    half the batch, so 3/4 of the unpipelined GEMM work in loops (bubbles computed like the rest), and
    the stage-to-stage permutes are priced as measured."""
    row, work, _ = measure("cola/btp", *TINY, pp=2, microbatches=2)
    plain = measured("cola/btp")[1]
    in_loops = lambda w: sum(g.flops * g.trip_count for g in w.gemms if g.in_loop)
    assert in_loops(work) * 4 == in_loops(plain) * 3
    assert row["pipeline"]["iterations"] == 3
    assert row["pipeline"]["p2p_bytes_per_iteration"] == row["pipeline"]["analytic_p2p_bytes_per_iteration"] == SEQ * 32 * 4
    permutes = [c for c in work.collectives if c.kind == "collective-permute"]
    pred = predict(work, a100)
    assert permutes and pred["parts"]["pipeline_p2p"] == pytest.approx(
        sum(collective_seconds(c, a100) * c.trip_count for c in permutes))
    assert sum(pred["parts"].values()) == pytest.approx(pred["seconds"])


@pytest.mark.slow
def test_traffic_scales_with_layers_not_with_their_square():
    """Stacked weights and saved activations are read and written a slice per layer, not whole."""
    per_layer = []
    for layers in (2, 6):
        row, work, _ = measure("cola/btp", f"model.n_layers={layers}", dtype="bfloat16")
        per_layer.append(sum(t.bytes * t.trip_count for t in work.traffic if t.in_loop) / layers)
    assert per_layer[1] == pytest.approx(per_layer[0], rel=0.05)


def test_gemm_time_has_waves_and_a_memory_roof(a100):
    tm, tn = a100.gemm_tile
    assert a100.sms == 12 * 9
    full = Gemm(1, 12 * tm, 9 * tn, 8192, 1, True, False)  # exactly one wave of output tiles, compute-bound
    one_more = dataclasses.replace(full, m=13 * tm)  # 117 tiles: two waves, 13/12 of the work
    assert gemm_seconds(one_more, a100, 2) - a100.kernel_overhead_s == pytest.approx(
        2 * (gemm_seconds(full, a100, 2) - a100.kernel_overhead_s))
    thin = Gemm(1, 8192, 8192, 1, 1, True, False)  # k=1: pure memory traffic
    assert gemm_seconds(thin, a100, 2) == pytest.approx(
        2 * (2 * 8192 + 8192 * 8192) / (a100.hbm_bytes_per_s * a100.memory_efficiency) + a100.kernel_overhead_s)


def test_ring_collective_times(a100):
    col = lambda kind, size, nbytes: Collective(kind, "bf16", (1,), nbytes, "", size, "c", 1, 1, None)
    bw = a100.node_link_bytes_per_s * a100.collective_efficiency
    assert collective_seconds(col("all-reduce", 4, 10**9), a100) == pytest.approx(a100.collective_latency_s + 1.5e9 / bw)
    assert collective_seconds(col("all-gather", 4, 10**9), a100) == pytest.approx(a100.collective_latency_s + 0.75e9 / bw)
    # A group wider than a node crosses the network.
    wide = collective_seconds(col("all-reduce", 8, 10**9), a100)
    assert wide == pytest.approx(a100.collective_latency_s + 1.75e9 / (a100.net_bytes_per_s * a100.collective_efficiency))


def test_predict_adds_up_its_parts(a100):
    layer = Gemm(1, 4096, 4096, 4096, 3, True, False)
    head = Gemm(1, 4096, 32000, 4096, 1, False, False)
    send = Collective("collective-permute", "bf16", (4096, 4096), 4096 * 4096 * 2, "{{0,4},{4,0}}", 2, "c", 1, 3, None)
    one = predict(Work([layer, head], [Traffic(10**8, 3, True)], [send], 2, 10**6), a100)
    assert one["seconds"] == pytest.approx(one["loop_s"] + one["edge_s"] + one["parts"]["optimizer"])
    assert one["parts"]["pipeline_p2p"] == pytest.approx(3 * collective_seconds(send, a100))
    assert sum(one["parts"].values()) == pytest.approx(one["seconds"])


def test_overlap_hides_backward_tp_collectives_up_to_the_weight_gradient_gemms(a100):
    """perf_model's overlap: the layers' backward all-reduces hide behind a third of the layers' GEMM
    time (dW), never more than themselves; forward and edge collectives stay exposed."""
    layer = Gemm(1, 4096, 4096, 4096, 3, True, False)
    ar = lambda shape, backward, depth: Collective("all-reduce", "bf16", shape, math.prod(shape) * 2, "{{0,1,2,3}}", 4,
                                                   "c", depth, 3 if depth else 1, None, backward=backward)
    for shape in ((4096, 4096), (64, 64)):  # more than dW can hide, and less
        cols = [ar(shape, True, 1), ar(shape, False, 1), ar(shape, True, 0)]
        work = Work([layer], [], cols, 2, 10**6)
        plain, hidden = predict(work, a100), predict(work, a100, overlap=True)
        backward_tp = 3 * collective_seconds(cols[0], a100)
        want = min(backward_tp, 3 * gemm_seconds(layer, a100, 2) / 3)
        assert plain["overlap_hidden_s"] == 0 < want and hidden["overlap_hidden_s"] == pytest.approx(want)
        assert hidden["seconds"] == pytest.approx(plain["seconds"] - want)


def test_the_authors_protocol_runs_their_configs_and_prices_the_iteration():
    """`bench paper --protocol authors`: 7B at micro-batch 1 x 4 accumulation steps, tied, their norm;
    1B at 2 x 16 with the sync norm; 13B (no config of theirs: 7B's) as one pipelined program of its 4
    micro-batches. An iteration is every micro-batch and one optimizer step; ours is per micro-batch."""
    seven = paper.row_config("llama-7b", "cola/btp", protocol="authors")
    assert (seven.train.batch_size, seven.train.microbatches, seven.model.tie_embeddings, seven.model.norm) == (1, 1, True, "online")
    assert paper.row_config("llama-7b", "cola/vanilla", protocol="authors").model.norm == "online"  # the default: untouched
    one = paper.row_config("llama-1b", "cola/btp", protocol="authors")
    assert (one.train.batch_size, one.model.norm, paper.runs_per_iteration("llama-1b", "authors")) == (2, "sync", 16)
    thirteen = paper.row_config("llama-13b", "dense/megatron", protocol="authors")
    assert (thirteen.train.batch_size, thirteen.train.microbatches, thirteen.parallel.pp) == (4, 4, 2)
    assert paper.runs_per_iteration("llama-13b", "authors") == paper.runs_per_iteration("llama-7b", "micro") == 1
    pred = {"seconds": 1.0, "with_overlap_s": 0.8, "parts": {"optimizer": 0.1}}
    row = lambda protocol, runs, m: {"protocol": protocol, "runs_per_iteration": runs, "microbatches": m, "predicted": {"x": pred}}
    assert paper.model_seconds(row("authors", 4, 1), "x") == pytest.approx(4 * 0.9 + 0.1)
    assert paper.model_seconds(row("authors", 4, 1), "x", overlap=True) == pytest.approx(4 * 0.7 + 0.1)
    assert paper.model_seconds(row("micro", 1, 2), "x") == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"--protocol: unknown 'theirs'"):
        paper.row_config("llama-7b", "cola/btp", protocol="theirs")


def test_permutes_cross_the_network_only_between_nodes(a100):
    assert a100.gpus_per_node == 4
    send = lambda pairs: Collective("collective-permute", "bf16", (1,), 10**9, pairs, 2, "c", 1, 1, None)
    inside, across = collective_seconds(send("{{0,1},{1,0}}"), a100), collective_seconds(send("{{0,4},{4,0}}"), a100)
    assert inside == pytest.approx(a100.p2p_latency_s + 1e9 / (a100.peer_link_bytes_per_s * a100.collective_efficiency))
    assert across == pytest.approx(a100.p2p_latency_s + 1e9 / (a100.net_bytes_per_s * a100.collective_efficiency))


def test_a_pair_in_a_directly_wired_node_has_its_peer_links_only():
    """Perlmutter's A100s are wired each to each (4 of 12 NVLink3 links per pair, no NVSwitch): a
    2-GPU all-reduce moves its bytes at a third of a 4-GPU one's bandwidth; through an NVSwitch
    (H100) any group has the whole node link; a 2-wide group over pp ({0,4}) spans nodes."""
    hw = load_hardware()
    a100, h100 = hw["a100-80gb"], hw["h100-80gb"]
    assert 3 * a100.peer_link_bytes_per_s == a100.node_link_bytes_per_s and h100.peer_link_bytes_per_s == h100.node_link_bytes_per_s
    reduce = lambda groups, size: Collective("all-reduce", "bf16", (1,), 10**9, groups, size, "c", 1, 1, None)
    bandwidth = lambda c, gpu: 2 * (c.group_size - 1) / c.group_size * c.bytes / (collective_seconds(c, gpu) - gpu.collective_latency_s)
    pair, four = reduce("{{0,1},{2,3}}", 2), reduce("{{0,1,2,3}}", 4)
    assert bandwidth(pair, a100) == pytest.approx(bandwidth(four, a100) / 3) == pytest.approx(a100.peer_link_bytes_per_s * a100.collective_efficiency)
    assert bandwidth(pair, h100) == pytest.approx(bandwidth(four, h100)) == pytest.approx(h100.node_link_bytes_per_s * h100.collective_efficiency)
    assert bandwidth(reduce("{{0,4},{1,5}}", 2), a100) == pytest.approx(a100.net_bytes_per_s * a100.collective_efficiency)


def test_shipped_hardware_file_and_its_errors(tmp_path):
    hw = load_hardware()
    assert {"a100-80gb", "h100-80gb", "h200-141gb"} <= set(hw)
    assert hw["a100-80gb"].peak_flops == 312e12 and hw["h200-141gb"].hbm_bytes == 141e9
    text = HARDWARE_FILE.read_text()
    bad = tmp_path / "hw.yaml"
    for broken, message in [(text.replace("  sms: 108\n", ""), "a100-80gb: missing sms"),
                            (text.replace("  sms: 108\n", "  sms: 108\n  smz: 1\n"), "unknown smz"),
                            (text.replace("peak_flops: 312.0e+12", "peak_flops: 312.0e12"), "a100-80gb.peak_flops must be a positive number")]:
        bad.write_text(broken)
        with pytest.raises(ConfigError, match=message):
            load_hardware(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_hardware(tmp_path / "missing.yaml")


SHIPPED = Path(__file__).parents[1] / "docs" / "results.json"
TRIO = ["dense/megatron", "cola/vanilla", "cola/btp"]


def _shipped_1b(tmp_path) -> tuple[dict, Path, Path]:
    """The shipped results, and their llama-1b rows of `bench paper` and `bench planner` saved as
    --paper-json and --planner-json read them."""
    shipped = json.loads(SHIPPED.read_text())
    paper_json, planner_json = tmp_path / "paper.json", tmp_path / "planner.json"
    for path, key in ((paper_json, "paper"), (planner_json, "planner")):
        path.write_text(json.dumps({**shipped[key], "rows": [r for r in shipped[key]["rows"] if r["model"] == "llama-1b"
                                                             and r.get("variant", "cola/btp") in TRIO]}))
    return shipped, paper_json, planner_json


@pytest.mark.slow  # a page, four plots and a rerender (~4 s of CPU)
def test_report_writes_page_plots_and_json(tmp_path, monkeypatch):
    """`bench report` end to end on the paper's 1B row: the paper's and planner's rows from saved runs
    (measured by the two tests below), the timed sections' fresh processes answered with the shipped
    measurements (a section itself: test_report_times_and_profiles_a_section), asked for
    llama-tiny as the flags say; the page, plots and JSON, and the page a pure function of the JSON."""
    shipped, paper_json, planner_json = _shipped_1b(tmp_path)
    profiles = {f"{arch}/{scheme}/tp{tp}": p for (arch, scheme, tp), p in zip(report.PROFILED, shipped["profile"])}
    asked = {}

    def shipped_section(section, *args):
        asked[section] = args
        tp = {"compare_section": 4, "single_device_section": 1}.get(section)
        sections = {"compare_section": shipped["step_compare"], "single_device_section": shipped["single_device"],
                    "measure_decode": shipped["decode"]}
        answer = sections[section] if tp is None else (sections[section], {k: p for k, p in profiles.items()
                                                                          if k.endswith(f"/tp{tp}")})
        return json.loads(json.dumps(answer))

    monkeypatch.setattr(report, "in_fresh_process", shipped_section)
    report.main(["--models", "llama-1b", "--variants", ",".join(TRIO), "--hardware", "a100-80gb",
                 "--paper-json", str(paper_json), "--planner-json", str(planner_json),
                 "--step-model", "llama-tiny", "--step-seq", "32", "--single-models", "llama-tiny", "--decode-model", "llama-tiny",
                 "--reps", "2", "--steps", "1", "--out", str(tmp_path)])
    tiny = lambda arch, tp: report.step_args("llama-tiny", arch, tp, 4, 32)
    assert asked["compare_section"][:4] == (tiny("cola", 4), 2, 1, "llama-tiny")
    assert asked["single_device_section"][:4] == ([tiny("dense", 1), tiny("cola", 1)], 2, 1, "llama-tiny")
    assert asked["measure_decode"] == ("llama-tiny", 2)
    page = (tmp_path / "results.md").read_text()
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["paper"]["rows"]
    assert [(r["protocol"], r["variant"]) for r in rows] == [(p, v) for p in paper.PROTOCOLS for v in TRIO]
    assert "### Which reading fits the paper" in page and "| llama-1b | cola/btp | 0.59 |" in page
    dense = rows[0]["predicted"]["a100-80gb"]["seconds"]
    assert f"| llama-1b | 1,1,1 | {dense:.2f} / 0.85" in page
    assert result["step_compare"] == shipped["step_compare"] and result["decode"] == shipped["decode"]
    assert [(r["arch"], r["tp"]) for r in result["profile"]] == [("cola", 1), ("dense", 1), ("cola", 4), ("dense", 4)]
    assert all(r["categories"]["gemm"] > 0 for r in result["profile"]) and "### Where the step time goes" in page
    for png in ("paper_vs_model.png", "layer_comm.png", "cpu_measured.png", "decode.png"):
        data = (tmp_path / "img" / png).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 10_000
        assert f"(img/{png})" in page
    (plan,) = result["planner"]["rows"]
    assert plan["model"] == "llama-1b" and "## 3. The planner on the paper's rows" in page
    assert "| llama-1b | 1 | 4 x 4096 |" in page and f"| {plan['seconds_to_plan']:.0f} s |" in page
    assert "## 5. Decoding on this machine" in page
    # The page is a pure function of the saved measurements.
    report.main(["--rerender", str(tmp_path / "results.json"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "results.md").read_text() == page


@pytest.mark.slow  # six compiles of llama-1b's train step on CPU (~22 s of CPU)
def test_bench_paper_measures_the_1b_row(capsys):
    """`bench paper` on the 1B row as `bench report` runs it: each protocol's trio compiled, its GEMM
    FLOPs as counted, priced, and the memory model (a GPU's bf16) under the CPU compile's peak."""
    paper.main(["--models", "llama-1b", "--variants", ",".join(TRIO), "--hardware", "a100-80gb", "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["protocol"], r["variant"]) for r in rows] == [(p, v) for p in paper.PROTOCOLS for v in TRIO]
    assert all(r["gemm_flops_hlo"] == r["gemm_flops_analytic"] for r in rows)
    assert math.isfinite(rows[2]["predicted"]["a100-80gb"]["gemm_utilization"])
    assert 0 < rows[2]["memory_model_bytes"] < rows[2]["peak_bytes"] + rows[2]["adamw_bytes"]  # GPU bf16 < CPU's


@pytest.mark.slow  # the planner on llama-1b, a cold cache (~20 s of CPU)
def test_bench_planner_plans_the_1b_row(tmp_path, monkeypatch):
    """`bench planner` on the 1B row as `bench report` runs it: its choice no slower than the paper's
    layout, timed from a cold cache, and the page's row."""
    from boost_jax.bench import planner

    monkeypatch.setenv("BOOST_JAX_CACHE", str(tmp_path / "cache"))  # the planner's compiles
    result = planner.run(["llama-1b"], planner.paper_hardware(), log=lambda s: None)
    (plan,) = result["rows"]
    assert plan["model"] == "llama-1b" and plan["choice"]["step_s"] <= plan["paper_layout"]["step_s"]
    assert result["settings"]["cold_cache"] and plan["seconds_to_plan"] > 0
    assert planner.table(result)[2].startswith("| llama-1b | 1 | 4 x 4096 |")


@pytest.mark.slow  # two llama-tiny steps compiled, timed and profiled
def test_report_times_and_profiles_a_section(tmp_path, monkeypatch):
    """A timed section of `bench report` (what its fresh process runs for the single device): the
    steps beside the matmul peak measured in the same run, under the name results.json keeps, and
    the profiles of the runners just timed (none compiled again), keyed as the page reads them."""
    from boost_jax.bench import step
    from boost_jax.bench.step import Runner
    from boost_jax.launch.peaks import measure_matmul_peak

    # The same probe at a size that takes milliseconds, not the 2 x 10 2048^3 matmuls of the benchmark.
    monkeypatch.setattr(step, "measure_matmul_peak", lambda dtype: measure_matmul_peak(dtype, n=256, reps=2))
    runners = [Runner(config_for("llama-tiny", arch, scheme, tp=1, batch_size=2, seq=32, dtype="float32",
                                 overrides=["log.health=false"]))
               for arch, scheme in (("dense", "megatron"), ("cola", "btp"))]
    sd = report.single_device(runners, 2, 1)
    assert sd["matmul_peak_flops"] > 0 and (sd["batch"], sd["seq"]) == (2, 32)
    assert [0 < r["fraction_of_matmul_peak"] < 2 and "fraction_of_peak" not in r for r in sd["rows"]] == [True, True]
    monkeypatch.setattr(report, "Runner", lambda cfg: pytest.fail(f"{cfg.model.arch} compiled again"))
    profiles = report.profiles(runners, "llama-tiny", 1, tmp_path)
    assert sorted(profiles) == ["cola/btp/tp1", "dense/megatron/tp1"]
    assert all(p["categories"]["gemm"] > 0 for p in profiles.values())


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_the_shipped_page_is_rendered_from_the_shipped_measurements(tmp_path):
    """docs/results.md is `bench report --rerender docs/results.json`, byte for byte, with the same plots:
    an edit to the page's code that changes what it says shows here, not on the next full measurement."""
    docs = Path(__file__).parents[1] / "docs"
    report.main(["--rerender", str(docs / "results.json"), "--out", str(tmp_path)])
    assert (tmp_path / "results.md").read_text() == (docs / "results.md").read_text()
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == sorted(p.name for p in (docs / "img").iterdir())


def test_the_results_page_template_is_all_rendered_and_has_no_holes():
    """bench/results_page.md holds no part that bench/report.py and its sections' modules never render; a table
    fills its own lines (an empty one none), and a slot left unfilled or a part the template lacks is a KeyError,
    not a page with a hole."""
    source = "".join(p.read_text() for p in Path(results_page.__file__).parent.glob("*.py"))
    assert set(results_page.parts()) == set(re.findall(r'(?:render|phrase)\("(\w+)"', source))
    lines = results_page.render("fit", hw="a100-80gb", table=["| a |", "|---|"])
    assert lines[0] == "### Which reading fits the paper (a100-80gb, model / paper)" and lines[4:] == ["| a |", "|---|", ""]
    assert results_page.render("fit", hw="a100-80gb", table=[]) == lines[:4] + [""]
    for part, slots, missing in [("fit", {"table": []}, "hw"), ("fit", {"hw": "a100-80gb"}, "table"), ("nope", {}, "nope")]:
        with pytest.raises(KeyError, match=missing):
            results_page.render(part, **slots)


def test_report_refuses_a_bad_saved_input_before_measuring(tmp_path, monkeypatch):
    """--rerender / --paper-json / --planner-json: a missing, damaged or foreign file is one ConfigError
    naming the flag and the file, raised before any section is measured or a page is written."""
    monkeypatch.setattr(report, "measure_all", lambda *a: pytest.fail("measured despite a bad saved input"))
    (tmp_path / "damaged.json").write_text('{"rows": [')
    (tmp_path / "paper.json").write_text(json.dumps({"settings": {}, "hardware": {}, "rows": []}))
    (tmp_path / "rows.json").write_text(json.dumps({"rows": []}))
    out = tmp_path / "out"
    for args, needle in [
        (["--rerender", str(tmp_path / "missing.json")], "--rerender " + str(tmp_path / "missing.json") + ": cannot read"),
        (["--paper-json", str(tmp_path / "damaged.json")], "--paper-json " + str(tmp_path / "damaged.json") + ": cannot read"),
        (["--paper-json", str(tmp_path / "paper.json"), "--planner-json", str(tmp_path / "rows.json")],
         "--planner-json " + str(tmp_path / "rows.json") + ": not the JSON this flag reads (missing settings)"),
        (["--rerender", str(tmp_path / "paper.json")], "(missing machine, commands, paper, planner, step_compare, single_device, profile)"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            report.main([*args, "--out", str(out)])
    assert not out.exists()


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_step_reports_its_fraction_of_the_measured_matmul_peak(monkeypatch):
    from boost_jax.analysis.program import config_for
    from boost_jax.bench import step
    from boost_jax.bench.step import Runner, measure_with_peak
    from boost_jax.launch.peaks import measure_matmul_peak

    # The same probe at a size that takes milliseconds, not the 2 x 10 2048^3 matmuls of the benchmark.
    monkeypatch.setattr(step, "measure_matmul_peak", lambda dtype: measure_matmul_peak(dtype, n=256, reps=2))

    cfg = config_for("llama-tiny", "cola", tp=1, batch_size=2, seq=32, dtype="float32")
    (row,), peak = measure_with_peak([Runner(cfg)], 1, 1)
    assert peak > 0 and row["fraction_of_peak"] == row["model_flops_per_s"] / peak  # CPU: the host's peak
    assert 0 < row["fraction_of_peak"] < 2
    assert "mfu" not in row  # a CPU has no datasheet peak
