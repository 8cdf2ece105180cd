"""The serving engine: continuous batching over a paged cache.

    engine = Engine(model, plan, ServeConfig(slots=8), cache="auto", eos_id=2, context=1024)
    engine.warm_up()                                   # every program compiled here, never per request
    request = engine.submit(Request([5, 9, 31], max_tokens=32, on_event=print))
    while engine.step(): ...                           # or engine.start(): a thread steps it

`slots` sequences decode together, one token each per step (the decode program, [slots, 1]). A
request waits in a queue until a slot is free and the page pool can promise it every page it may
need (serve/pages.py); its prompt is then prefilled `prefill_chunk` tokens per step (the prefill
program, [1, prefill_chunk]), one chunk between two decode steps, so a long prompt never stalls the
slots already decoding. After its last chunk (which samples its first token) it joins the decode
step that follows, and at its end (its <eos>, max_tokens, or a cancellation) its slot and pages are
freed at once, taken by the next request at the next step.

Both programs take every per-request choice as an array (positions, page tables, temperature,
top_p, seed), so they are compiled once each for their shapes (`warm_up`) and `compilations` does
not move while serving. Both run the model's own cached decoding (Model.decode through the
Decoder's laid-out parameters) over a view of each row's pages (layers/paged_cache.py), so a greedy
completion is the token sequence `Decoder.generate` gives. Token i of a sampled request is drawn
with fold_in(key(seed), i): a seed repeats a completion whatever the other slots hold.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from boost_jax.config import ServeConfig
from boost_jax.layers import paged_cache
from boost_jax.model import Model
from boost_jax.model.decode import COMPILER_OPTIONS, Decoder, cache_bytes_per_token
from boost_jax.parallel.plan import Plan
from boost_jax.runtime.errors import ConfigError
from boost_jax.serve.pages import Pages

TOP_LOGPROBS = 5  # the most likely tokens each step reports (OpenAI's completions allow up to 5)
GIB = 1 << 30


@dataclass(eq=False)
class Request:
    """One completion: its prompt's token ids, how many new tokens at most, how to sample. The engine
    calls `on_event(request, tokens, logprobs, finish)` from its thread after each new token (tokens
    and logprobs: the new ones; finish: None, or "stop" / "length" / "cancelled" at the end)."""

    prompt: list[int]
    max_tokens: int
    on_event: Callable = lambda *a: None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # tokens it ends at besides the end-of-document one (a chat's end of turn)
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by any thread (a client gone): the engine drops it at its next step
    prefilled: int = 0
    slot: int | None = None


@dataclass(frozen=True)
class Step:
    """What one program call returns, on the host: each row's token, its logprob, the top tokens and theirs."""

    token: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seed: jax.Array,
                index: jax.Array) -> jax.Array:
    """Token ids [B] from logits [B, V], each row its own way: greedy where temperature [B] is 0 (the
    argmax, as decode.sample), else drawn from the temperature-scaled distribution cut to its smallest
    set of top_p [B] probability, with fold_in(key(seed[B]), index[B])."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]  # the first token always
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    scaled = jnp.where(keep, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed, index)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def pool_pages(serve: ServeConfig, page_bytes: int, context: int) -> int:
    """Pages in the pool (the null page included): `serve.cache_gib` per device, or every slot at the
    full context; refused when that holds less than one request at the context."""
    per_seq = -(-context // serve.page_tokens)
    n = int(serve.cache_gib * GIB // page_bytes) if serve.cache_gib else serve.slots * per_seq + 1
    if n - 1 < per_seq:
        raise ConfigError(f"serve.cache_gib={serve.cache_gib} holds {max(n - 1, 0)} pages of {serve.page_tokens} "
                          f"tokens ({page_bytes:,} bytes each per device): less than one request at the context "
                          f"({context} positions, {per_seq} pages); raise serve.cache_gib (0 = every slot at the context)")
    return n


class Engine:
    """Decode slots over a paged cache for `model` under `plan` (see the module's docstring). Not
    thread-safe but for `submit` and `Request.cancelled`: one thread (`start`'s, or the caller's) steps it."""

    def __init__(self, model: Model, plan: Plan, serve: ServeConfig, *, cache: str, eos_id: int | None, context: int):
        if plan.size("batch") > 1:
            raise ConfigError(f"serving runs one data-parallel replica, its batch split {plan.size('batch')} ways "
                              "here: pass parallel.dp=1 parallel.fsdp=1 (and parallel.tp=N for more devices)")
        self.decoder = Decoder(model, plan, cache=cache, eos_id=eos_id)
        self.plan, self.serve, self.eos_id, self.context = plan, serve, eos_id, context
        self.kind = self.decoder.cache_name
        self.page_bytes = cache_bytes_per_token(self.kind, model.cfg, plan) * serve.page_tokens
        self.max_pages = -(-context // serve.page_tokens)
        self.pages = Pages(pool_pages(serve, self.page_bytes, context), serve.page_tokens, self.max_pages)
        self._replicated = NamedSharding(plan.mesh, PartitionSpec())
        make_pool = jax.jit(lambda: paged_cache.constrain_pool(
            paged_cache.empty_pool(self.kind, model.cfg, self.pages.n_pages, serve.page_tokens), plan.constrain))
        self.pool = make_pool()
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,),
                                compiler_options=COMPILER_OPTIONS.get(plan.mesh.devices.flat[0].platform, {}))
        self.slots: list[Request | None] = [None] * serve.slots
        self.waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.generated = 0  # tokens produced since start-up
        self.cancelled = 0  # requests dropped before their end (a client gone, a stop string)
        self.busy_s = 0.0  # seconds spent in program calls

    # ------------------------------------------------------------------ the program

    def _forward_fn(self, params, pool, tokens, positions, valid, tables, logits_at, temperature, top_p, seed, index):
        """Rows' tokens [B, S] at positions [B, S] (`valid` [B, S]: a real token) through the model over
        their pages (tables [B, P]) -> (the pool with their keys and values, each row's next token at
        its position logits_at [B], its logprob, the top TOP_LOGPROBS tokens and theirs)."""
        rows = paged_cache.view(pool, tables)
        rows = tuple(c.constrain(self.plan.constrain) for c in rows)
        logits, rows = self.decoder._decode(params, tokens, rows, positions, logits_at)  # noqa: SLF001 (the Decoder's model call)
        pool = paged_cache.constrain_pool(paged_cache.store(pool, rows, tables, positions, valid), self.plan.constrain)
        token = sample_rows(logits, temperature, top_p, seed, index)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
        return pool, (token, chosen, top_ids.astype(jnp.int32), top_logprobs)

    def _call(self, rows: list[Request | None], tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray,
              logits_at: np.ndarray) -> Step:
        tables = np.stack([self.pages.table(r.id if r else None) for r in rows])
        sampling = [(r.temperature, r.top_p, r.seed, len(r.tokens)) if r else (0.0, 1.0, 0, 0) for r in rows]
        temperature, top_p, seed, index = (np.array(c, d) for c, d in zip(
            zip(*sampling), (np.float32, np.float32, np.uint32, np.int32)))
        put = lambda x: jax.device_put(x, self._replicated)
        t0 = time.perf_counter()
        self.pool, out = self._forward(self.decoder.params, self.pool, *map(put, (
            tokens, positions, valid, tables, logits_at, temperature, top_p, seed, index)))
        out = Step(*jax.device_get(out))
        self.busy_s += time.perf_counter() - t0
        return out

    @property
    def compilations(self) -> int:
        """Programs compiled so far (the prefill and decode shapes of the one forward)."""
        return self._forward._cache_size()  # noqa: SLF001 (jax.jit's count of its compiled programs)

    def warm_up(self) -> None:
        """Compile the prefill and decode programs (twice each: the second call sees the pool laid out
        as the program returns it), writing nothing: every row idle."""
        for _ in range(2):
            self._prefill_call(None, 0, 0)
            self._decode_call()

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> Request:
        """Queue `request` (any thread). Its prompt + max_tokens must fit the context (the caller says
        so to its client first: `check`)."""
        self.check(request)
        with self._lock:
            self.waiting.append(request)
            self._lock.notify()
        return request

    def check(self, request: Request) -> None:
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if len(request.prompt) + request.max_tokens > self.context:
            raise ValueError(f"the prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) is more "
                             f"than the model's context of {self.context} positions")

    def cancel(self, request: Request) -> None:
        """Drop `request` (any thread): its slot and pages are freed at the engine's next step."""
        request.cancelled = True
        with self._lock:
            self._lock.notify()

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """Drop cancelled requests, admit waiting ones, run one prefill chunk and one decode step.
        False when there was nothing to do."""
        with self._lock:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
                self.cancelled += 1
                r.on_event(r, [], [], "cancelled")
            for r in self.slots:
                if r is not None and r.cancelled:
                    self.cancelled += 1
                    self._end(r, "cancelled")
            self._admit()
        prefilling = [r for r in self.slots if r is not None and r.prefilled < len(r.prompt)]
        decoding = [r for r in self.slots if r is not None and r.prefilled == len(r.prompt)]
        if prefilling:
            self._prefill_chunk(min(prefilling, key=lambda r: r.id))
        if decoding:
            self._decode_step(decoding)
        return bool(prefilling or decoding)

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            r = self.waiting[0]
            if not self.pages.admit(r.id, len(r.prompt) + r.max_tokens):
                return  # the oldest waits for pages; none jumps it
            self.waiting.popleft()
            r.slot = self.slots.index(None)
            self.slots[r.slot] = r

    def _prefill_call(self, r: Request | None, start: int, n: int) -> Step:
        chunk = self.serve.prefill_chunk
        tokens = np.zeros((1, chunk), np.int32)
        if r is not None:
            tokens[0, :n] = r.prompt[start:start + n]
        positions = (start + np.arange(chunk, dtype=np.int32))[None]
        valid = (np.arange(chunk) < n)[None]
        return self._call([r], tokens, positions, valid, np.array([max(n - 1, 0)], np.int32))

    def _prefill_chunk(self, r: Request) -> None:
        n = min(self.serve.prefill_chunk, len(r.prompt) - r.prefilled)
        self.pages.grow(r.id, r.prefilled + n)
        out = self._prefill_call(r, r.prefilled, n)
        r.prefilled += n
        if r.prefilled == len(r.prompt):  # the last chunk: its first token
            self._emit(r, out, 0)

    def _decode_call(self, rows: list[Request | None] | None = None) -> Step:
        rows = rows or [None] * self.serve.slots
        live = [r is not None for r in rows]
        tokens = np.array([[r.tokens[-1] if r else 0] for r in rows], np.int32)
        positions = np.array([[len(r.prompt) + len(r.tokens) - 1 if r else 0] for r in rows], np.int32)
        return self._call(rows, tokens, positions, np.array(live)[:, None], np.zeros(len(rows), np.int32))

    def _decode_step(self, decoding: list[Request]) -> None:
        for r in decoding:
            self.pages.grow(r.id, len(r.prompt) + len(r.tokens))
        ids = {r.id for r in decoding}
        rows = [r if r is not None and r.id in ids else None for r in self.slots]
        out = self._decode_call(rows)
        for r in decoding:
            self._emit(r, out, r.slot)

    def _emit(self, r: Request, out: Step, row: int) -> None:
        token = int(out.token[row])
        self.generated += 1
        if token == self.eos_id or token in r.stop_ids:  # not returned, as generate's
            self._end(r, "stop")
            return
        r.tokens.append(token)
        logprob = {"token": token, "logprob": float(out.logprob[row]),
                   "top": dict(zip(out.top_ids[row].tolist(), out.top_logprobs[row].tolist()))}
        finish = "length" if len(r.tokens) >= r.max_tokens else None
        r.on_event(r, [token], [logprob], None)
        if finish:
            self._end(r, finish)

    def _end(self, r: Request, finish: str) -> None:
        self.pages.release(r.id)
        self.slots[r.slot] = None
        r.on_event(r, [], [], finish)

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        """Step in a thread of its own until `stop`."""
        self._thread = threading.Thread(target=self._run, name="boost_jax-serve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            if not self.step():
                with self._lock:
                    if not self._stopping and self.idle():
                        self._lock.wait(0.5)

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def metrics(self) -> dict[str, float]:
        """The numbers /metrics reports."""
        return {"requests_waiting": len(self.waiting), "requests_running": self.running,
                "cache_pages_used": self.pages.used, "cache_pages_free": self.pages.free,
                "cache_page_bytes": self.page_bytes, "generated_tokens": self.generated,
                "cancelled_requests": self.cancelled,
                "tokens_per_second": self.generated / self.busy_s if self.busy_s else 0.0,
                "compilations": self.compilations}
