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
from boost_jax.training.run import train

LAYOUTS = {"tp2": ["parallel.tp=2"], "fsdp2": ["parallel.fsdp=2"]}  # btp: tp splits d, fsdp splits r
CASES = [("tp2", "gram"), ("tp2", "gather"), ("tp2", "distribute"), ("fsdp2", "gather"), ("fsdp2", "distribute")]
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
