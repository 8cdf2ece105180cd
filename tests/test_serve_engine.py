"""The serving engine (serving/engine.py): every greedy completion of 32 mixed-length requests served at
once through decode slots and a paged cache equals Decoder.generate's (what `python -m
boost_jax.generate` and api.generate run), token for token, for each cache kind, on one device and
under tp; nothing compiles after warm-up; a seed repeats a sample; a cancelled request frees its slot
and pages at once; under tp each device holds its share of the page pool."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from boost_jax.config import ConfigError, ServeConfig, load_config
from boost_jax.config.hardware import machine_of
from boost_jax.model import Model
from boost_jax.model.decode import Decoder
from boost_jax.parallel import make_plan
from boost_jax.serving.engine import Engine, Request
from boost_jax.serving.programs import pool_size

CONTEXT = 96


def setup(arch, tp=1, *overrides):
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}", "parallel.dp=1", f"parallel.tp={tp}",
                             *overrides])
    return Model(cfg.model, rngs=nnx.Rngs(0)), make_plan(cfg, jax.devices()[:tp])


def mixed_requests(vocab, n=32, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, int(rng.integers(1, 60))).tolist(), int(rng.integers(1, 30))) for _ in range(n)]


def serve_all(engine, requests, **sampling):
    served = [engine.submit(Request(p, n, **sampling)) for p, n in requests]
    steps = 0
    while engine.step():
        steps += 1
    return served, steps


# Each cache kind's pool under tp in the slow tier (one device's pool is the same pages, unsplit).
@pytest.mark.parametrize("arch, tp, cache, overrides", [
    ("dense", 1, "full", ()),
    pytest.param("cola", 2, "latent", ("model.attn_latent_heads=2",), marks=pytest.mark.slow),
    pytest.param("dense", 4, "full", ("model.n_kv_heads=4",), marks=pytest.mark.slow),
    pytest.param("svd", 4, "latent_v", ("model.n_kv_heads=4",), marks=pytest.mark.slow),
])
def test_greedy_completions_served_together_equal_generate(arch, tp, cache, overrides):
    model, plan = setup(arch, tp, *overrides)
    requests = mixed_requests(model.cfg.vocab_size)
    engine = Engine(model, plan, ServeConfig(slots=8, page_tokens=8, prefill_chunk=16, buckets=2), cache=cache,
                    eos_id=None, context=CONTEXT)
    engine.warm_up()
    compiled = engine.compilations
    served, steps = serve_all(engine, requests)
    # Greedy is a prefix: each request's tokens are the first max_tokens of one long generation.
    longest = Decoder(model, plan, cache=cache).generate([p for p, _ in requests], max(n for _, n in requests)).tokens
    assert [r.tokens for r in served] == [full[:n] for full, (_, n) in zip(longest, requests)]
    # Every shape at warm-up (prefill rows 2, 4; decode rows 4, 8 x pages 6, 12), none per request.
    assert engine.compilations == compiled == engine.programs == 6
    assert engine.pages.used == 0 and engine.running == 0  # every page back
    assert steps < sum(n for _, n in requests) // 2  # batched: far fewer steps than tokens


@pytest.fixture(scope="module")
def dense():
    """One device, a dense model, an engine of 2 slots (so requests wait, join and leave)."""
    model, plan = setup("dense")
    return model, Engine(model, plan, ServeConfig(slots=2, page_tokens=8, prefill_chunk=16), cache="full",
                         eos_id=None, context=CONTEXT)


def test_a_seed_repeats_a_sample_whatever_else_is_served(dense):
    model, engine = dense
    prompt = list(range(5, 25))
    alone, _ = serve_all(engine, [(prompt, 20)], temperature=1.0, top_p=0.9, seed=3)
    crowd, _ = serve_all(engine, [(prompt, 20)] + mixed_requests(model.cfg.vocab_size, 5), temperature=1.0,
                         top_p=0.9, seed=3)
    other, _ = serve_all(engine, [(prompt, 20)], temperature=1.0, top_p=0.9, seed=4)
    assert alone[0].tokens == crowd[0].tokens != other[0].tokens


def test_a_cancelled_request_frees_its_slot_and_pages_at_the_next_step(dense):
    _, engine = dense
    busy = engine.submit(Request([9, 9, 9], 60))  # holds the other slot throughout
    ends = []
    first = engine.submit(Request(list(range(3, 40)), 50, on_event=lambda r, t, lp, end: end and ends.append(end)))
    second = engine.submit(Request([5, 6, 7], 4))
    for _ in range(6):
        engine.step()
    assert engine.pages.used > 0 and first.tokens and engine.slots == [busy, first]
    engine.cancel(first)
    engine.step()  # the cancelled request leaves, the waiting one takes its slot in the same step
    assert ends == ["cancelled"] and engine.slots == [busy, second]
    assert engine.pages.owned(second.id) and first.id not in engine.pages.sequences()
    engine.cancel(busy)
    while engine.step():
        pass
    assert engine.pages.used == 0


@pytest.mark.slow
def test_under_tp_each_device_holds_its_share_of_a_latent_pool():
    """Latent heads g = tp: each device's pages hold 1/tp of the latents (a full pool: 1/tp of the kv heads)."""
    sizes = {}
    for g, tp in ((1, 1), (2, 2)):
        model, plan = setup("cola", tp, f"model.attn_latent_heads={g}")
        engine = Engine(model, plan, ServeConfig(slots=2, page_tokens=8), cache="latent", eos_id=None, context=CONTEXT)
        layer = engine.pool[0].k
        sizes[tp] = (engine.page_bytes, math.prod(layer.addressable_shards[0].data.shape))
    assert sizes[2][0] * 2 == sizes[1][0] and sizes[2][1] * 2 == sizes[1][1]


def test_a_pool_too_small_for_one_request_at_the_context_is_refused(dense):
    model, engine = dense
    with pytest.raises(ConfigError, match="serve.cache_gib=1e-06 holds .* less than one request at the context"):
        Engine(model, engine.plan, ServeConfig(cache_gib=1e-6, page_tokens=8), cache="full", eos_id=None,
               context=CONTEXT)


def test_cache_gib_0_is_what_a_gpu_has_left_and_on_cpu_every_slot_at_the_context(dense):
    """serve.cache_gib=0: on CPU devices (no HBM figure) every slot at the context; given the bytes a
    GPU has left (PagedPrograms.memory_left), as many pages as they hold, refused where that is less
    than one request; a GPU is found in the hardware file by the device_kind it reports."""
    model, engine = dense
    serve = ServeConfig(slots=3, page_tokens=8)
    cpu = pool_size(serve, "full", model.cfg, engine.plan, CONTEXT)
    assert cpu.pages == 3 * -(-CONTEXT // 8) + 1 and cpu.bytes == cpu.pages * cpu.page_bytes > 0
    assert pool_size(serve, "full", model.cfg, engine.plan, CONTEXT, 20 * cpu.page_bytes + 5).pages == 20
    assert pool_size(serve, "full", model.cfg, engine.plan, CONTEXT, 10**6 * cpu.page_bytes).pages == cpu.pages  # at most every slot
    with pytest.raises(ConfigError, match="GiB the device has left .* less than one request at the context"):
        pool_size(serve, "full", model.cfg, engine.plan, CONTEXT, cpu.page_bytes)
    assert machine_of("NVIDIA H100 80GB HBM3").name == "h100-80gb" and machine_of("NVIDIA B9") is None
