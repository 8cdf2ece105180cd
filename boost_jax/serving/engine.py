"""The serving engine: continuous batching over a paged cache.

    engine = Engine(model, plan, ServeConfig(slots=8), cache="auto", eos_id=2, context=1024)
    engine.warm_up()                                   # every program compiled here, never per request
    request = engine.submit(Request([5, 9, 31], max_tokens=32, on_event=print))
    while engine.step(): ...                           # or engine.start(): a thread steps it

`slots` sequences decode together. A request waits in a queue until a slot is free and the page
pool can promise it every page it may need (serving/pages.py); its prompt is then prefilled
`prefill_chunk` tokens per step, the chunks of up to `prefill_rows` prompts in one call, between two
decode steps, so a long prompt never stalls the slots already decoding. After its last chunk (which
samples its first token) it joins the decode step that follows, and at its end (its <eos>,
max_tokens, or a cancellation) its slot and pages are freed at once, taken by the next request at
the next step.

A decode call runs the fewest rows (`slots`, slots/2, ...: `serve.buckets` sizes) and table pages
(the context's, half of it, ...) that hold its requests, so a step of a few short requests reads few
rows of few pages; it gathers their pages once and decodes up to `decode_steps` tokens in a loop on
the device (one while a prompt is prefilling; while requests wait, no more than frees the first slot
by its length), then stores back the positions written. Every shape is compiled at `warm_up`, and
both programs take every per-request choice as an array (positions, page tables, counts,
temperature, top_p, seed), so `compilations` does not move while serving. Both run the model's own
cached decoding (Model.decode through the Decoder's laid-out parameters; serving/programs.py) over a
view of each row's pages (layers/paged_cache.py), so a greedy completion is the token sequence `Decoder.generate`
gives. Token i of a sampled request is drawn with fold_in(key(seed), i): a seed repeats a
completion whatever the other slots hold.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from boost_jax.config import ServeConfig
from boost_jax.model import Model
from boost_jax.model.decode import Decoder
from boost_jax.parallel.plan import Plan
from boost_jax.runtime.errors import ConfigError
from boost_jax.serving.pages import Pages
from boost_jax.serving.programs import PagedPrograms


class EngineFailed(RuntimeError):
    """A request submitted after a step of the engine raised: its thread has stopped."""


@dataclass(eq=False)
class Request:
    """One completion: its prompt's token ids, how many new tokens at most, how to sample. The engine
    calls `on_event(request, tokens, logprobs, finish)` from its thread after each call that gave it
    new tokens (tokens and logprobs: the new ones, up to serve.decode_steps; finish: None) and at its
    end (no tokens; finish: "stop" / "length" / "cancelled", or "error" when the engine failed)."""

    prompt: list[int]
    max_tokens: int
    on_event: Callable = lambda *a: None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # tokens it ends at besides the end-of-document one (a chat's end of turn)
    logprobs: bool = False  # its tokens' logprobs and the top ones computed (else its events carry zeros)
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by any thread (a client gone): the engine drops it at its next step
    prefilled: int = 0
    slot: int | None = None


@dataclass(frozen=True)
class Step:
    """What one program call returns, on the host: each row's tokens [B, steps], their logprobs, the top
    tokens and theirs [B, steps, TOP_LOGPROBS]."""

    token: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def shapes(top: int, n: int) -> tuple[int, ...]:
    """The `n` sizes top, top/2, top/4, ... (rounded up, at least 1, no repeats), ascending: the rows or
    pages programs are compiled for."""
    return tuple(sorted({max(1, -(-top // 2**k)) for k in range(n)}))


def fit(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of `sizes` (ascending) holding n."""
    return next(s for s in sizes if s >= n)


class Engine:
    """Decode slots over a paged cache for `model` under `plan` (see the module's docstring). Not
    thread-safe but for `submit` and `Request.cancelled`: one thread (`start`'s, or the caller's) steps it."""

    def __init__(self, model: Model, plan: Plan, serve: ServeConfig, *, cache: str, eos_id: int | None, context: int):
        if plan.size("batch") > 1:
            raise ConfigError(f"serving runs one data-parallel replica, its batch split {plan.size('batch')} ways "
                              "here: pass parallel.dp=1 parallel.fsdp=1 (and parallel.tp=N for more devices)")
        self.decoder = Decoder(model, plan, cache=cache, eos_id=eos_id)
        self.plan, self.serve, self.eos_id, self.context = plan, serve, eos_id, context
        self.paged = PagedPrograms(self.decoder, serve, context)
        self.kind, self.page_bytes, self.max_pages = self.paged.kind, self.paged.size.page_bytes, self.paged.max_pages
        self.pages = Pages(self.paged.size.pages, serve.page_tokens, self.max_pages)
        # The shapes compiled at warm-up: a decode step runs the fewest rows and table pages that hold
        # its live rows (a step of 3 short rows reads 3 rows of few pages, not every slot's context);
        # a prefill call takes up to prefill_rows prompts' chunks, over the whole table.
        self.decode_rows = shapes(serve.slots, serve.buckets)
        self.decode_pages = shapes(self.max_pages, serve.buckets)
        self.prefill_rows = shapes(min(serve.prefill_rows, serve.slots), serve.buckets)
        self.pool = self.paged.empty_pool()
        self.slots: list[Request | None] = [None] * serve.slots
        self.waiting: deque[Request] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None  # what stopped the engine thread, if an error did
        self.generated = 0  # tokens produced since start-up
        self.cancelled = 0  # requests dropped before their end (a client gone, a stop string)
        self.busy_s = 0.0  # seconds spent in program calls

    # ------------------------------------------------------------------ the programs

    def _call(self, program, rows: list[Request | None], width: int, *arrays: np.ndarray) -> Step:
        """`program` on `arrays` for `rows` (None: an idle row) over the first `width` pages of their tables."""
        tables = np.stack([self.pages.table(r.id if r else None)[:width] for r in rows])
        sampling = [(r.temperature, r.top_p, r.seed, len(r.tokens), r.logprobs) if r else (0.0, 1.0, 0, 0, False)
                    for r in rows]
        sampling = (np.array(c, d) for c, d in zip(zip(*sampling), (np.float32, np.float32, np.uint32, np.int32, bool)))
        put = lambda x: jax.device_put(x, self.paged.replicated)
        t0 = time.perf_counter()
        self.pool, out = program(self.decoder.params, self.pool, *map(put, (tables, *arrays, *sampling)))
        out = Step(*jax.device_get(out))
        self.busy_s += time.perf_counter() - t0
        return out

    @property
    def compilations(self) -> int:
        """Programs compiled so far (every prefill and decode shape of the one forward)."""
        return sum(p._cache_size() for p in (self.paged.prefill, self.paged.decode))  # noqa: SLF001 (jax.jit's count)

    @property
    def programs(self) -> int:
        """The programs `warm_up` compiles: one per prefill and decode shape."""
        return len(self.prefill_rows) + len(self.decode_rows) * len(self.decode_pages)

    def warm_up(self) -> None:
        """Compile every prefill and decode shape, writing nothing: every row idle. The first call runs
        twice: its second sees the pool laid out as the programs return it, as every later call does."""
        self._prefill_call([None])
        for b in self.prefill_rows:
            self._prefill_call([None] * b)
        for b in self.decode_rows:
            for width in self.decode_pages:
                self._decode_call([None] * b, width, 0)

    def submit(self, request: Request) -> Request:
        """Queue `request` (any thread). Its prompt + max_tokens must fit the context (the caller says
        so to its client first: `check`)."""
        self.check(request)
        with self._lock:
            if self.failure is not None:
                raise EngineFailed(self.failure)
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
        """Drop cancelled requests, admit waiting ones, run one prefill call (up to prefill_rows
        prompts' next chunks) and one decode step. False when there was nothing to do."""
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
        live = sorted((r for r in self.slots if r is not None), key=lambda r: r.id)
        prefilling = [r for r in live if r.prefilled < len(r.prompt)]
        decoding = [r for r in live if r.prefilled == len(r.prompt)]
        if prefilling:
            self._prefill(prefilling[:self.prefill_rows[-1]])
        if decoding:
            # Several tokens per call while nothing joins: one while a prompt is prefilling; while
            # requests wait, no more than free the first slot by its length (an <eos> may end one
            # sooner: its slot waits out the call).
            left = [r.max_tokens - len(r.tokens) for r in decoding]
            steps = 1 if prefilling else min(self.serve.decode_steps, min(left) if self.waiting else max(left))
            self._decode_step(decoding, steps)
        return bool(prefilling or decoding)

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            r = self.waiting[0]
            if not self.pages.admit(r.id, len(r.prompt) + r.max_tokens):
                return  # the oldest waits for pages; none jumps it
            self.waiting.popleft()
            r.slot = self.slots.index(None)
            self.slots[r.slot] = r

    def _prefill_call(self, rows: list[Request | None]) -> Step:
        """Each row's next prompt chunk (None: idle) in the fewest prefill rows that hold them."""
        chunk = self.serve.prefill_chunk
        rows = rows + [None] * (fit(self.prefill_rows, len(rows)) - len(rows))
        tokens, n = np.zeros((len(rows), chunk), np.int32), np.zeros(len(rows), np.int32)
        start = np.array([r.prefilled if r else 0 for r in rows], np.int32)
        for i, r in enumerate(rows):
            if r is not None:
                n[i] = min(chunk, len(r.prompt) - r.prefilled)
                tokens[i, :n[i]] = r.prompt[r.prefilled:r.prefilled + n[i]]
        positions = start[:, None] + np.arange(chunk, dtype=np.int32)[None]
        valid = np.arange(chunk)[None] < n[:, None]
        return self._call(self.paged.prefill, rows, self.max_pages, tokens, positions, valid, np.maximum(n - 1, 0))

    def _prefill(self, rows: list[Request]) -> None:
        for r in rows:
            self.pages.grow(r.id, min(len(r.prompt), r.prefilled + self.serve.prefill_chunk))
        out = self._prefill_call(rows)
        for i, r in enumerate(rows):
            r.prefilled = min(len(r.prompt), r.prefilled + self.serve.prefill_chunk)
            if r.prefilled == len(r.prompt):  # the last chunk: its first token
                self._emit(r, out, i)

    def _decode_call(self, rows: list[Request | None], width: int, steps: int) -> Step:
        """Up to `steps` new tokens for each row (None: idle), none past its max_tokens, over the first
        `width` pages of its table."""
        last = np.array([r.tokens[-1] if r else 0 for r in rows], np.int32)
        start = np.array([len(r.prompt) + len(r.tokens) - 1 if r else 0 for r in rows], np.int32)
        count = np.array([min(steps, r.max_tokens - len(r.tokens)) if r else 0 for r in rows], np.int32)
        return self._call(self.paged.decode, rows, width, last, start, count)

    def _decode_step(self, decoding: list[Request], steps: int) -> None:
        """Up to `steps` tokens for each decoding request, in the fewest rows and pages that hold them
        all. A request that ends before its last one (its <eos>) drops the rest: its pages go back whole."""
        ends = [len(r.prompt) + min(len(r.tokens) + steps, r.max_tokens) - 1 for r in decoding]  # positions held
        for r, end in zip(decoding, ends):
            self.pages.grow(r.id, end)
        width = fit(self.decode_pages, self.pages.pages_for(max(ends)))
        out = self._decode_call(decoding + [None] * (fit(self.decode_rows, len(decoding)) - len(decoding)), width, steps)
        for i, r in enumerate(decoding):
            self._emit(r, out, i, steps)

    def _emit(self, r: Request, out: Step, row: int, count: int = 1) -> None:
        """Hand `r` its tokens out[row, :count] in one event, up to its end (its <eos>, not returned, as
        generate's; or its max_tokens)."""
        tokens, logprobs, finish = [], [], None
        for column in range(count):
            token = int(out.token[row, column])
            self.generated += 1
            if token == self.eos_id or token in r.stop_ids:
                finish = "stop"
                break
            tokens.append(token)
            logprobs.append({"token": token, "logprob": float(out.logprob[row, column]),
                             "top": dict(zip(out.top_ids[row, column].tolist(), out.top_logprobs[row, column].tolist()))})
            if len(r.tokens) + len(tokens) >= r.max_tokens:
                finish = "length"
                break
        r.tokens += tokens
        if tokens:
            r.on_event(r, tokens, logprobs, None)
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
        try:
            while not self._stopping:
                if not self.step():
                    with self._lock:
                        if not self._stopping and self.idle():
                            self._lock.wait(0.5)
        except Exception as e:  # a step that raised: every request ends "error" now, none waits for a dead thread
            traceback.print_exc(file=sys.stderr)
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, failure: str) -> None:
        with self._lock:
            self.failure = failure
            ended = [r for r in (*self.waiting, *self.slots) if r is not None]
            self.waiting.clear()
            self.slots = [None] * len(self.slots)
        for r in ended:
            r.on_event(r, [], [], "error")

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
