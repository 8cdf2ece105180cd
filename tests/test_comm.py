"""The communication pattern of each TP scheme, read from the compiled HLO (docs/design.md sections 2-3)."""

import functools

import jax
import pytest

from boost_jax.analysis.comm import forward, in_layers, measure
from boost_jax.analysis.hlo import audit
from boost_jax.analysis.issued import issued
from boost_jax.analysis.program import build, config_for

B, S, TP = 4, 64, 4


def config(arch, scheme, dtype="bfloat16", dp=1, *overrides):
    return config_for("llama-tiny", arch, scheme, tp=TP, dp=dp, batch_size=B * dp, seq=S, dtype=dtype,
                      overrides=["model.n_kv_heads=8", *overrides])  # MHA: no kv-head replication


@functools.cache  # each variant compiled once per test process
def comm(*a, **kw):
    return measure(build(config(*a, **kw)))


@pytest.fixture
def btp():
    return comm("cola", "btp")


def test_btp_layer_moves_only_latents(btp):
    m = config("cola", "btp").model
    latent_bytes = B * S * 7 * m.attn_rank * 2
    stats_bytes = 2 * B * S * 2  # online RMSNorm: one more bf16 column in the q|k|v and gate|up buffers
    assert btp["layer_forward_bytes"] == latent_bytes + stats_bytes
    assert btp["analytic_layer_forward_bytes"] == latent_bytes
    assert btp["layer_forward_issued"] == {"all-reduce": 4}  # q|k|v (+stats), o, gate|up (+stats), down
    assert btp["layer_forward_collectives"] == 4
    widths = sorted(int(op.split("]")[0].rsplit(", ", 1)[1]) for op in btp["layer_forward_ops"])
    assert widths == [16, 16, 2 * 16 + 1, 3 * 16 + 1]  # no collective wider than the latents (+1 stat)
    assert all("over 4" in op for op in btp["layer_forward_ops"])  # tp groups only
    # Backward: the latents' gradients, all-reduced once each at the column-parallel B.
    assert btp["layer_backward_collectives"] == 4
    assert set(btp["by_kind"]["backward"]) == {"all-reduce"}


@pytest.mark.parametrize("arch, scheme", [("cola", "btp"), pytest.param("dense", "megatron", marks=pytest.mark.slow)])
def test_the_gradients_forward_collectives_are_the_losss_own(arch, scheme):
    """`measure` compiles the value and gradient once and takes as forward the collectives JAX did not
    name as the backward pass's: per layer they are exactly those of the loss compiled on its own."""
    prog = build(config(arch, scheme))
    both = audit(jax.value_and_grad(prog.loss), prog.params, prog.batch)
    what = lambda cols: sorted((c.kind, c.dtype, c.shape, c.bytes, c.replica_groups) for c in in_layers(cols))
    assert what(forward(both)) == what(audit(prog.loss, prog.params, prog.batch))
    assert 0 < len(in_layers(forward(both))) < len(in_layers(both))  # the backward's are told apart


@pytest.mark.parametrize("scheme, overrides", [
    ("btp", ()), pytest.param("vanilla", (), marks=pytest.mark.slow),
    pytest.param("btp", ("model.attn_latent_heads=4",), marks=pytest.mark.slow)])
def test_decoupled_rope_collectives_equal_the_formula(scheme, overrides):
    """model.attn_rope_dims=4 (config/schemes.py): under btp the rotary keys' projection rides in the
    q|k|v collective (+ g d_r per token forward) and the one replicated rotary key's gradient is one more
    all-reduce backward (none with latent heads); under vanilla the projection is replicated: nothing."""
    r = comm("cola", scheme, "bfloat16", 1, "model.attn_rope_dims=4", *overrides)
    # online RMSNorm's statistic in two buffers (one copy per rank in a reduce-scatter's: latent heads)
    stats = B * S * 2 * (1 + (TP if overrides else 1)) if scheme == "btp" else 0
    assert r["layer_forward_bytes"] == r["analytic_layer_forward_bytes"] + stats
    assert r["layer_backward_all_reduce_parts"] == r["analytic_layer_backward_all_reduces"]
    if scheme == "btp" and not overrides:
        assert r["analytic_layer_forward_bytes"] == B * S * (7 * 16 + 4) * 2


def test_btp_edges_are_vocab_parallel(btp):
    kinds = btp["edges"]["forward"]["by_kind"]
    assert kinds["reduce-scatter"]["count"] == 1  # the embedding: each rank keeps its d/p slice
    assert kinds["all-gather"]["count"] == 1  # once, after the last layer
    assert kinds["reduce-scatter"]["bytes"] == B * S * 64 * 2
    # XLA hoists the final norm's upcast above the gather, so this one moves as f32.
    assert kinds["all-gather"]["bytes"] in (B * S * 64 * 2, B * S * 64 * 4)


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_data_parallel_adds_only_gradient_all_reduces_over_dp(btp):
    r = comm("cola", "btp", dp=2)
    assert r["layer_forward_bytes"] == btp["layer_forward_bytes"]  # per replica, the same TP traffic
    extra = [op for op in r["layer_backward_ops"] if "over 2" in op]
    assert extra and all(op.startswith("all-reduce") for op in extra)  # weight gradients, dp groups


@pytest.mark.parametrize("arch, scheme, count", [("dense", "megatron", 2), ("cola", "vanilla", 4)])
def test_forward_volume_matches_analytic(arch, scheme, count):
    r = comm(arch, scheme)
    assert r["layer_forward_bytes"] == r["analytic_layer_forward_bytes"]
    assert r["layer_forward_collectives"] == count  # vanilla's 7 all-reduces, XLA-combined into 4
    assert set(r["by_kind"]["forward"]) == {"all-reduce"}


def test_megatron_backward_all_reduces_each_input_gradient_once():
    # q|k|v and gate|up run as stacked GEMMs, so each block's input gradient is one partial sum.
    r = comm("dense", "megatron")
    assert r["layer_backward_collectives"] == 2
    assert r["layer_backward_bytes"] == r["layer_forward_bytes"] == r["analytic_layer_forward_bytes"]


@pytest.mark.parametrize("arch, scheme", [("dense", "megatron"), ("cola", "vanilla"), ("cola", "btp")])
def test_backward_matches_analytic(arch, scheme):
    """Each partial sum the scheme's backward leaves (config/schemes.py), combined or not by XLA, is one part
    of an all-reduce in the layers' backward: same sizes, no other collective."""
    r = comm(arch, scheme)
    assert r["layer_backward_all_reduce_parts"] == r["analytic_layer_backward_all_reduces"]
    assert r["layer_backward_bytes"] == r["analytic_layer_backward_bytes"]
    assert set(r["by_kind"]["backward"]) == {"all-reduce"}


def test_grouped_vanilla_all_reduces_each_inputs_gradient_once():
    """The authors' baseline: A_q|A_k|A_v and A_gate|A_up as one column-parallel GEMM each, so the
    backward sums 3 x [T, d] + [T, d_ff] (o's input is [T, d] at MHA); ungrouped, 6 x [T, d] + [T, d_ff]."""
    m, t = config("cola", "vanilla").model, B * S
    assert comm("cola", "vanilla")["layer_backward_all_reduce_parts"] == sorted([t * m.d_model * 2] * 3 + [t * m.d_ff * 2])


@pytest.mark.slow
@pytest.mark.parametrize("arch, scheme, overrides", [
    ("cola", "vanilla", ("model.grouping=false",)), ("cola", "btp", ("model.grouping=false",)),
    ("dense", "megatron", ("model.grouping=false",)), ("dense", "megatron", ("model.n_kv_heads=4",)),  # GQA: q apart
    ("cola", "btp", ("model.n_kv_heads=4", "parallel.tp=2"))])
def test_backward_matches_analytic_ungrouped_and_gqa(arch, scheme, overrides):
    r = measure(build(config(arch, scheme, "bfloat16", 1, *overrides)))
    assert r["layer_backward_all_reduce_parts"] == r["analytic_layer_backward_all_reduces"]


def test_backward_analytic_is_none_where_xla_places_the_kv_gradient():
    # llama-tiny's 2 kv heads at tp=4 are replicated: XLA sums their gradient where it chooses.
    r = measure(build(config_for("llama-tiny", "cola", "btp", tp=TP, batch_size=B, seq=S, dtype="bfloat16")))
    assert r["analytic_layer_backward_all_reduces"] is None and r["analytic_layer_backward_bytes"] is None


@pytest.mark.slow  # three abstract compiles of llama-7b, ~10 s each
@pytest.mark.parametrize("arch, scheme", [("dense", "megatron"), ("cola", "vanilla"), ("cola", "btp")])
def test_llama_7b_tp4_forward_and_backward_equal_the_analytic(arch, scheme):
    """The paper's setting (bf16, 4 x 4096 tokens, tp=4): the compiled train step's per-layer
    collectives equal the analytic both ways. Vanilla's backward is the authors' 0.7109 GiB."""
    r = measure(build(config_for("llama-7b", arch, scheme, tp=4, batch_size=4, seq=4096, dtype="bfloat16")))
    lat = r["analytic_layer_forward_bytes"]
    stats = 2 * 4 * 4096 * 2 if scheme == "btp" else 0  # online RMSNorm's statistics ride in two latents
    assert r["layer_forward_bytes"] == lat + stats
    assert set(r["by_kind"]["forward"]) == set(r["by_kind"]["backward"]) == {"all-reduce"}
    assert r["layer_backward_all_reduce_parts"] == r["analytic_layer_backward_all_reduces"]
    assert r["layer_backward_collectives"] == len(r["analytic_layer_backward_all_reduces"])
    if scheme == "vanilla":
        assert r["layer_backward_bytes"] == (3 * 4096 + 11008) * 4 * 4096 * 2 == 0.7109375 * 2**30


def latent_heads_comm(tp: int, *overrides: str, model: str = "llama-tiny", batch: int = B, seq: int = S) -> dict:
    return measure(build(config_for(model, "cola", "btp", tp=tp, batch_size=batch, seq=seq, dtype="bfloat16",
                                    overrides=[f"model.attn_latent_heads={tp}", *overrides])))


def assert_latent_heads_equal_the_formula(r: dict, tokens: int, tp: int, online: bool, grouped: bool):
    """Per layer, kinds, counts and bytes: the k/v latents reduce-scattered forward (the online norm's
    statistic riding in the first, one column per rank's share), their gradients all-gathered backward,
    everything else all-reduced as in btp (config/schemes.py)."""
    stat = 2 * tokens  # one bf16 column
    scatters = 1 if grouped else 2
    forward, backward = r["by_kind"]["forward"], r["by_kind"]["backward"]
    analytic = r["analytic_layer_forward_by_kind"]
    assert set(forward) == {"all-reduce", "reduce-scatter"} and set(backward) == {"all-reduce", "all-gather"}
    assert forward["reduce-scatter"]["count"] == backward["all-gather"]["count"] == scatters
    assert r["layer_forward_issued"]["reduce-scatter"] == scatters
    assert forward["reduce-scatter"]["bytes"] == analytic["reduce-scatter"] + online * tp * stat
    # gate|up's statistic column (online), or the sync norm's two fp32 [T, 1] all-reduces
    assert forward["all-reduce"]["bytes"] == analytic["all-reduce"] + (stat if online else 2 * 4 * tokens)
    gathers = r["analytic_layer_backward_all_gathers"]
    assert r["layer_backward_all_gather_parts"] == sorted([gathers[0] + online * tp * stat, *gathers[1:]])
    sync = [] if online else [4 * tokens] * 2  # the sync norm's statistics, summed back (a plain psum's transpose)
    assert r["layer_backward_all_reduce_parts"] == sorted(r["analytic_layer_backward_all_reduces"] + sync)


@pytest.mark.parametrize("norm, grouping", [("online", True), pytest.param("sync", True, marks=pytest.mark.slow),
                                            pytest.param("online", False, marks=pytest.mark.slow)])
def test_latent_heads_reduce_scatter_the_kv_latents_as_the_formula_says(norm, grouping, btp):
    r = latent_heads_comm(TP, "model.n_kv_heads=8", f"model.norm={norm}", f"model.grouping={grouping}")
    assert_latent_heads_equal_the_formula(r, B * S, TP, norm == "online", grouping)
    if norm == "online" and grouping:  # k|v leave q's all-reduce for one reduce-scatter; the total is btp's
        m = config("cola", "btp").model
        assert r["analytic_layer_forward_by_kind"]["reduce-scatter"] == B * S * 2 * m.attn_rank * 2
        assert r["layer_forward_bytes"] == btp["layer_forward_bytes"] + (TP - 1) * 2 * B * S
        assert r["layer_forward_collectives"] == btp["layer_forward_collectives"] + 1
        # On a ring the k|v latents send (TP-1)/TP of their bytes, not an all-reduce's twice that.
        ring = lambda kind, n: (2 if kind == "all-reduce" else 1) * (TP - 1) / TP * n
        kv = r["analytic_layer_forward_by_kind"]["reduce-scatter"]
        assert r["analytic_layer_forward_ring_bytes"] == pytest.approx(
            sum(ring(k, n) for k, n in r["analytic_layer_forward_by_kind"].items()))
        assert btp["analytic_layer_forward_ring_bytes"] - r["analytic_layer_forward_ring_bytes"] == pytest.approx(
            (TP - 1) / TP * kv)
        assert r["layer_forward_ring_bytes"] == pytest.approx(
            sum(ring(k, v["bytes"]) for k, v in r["by_kind"]["forward"].items()))


@pytest.mark.slow  # two abstract compiles of llama-7b
def test_llama_7b_tp8_latent_heads_equal_the_formula():
    """The issue's setting: llama-7b btp tp=8, 4 x 4096 tokens, bf16, g=8."""
    r = latent_heads_comm(8, model="llama-7b", batch=4, seq=4096)
    assert_latent_heads_equal_the_formula(r, 4 * 4096, 8, True, True)
    assert r["analytic_layer_forward_by_kind"] == {"all-reduce": 4096 * 4 * (2 * 1024 + 3 * 1024) * 2,
                                                   "reduce-scatter": 4096 * 4 * 2 * 1024 * 2}


def test_vanilla_moves_far_more_than_btp(btp):
    vanilla = comm("cola", "vanilla")
    assert vanilla["layer_forward_bytes"] > 5 * btp["analytic_layer_forward_bytes"]


def test_fp32_payload_is_counted_at_fp32():
    r = comm("cola", "btp", "float32")
    assert r["layer_forward_bytes"] == B * S * (7 * 16 + 2) * 4  # 7 latents + 2 statistics columns
    assert r["backend_upcast_extra_bytes"]["forward"] == 0


def test_bf16_upcast_is_reported_separately(btp):
    # XLA's CPU backend moves bf16 all-reduces as f32; the program (and a GPU) moves bf16.
    assert btp["backend_upcast_extra_bytes"]["forward"] == btp["layer_forward_bytes"]


@pytest.mark.parametrize("norm, grouping, count", [("online", True, 4), ("sync", True, 6),
                                                   ("online", False, 7), ("sync", False, 9)])
def test_online_norm_and_grouping_all_reduce_counts(norm, grouping, count):
    prog = build(config("cola", "btp", "bfloat16", 1, f"model.norm={norm}", f"model.grouping={grouping}"))
    assert dict(issued(prog.loss, prog.params, prog.batch)["layer"]) == {"all-reduce": count}
