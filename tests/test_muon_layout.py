"""Where each split decoder matrix is orthogonalised (training/muon_layout.py, docs/design.md section
14): each way's collectives, as compiled in the optimizer's update, are its formula's; auto takes the
cheapest way of each matrix on train.muon.hardware; a way a matrix's split does not allow is refused
by name. (tests/test_optimizer_layouts.py checks that every way leaves one device's parameters.)"""

import re

import jax
import pytest

from boost_jax.analysis.comm import optimizer_comm
from boost_jax.analysis.program import build
from boost_jax.config import ConfigError, load_config
from boost_jax.config.hardware import one_machine
from boost_jax.parallel import abstract_plan
from boost_jax.training.muon_layout import chosen_ways, layer_matrices, way_seconds, ways
from boost_jax.training.optimizers import matrix_ns_flops
from boost_jax.training.run import train

LAYOUTS = {"tp2": ["parallel.tp=2"], "fsdp2": ["parallel.fsdp=2"]}  # btp: tp splits d, fsdp splits r
# Each way once (gram needs tp's split of the long side); a way's formula does not depend on the side split.
CASES = [("tp2", "gram"), ("tp2", "gather"), ("fsdp2", "distribute")]
INNER_LOOP = {("tp2", "gram"), ("fsdp2", "distribute")}


def tiny(*extra, preset="llama-tiny"):
    return load_config(None, [f"model.preset={preset}", "model.arch=cola", "train.optimizer=muon",
                              "train.batch_size=4", "train.seq_len=32", "parallel.dp=1", *extra])


@pytest.mark.parametrize("layout, way", [
    pytest.param(*c, id="-".join(c), marks=() if c in INNER_LOOP else pytest.mark.slow) for c in CASES])
def test_each_ways_compiled_collectives_are_its_formula(layout, way):
    cfg = tiny(*LAYOUTS[layout], f"train.muon.comm={way}")
    r = optimizer_comm(build(cfg), one_machine(None, "h100-80gb"))
    assert r["ways"] == {way: 14}  # 7 projections x (A, B)
    layers, rank = cfg.model.n_layers, cfg.model.attn_rank
    if way == "gram":
        # ns_steps all-reduces of each factor's [L, r, r] Gram matrix; XLA combines a few with the [L]
        # vector of the Frobenius norms (+4 L bytes each)
        assert r["formula"] == {f"all-reduce {4 * layers * rank * rank} B": 14 * cfg.train.muon.ns_steps}
        assert sum(r["measured"].values()) == 14 * cfg.train.muon.ns_steps
        assert 0 <= r["bytes"] - r["formula_bytes"] <= 4 * layers * 14
    else:  # one all-gather of the whole factor, or an all-to-all of 1/g of it there and one back
        assert r["measured"] == r["formula"]
        assert sum(r["formula"].values()) == 14 * (1 if way == "gather" else 2)
    assert r["norms_and_clip"] <= 2


def test_auto_takes_the_cheapest_way_of_each_matrix():
    for cfg in (tiny("parallel.tp=2"), tiny("parallel.fsdp=2"),
                tiny("parallel.tp=4", "train.batch_size=16", "train.seq_len=4096", "train.microbatches=4",
                     preset="llama-7b")):
        plan = abstract_plan(cfg)
        hw = one_machine(None, cfg.train.muon.hardware)
        chosen = chosen_ways(cfg, plan, hw.gpus_per_node)
        for path, (shape, spec) in layer_matrices(cfg, plan).items():
            options = ways(shape, spec, dict(plan.mesh.shape), cfg.train.muon.ns_steps, hw.gpus_per_node)
            assert len(options) >= 2 and chosen[path] == min(options.values(), key=lambda w: w.seconds(hw))
        totals = way_seconds(cfg, plan, hw)
        assert sum(w.seconds(hw) for w in chosen.values()) <= min(totals.values())
        if cfg.model.preset == "llama-7b":  # 8 whole layers per rank: the fewest bytes and no redundant FLOPs
            assert {w.name for w in chosen.values()} == {"distribute"}
            assert set(totals) == {"gram", "gather", "distribute"}
        else:  # tiny matrices: one gather is cheaper than the calls of the other two
            assert {w.name for w in chosen.values()} == {"gather"}


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_latent_heads_b_is_priced_per_block():
    """Latent heads' k and v B (block-diagonal, `optimizers.latent_head_blocks`): under gram each device's
    whole blocks are orthogonalised where they lie, so the formula, as the compiled update, has no Gram
    all-reduce for them; every way's FLOPs are the blocks', not the stacked matrix's."""
    cfg = tiny("parallel.tp=2", "model.attn_latent_heads=2", "model.n_kv_heads=2", "train.muon.comm=gram")
    r = optimizer_comm(build(cfg), one_machine(None, "h100-80gb"))
    steps = cfg.train.muon.ns_steps
    assert r["ways"] == {"gram": 14}
    assert sum(r["measured"].values()) == sum(r["formula"].values()) == (14 - 2) * steps
    big = tiny("parallel.tp=8", "model.attn_latent_heads=8", preset="llama-7b")
    plan = abstract_plan(big)
    (shape, spec), mesh = layer_matrices(big, plan)[("layers", "attn", "k", "b")], dict(plan.mesh.shape)
    assert shape == (32, 1024, 512)  # [L, r, H_kv d_h / g]: 8 blocks [128, 512]
    per_block = ways(shape, spec, mesh, steps, block_rows=128)
    stacked = ways(shape, spec, mesh, steps)
    assert per_block["gather"].flops == 32 * 8 * matrix_ns_flops(128, 512, steps)  # 1.5 GFLOP per layer
    assert stacked["gather"].flops == 32 * matrix_ns_flops(512, 1024, steps)  # 6.7: 4.4x the blocks'
    assert per_block["gram"].collectives == () and per_block["gram"].flops == per_block["gather"].flops / 8
    assert chosen_ways(big, plan, None)[("layers", "attn", "k", "b")].flops < stacked["gather"].flops / 4


@pytest.mark.slow  # one more compile of the update
def test_a_latent_heads_b_split_on_its_columns_all_reduces_each_blocks_gram_matrix():
    """fsdp splits B's columns, so each block's Gram matrix is a sum over its shards: left in place,
    the compiled update all-reduces [L g, r/g, r/g] fp32 once per iteration, as `ways` prices it."""
    from collections import Counter

    from boost_jax.analysis.hlo import collectives
    from boost_jax.analysis.program import optimizer_state
    from boost_jax.training.optimizers import latent_head_blocks, make_optimizer

    cfg = tiny("parallel.fsdp=2", "model.attn_latent_heads=2", "model.n_kv_heads=2")
    prog, plan, blocks = build(cfg), abstract_plan(cfg), latent_head_blocks(cfg.model)
    tx = make_optimizer(cfg.train, prog.params, {}, split=True, blocks=blocks)  # every matrix where it lies
    found = collectives(jax.jit(tx.update).lower(prog.params, optimizer_state(prog, tx), prog.params).compile().as_text())
    layers, rows, steps = cfg.model.n_layers, blocks[("layers", "attn", "k", "b")], cfg.train.muon.ns_steps
    grams = Counter(c.kind for c in found if c.shape == (layers * 2, rows, rows))
    shape, spec = layer_matrices(cfg, plan)[("layers", "attn", "k", "b")]
    assert ways(shape, spec, dict(plan.mesh.shape), steps, block_rows=rows)["gram"].collectives == (
        ("all-reduce", 4 * layers * 2 * rows * rows, steps),)
    assert grams == {"all-reduce": 2 * steps}  # k's and v's B


@pytest.mark.parametrize("overrides, needle", [
    (["model.arch=svd", "parallel.scheme=vanilla", "parallel.tp=2", "train.muon.comm=gram"], "short side is"),
    (["parallel.tp=4", "train.muon.comm=distribute"], "do not divide"),  # llama-tiny's 2 layers over 4 ranks
])
def test_a_way_the_matrix_split_does_not_allow_is_refused_by_name(overrides, needle):
    cfg = tiny(*overrides)
    with pytest.raises(ConfigError, match="train.muon.comm") as e:
        chosen_ways(cfg, abstract_plan(cfg), None)
    message = str(e.value)
    assert "layers.attn.k.a" in message and needle in message and re.search(r"allows [a-z, ]*gather", message)


def test_a_refused_way_or_mesh_leaves_no_run_dir_behind(tmp_path):
    """Refused before the run dir is made: a rerun with a fixed config starts clean."""
    for overrides, needle in [(["parallel.tp=4", "train.muon.comm=distribute"], "train.muon.comm: distribute"),
                              (["parallel.tp=3"], "does not divide the 4 devices")]:
        run_dir = tmp_path / "run"
        with pytest.raises(ConfigError, match=needle):
            train(tiny(*overrides, f"run_dir={run_dir}", "train.steps=1"), devices=jax.devices()[:4])
        assert not run_dir.exists()
