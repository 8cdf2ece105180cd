"""`bench decode [CONFIG.yaml] [section.key=value ...]`: generation speed on this machine against the
memory-bound floor.

For the config's model (random weights of its shape, one device unless the config's mesh says
otherwise), each cache kind (--caches) and batch size (--batches): prompts of --prompt-len tokens
are prefilled and --new-tokens generated greedily (`boost_jax/model/decode.py`), after a warm-up that
compiles the programs. Reported: prefill and decode tokens/s, the time of one decode step, the
bytes one cached token takes (all layers, beside what a dense model of the same shape keeps), and
the step against its memory-bound floor: a step reads every weight once (at the compute dtype: the
decoder serves the weights cast to it; of an untied embedding table only the rows looked up) and
every cached token of every row once, so it cannot take less than (weight bytes + cached bytes) /
the read bandwidth measured here (`flops.measure_read_bandwidth`). `--hf` times Hugging Face
`generate` (transformers + PyTorch, with its KV cache, greedy, the same prompts and token counts) on
the same dense LLaMA, when both are installed; both sides end to end, prefill included, and beside
them a decode step's matmuls alone (every projection and the LM head, one after another at the
batch's rows) in PyTorch and in XLA (compiled as the decoder's programs are): the GEMM libraries'
share of the difference.
`--xla-defaults` also times each step under XLA's default options, beside `decode.COMPILER_OPTIONS`.
`--api` also times `api.generate` called in a loop, as a user calls it (after its first call, which
compiles), beside the same call on the kept Decoder, both end to end.
`--vary section.key=V1,V2,...` measures one variant per value side by side in one run (repeat: every
combination), e.g. `--vary parallel.tp=1,2,4 --vary model.attn_latent_heads=1,4`: each row also
gives the bytes a cached token takes per device (a full cache split over the kv heads, a latent one
over tp only with latent heads, `decode.cache_bytes_per_token`). On simulated CPU devices the
tokens/s compare variants with one another, not with a real mesh.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boost_jax import api
from boost_jax.bench import hf
from boost_jax.bench.common import add_vary, config_of, parse, parser, seconds, variants
from boost_jax.config import Config, ConfigError
from boost_jax.config.archs import ARCHS
from boost_jax.launch.peaks import measure_read_bandwidth
from boost_jax.layers.kv_cache import CACHES, KVCache, cache_type
from boost_jax.model import Model
from boost_jax.model.decode import COMPILER_OPTIONS, Decoder, cache_bytes_per_token
from boost_jax.parallel import make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.runtime.cli import int_list
from boost_jax.runtime.units import MIB


def measure(cfg: Config, caches: list[str], batches: list[int], prompt_len: int, new_tokens: int, reps: int,
            bandwidth: float, xla_defaults: bool = False, through_api: bool = False) -> dict:
    """Rows of speeds per (cache kind, batch size), with the memory-bound floor of each decode step, the
    kinds timed in turn in every repetition on the same prompts;
    with `xla_defaults`, each row's step also timed (interleaved) under XLA's default options instead
    of `decode.COMPILER_OPTIONS`; with `through_api`, `api.generate` timed (interleaved) beside the
    kept Decoder's call."""
    m = cfg.model
    model = Model(m, rngs=nnx.Rngs(cfg.train.seed))
    plan = make_plan(cfg, mesh_devices(cfg.parallel))
    itemsize = jnp.dtype(m.dtype).itemsize
    weight_bytes = sum(x.size * itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # A step looks up one embedding row per sequence; only a tied head reads the whole table.
    table_bytes = 0 if m.tie_embeddings else model.embed[...].size * itemsize
    kinds = {cache: (Decoder(model, plan, cache=cache),
                     Decoder(model, plan, cache=cache, compiler_options={}) if xla_defaults else None)
             for cache in caches}
    rows = []
    rng = np.random.default_rng(0)
    for b in batches:
        prompts = rng.integers(3, m.vocab_size, (b, prompt_len)).tolist()  # every kind decodes the same prompts
        timed = {cache: ([], [], [], []) for cache in caches}  # runs, the baseline's, calls, api.generate's
        api_call = lambda cache: api.generate(model, prompts, max_new_tokens=new_tokens, plan=plan, cache=cache)
        for cache, pair in kinds.items():
            for d in filter(None, pair):
                d.generate(prompts, new_tokens)  # compiles every program this shape needs
            if through_api:
                api_call(cache)  # its first call: what api.generate keeps for the model is made here
        for _ in range(reps):  # the kinds interleaved: machine noise hits them alike
            for cache, (decoder, baseline) in kinds.items():
                runs, base, calls, api_calls = timed[cache]
                t0 = time.perf_counter()
                runs.append(decoder.generate(prompts, new_tokens))
                calls.append(time.perf_counter() - t0)
                if baseline:
                    base.append(baseline.generate(prompts, new_tokens).decode_s)
                if through_api:
                    api_calls.append(seconds(lambda: api_call(cache)))
        for cache, (decoder, _) in kinds.items():
            runs, base, calls, api_calls = timed[cache]
            per_token = cache_type(cache, m).bytes_per_token(m, itemsize)
            per_device = cache_bytes_per_token(cache, m, plan)
            prefill = statistics.median(r.prefill_s for r in runs)
            decode = statistics.median(r.decode_s for r in runs)
            steps = new_tokens - 1  # the first new token comes from the prefill
            # Cached tokens a step reads, on average over the steps: each row's prompt and what it has made.
            cached = b * (prompt_len + new_tokens / 2)
            read = weight_bytes - table_bytes + (b * m.d_model * itemsize if table_bytes else 0)
            floor = (read + cached * per_token) / bandwidth
            rows.append({"cache": cache, "batch": b, "prefill_tokens_per_s": b * prompt_len / prefill,
                         "decode_tokens_per_s": b * steps / decode, "step_s": decode / steps, "floor_s": floor,
                         "end_to_end_tokens_per_s": b * new_tokens / (prefill + decode),
                         "step_over_floor": decode / steps / floor, "cache_bytes_per_token": per_token,
                         "cache_bytes_per_token_per_device": per_device,
                         "cache_bytes_per_device": b * (prompt_len + new_tokens) * per_device,
                         "programs": decoder.programs,
                         **({"xla_defaults_step_s": statistics.median(base) / steps} if base else {}),
                         **({"call_s": statistics.median(calls), "api_call_s": statistics.median(api_calls),
                             "api_tokens_per_s": b * new_tokens / statistics.median(api_calls)} if api_calls else {})})
    rows.sort(key=lambda r: caches.index(r["cache"]))  # by kind, then batch, as the tables read them
    return {"model": m.preset, "arch": m.arch, "dtype": m.dtype, "tp": cfg.parallel.tp,
            "attn_latent_heads": m.attn_latent_heads, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "weight_bytes": weight_bytes, "dense_cache_bytes_per_token": KVCache.bytes_per_token(m, itemsize),
            "rows": rows}


def measure_with_bandwidth(run) -> dict:
    """`run(bandwidth)` bracketed by `measure_read_bandwidth` (the best of before and after: noise only slows),
    its floors then scaled to the best bandwidth."""
    before = measure_read_bandwidth()
    result = run(before)
    best = max(before, measure_read_bandwidth())
    for run_result in result["runs"] if "runs" in result else [result]:
        for r in run_result["rows"]:
            r["floor_s"] *= before / best
            r["step_over_floor"] = r["step_s"] / r["floor_s"]
    return {"read_bandwidth_bytes_per_s": best, **result}


def gemm_chain_seconds(weights: list[np.ndarray], batch: int, reps: int) -> float:
    """Seconds XLA takes for `weights`' ([out, in]) matmuls of `batch` rows one after another, compiled
    as the decoder's programs are (`decode.COMPILER_OPTIONS`, each weight [in, out] as our layers keep
    it): the median of `reps` (hf.gemm_chain_seconds is PyTorch's)."""
    chain = [jnp.asarray(w.T) for w in weights]
    inputs = {w.shape[1]: jax.random.normal(jax.random.key(0), (batch, w.shape[1])) for w in weights}

    def chained(chain, inputs):
        s = jnp.zeros(())
        for w in chain:
            s = ((inputs[w.shape[0]] + s) @ w)[0, 0] * 1e-30
        return s

    run = jax.jit(chained, compiler_options=COMPILER_OPTIONS.get(jax.devices()[0].platform, {}))
    run(chain, inputs).block_until_ready()
    return statistics.median(seconds(lambda: run(chain, inputs).block_until_ready()) for _ in range(reps))


def hf_generate(cfg: Config, batches: list[int], prompt_len: int, new_tokens: int, reps: int) -> dict:
    """Hugging Face `generate` (greedy, its KV cache) on the same dense LLaMA, exported by boost_jax;
    per batch also a decode step's matmuls alone, one after another, in PyTorch and in XLA: how much
    of the difference is the two GEMM libraries' at a step's few rows."""
    import torch  # optional: torch

    hf_model = hf.load_llama(cfg).eval()
    weights = hf.step_weights(hf_model)
    rows = []
    rng = np.random.default_rng(0)
    for b in batches:
        prompts = torch.tensor(rng.integers(3, cfg.model.vocab_size, (b, prompt_len)))
        run = lambda: hf_model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        with torch.inference_mode():
            run()
            call_s = statistics.median(seconds(run) for _ in range(reps))
        rows.append({"batch": b, "end_to_end_tokens_per_s": b * new_tokens / call_s, "seconds": call_s,
                     "step_gemms_s": hf.gemm_chain_seconds(weights, b, 5 * reps),
                     "xla_step_gemms_s": gemm_chain_seconds(weights, b, 5 * reps)})
    return {**hf.versions(), "step_gemms": len(weights), "rows": rows}


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench decode", __doc__)
    p.add_argument("--caches", default="",
                   help=f"comma-separated, from {list(CACHES)} (default: every kind the arch has; the latent kinds: "
                        "low-rank archs)")
    p.add_argument("--batches", type=int_list, default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf", action="store_true", help="also time Hugging Face generate (needs torch and transformers)")
    p.add_argument("--api", action="store_true",
                   help="also time api.generate called in a loop, beside the kept Decoder's call")
    p.add_argument("--xla-defaults", action="store_true",
                   help="also time each decode step under XLA's default options, side by side (decode.COMPILER_OPTIONS)")
    add_vary(p)
    a = parse(p, argv)
    if a.prompt_len < 1 or a.new_tokens < 2 or a.reps < 1 or not a.batches or min(a.batches) < 1:
        raise ConfigError("--prompt-len, --reps and --batches must be at least 1 and --new-tokens at least 2")
    if a.vary and a.hf:
        raise ConfigError("--hf times one dense LLaMA: leave out --vary")
    configs = variants(a.config, a.vary, decoding=True) if a.vary else [("", config_of(a.config, decoding=True))]
    cfg = configs[0][1]
    if a.hf:
        hf.check_llama(cfg)
    low_rank = ARCHS[cfg.model.arch].low_rank
    caches = [c for c in a.caches.split(",") if c] or [c for c in CACHES if low_rank or not c.startswith("latent")]
    if bad := [c for c in caches if c not in CACHES]:
        raise ConfigError(f"--caches: unknown {bad}; choose from {list(CACHES)}")
    if not low_rank and (bad := [c for c in caches if c.startswith("latent")]):
        raise ConfigError(f"--caches {','.join(bad)}: model.arch={cfg.model.arch} has no latents (full only)")
    if a.vary:
        result = {"device": jax.devices()[0].device_kind, **measure_with_bandwidth(lambda bandwidth: {"runs": [
            {"variant": label, **measure(c, caches, a.batches, a.prompt_len, a.new_tokens, a.reps, bandwidth,
                                         a.xla_defaults, a.api)} for label, c in configs]})}
        print(json.dumps(result, indent=1)) if a.json else print_variants(result)
        return
    result = {"device": jax.devices()[0].device_kind, **measure_with_bandwidth(
        lambda bandwidth: measure(cfg, caches, a.batches, a.prompt_len, a.new_tokens, a.reps, bandwidth,
                                  a.xla_defaults, a.api))}
    if a.hf:
        result["hf"] = hf_generate(cfg, a.batches, a.prompt_len, a.new_tokens, a.reps)
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print_table(result)


def print_variants(r: dict) -> None:
    """The --vary table: one row per variant, cache kind and batch size."""
    first = r["runs"][0]
    print(f"{first['model']} {first['arch']} {first['dtype']} on {r['device']}: prompts of {first['prompt_len']}, "
          f"{first['new_tokens']} new tokens, greedy; tokens/s compare the rows (simulated devices share this host's cores)")
    print(f"{'variant':40s} {'cache':8s} {'batch':>5s} {'B/token/dev':>11s} {'cache MiB/dev':>13s} {'decode tok/s':>12s} "
          f"{'step ms':>8s}")
    for run in r["runs"]:
        for row in run["rows"]:
            print(f"{run['variant']:40s} {row['cache']:8s} {row['batch']:5d} {row['cache_bytes_per_token_per_device']:11,d} "
                  f"{row['cache_bytes_per_device'] / MIB:13.2f} {row['decode_tokens_per_s']:12,.1f} "
                  f"{1e3 * row['step_s']:8.2f}")


def print_table(r: dict) -> None:
    print(f"{r['model']} {r['arch']} {r['dtype']} on {r['device']}: prompts of {r['prompt_len']}, {r['new_tokens']} new "
          f"tokens, greedy; weights {r['weight_bytes'] / MIB:.1f} MiB; read bandwidth "
          f"{r['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"{'cache':7s} {'batch':>5s} {'B/token':>8s} {'per dev':>8s} {'prefill tok/s':>13s} {'decode tok/s':>12s} "
          f"{'step ms':>8s} {'floor ms':>8s} {'x floor':>7s}")
    for row in r["rows"]:
        print(f"{row['cache']:7s} {row['batch']:5d} {row['cache_bytes_per_token']:8d} "
              f"{row['cache_bytes_per_token_per_device']:8d} {row['prefill_tokens_per_s']:13,.0f} "
              f"{row['decode_tokens_per_s']:12,.1f} {1e3 * row['step_s']:8.2f} {1e3 * row['floor_s']:8.2f} "
              f"{row['step_over_floor']:7.2f}")
    print(f"(a dense model of this shape caches {r['dense_cache_bytes_per_token']} bytes per token)")
    if any("xla_defaults_step_s" in row for row in r["rows"]):
        print("under XLA's default options (side by side): step ms "
              + ", ".join(f"{row['cache']} b{row['batch']} {1e3 * row['xla_defaults_step_s']:.2f} "
                          f"({row['xla_defaults_step_s'] / row['step_s']:.2f}x)" for row in r["rows"]))
    if any("api_call_s" in row for row in r["rows"]):
        print("api.generate in a loop, after its first call (end to end; x: its call's time over the kept Decoder's): "
              + ", ".join(f"{row['cache']} b{row['batch']} {row['api_tokens_per_s']:,.1f} tok/s "
                          f"({row['api_call_s'] / row['call_s']:.2f}x)" for row in r["rows"]))
    if hf := r.get("hf"):
        print(f"Hugging Face generate (transformers {hf['transformers']}, torch {hf['torch']}, {hf['threads']} threads):")
        for row in hf["rows"]:
            mine = next(x for x in r["rows"] if x["batch"] == row["batch"] and x["cache"] == "full")
            print(f"  batch {row['batch']:3d}: {row['end_to_end_tokens_per_s']:10,.1f} tokens/s end to end; boost_jax "
                  f"{mine['end_to_end_tokens_per_s']:,.1f} ({mine['end_to_end_tokens_per_s'] / row['end_to_end_tokens_per_s']:.2f}x)\n"
                  f"             a step's {hf['step_gemms']} matmuls alone, one after another: PyTorch {1e3 * row['step_gemms_s']:.2f} ms, XLA "
                  f"{1e3 * row['xla_step_gemms_s']:.2f} ms ({row['xla_step_gemms_s'] / row['step_gemms_s']:.2f}x), "
                  f"boost_jax's whole step {1e3 * mine['step_s']:.2f} ms")
