"""Context parallelism (parallel/context.py): the sequence split over cp is the single-device model
(fp32 loss and gradients) under every attention variant and composed with tp, fsdp, pp,
accumulation, remat and document masking; its collectives on the HLO are the analytic ones; a run
tracks one device, across resumes onto other cp; bad layouts are refused by name."""

import functools
import json

import jax
import numpy as np
import pytest

from boost_jax.analysis.comm import measure
from boost_jax.analysis.program import build
from boost_jax.config import ConfigError, load_config
from boost_jax.data.loader import segment_ids
from boost_jax.model.weights import init_params
from boost_jax.parallel.context import balance, balanced_order
from boost_jax.training.run import train

BASE = ["model.preset=llama-tiny", "train.batch_size=4", "train.seq_len=32", "parallel.dp=1"]


def loss_and_grads(arch: str, *overrides: str):
    cfg = load_config(None, [*BASE, f"model.arch={arch}", *overrides])
    prog = build(cfg)
    params = jax.device_put(init_params(cfg), jax.tree.map(lambda p: p.sharding, prog.params))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if cfg.data.document_mask:  # a document ends at every token = 0 mod 5: several per row, across the chunks
        batch["segment_ids"] = segment_ids(batch["inputs"] % 5, 0)
    batch = jax.device_put(batch, prog.batch["inputs"].sharding)
    return jax.device_get(jax.jit(jax.value_and_grad(prog.loss))(params, batch))


@functools.cache
def one_device(arch: str, *data: str):
    return loss_and_grads(arch, *data)


def assert_equal_to_one_device(arch: str, *overrides: str):
    value, grads = loss_and_grads(arch, *overrides)
    ref_value, ref_grads = one_device(arch, *(o for o in overrides if o.startswith(("data.", "model."))))
    assert value == pytest.approx(ref_value, rel=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(g - r).max() <= 1e-5 * np.abs(r).max(), (np.abs(g - r).max(), np.abs(r).max())


VARIANTS = ("gather", "ring", "latent")  # the inner tier: gather with tp; ring and latent in the slow tier


@pytest.mark.parametrize("attention", [a if a == "gather" else pytest.param(a, marks=pytest.mark.slow) for a in VARIANTS])
def test_each_attention_variant_with_tp_equals_one_device(attention):
    assert_equal_to_one_device("cola", "parallel.cp=2", "parallel.tp=2", f"parallel.cp_attention={attention}")


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
@pytest.mark.parametrize("attention", [pytest.param("gather", marks=pytest.mark.slow), "latent",
                                       pytest.param("ring", marks=pytest.mark.slow)])
def test_latent_heads_with_cp_and_tp_equal_one_device(attention):
    """Latent heads under btp (each tp rank its own groups of the k/v latents) composed with cp; the
    latent variant gathers each rank's own groups over cp and rebuilds its own kv heads from them."""
    assert_equal_to_one_device("cola", "model.attn_latent_heads=2", "parallel.cp=2", "parallel.tp=2",
                               f"parallel.cp_attention={attention}", "train.remat=lowrank")


# cp = 2 and 4 alone and with tp 2 (btp and megatron), fsdp 2, pp 2 with micro-batches, gradient
# accumulation, every remat mode, document masks, chunked loss, GQA's replicated kv heads (tp 4 > 2
# kv heads), and the vanilla scheme's rank-split latents.
GRID = [
    ("cola", "parallel.cp=2"),
    *(("cola", "parallel.cp=4", f"parallel.cp_attention={a}") for a in VARIANTS),
    ("dense", "parallel.cp=2", "parallel.tp=2", "parallel.scheme=megatron"),
    ("dense", "parallel.cp=4", "parallel.tp=2", "parallel.scheme=megatron", "parallel.cp_attention=ring"),
    ("svd", "parallel.cp=2", "parallel.fsdp=2", "parallel.tp=2"),
    ("cola", "parallel.cp=4", "parallel.fsdp=2", "parallel.cp_attention=latent"),
    ("lax", "parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "train.microbatches=2", "parallel.cp_attention=ring"),
    ("cola", "parallel.cp=2", "parallel.pp=2", "train.microbatches=2", "parallel.cp_attention=latent"),
    ("cola", "parallel.cp=2", "parallel.dp=2", "train.microbatches=2"),
    ("lax", "parallel.cp=2", "parallel.tp=2", "train.remat=lowrank", "parallel.cp_attention=latent"),
    ("cola", "parallel.cp=2", "parallel.tp=2", "train.remat=full", "parallel.cp_attention=ring"),
    *(("cola", "parallel.cp=2", "parallel.tp=2", "data.document_mask=true", f"parallel.cp_attention={a}")
      for a in VARIANTS),
    ("cola", "parallel.cp=2", "parallel.tp=2", "train.loss_chunk=8"),
    *(("cola", "parallel.cp=2", "parallel.tp=4", f"parallel.cp_attention={a}") for a in VARIANTS),
    ("cola", "parallel.cp=2", "parallel.tp=2", "parallel.scheme=vanilla", "parallel.cp_attention=latent"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join([c[0], *(o.split(".")[-1] for o in c[1:])]))
def test_grid_equals_one_device(case):
    assert_equal_to_one_device(*case)


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
@pytest.mark.parametrize("attention", [pytest.param("gather", marks=pytest.mark.slow), "latent",
                                       pytest.param("ring", marks=pytest.mark.slow)])
def test_decoupled_rope_with_cp_and_tp_equals_one_device(attention):
    """model.attn_rope_dims: the rotary keys gathered with the latents (latent) or inside k (gather, ring)."""
    assert_equal_to_one_device("cola", "model.attn_rope_dims=4", "parallel.cp=2", "parallel.tp=2",
                               f"parallel.cp_attention={attention}")


def test_balanced_order_round_trips_and_balances_causal_work():
    order = balanced_order(16, 2)
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert np.argsort(order)[order].tolist() == list(range(16))  # the inverse puts every token back
    for cp in (2, 4, 8):
        work = [sum(balanced_order(64, cp).reshape(cp, -1)[i] + 1) for i in range(cp)]  # keys each query sees
        assert len(set(work)) == 1, work  # every device attends over as many keys
    batch = {"inputs": np.arange(16)[None] * 10, "targets": np.arange(16)[None]}
    out = balance(batch, 2)
    assert np.asarray(out["positions"])[0].tolist() == order.tolist()
    assert np.asarray(out["inputs"])[0, np.argsort(order)].tolist() == (np.arange(16) * 10).tolist()
    with pytest.raises(ValueError, match="seq_len=12 does not divide into 2 x cp = 8 chunks"):
        balanced_order(12, 4)


def context_of(attention: str) -> dict:
    cfg = load_config(None, ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=4", "train.seq_len=64",
                             "parallel.dp=1", "parallel.tp=2", "parallel.cp=2", "model.dtype=bfloat16",
                             f"parallel.cp_attention={attention}"])
    return measure(build(cfg))


@pytest.mark.parametrize("attention, kind, shape, backward", [
    # k and v of the whole sequence (this device's kv head); backward, a reduce-scatter of each gradient
    ("gather", "all-gather", "[4, 64, 1, 8]", ["reduce-scatter bf16[4, 32, 1, 8]"] * 2),
    # the other device's block of k and v; backward, k and v again, then dk and dv out and home
    ("ring", "collective-permute", "[4, 32, 1, 8]", ["collective-permute bf16[4, 32, 1, 8]"] * 6),
    # the rank-16 latents of k and v (replicated over tp); backward, their gradients reduce-scattered
    pytest.param("latent", "all-gather", "[4, 64, 16]", ["reduce-scatter bf16[4, 32, 16]"] * 2, marks=pytest.mark.slow),
])
def test_cp_collectives_on_the_hlo_are_the_analytic_ones(attention, kind, shape, backward):
    """Per layer: two collectives along cp forward (k and v, or their latents) whose bytes are the
    analytic figure, their transposes backward (and the weight gradients' all-reduce over cp), and
    the TP side exactly what it is without cp."""
    r = context_of(attention)
    ctx = r["context"]
    assert ctx["forward_ops"] == [f"{kind} bf16{shape} over 2 ({ctx['analytic_forward_bytes'] / 2 / 2**20:.2f} MiB)"] * 2
    assert ctx["forward"]["count"] == 2 and ctx["forward"]["bytes"] == ctx["analytic_forward_bytes"]
    ops = [op.split(" over ")[0] for op in ctx["backward_ops"]]
    assert sorted(op for op in ops if not op.startswith("all-reduce")) == backward
    assert [op for op in ops if op.startswith("all-reduce f32")] and len(ops) == len(backward) + 1
    # The attention heads stay split over tp: the TP side is the scheme's analytic volume, for half the tokens.
    assert r["layer_forward_collectives"] == 4 and r["by_kind"]["forward"].keys() == {"all-reduce"}
    assert r["forward_over_analytic"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.slow
def test_twenty_steps_at_cp2_tp2_track_one_device(tmp_path, tiny_overrides):
    common = [*tiny_overrides, "train.steps=20", "checkpoint.every=0", "train.eval_every=0"]
    one = train(load_config(None, [*common, "parallel.dp=1", f"run_dir={tmp_path / 'one'}"]), jax.devices()[:1])
    split = train(load_config(None, [*common, "parallel.cp=2", "parallel.tp=2", "parallel.dp=1",
                                     f"run_dir={tmp_path / 'cp'}"]), jax.devices()[:4])
    np.testing.assert_allclose(split["losses"], one["losses"], rtol=2e-5)
    assert one["losses"][-1] < one["losses"][0] - 0.5


@pytest.mark.slow
def test_a_run_resumes_from_cp2_to_cp1_and_back(tmp_path, tiny_overrides):
    """9 steps on one device against one run resumed twice: steps 0-3 at cp 2 x tp 2, 3-6 at cp 1
    (dp 2 x tp 2), 6-9 at cp 4 by the ring: the losses follow the single device's."""
    common = [*tiny_overrides, "train.schedule_steps=9", "train.eval_every=0"]
    one = train(load_config(None, [*common, "train.steps=9", "checkpoint.every=0", "parallel.dp=1",
                                   f"run_dir={tmp_path / 'one'}"]), jax.devices()[:1])  # the reference: no saves
    moved = [*common, "checkpoint.every=3", f"run_dir={tmp_path / 'moved'}"]
    layouts = [["parallel.cp=2", "parallel.tp=2", "parallel.dp=2"], ["parallel.tp=2", "parallel.dp=4"],
               ["parallel.cp=4", "parallel.dp=2", "parallel.cp_attention=ring"]]
    runs = [train(load_config(None, [*moved, f"train.steps={3 * i}", *layout])) for i, layout in enumerate(layouts, 1)]
    assert [r["start_step"] for r in runs] == [0, 3, 6]
    np.testing.assert_allclose([x for r in runs for x in r["losses"]], one["losses"], rtol=2e-5)


@pytest.mark.parametrize("overrides, message", [
    (["train.seq_len=36", "parallel.cp=4"], "train.seq_len=36 must divide by 2 x parallel.cp = 8"),
    (["parallel.cp=3", "train.seq_len=36"], r"pp x dp x fsdp x cp x tp = 1 x 1 x 1 x 3 x 1 does not divide the 8"),
    (["parallel.cp=2", "train.loss_chunk=9", "train.seq_len=36"], "train.loss_chunk: 9 must divide by parallel.cp=2"),
    (["parallel.cp=2", "model.arch=dense", "parallel.cp_attention=latent"], "arch dense has none"),
    (["parallel.cp=0"], "parallel.cp"),
])
def test_bad_layouts_are_refused_before_any_work(overrides, message):
    from boost_jax.parallel import make_plan

    with pytest.raises(ConfigError, match=message):
        make_plan(load_config(None, [*BASE, "model.arch=cola", *overrides]), jax.devices())



@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_the_planner_splits_a_sequence_only_where_the_batch_cannot_be(tmp_path):
    """One row on two GPUs: only cp = 2 uses both, and it is priced with its memory and time. Two
    rows: data parallelism does the same work without attention's collectives, and cp = 2 is not
    priced."""
    from boost_jax.bench.planner import paper_hardware
    from boost_jax.planner.layouts import Space
    from boost_jax.planner.price import DiskCache
    from boost_jax.planner.search import rank_layouts

    args = ["model.preset=llama-tiny", "model.arch=cola", "train.seq_len=64", "model.dtype=bfloat16"]
    space = Space(schemes=("btp",), tp=(1,), pp=(1,), remat=("none",))
    run = lambda rows: rank_layouts([*args, f"train.batch_size={rows}"], gpus=2, hw=paper_hardware(), space=space,
                            headroom=0.1, cache=DiskCache(tmp_path))
    [only] = [c for c in run(1) if c.step]
    assert (only.layout.cp, only.layout.dp) == (2, 1) and only.step["seconds"] > 0 and only.memory["total"] > 0
    two = run(2)
    considered = {(c.layout.dp, c.layout.fsdp) for c in two if c.step or c.why.startswith("not priced: cannot beat")}
    assert considered == {(2, 1), (1, 2)}  # priced, or pruned by the bound once the other was priced
    split = [c.why for c in two if c.layout.cp == 2]  # at M = 1 and 2
    assert split == ["not priced: dp=2 without context parallelism fits"] * 2


@pytest.mark.slow  # two benchmarks timing and training each cp variant
def test_bench_step_and_memory_put_cp_side_by_side(capsys):
    """`--vary parallel.cp=1,2`: one variant per value, timed against the first; in `bench memory`
    each against the budget, and only those within it trained."""
    from boost_jax.analysis.memory_model import breakdown
    from boost_jax.bench import memory, step
    from boost_jax.bench.common import config_of

    args = ["model.preset=llama-tiny", "model.arch=cola", "train.batch_size=2", "train.seq_len=256", "parallel.dp=1",
            "log.health=false", "--vary", "parallel.cp=1,2"]  # health: no part of it, most of the step's compile
    step.main([*args, "--reps", "1", "--steps", "1", "--json"])
    results = json.loads(capsys.readouterr().out)["results"]
    assert [(r["variant"], r["cp"]) for r in results] == [("parallel.cp=1", 1), ("parallel.cp=2", 2)]
    assert results[0]["time_vs_first"] == 1 and results[1]["time_vs_first"] > 0
    # A budget between the memory model's totals of the two (no compile): the compiled ones fall either side.
    one, two = (breakdown(config_of(args[:-2], f"parallel.cp={cp}"))["total"] for cp in (1, 2))
    budget = (one + two) / 2 / 2**30
    memory.main([*args, "--budget-gib", str(budget), "--time", "--reps", "1", "--steps", "1", "--json"])
    one, two = json.loads(capsys.readouterr().out)["rows"]
    assert two["fwd_bwd_peak_bytes"] < 0.8 * one["fwd_bwd_peak_bytes"]  # half the positions per device
    assert one["total_bytes"] > budget * 2**30 >= two["total_bytes"]
    assert (one["fits"], two["fits"]) == (False, True)
    assert "step_s" not in one and two["step_s"] > 0 and np.isfinite(two["last_loss"])
    with pytest.raises(ConfigError, match="--vary 'parallel.cp': expected section.key=V1,V2"):
        step.main([*args[:-2], "--vary", "parallel.cp"])
