"""Communication audit of compiled HLO: kinds, payload bytes, groups, loop trip counts, bf16 upcasts."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from boost_jax.analysis import audit, collectives, summarize
from boost_jax.analysis.hlo import canonical_groups

TP_GROUPS = "{{0,1,2,3},{4,5,6,7}}"
F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def smap(mesh, f, in_specs=P(), out_specs=P()):
    # check_vma=False: the tests pick out_specs for the collective under test, not for replication.
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def sds(shape, dtype=F32, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_psum_is_one_all_reduce(mesh):
    [c] = audit(smap(mesh, lambda x: jax.lax.psum(x, "tp")), sds((16, 64)))
    assert (c.kind, c.dtype, c.shape, c.bytes) == ("all-reduce", "f32", (16, 64), 16 * 64 * 4)
    assert (c.replica_groups, c.group_size, c.loop_depth, c.trip_count) == (TP_GROUPS, 4, 0, 1)
    assert c.upcast_from is None and c.bytes_as_compiled == c.bytes


@pytest.mark.parametrize("f", [lambda x: jax.lax.psum(x, "tp"),
                               lambda x: jax.lax.psum(x * 2, "tp") + 1],  # convert fused into producer
                         ids=["plain", "fused"])
def test_bf16_psum_reported_at_bf16(mesh, f):
    # The CPU backend (AllReducePromotion) moves it as f32; the program, and a GPU, move bf16.
    [c] = audit(smap(mesh, f), sds((16, 64), BF16))
    assert (c.dtype, c.bytes, c.upcast_from, c.bytes_as_compiled) == ("bf16", 2048, "f32", 4096)


@pytest.mark.parametrize("kind,f,in_specs,out_specs,shape,nbytes", [
    # all-gather: the gathered OUTPUT, [16,16] per device -> [16,64]
    ("all-gather", lambda x: jax.lax.all_gather(x, "tp", axis=1, tiled=True), P(None, "tp"), P(),
     (16, 64), 4096),
    # reduce-scatter: the INPUT, [16,64] -> [4,64] per device
    ("reduce-scatter", lambda x: jax.lax.psum_scatter(x, "tp", tiled=True), P(), P("tp"), (4, 64), 4096),
    ("collective-permute", lambda x: jax.lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]),
     P(), P("tp"), (16, 64), 4096),
    # the CPU backend issues all-to-all as one op on a tuple of 4 [4,64] pieces: bytes sum them
    ("all-to-all", lambda x: jax.lax.all_to_all(x, "tp", 0, 1, tiled=True), P(), P("tp"), (4, 64), 4096),
])
def test_kinds_and_byte_conventions(mesh, kind, f, in_specs, out_specs, shape, nbytes):
    [c] = audit(smap(mesh, f, in_specs, out_specs), sds((16, 64)))
    assert (c.kind, c.shape, c.bytes) == (kind, shape, nbytes)
    if kind == "collective-permute":
        assert c.group_size == 2 and c.replica_groups.startswith("{{0,1},{1,2},{2,3},{3,0}")
    else:
        assert (c.replica_groups, c.group_size) == (TP_GROUPS, 4)


def test_scan_collectives_counted_per_iteration(mesh):
    body = lambda c, _: (jax.lax.psum(c, "tp") * 0.5, None)  # noqa: E731
    cols = audit(smap(mesh, lambda x: jax.lax.scan(body, x, None, length=5)[0]), sds((16, 64)))
    [c] = cols
    assert (c.loop_depth, c.trip_count, c.trip_count_known) == (1, 5, True)
    assert summarize(cols, in_loop=True) == {"count": 1, "bytes": 4096,
                                             "by_kind": {"all-reduce": {"count": 1, "bytes": 4096}}}
    assert summarize(cols)["count"] == 5 and summarize(cols)["bytes"] == 5 * 4096
    assert summarize(cols, in_loop=False)["count"] == 0


def test_nested_scans_multiply_trip_counts(mesh):
    inner = lambda c, _: (jax.lax.psum(c, "tp") * 0.5, None)  # noqa: E731
    outer = lambda c, _: (jax.lax.scan(inner, c, None, length=3)[0], None)  # noqa: E731
    [c] = audit(smap(mesh, lambda x: jax.lax.scan(outer, x, None, length=4)[0]), sds((16, 64)))
    assert (c.loop_depth, c.trip_count) == (2, 12)


@pytest.mark.parametrize("dtype,upcast", [(F32, None), (BF16, "f32")])
def test_gspmd_matmul_over_sharded_dim_all_reduces(mesh, dtype, upcast):
    a = sds((16, 64), dtype, NamedSharding(mesh, P("dp", "tp")))
    b = sds((64, 32), dtype, NamedSharding(mesh, P("tp", None)))
    f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("dp", None)))
    [c] = audit(f, a, b)
    size = jnp.dtype(dtype).itemsize
    assert (c.kind, c.shape, c.bytes, c.upcast_from) == ("all-reduce", (8, 32), 8 * 32 * size, upcast)
    assert (c.replica_groups, c.group_size) == (TP_GROUPS, 4)


@pytest.mark.parametrize("x_dtype,x_name,x_size", [(F32, "f32", 4), (BF16, "bf16", 2)])
def test_two_psums_bytes_combined_or_not(mesh, x_dtype, x_name, x_size):
    # JAX emits two all-reduces; XLA's all-reduce combiner (jax 0.10.2) merges them into ONE op on
    # a tuple, even when one was a promoted bf16 and the other a genuine f32 (SCAN_HLO below pins
    # that form). Combined or not, the parts and the byte totals must come out right.
    f = smap(mesh, lambda x, y: (jax.lax.psum(x, "tp"), jax.lax.psum(y, "tp")), (P(), P()), (P(), P()))
    cols = audit(f, sds((16, 64), x_dtype), sds((16, 32)))
    assert sorted(p for c in cols for p in c.parts) == sorted([(x_name, (16, 64)), ("f32", (16, 32))])
    assert summarize(cols)["bytes"] == 16 * 64 * x_size + 16 * 32 * 4
    assert sum(c.bytes_as_compiled for c in cols) == (16 * 64 + 16 * 32) * 4


# Real compiled CPU HLO (jax 0.10.2, metadata stripped): scan of length 3 over a (bf16, f32) carry,
# each iteration psum-ing both; XLA promoted the bf16 psum to f32 and combined the two.
SCAN_HLO = """\
HloModule jit__lambda, is_scheduled=true, entry_computation_layout={(bf16[16,64]{1,0}, f32[16,32]{1,0})->(bf16[16,64]{1,0}, f32[16,32]{1,0})}, num_partitions=8
%fused_computation (param_0.3: f32[16,64]) -> bf16[16,64] {
  %param_0.3 = f32[16,64]{1,0} parameter(0)
  %convert.17 = bf16[16,64]{1,0} convert(%param_0.3)
  %convert.16 = f32[16,64]{1,0} convert(%convert.17)
  %tanh.4 = f32[16,64]{1,0} tanh(%convert.16)
  ROOT %convert.15 = bf16[16,64]{1,0} convert(%tanh.4)
}
%wrapped_add_computation (param_0.4: s32[], param_1: s32[]) -> s32[] {
  %param_0.4 = s32[] parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %add.8 = s32[] add(%param_0.4, %param_1)
}
%wrapped_convert_computation (param_0.5: bf16[16,64]) -> f32[16,64] {
  %param_0.5 = bf16[16,64]{1,0} parameter(0)
  ROOT %convert.18 = f32[16,64]{1,0} convert(%param_0.5)
}
%region_1.0_promoted (x.2: f32[], y.2: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.2 = f32[] parameter(1)
  ROOT %add.7 = f32[] add(%x.2, %y.2)
}
%region_0.3_spmd (param: (s32[], bf16[16,64], f32[16,32])) -> (s32[], bf16[16,64], f32[16,32]) {
  %param = (s32[], bf16[16,64]{1,0}, f32[16,32]{1,0}) parameter(0)
  %constant.0.clone = s32[] constant(1)
  %get-tuple-element.29 = f32[16,32]{1,0} get-tuple-element(%param), index=2
  %get-tuple-element.28 = bf16[16,64]{1,0} get-tuple-element(%param), index=1
  %get-tuple-element.27 = s32[] get-tuple-element(%param), index=0
  %wrapped_convert = f32[16,64]{1,0} fusion(%get-tuple-element.28), kind=kLoop, calls=%wrapped_convert_computation
  %wrapped_add = s32[] fusion(%get-tuple-element.27, %constant.0.clone), kind=kLoop, calls=%wrapped_add_computation
  %all-reduce = (f32[16,64]{1,0}, f32[16,32]{1,0}) all-reduce(%wrapped_convert, %get-tuple-element.29), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%region_1.0_promoted
  %get-tuple-element.22 = f32[16,64]{1,0} get-tuple-element(%all-reduce), index=0
  %get-tuple-element.32 = f32[16,32]{1,0} get-tuple-element(%all-reduce), index=1
  %tanh_convert_fusion = bf16[16,64]{1,0} fusion(%get-tuple-element.22), kind=kLoop, calls=%fused_computation
  %copy.12 = f32[16,32]{1,0} copy(%get-tuple-element.32)
  ROOT %tuple.16 = (s32[], bf16[16,64]{1,0}, f32[16,32]{1,0}) tuple(%wrapped_add, %tanh_convert_fusion, %copy.12)
}
%wrapped_compare_computation (param_0.6: s32[], param_1.1: s32[]) -> pred[] {
  %param_0.6 = s32[] parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %lt.3 = pred[] compare(%param_0.6, %param_1.1), direction=LT
}
%region_3.4_spmd (param.1: (s32[], bf16[16,64], f32[16,32])) -> pred[] {
  %param.1 = (s32[], bf16[16,64]{1,0}, f32[16,32]{1,0}) parameter(0)
  %constant.1.clone = s32[] constant(3)
  %get-tuple-element.15 = s32[] get-tuple-element(%param.1), index=0
  ROOT %wrapped_compare = pred[] fusion(%get-tuple-element.15, %constant.1.clone), kind=kLoop, calls=%wrapped_compare_computation
}
ENTRY %main.6_spmd (param.4: bf16[16,64], param.5: f32[16,32]) -> (bf16[16,64], f32[16,32]) {
  %param.4 = bf16[16,64]{1,0} parameter(0), sharding={replicated}
  %param.5 = f32[16,32]{1,0} parameter(1), sharding={replicated}
  %constant.3.clone.1 = s32[] constant(0)
  %copy.13 = bf16[16,64]{1,0} copy(%param.4)
  %copy.14 = f32[16,32]{1,0} copy(%param.5)
  %copy.15 = s32[] copy(%constant.3.clone.1)
  %tuple.14 = (s32[], bf16[16,64]{1,0}, f32[16,32]{1,0}) tuple(%copy.15, %copy.13, %copy.14)
  %while.11 = (s32[], bf16[16,64]{1,0}, f32[16,32]{1,0}) while(%tuple.14), condition=%region_3.4_spmd, body=%region_0.3_spmd, backend_config={"dynamic_variables":[],"known_induction_variable":{"tuple_index":"0"},"known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"3"}}
  %get-tuple-element.18 = bf16[16,64]{1,0} get-tuple-element(%while.11), index=1
  %get-tuple-element.19 = f32[16,32]{1,0} get-tuple-element(%while.11), index=2
  ROOT %tuple.11 = (bf16[16,64]{1,0}, f32[16,32]{1,0}) tuple(%get-tuple-element.18, %get-tuple-element.19)
}
"""


def test_parse_real_cpu_hlo():
    [c] = collectives(SCAN_HLO)
    assert (c.kind, c.name, c.computation) == ("all-reduce", "all-reduce", "region_0.3_spmd")
    assert (c.loop_depth, c.trip_count, c.replica_groups, c.group_size) == (1, 3, TP_GROUPS, 4)
    assert c.parts == (("bf16", (16, 64)), ("f32", (16, 32)))
    assert (c.dtype, c.shape, c.bytes, c.bytes_as_compiled) == ("bf16", (16, 64), 4096, 6144)
    assert summarize([c])["bytes"] == 3 * 4096


# Hand-written in XLA's printed format (GPU-style): async pairs, iota groups, a while without a
# known trip count, a conditional branch.
ASYNC_HLO = """\
HloModule m, num_partitions=8
%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %a = bf16[] add(%x, %y)
}
%branch (p: bf16[4,64]) -> bf16[4,64] {
  %p = bf16[4,64]{1,0} parameter(0)
  ROOT %cp = bf16[4,64]{1,0} collective-permute(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}
}
%body (t: (s32[], bf16[4,64])) -> (s32[], bf16[4,64]) {
  %t = (s32[], bf16[4,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[4,64]{1,0} get-tuple-element(%t), index=1
  %ars = bf16[4,64]{1,0} all-reduce-start(%v), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = bf16[4,64]{1,0} all-reduce-done(%ars)
  %ags = (bf16[4,64]{1,0}, bf16[4,128]{1,0}) all-gather-start(%ard), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}, use_global_device_ids=true
  %agd = bf16[4,128]{1,0} all-gather-done(%ags)
  %c = bf16[4,64]{1,0} conditional(%i, %ard), branch_computations={%branch}
  ROOT %r = (s32[], bf16[4,64]{1,0}) tuple(%i, %c)
}
%cond (t: (s32[], bf16[4,64])) -> pred[] {
  %t = (s32[], bf16[4,64]{1,0}) parameter(0)
  ROOT %b = pred[] constant(true)
}
ENTRY %main (p0: bf16[4,64]) -> (s32[], bf16[4,64]) {
  %p0 = bf16[4,64]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], bf16[4,64]{1,0}) tuple(%z, %p0)
  ROOT %w = (s32[], bf16[4,64]{1,0}) while(%t0), condition=%cond, body=%body
}
"""


def test_parse_async_pairs_iota_groups_branches():
    by_kind = {c.kind: c for c in collectives(ASYNC_HLO)}
    ar, ag, cp = (by_kind[k] for k in ("all-reduce", "all-gather", "collective-permute"))
    assert (ar.kind, ar.name, ar.bytes, ar.replica_groups) == ("all-reduce", "ard", 512, TP_GROUPS)
    assert (ag.kind, ag.bytes, ag.group_size) == ("all-gather", 1024, 2)
    assert ag.replica_groups == "{{0,4},{1,5},{2,6},{3,7}}"
    assert (cp.kind, cp.computation, cp.group_size) == ("collective-permute", "branch", 2)
    assert all(c.loop_depth == 1 and c.trip_count == 1 and not c.trip_count_known for c in (ar, ag, cp))
    assert all(c.upcast_from is None for c in (ar, ag, cp))  # bf16 natively: no promotion


def test_canonical_groups():
    assert canonical_groups("[2,4]<=[8]") == canonical_groups("{ {0,1,2,3}, {4,5,6,7} }") == TP_GROUPS
    assert canonical_groups("[1,8]<=[8]") == "{{0,1,2,3,4,5,6,7}}"
