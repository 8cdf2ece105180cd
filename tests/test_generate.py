"""Generation with a KV cache: the tokens a decoder picks are those repeated full forwards pick, for
every arch, cache kind and layout; rows of one batch never see each other; a seed reproduces a
sample; one program per shape bucket, never per token, and the cache never moves; bad input is one
message."""

import contextlib
import functools
import gc
import json
import math
import re
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import dispatch

from boost_jax import api, generate
from boost_jax.config import ConfigError, ModelConfig, load_config
from boost_jax.layers.kv_cache import empty
from boost_jax.model import Model
from boost_jax.model.decode import Decoder, Sampling
from boost_jax.parallel import make_plan, single_device_plan

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [30, 31, 32, 33, 34, 35], [40, 41, 42]]  # three lengths
NEW = 32


def tiny(arch, **kw) -> ModelConfig:
    return ModelConfig(preset="llama-tiny", arch=arch, **kw).resolved()  # GQA: 8 heads, 2 kv heads


@functools.cache
def model_of(arch, **kw):
    return Model(tiny(arch, **dict(kw)), rngs=nnx.Rngs(0))


def greedy_by_full_forwards(model, prompts, new):
    """The reference: each next token the argmax of a full forward of the sequence so far, no cache
    (one padded shape, so one program: a causal model's logit at p does not see the padding after p)."""
    plan = single_device_plan(model.cfg)
    forward = nnx.jit(lambda m, t: m(t, plan=plan))
    width = max(map(len, prompts)) + new
    seqs = [list(p) for p in prompts]
    for _ in range(new):
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
        logits = np.asarray(forward(model, tokens))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


# cola's decoder against full forwards: test_cli_generates_and_reports_as_json.
@pytest.mark.parametrize("arch, kw", [
    ("dense", ()), ("lax", ()), pytest.param("svd", (), marks=pytest.mark.slow),
    pytest.param("dense", (("tie_embeddings", True),), marks=pytest.mark.slow),
])
def test_greedy_decoding_equals_repeated_full_forwards(arch, kw):
    model = model_of(arch, **dict(kw))
    got = Decoder(model, single_device_plan(model.cfg)).generate(PROMPTS, NEW)
    assert got.tokens == greedy_by_full_forwards(model, PROMPTS, NEW)
    # One prefill program and one decode loop, its cache holding every position a row may reach; not per token.
    assert got.programs == {"prefill": 1, "decode": 1}


# cola's: tests/test_open_models_parallel.py (with biases, against the full forward).
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) for a in ("lax", "svd")])  # the inner tier: cola's
def test_the_latent_caches_compute_what_the_full_one_does(arch):
    """Prefill and three steps through each cache kind: the same logits (fp32, 1e-5), the same tokens."""
    model = model_of(arch)
    plan = single_device_plan(model.cfg)
    seq = jax.random.randint(jax.random.key(5), (2, 12), 0, 512)
    logits = {}
    for kind in ("full", "latent_v", "latent"):
        cache, out = empty(kind, model.cfg, 2, 16), []
        step = nnx.jit(lambda m, t, c, p: m.decode(t, c, plan=plan, positions=p))
        for lo, hi in [(0, 9), (9, 10), (10, 11), (11, 12)]:
            x, cache = step(model, seq[:, lo:hi], cache, jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo)))
            out.append(np.asarray(x))
        logits[kind] = np.concatenate(out, axis=1)
    full = logits["full"]
    for kind in ("latent_v", "latent"):
        assert np.abs(logits[kind] - full).max() <= 1e-5 * np.abs(full).max(), kind
    tokens = {c: Decoder(model, plan, cache=c).generate(PROMPTS, 12).tokens for c in ("full", "latent_v", "latent")}
    assert tokens["latent"] == tokens["latent_v"] == tokens["full"]


# Latent heads (model.attn_latent_heads=g), and decoupled RoPE on top (model.attn_rope_dims): the latent
# caches split over tp by latent heads. (arch, g, tp, kv_heads, rope_dims); the inner tier: the absorbed
# cache split by latent heads. The slow tier: the latent cache split by them, the absorbed cache without
# latent heads on one device (svd; LaX's latent caches on one device:
# test_the_latent_caches_compute_what_the_full_one_does[lax]) and under tp, and LaX at tp = 4 with 2 kv
# heads per latent head.
LATENT_HEADS = [
    pytest.param("cola", 2, 2, 2, 0, id="cola-2-2-2", marks=pytest.mark.slow),
    pytest.param("cola", 2, 2, 2, 4, id="cola-2-2-2-absorbed"),
    pytest.param("svd", 1, 1, 2, 4, id="svd-1-1-2-absorbed", marks=pytest.mark.slow),
    pytest.param("cola", 1, 2, 2, 4, id="cola-1-2-2-absorbed", marks=pytest.mark.slow),
    pytest.param("lax", 4, 4, 8, 4, id="lax-4-4-8-absorbed", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch, g, tp, kv_heads, rope_dims", LATENT_HEADS)
def test_latent_caches_split_over_tp_and_decode_as_one_device(arch, g, tp, kv_heads, rope_dims):
    """Every cache kind gives the full cache's logits on one device and under btp at tp (fp32, 1e-5),
    where each device holds 1/tp of the latents (its own groups); greedy decoding with the split latent
    cache picks one device's tokens. With decoupled RoPE the latent cache keeps the k and v latents and
    the rotary keys and absorbs B_k and B_v (no key rebuilt)."""
    kw = dict(attn_latent_heads=g, n_kv_heads=kv_heads, **({"attn_rope_dims": rope_dims} if rope_dims else {}))
    model = Model(tiny(arch, **kw), rngs=nnx.Rngs(0))
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}", *(f"model.{k}={v}" for k, v in kw.items()),
                             "parallel.dp=1", f"parallel.tp={tp}", "train.batch_size=4"])
    one, plan = single_device_plan(model.cfg), make_plan(cfg, jax.devices()[:tp])
    seq = jax.random.randint(jax.random.key(5), (4, 11), 0, 512)
    graphdef, state = nnx.split(model, nnx.Param)

    def run(p, kind):  # a prefill and two steps -> logits, the cache's first layer
        params = jax.device_put(nnx.to_pure_dict(state), p.named(p.param_specs(state)))
        cache, out = tuple(c.constrain(p.constrain) for c in empty(kind, model.cfg, 4, 16)), []
        step = jax.jit(lambda params, t, c, pos: nnx.merge(graphdef, params).decode(t, c, plan=p, positions=pos))
        for lo, hi in [(0, 9), (9, 10), (10, 11)]:
            x, cache = step(params, seq[:, lo:hi], cache, jnp.broadcast_to(jnp.arange(lo, hi), (4, hi - lo)))
            out.append(np.asarray(x))
        return np.concatenate(out, axis=1), cache[0]

    full, _ = run(one, "full")
    # One device's full cache is the reference; at tp = 1 the plan is one device's.
    for kind, p in [("latent_v", one), ("latent", one), *((k, plan) for k in ("full", "latent_v", "latent") if tp > 1)]:
        logits, layer = run(p, kind)
        assert np.abs(logits - full).max() <= 1e-5 * np.abs(full).max(), (kind, p.mesh.shape)
        if not rope_dims and kind != "full":
            assert layer.v.sharding.shard_shape(layer.v.shape) == (4, 16, model.cfg.attn_rank // p.size("act_kv_latent"))
    split = plan.size("act_kv_latent")
    if rope_dims:
        assert type(layer).__name__ == "AbsorbedCache"
        assert layer.k.sharding.shard_shape(layer.k.shape) == (4, 16, model.cfg.attn_rank // split)
        assert layer.r.sharding.shard_shape(layer.r.shape) == (4, g // plan.size("act_kv_rope"), 16, rope_dims)
    else:
        assert split == tp
    tokens = Decoder(model, one).generate(PROMPTS, 12).tokens
    assert Decoder(model, plan, cache="latent").generate(PROMPTS, 12).tokens == tokens


@pytest.fixture(scope="module")
def cola_decoder():
    """cola's greedy decoder on one device, for the tests below that read its tokens (its programs, one per
    shape bucket, compiled once for them all)."""
    model = model_of("cola")
    return Decoder(model, single_device_plan(model.cfg))


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_a_row_does_not_depend_on_the_rest_of_its_batch(cola_decoder):
    together = cola_decoder.generate(PROMPTS, 16).tokens
    assert together == [cola_decoder.generate([p], 16).tokens[0] for p in PROMPTS]


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_sampling_is_reproducible_from_the_seed():
    model = model_of("cola")
    decoder = Decoder(model, single_device_plan(model.cfg))
    draw = lambda **kw: decoder.generate(PROMPTS, 16, Sampling(**kw)).tokens
    greedy = draw()
    assert draw(temperature=1.0, seed=7) == draw(temperature=1.0, seed=7)
    assert draw(temperature=1.0, seed=7) != draw(temperature=1.0, seed=8)
    assert draw(temperature=1.0, top_k=1, seed=7) == greedy  # only the most likely token is left
    assert draw(temperature=1.0, top_p=1e-6, seed=7) == greedy  # the smallest set is the most likely token
    assert draw(temperature=1.0, seed=7) != greedy
    # The seed is the programs' key argument, not part of them: the sampling modes drawn above
    # (greedy, temperature, top-k, top-p) are all the programs there are.
    assert decoder.programs == {"prefill": 4, "decode": 4}


def test_each_row_stops_at_its_end_of_document_token(cola_decoder):
    free = cola_decoder.generate(PROMPTS, 16).tokens
    eos = free[0][5]  # what row 0 says sixth: made the end-of-document token
    got = Decoder(model_of("cola"), cola_decoder.plan, eos_id=eos).generate(PROMPTS, 16).tokens
    assert got[0] == free[0][:free[0].index(eos)]
    for row, full in zip(got[1:], free[1:]):
        assert row == (full[:full.index(eos)] if eos in full else full)


@pytest.mark.parametrize("arch, cache, tp, model_kw", [("dense", "full", 1, {}),
                                             ("cola", "latent", 2, {"attn_latent_heads": 2, "n_kv_heads": 2})])
def test_a_decode_step_never_moves_the_cache(monkeypatch, arch, cache, tp, model_kw):
    """The loop's program writes each layer's cache in place and reads it where it lies: no
    transpose or copy of a cache-sized buffer (a token-major cache was transposed whole at every step;
    the split latent cache of latent heads, each device's values [B, T, r / tp], was copied to
    [B, r / tp, T] at every step)."""
    model = model_of(arch, **model_kw)
    plan = single_device_plan(model.cfg)
    if tp > 1:
        cfg = load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}", "parallel.dp=1", f"parallel.tp={tp}",
                                 "train.batch_size=8", *(f"model.{k}={v}" for k, v in model_kw.items())])
        plan = make_plan(cfg, jax.devices()[:tp])
    decoder = Decoder(model, plan, cache=cache)
    chunk, calls = decoder._chunk, []

    def record(*args, **kw):
        calls.append((jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args), kw))
        return chunk(*args, **kw)

    monkeypatch.setattr(decoder, "_chunk", record)
    monkeypatch.setattr(Decoder, "programs", property(lambda self: {}))
    decoder.generate(np.arange(3, 3 + 8 * 20).reshape(8, 20).tolist(), 4)
    args, kw = calls[0]
    cache_elems = math.prod(args[1][0].k.sharding.shard_shape(args[1][0].k.shape))  # per device, as the HLO's
    text = chunk.lower(*args, **kw).compile().as_text()
    moved = [line.strip()[:120] for line in text.splitlines()
             if (m := re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} (transpose|copy|fusion)\(", line))
             and math.prod(map(int, m.group(1).split(","))) == cache_elems
             and (m.group(2) != "fusion" or re.search(r"transpose|copy", line.split("=")[0]))]
    assert not moved, moved


@pytest.mark.parametrize("arch, scheme, dp, fsdp, tp, cache", [
    ("cola", "btp", 2, 1, 2, "full"),
    # each scheme's full cache at tp = 4, over llama-tiny's 2 kv heads (megatron's with fsdp)
    pytest.param("dense", "megatron", 1, 2, 4, "full", marks=pytest.mark.slow),
    pytest.param("lax", "vanilla", 2, 1, 4, "full", marks=pytest.mark.slow),
    pytest.param("svd", "btp", 1, 1, 4, "full", marks=pytest.mark.slow),
    # the latent caches under the schemes that split the rank (btp) or the heads (vanilla); latent_v's
    # split v latent is the latent cache's
    pytest.param("cola", "btp", 1, 1, 4, "latent", marks=pytest.mark.slow),
    pytest.param("lax", "vanilla", 1, 2, 2, "latent", marks=pytest.mark.slow),
])
def test_sharded_decoding_equals_one_device(arch, scheme, dp, fsdp, tp, cache):
    cfg = load_config(None, ["model.preset=llama-tiny", f"model.arch={arch}", f"parallel.scheme={scheme}",
                             f"parallel.dp={dp}", f"parallel.fsdp={fsdp}", f"parallel.tp={tp}", "train.batch_size=4"])
    model = model_of(arch)
    plan = make_plan(cfg, jax.devices()[:dp * fsdp * tp])
    one = Decoder(model, single_device_plan(model.cfg), cache=cache).generate(PROMPTS, 12).tokens
    assert Decoder(model, plan, cache=cache).generate(PROMPTS, 12).tokens == one  # 3 rows padded to the split of 2
    # and the logits, through the cache laid out by the scheme
    seq = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 10)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(10), (4, 10))
    graphdef, state = nnx.split(model, nnx.Param)

    def run(p):
        params = jax.device_put(nnx.to_pure_dict(state), p.named(p.param_specs(state)))
        decode = lambda params: nnx.merge(graphdef, params).decode(seq, empty(cache, model.cfg, 4, 16), plan=p,
                                                                    positions=pos)[0]
        return np.asarray(jax.jit(decode)(params))

    want, got = run(single_device_plan(model.cfg)), run(plan)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@contextlib.contextmanager
def compiles():
    """The programs built inside the block: jax.monitoring's lowering events, one per jit cache miss
    (a hit in the tests' persistent compilation cache skips XLA's compile, not the lowering)."""
    events = []
    listen = lambda event, _secs, **_: events.append(event) if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_the_api_compiles_once_per_model_and_follows_replaced_weights():
    model, other = (Model(tiny("dense"), rngs=nnx.Rngs(seed)) for seed in (10, 11))  # own models: nothing kept yet
    tokens = np.asarray([PROMPTS[0]], np.int32)
    with compiles() as first:
        out, logits = api.generate(model, PROMPTS, max_new_tokens=NEW), api.forward(model, tokens)
    with compiles() as again:
        assert api.generate(model, PROMPTS, max_new_tokens=NEW) == out
        np.testing.assert_array_equal(api.forward(model, tokens), logits)
    assert first and again == []
    want = Decoder(other, single_device_plan(other.cfg)).generate(PROMPTS, NEW).tokens
    want_logits = nnx.jit(lambda m, t: m(t, plan=single_device_plan(m.cfg)))(other, tokens)
    assert want != out
    nnx.update(model, nnx.state(other))  # the parameters replaced: the same programs, the new weights
    with compiles() as replaced:
        assert api.generate(model, PROMPTS, max_new_tokens=NEW) == want
        np.testing.assert_array_equal(api.forward(model, tokens), want_logits)
    assert replaced == []
    kept = weakref.ref(model)
    del model
    gc.collect()
    assert kept() is None  # what is kept for a model never keeps the model alive


def test_bf16_decoding_tracks_the_bf16_forward():
    """In bf16 the cache holds bf16 keys and values: prefill + steps stay within 2% of the logits'
    scale of the full bf16 forward (what a GPU would serve)."""
    model = Model(tiny("cola", dtype="bfloat16"), rngs=nnx.Rngs(0))
    plan = single_device_plan(model.cfg)
    seq = jax.random.randint(jax.random.key(6), (2, 12), 0, 512)
    want = np.asarray(nnx.jit(lambda m, t: m(t, plan=plan))(model, seq))
    cache, out = empty("full", model.cfg, 2, 16), []
    for lo, hi in [(0, 8), (8, 9), (9, 10), (10, 11), (11, 12)]:
        x, cache = nnx.jit(lambda m, t, c, p: m.decode(t, c, plan=plan, positions=p))(
            model, seq[:, lo:hi], cache, jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo)))
        out.append(np.asarray(x))
    assert np.abs(np.concatenate(out, axis=1) - want).max() <= 0.02 * np.abs(want).max()


def test_refusals_name_the_problem():
    model = model_of("dense")
    plan = single_device_plan(model.cfg)
    decoder = Decoder(model, plan)
    for prompts, new, needle in [([[]], 4, "prompt 0 is empty"), ([[1, 2]], 0, "max_new_tokens must be a positive"),
                                 ([[1, 600]], 4, "outside the vocabulary"), ([], 4, "no prompts")]:
        with pytest.raises(ConfigError, match=needle):
            decoder.generate(prompts, new)
    with pytest.raises(ConfigError, match="more than the model's 16"):
        decoder.generate([[1] * 10], 8, max_len=16)
    with pytest.raises(ConfigError, match="top_p must be in"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError, match="--cache latent: a latent cache needs a low-rank arch"):
        Decoder(model, plan, cache="latent")
    piped = load_config(None, ["model.preset=llama-tiny", "model.arch=dense", "parallel.pp=2", "parallel.dp=1",
                               "train.microbatches=2", "train.batch_size=4"])
    split = load_config(None, ["model.preset=llama-tiny", "model.arch=dense", "parallel.cp=2", "parallel.dp=1"])
    for cfg in (piped, split):
        with pytest.raises(ConfigError, match="without pipeline stages or context parallelism: pass parallel.pp=1 "
                                              "parallel.cp=1"):
            Decoder(model, make_plan(cfg, jax.devices()[:2]))


# ----------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def run_dir(tiny_run_dir):
    """A cola run dir trained 4 steps, with its checkpoint and tokenizer."""
    return tiny_run_dir


@pytest.mark.parametrize("overrides, tp, chosen", [
    # One CPU device (~2.5 FLOPs per byte): rebuilding every key from its latent costs more than the bytes
    # it saves, so the latent cache (256 of a full cache's 1,024 elements per token and layer) loses to
    # latent_v, which reads 640 and rebuilds nothing.
    ([], 1, "latent_v"),
    ([], 4, "full"),  # per device all three read 256 (latents replicated); a tie goes to full, which computes least
    (["model.attn_latent_heads=8"], 8, "latent_v"),  # latent 32 per device, but its rebuild still costs more
    (["model.attn_rope_dims=16"], 1, "latent"),  # absorbed: 272 per token and layer, no key rebuilt
    (["model.attn_rope_dims=16", "model.attn_latent_heads=4"], 4, "latent"),  # absorbed and split: 80
    (["model.arch=dense"], 1, "full"),
])
def test_the_auto_cache_is_the_fastest_modelled_step(overrides, tp, chosen):
    """`--cache auto`: llama-60m (8 kv heads of 64, rank 128) under btp at each tp, by a roofline of
    this CPU at one row of 4,096 positions."""
    from boost_jax.model.decode import choose_cache
    from boost_jax.parallel import make_plan

    cfg = load_config(None, ["model.preset=llama-60m", "model.arch=cola", f"parallel.tp={tp}", "parallel.dp=1",
                             "train.batch_size=8", *overrides])
    choice = choose_cache(cfg.model, make_plan(cfg, jax.devices()[:tp]))
    assert choice.kind == chosen and choice.step_us[chosen] == min(choice.step_us.values())
    assert choice.bytes_per_token["full"] == cfg.model.n_layers * 2 * 8 * 64 * 4 // tp  # fp32, split over the kv heads
    assert f"{chosen} (auto: the fastest modelled step" in choice.why()


def test_cli_generates_and_reports_as_json(run_dir, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nimport os\n")
    generate.main([str(run_dir), "--prompts-file", str(prompts), "--max-new-tokens", "8", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["prompts"] == ["def main(", "import os"] and len(out["tokens"]) == 2
    # --cache auto (the default) says which kind it chose, on stderr and in the JSON
    assert out["cache_auto"] and out["cache"] == min(out["cache_step_us"], key=out["cache_step_us"].get)
    assert f"cache: {out['cache']} (auto:" in captured.err
    assert all(len(t) <= 8 for t in out["tokens"]) and out["decode_tokens_per_s"] > 0
    _, model, _ = api.restore(run_dir)
    assert out["tokens"][0] == greedy_by_full_forwards(model, out["prompt_ids"][:1], len(out["tokens"][0]))[0]


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.dp=1"],
    pytest.param(["parallel.dp=2", "parallel.fsdp=2", "parallel.tp=2", "parallel.scheme=vanilla"], marks=pytest.mark.slow),
])
def test_cli_serves_the_checkpoint_on_any_layout_token_for_token(run_dir, capsys, tmp_path, layout):
    """Trained on one device, served under tp, fsdp (weights sharded, gathered per layer), dp: the
    same greedy tokens."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nimport os\nclass A:\n")

    def tokens(*overrides):
        generate.main([str(run_dir), "--prompts-file", str(prompts), "--max-new-tokens", "12", "--json", *overrides])
        return json.loads(capsys.readouterr().out)["tokens"]

    one = tokens()
    assert sum(map(len, one)) > 12 and tokens(*layout) == one


def test_cli_streams_one_prompt(run_dir, capsys):
    generate.main([str(run_dir), "--prompt", "def main(", "--max-new-tokens", "8", "model.dtype=bfloat16"])
    assert capsys.readouterr().out.startswith("def main(")


@pytest.mark.parametrize("args, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "inf"], "temperature must be >= 0 and finite (0 = greedy), got inf"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--max-new-tokens", "100"], "more than the model's 64 (train.seq_len"),
    (["model.d_model=128"], "different model.d_model"),
    (["--step", "3"], "has no checkpoint of step 3"),
    (["--prompt", ""], "--prompt is empty"),
    # Decoding's own reason first, not the pipeline schedule's want of micro-batches.
    (["parallel.pp=2"], "parallel.pp=2 parallel.cp=1: decoding runs without pipeline stages"),
])
def test_cli_refuses_bad_input_by_name(run_dir, args, needle):
    with pytest.raises(SystemExit, match=needle.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        generate.main([str(run_dir), "--prompt", "def main(", *args])


@pytest.mark.slow  # a process
def test_cli_errors_are_one_message(run_dir, tmp_path):
    """What a process shows of a refusal (exit 1, the message, no traceback), once; the refusals' own
    messages are checked in-process (above, and a missing run dir here)."""
    with pytest.raises(SystemExit, match="run dir not found"):
        generate.main([str(tmp_path / "nope"), "--prompt", "x"])
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02")
    proc = subprocess.run([sys.executable, "-m", "boost_jax.generate", str(run_dir), "--prompts-file", str(binary)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "not a text file" in proc.stderr, proc.stderr


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_decode_reports_speed_beside_the_floor(capsys):
    from boost_jax.bench import decode

    decode.main(["model.preset=llama-tiny", "model.arch=cola", "--batches", "2", "--prompt-len", "8",
                 "--new-tokens", "4", "--reps", "1", "--json"])  # a list of batches: the --hf test below
    r = json.loads(capsys.readouterr().out)
    assert [(x["cache"], x["batch"]) for x in r["rows"]] == [(c, 2) for c in ("full", "latent_v", "latent")]
    # llama-tiny: 2 layers x 2 kv heads x 8 dims; its latents are 16 wide, wider than the 2 x 8 of GQA's k.
    assert r["dense_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4 == r["rows"][0]["cache_bytes_per_token"]
    assert r["rows"][1]["cache_bytes_per_token"] == 2 * (2 * 8 + 16) * 4 and r["rows"][2]["cache_bytes_per_token"] == 2 * 2 * 16 * 4
    assert all(x["step_s"] > 0 and x["floor_s"] > 0 and x["decode_tokens_per_s"] > 0 for x in r["rows"])


@pytest.mark.slow  # four decoders compiled and timed: about 15 s of CPU
def test_bench_decode_varies_the_layout_side_by_side_with_each_devices_cache(capsys):
    """--vary: one run per value; a latent-heads model's latent cache is split over tp, as the full one."""
    from boost_jax.bench import decode

    decode.main(["model.preset=llama-tiny", "model.arch=cola", "model.attn_latent_heads=2", "--vary", "parallel.tp=1,2",
                 "--caches", "full,latent", "--batches", "2", "--prompt-len", "4", "--new-tokens", "2", "--reps", "1",
                 "--json"])
    r = json.loads(capsys.readouterr().out)
    assert [(run["variant"], run["tp"]) for run in r["runs"]] == [("parallel.tp=1", 1), ("parallel.tp=2", 2)]
    # llama-tiny: 2 layers; full: k and v, 2 kv heads x 8 dims; latent: h_k and h_v, 16 wide; fp32
    per_device = {(run["tp"], x["cache"]): x["cache_bytes_per_token_per_device"] for run in r["runs"] for x in run["rows"]}
    assert per_device == {(1, "full"): 256, (1, "latent"): 256, (2, "full"): 128, (2, "latent"): 128}
    assert all(x["cache_bytes_per_device"] == 2 * 6 * x["cache_bytes_per_token_per_device"] and x["decode_tokens_per_s"] > 0
               for run in r["runs"] for x in run["rows"])


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_bench_decode_times_xla_defaults_side_by_side(capsys):
    from boost_jax.bench import decode

    decode.main(["model.preset=llama-tiny", "model.arch=dense", "--batches", "2", "--prompt-len", "8",
                 "--new-tokens", "4", "--reps", "1", "--xla-defaults", "--api"])
    out = capsys.readouterr().out
    assert "under XLA's default options (side by side): step ms full b2 " in out
    assert re.search(r"api.generate in a loop, after its first call .*: full b2 [0-9,.]+ tok/s \([0-9.]+x\)", out)


@pytest.mark.slow  # torch and transformers beside XLA
def test_bench_decode_hf_times_a_steps_matmuls_in_both_libraries(capsys):
    """`--hf`: beside Hugging Face's generate, a decode step's matmuls alone, in the step's order, in
    PyTorch and in XLA."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from boost_jax.bench import decode, hf

    decode.main(["model.preset=llama-tiny", "model.arch=dense", "--caches", "full", "--batches", "1,3",
                 "--prompt-len", "8", "--new-tokens", "4", "--reps", "1", "--hf", "--json"])
    r = json.loads(capsys.readouterr().out)["hf"]
    full = load_config(None, ["model.preset=llama-tiny", "model.arch=dense"])
    cfg = full.model
    assert r["step_gemms"] == 7 * cfg.n_layers + 1 and [x["batch"] for x in r["rows"]] == [1, 3]
    assert all(x["step_gemms_s"] > 0 and x["xla_step_gemms_s"] > 0 for x in r["rows"])
    # Each layer's q, k, v, o, gate, up, down ([out, in], as torch keeps them), then the LM head.
    shapes = [w.shape for w in hf.step_weights(hf.load_llama(full))]
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    assert shapes == [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)] * cfg.n_layers + [(cfg.vocab_size, d)]


# ----------------------------------------------------------------------------- chat (generate --chat)


def test_a_row_stops_at_any_of_several_stop_tokens(cola_decoder):
    """A chat template's end-of-turn token and the eos: a row stops at whichever comes first."""
    free = cola_decoder.generate(PROMPTS[:1], 16).tokens[0]
    got = api.generate(model_of("cola"), PROMPTS[:1], max_new_tokens=16, eos_id=(free[7], free[4]))[0]
    assert got == free[:min(free.index(free[4]), free.index(free[7]))]


def test_cli_chat_renders_the_template_and_the_api_agrees(run_dir, capsys):
    """--chat: each prompt one user turn in the run's template (here the shipped ChatML one, the
    tiny run's tokenizer having none) with the assistant's opening; it stops at the <eos> that
    closes a turn, and api.generate_chat replies the same."""
    generate.main([str(run_dir), "--chat", "--prompt", "What is 2 + 3?", "--max-new-tokens", "6", "--json",
                   "data.chat_template=chatml"])
    out = json.loads(capsys.readouterr().out)
    chat = api.restore_chat(run_dir, "data.chat_template=chatml")
    assert chat.stop_ids == (chat.tokenizer.token_to_id("<eos>"),)
    assert out["prompt_ids"][0] == chat.tokenizer.encode("<|im_start|>user\nWhat is 2 + 3?<eos>\n"
                                                         "<|im_start|>assistant\n").ids
    _, model, _ = api.restore(run_dir)
    assert api.generate_chat(model, chat, ["What is 2 + 3?"], max_new_tokens=6) == out["texts"]
    with pytest.raises(api.DataError, match="conversations.0.: message 0 has the unknown role 'robot'"):
        api.generate_chat(model, chat, [[{"role": "robot", "content": "hi"}]], max_new_tokens=6)
