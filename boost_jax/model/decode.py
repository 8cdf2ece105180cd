"""Text generation: a batch of prompts prefilled in one forward, then a compiled decode loop.

    decoder = Decoder(model, plan, cache="full", eos_id=2)
    out = decoder.generate([[5, 9, 31], [7]], max_new_tokens=32, sampling=Sampling(temperature=0.8, top_p=0.95))
    out.tokens                                  # each row's new tokens (up to, not including, its <eos>)

Prompts of different lengths share one batch: they are right-padded and prefilled together, and
each row then decodes at its own next position (the cache and causality keep rows apart: a row's
tokens never depend on the others in its batch). Programs are compiled per (batch size, prompt
length bucket) for the prefill and per (batch size, cache length bucket) for the decode loop, never
per token: the loop runs up to `CHUNK` steps per call in a `lax.while_loop` and stops early when
every row is done. The cache holds, from the prefill on, the positions the longest row may reach
(its prompt + max_new_tokens, to the next power of two): one decode program per generation, where a
cache grown on demand took one per bucket passed and a program to grow it each time. Sampling is greedy at temperature 0; otherwise temperature, top-k and top-p (nucleus)
shape the distribution and token i of every row is drawn with `fold_in(key(seed), i)`, so a seed
reproduces a generation whatever the chunking.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from boost_jax.config.archs import ARCHS, AUTO_CACHE
from boost_jax.layers.kv_cache import CACHES, Cache, cache_type, empty
from boost_jax.model import Model, unstack_layers
from boost_jax.model.cache_choice import REFERENCE, Roofline, step_seconds
from boost_jax.parallel.plan import Plan
from boost_jax.runtime.errors import ConfigError

DECODING_LAYOUT = ("decoding runs without pipeline stages or context parallelism: pass parallel.pp=1 "
                   "parallel.cp=1 (a checkpoint restores onto any layout)")
CHUNK = 16  # decode steps per call of the compiled loop (the granularity of streaming)
MIN_BUCKET = 16
# XLA options of the prefill and decode programs, per platform. On CPU, XLA's default library for
# dots (YNNPACK) runs a decode step's skinny GEMMs, [batch, d] x [d, n] at batch 8-32, several times
# slower than the memory-bound floor; XNNPACK's runs them faster (`bench decode`, docs/results.md).
COMPILER_OPTIONS = {"cpu": {"xla_cpu_experimental_ynn_fusion_type": "",
                            "xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}}


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled from the temperature-scaled
    distribution cut to its top_k tokens (0: all) and to the smallest set of top_p probability."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name, kind in (("temperature", (int, float)), ("top_k", int), ("top_p", (int, float)), ("seed", int)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if not 0 <= self.temperature < float("inf"):  # inf would sample uniformly, whatever the model says
            raise ConfigError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = no cut), got {self.top_k}")


@dataclass
class Generation:
    """What `Decoder.generate` returns: each row's new tokens, and where the time went."""

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0
    programs: dict[str, int] = field(default_factory=dict)

    def timings(self) -> dict:
        """Seconds and tokens/s of the prefill and the decode loop (compile time included in the first call)."""
        rate = lambda n, s: n / s if s > 0 else None
        return {"prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "prefill_tokens_per_s": rate(self.prompt_tokens, self.prefill_s),
                "decode_tokens_per_s": rate(self.new_tokens, self.decode_s)}


def bucket(n: int) -> int:
    """The power of two >= n (at least MIN_BUCKET): the lengths programs are compiled for."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def _as_returned(sharding: NamedSharding) -> NamedSharding:
    """`sharding` as a program returns it: without the mesh axes of size 1 (and trailing None), as
    XLA writes an output's layout. The decode loop's state, first placed this way, is then laid out
    as the loop hands it back, and the loop's next call is the same program."""
    sizes = sharding.mesh.shape
    keep = lambda entry: tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a and sizes[a] > 1)
    entries = [axes[0] if len(axes) == 1 else (axes or None) for axes in map(keep, sharding.spec)]
    while entries and entries[-1] is None:
        entries.pop()
    return NamedSharding(sharding.mesh, PartitionSpec(*entries))


def sample(logits: jax.Array, key: jax.Array, index: jax.Array, sampling: Sampling) -> jax.Array:
    """Token ids [B] from logits [B, V]: greedy at temperature 0, else drawn with fold_in(key, index)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        before = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) - jax.nn.softmax(sorted_logits, axis=-1)
        keep_sorted = before < sampling.top_p  # the smallest prefix reaching top_p (the first token always)
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(jax.random.fold_in(key, index), logits).astype(jnp.int32)


def _served(w, sharding, dtype):
    """A parameter as a decoder serves it: floats at the compute dtype, laid out by `sharding` (an
    abstract one, jax.ShapeDtypeStruct, stays abstract)."""
    if jnp.issubdtype(w.dtype, jnp.floating):
        if isinstance(w, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(w.shape, dtype, sharding=sharding)
        w = w.astype(dtype) if w.dtype != dtype else w
    return jax.device_put(w, sharding)


def cache_bytes_per_token(kind: str, cfg, plan: Plan) -> int:
    """Bytes one cached position of one row takes on one device, all layers, for a cache `kind`
    (CACHES) laid out by `plan`: a full cache is split over the kv heads, a latent one over tp only
    with latent heads (`model.attn_latent_heads`), else replicated."""
    kind_type = cache_type(kind, cfg)
    layer = jax.eval_shape(lambda: kind_type.empty(cfg, 1, 1))
    on_device = lambda a, axes: math.prod(plan.sharding(axes).shard_shape(a.shape)) * a.dtype.itemsize
    per_layer = sum(on_device(getattr(layer, name), (None, *axes[1:])) for name, axes in kind_type.AXES.items())
    return cfg.n_layers * per_layer


@dataclass(frozen=True)
class CacheChoice:
    """`--cache auto`'s answer: the kind, and per kind its bytes per cached token per device and its
    modelled step (`model/cache_choice.py`) at `batch` rows of `context` positions."""

    kind: str
    bytes_per_token: dict[str, int]
    step_us: dict[str, float]
    batch: int
    context: int

    def why(self) -> str:
        """One line: what was chosen and why."""
        per = ", ".join(f"{k} {self.step_us[k]:,.1f} us ({self.bytes_per_token[k]:,} B/token)" for k in self.step_us)
        return (f"{self.kind} (auto: the fastest modelled step here, at batch {self.batch} and {self.context} "
                f"positions, by a roofline of bytes read and FLOPs: {per})")


def choose_cache(cfg, plan: Plan, batch: int = REFERENCE[0], context: int = REFERENCE[1]) -> CacheChoice:
    """The cache kind whose decode step is modelled fastest for `cfg` under `plan` at `batch` rows of
    `context` positions (`model/cache_choice.step_seconds`: bytes read and FLOPs by a roofline of
    the plan's device). A tie goes to the kind that computes less per step: full, then latent_v, then
    latent (docs/design.md section 11)."""
    kinds = [k for k in CACHES if k == "full" or ARCHS[cfg.arch].low_rank]
    sizes = {k: cache_bytes_per_token(k, cfg, plan) for k in kinds}
    roofline = Roofline.of(plan.platform)
    tp = plan.size("act_heads")
    seconds = {k: step_seconds(k, cfg, sizes[k], tp, tp, roofline, batch, context) for k in kinds}
    kind = min(kinds, key=lambda k: (seconds[k], kinds.index(k)))
    return CacheChoice(kind, sizes, {k: s * 1e6 for k, s in seconds.items()}, batch, context)


class Decoder:
    """A model's generation under one plan: its parameters laid out once, its programs compiled per
    shape bucket and kept (`programs` counts them). `compiler_options`: XLA's options for the
    prefill and decode programs (None: the plan's platform's `COMPILER_OPTIONS`; {}: XLA's defaults).
    An abstract model (its parameters jax.ShapeDtypeStruct: weights.abstract_model) gives a decoder
    whose programs compile (`compiled`: what `bench memory --inference` reads) but never run.
    `cache="auto"` takes `choose_cache`'s kind (`cache_name` says which)."""

    def __init__(self, model: Model, plan: Plan, *, cache: str = "full", eos_id: int | Sequence[int] | None = None,
                 compiler_options: dict | None = None):
        if cache not in (*CACHES, AUTO_CACHE):
            raise ConfigError(f"cache {cache!r}: choose one of {[*CACHES, AUTO_CACHE]}")
        if plan.pipeline is not None or plan.size("seq") > 1:
            raise ConfigError(DECODING_LAYOUT)
        self.cfg, self.plan, self.eos_id = model.cfg, plan, eos_id
        # The ids a row stops at: the end-of-document token, or a chat template's end-of-turn ones.
        self.stops = () if eos_id is None else (int(eos_id),) if np.ndim(eos_id) == 0 else tuple(map(int, eos_id))
        self.cache_name = choose_cache(self.cfg, plan).kind if cache == AUTO_CACHE else cache
        try:
            cache_type(self.cache_name, self.cfg).empty(self.cfg, 1, 1)  # a latent cache refuses a dense model here
        except ValueError as e:
            raise ConfigError(f"--cache {cache}: {e}") from None
        self.graphdef, state = nnx.split(model, nnx.Param)
        self._lay_out(state)
        self.rows = plan.size("batch")  # a batch is padded to a multiple of the data-parallel split
        if compiler_options is None:
            compiler_options = COMPILER_OPTIONS.get(plan.mesh.devices.flat[0].platform, {})
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("length", "sampling"),
                                compiler_options=compiler_options)
        self._chunk = jax.jit(self._chunk_fn, static_argnames=("sampling", "max_new"), donate_argnums=(1,),
                              compiler_options=compiler_options)

    def _lay_out(self, state: nnx.State) -> None:
        """Place the parameters `state` for the plan, remembering (weakly) which arrays they came from."""
        leaves = jax.tree.leaves(nnx.to_pure_dict(state))
        # Served at the compute dtype: a step reads every weight once, so bf16 weights halve its bytes.
        # Cast and placed on the devices, never through the host; weights already in that dtype and
        # layout (api.restore onto this plan) are used as they are, not copied.
        params = jax.tree.map(lambda w, s: _served(w, s, jnp.dtype(self.cfg.dtype)), nnx.to_pure_dict(state),
                              self.plan.named(self.plan.param_specs(state)))
        # Each layer's weights its own buffers (the layers run one by one); the stack's shapes stand in
        # for it in the model, which never reads it while decoding.
        stacked = params.pop("layers")
        self.params = {"rest": params, "layers": unstack_layers(stacked, self.cfg.n_layers)}
        self.stack = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), stacked)
        # Weak references to the arrays laid out, what refresh compares; an abstract model's have none.
        self._sources = [weakref.ref(w) for w in leaves if isinstance(w, jax.Array)]

    def refresh(self, model: Model) -> None:
        """Take `model`'s parameters again if any was replaced since they were laid out (a Variable
        assigned, `nnx.update`, an optimizer step: JAX arrays are never changed in place); the
        compiled programs are kept. `model` has the structure this Decoder was built for."""
        graphdef, state = nnx.split(model, nnx.Param)
        if graphdef != self.graphdef:
            raise ConfigError("Decoder.refresh: the model's structure differs from the one this Decoder was "
                              "built for; build a Decoder for it")
        leaves = jax.tree.leaves(nnx.to_pure_dict(state))
        if len(leaves) != len(self._sources) or any(ref() is not w for ref, w in zip(self._sources, leaves)):
            self._lay_out(state)

    @property
    def programs(self) -> dict[str, int]:
        """Compiled programs so far: prefill per (batch, prompt bucket), the loop per (batch, cache bucket)."""
        return {"prefill": self._prefill._cache_size(), "decode": self._chunk._cache_size()}

    def _decode(self, params, tokens, cache: Cache, positions, logits_at):
        model = nnx.merge(self.graphdef, {**params["rest"], "layers": self.stack})
        return model.decode(tokens, cache, plan=self.plan, positions=positions, logits_at=logits_at,
                            layers=params["layers"])

    def _empty(self, batch: int, length: int) -> Cache:
        cache = empty(self.cache_name, self.cfg, batch, length)
        return tuple(c.constrain(self.plan.constrain) for c in cache)

    def _prefill_fn(self, params, tokens, lengths, key, *, length: int, sampling: Sampling):
        """Prompts [B, P] (right-padded) into an empty cache of `length`; the first new token of each row."""
        b, p = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(p), (b, p))
        logits, cache = self._decode(params, tokens, self._empty(b, length), positions, lengths - 1)
        return sample(logits, key, jnp.int32(0), sampling), cache

    def _chunk_fn(self, params, cache, state, key, *, sampling: Sampling, max_new: int):
        """Up to CHUNK decode steps, stopping early when every row is done (the cache holds every
        position a row may reach: `generate` sizes it)."""

        def more(carry):
            i, _, s = carry
            return (i < CHUNK) & ~jnp.all(s["done"])

        def step(carry):
            i, cache, s = carry
            logits, cache = self._decode(params, s["last"][:, None], cache, s["position"][:, None],
                                         jnp.zeros_like(s["last"]))
            token = sample(logits, key, s["index"], sampling)
            live = ~s["done"]
            # A done row writes nothing (its slot index is out of range) and stays where it is.
            out = s["out"].at[jnp.arange(token.shape[0]), jnp.where(live, s["count"], max_new)].set(token, mode="drop")
            count = s["count"] + live
            done = s["done"] | (live & jnp.isin(token, self._eos())) | (count >= max_new)
            return i + 1, cache, {"last": jnp.where(live, token, s["last"]), "position": s["position"] + live,
                                  "count": count, "done": done, "out": out, "index": s["index"] + 1}

        _, cache, state = jax.lax.while_loop(more, step, (jnp.int32(0), cache, state))
        # The state laid out as it came in (its rows on the batch axes), so the next call is this program.
        rows = lambda v: self.plan.constrain(v, ("batch",) + (None,) * (v.ndim - 1)) if v.ndim else v
        return cache, jax.tree.map(rows, state)

    def _eos(self) -> np.ndarray:
        return np.asarray(self.stops or (-1,), np.int32)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
                 max_len: int | None = None, on_tokens: Callable[[list[list[int]]], None] | None = None) -> Generation:
        """Each prompt's continuation: up to `max_new_tokens` new tokens, a row stopping at `eos_id`
        (which is not returned). `max_len`: the positions a row may reach (prompt + new), refused
        beyond. `on_tokens` sees every row's tokens so far after the prefill (the first token) and
        after each decode call (streaming)."""
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, max_new_tokens, max_len)
        n = len(prompts)
        b = -(-n // self.rows) * self.rows  # padding rows (copies of the first prompt) keep the split even
        rows = prompts + [prompts[0]] * (b - n)
        lengths = np.array([len(p) for p in rows], np.int32)
        width = bucket(int(lengths.max()))
        tokens = np.zeros((b, width), np.int32)
        for i, p in enumerate(rows):
            tokens[i, :len(p)] = p
        key = jax.random.key(sampling.seed)
        sampling = replace(sampling, seed=0)  # the programs take the key: a new seed is no new program
        length = bucket(int(lengths.max()) + max_new_tokens)  # every position a row may reach
        put = lambda x: jax.device_put(x, _as_returned(self.plan.sharding(("batch",) + (None,) * (x.ndim - 1))))
        t0 = time.perf_counter()
        first, cache = self._prefill(self.params, put(tokens), put(lengths), key, length=length, sampling=sampling)
        first = np.asarray(first)
        prefill_s = time.perf_counter() - t0
        done = np.isin(first, self._eos()) | (max_new_tokens <= 1)
        out = np.full((b, max_new_tokens), -1, np.int32)
        out[:, 0] = first
        if on_tokens is not None:
            on_tokens(self._rows(out[:n]))
        state = jax.tree.map(put, {"last": first, "position": lengths.copy(), "count": np.ones(b, np.int32),
                                   "done": done, "out": out})
        # The generation index of the next token (its sampling key), on the mesh as the loop returns it:
        # the second call of the loop is then the first's program.
        state["index"] = jax.device_put(jnp.int32(1), _as_returned(self.plan.sharding(())))
        t0 = time.perf_counter()
        while not np.all(jax.device_get(state["done"])):
            cache, state = self._chunk(self.params, cache, state, key, sampling=sampling, max_new=max_new_tokens)
            if on_tokens is not None:
                on_tokens(self._rows(jax.device_get(state["out"])[:n]))
        decode_s = time.perf_counter() - t0
        result = self._rows(jax.device_get(state["out"])[:n])
        return Generation(result, prefill_s, decode_s, int(lengths[:n].sum()), sum(map(len, result)), self.programs)

    def compiled(self, batch: int, prompt: int, length: int, max_new: int = CHUNK) -> dict:
        """The programs of a generation, compiled without running: the prefill of `batch` prompts of
        `prompt` tokens into a cache of `length` positions, and one call of the decode loop on that
        cache (up to CHUNK steps of every row, `max_new` tokens each), greedy."""
        prefill, cache = self.compiled_prefill(batch, prompt, length)
        return {"prefill": prefill, "decode": self.compiled_decode(cache, batch, max_new), "cache": cache}

    def compiled_prefill(self, batch: int, prompt: int, length: int) -> tuple[jax.stages.Compiled, Cache]:
        """The prefill program (`compiled`) and the cache it returns, as abstract arrays with their layout."""
        key, sampling = jax.random.key(0), Sampling()
        prefill = self._prefill.trace(self.params, self._rows_of(batch, prompt), self._rows_of(batch), key,
                                      length=length, sampling=sampling)
        compiled = prefill.lower().compile()
        cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             prefill.out_info[1], compiled.output_shardings[1])
        return compiled, cache

    def compiled_decode(self, cache: Cache, batch: int, max_new: int = CHUNK) -> jax.stages.Compiled:
        """One call of the decode loop on `cache` (a `compiled_prefill`'s, of `batch` rows), compiled."""
        rows = lambda *shape: self._rows_of(batch, *shape)
        state = {"last": rows(), "position": rows(), "count": rows(), "done": rows(), "out": rows(max_new),
                 "index": jax.ShapeDtypeStruct((), jnp.int32)}
        state["done"] = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=state["done"].sharding)
        return self._chunk.lower(self.params, cache, state, jax.random.key(0), sampling=Sampling(),
                                 max_new=max_new).compile()

    def _rows_of(self, batch: int, *shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch, *shape), jnp.int32,
                                    sharding=self.plan.sharding(("batch",) + (None,) * len(shape)))

    def _rows(self, out: np.ndarray) -> list[list[int]]:
        """Each row's tokens up to its first <eos> or unwritten slot."""
        rows = []
        for r in out.tolist():
            end = next((i for i, t in enumerate(r) if t < 0 or t in self.stops), len(r))
            rows.append(r[:end])
        return rows

    def _check(self, prompts: list[list[int]], max_new_tokens: int, max_len: int | None) -> None:
        vocab = self.cfg.vocab_size
        if not prompts:
            raise ConfigError("no prompts to generate from")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        for i, p in enumerate(prompts):
            if not p:
                raise ConfigError(f"prompt {i} is empty: a continuation needs at least one token")
            if bad := [t for t in p if not 0 <= t < vocab]:
                raise ConfigError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            if max_len is not None and len(p) + max_new_tokens > max_len:
                raise ConfigError(f"prompt {i} ({len(p)} tokens) + max_new_tokens={max_new_tokens} = "
                                  f"{len(p) + max_new_tokens} positions is more than the model's {max_len} "
                                  "(train.seq_len, the context it was trained on); shorten the prompt or "
                                  "max_new_tokens (nothing is truncated)")
