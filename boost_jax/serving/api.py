"""The HTTP routes of `python -m boost_jax.serve`: OpenAI's completions and chat completions (streamed
as server-sent events or whole), models, health and Prometheus metrics, on FastAPI, over an Engine
stepping in its own thread.

    app = create_app(engine, tokenizer, model_name="my-run", serve=cfg.serve)

A request's body is checked field by field before it reaches the engine: each bad field is one 400
in OpenAI's error shape naming it (`param`); an unknown model is 404; a full queue (`serve.queue`
requests waiting) is 503 with Retry-After. A client that goes away mid-stream cancels its request:
its slot and pages are freed at the engine's next step. Stop strings are found in the detokenized
text (the engine stops at the tokenizer's end-of-document token, never returned); a streamed text
holds back the characters that could still begin a stop string.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from tokenizers import Tokenizer

from boost_jax.config import ServeConfig
from boost_jax.data.chat import ChatTokens, check_turns
from boost_jax.runtime.errors import BoostJaxError
from boost_jax.serving.engine import Engine, EngineFailed, Request as Completion
from boost_jax.serving.programs import TOP_LOGPROBS

RETRY_AFTER_S = 1
MAX_STOPS = 4  # OpenAI's limit on `stop` strings


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, the field at fault, its type and code."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code, self.headers = status, param, kind, code, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _engine_failed(failure: str | None) -> ApiError:
    return ApiError(500, f"the serving engine has stopped: {failure}; the server must be restarted", kind="server_error",
                    code="engine_failed")


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


def _field(body: dict, name: str, kinds: tuple, default=None, *, check: Callable | None = None, must: str = ""):
    """body[name] if of one of `kinds` (bool is never a number) and passing `check`, else one 400 naming it."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(name, f"expected {must or ' or '.join(k.__name__ for k in kinds)}, got {json.dumps(value)[:80]}")
    if check is not None and not check(value):
        raise _bad(name, f"must be {must}, got {value!r}")
    return value


@dataclass
class Sampling:
    """A request's common fields, checked."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    logprobs: int | None  # how many top tokens per position (0: the chosen one only); None: no logprobs
    stream: bool
    include_usage: bool

    @classmethod
    def read(cls, body: dict, serve: ServeConfig, *, chat: bool) -> Sampling:
        max_tokens = _field(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                            (int,), serve.max_tokens, check=lambda v: v >= 1, must="an integer >= 1")
        temperature = _field(body, "temperature", (int, float), 1.0,
                             check=lambda v: 0 <= v <= 2, must="a number in [0, 2]")
        top_p = _field(body, "top_p", (int, float), 1.0, check=lambda v: 0 < v <= 1, must="a number in (0, 1]")
        seed = _field(body, "seed", (int,), 0, check=lambda v: 0 <= v < 2**32, must="an integer in [0, 2^32)")
        stop = _field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", f"must be a non-empty string or a list of up to {MAX_STOPS}, got {json.dumps(stop)[:80]}")
        if chat:
            wanted = _field(body, "logprobs", (bool,), False)
            top = _field(body, "top_logprobs", (int,), 0, check=lambda v: 0 <= v <= TOP_LOGPROBS,
                         must=f"an integer in [0, {TOP_LOGPROBS}]")
            logprobs = top if wanted else None
        else:
            logprobs = _field(body, "logprobs", (int,), None, check=lambda v: 0 <= v <= TOP_LOGPROBS,
                              must=f"an integer in [0, {TOP_LOGPROBS}]")
        _field(body, "n", (int,), 1, check=lambda v: v == 1, must="1 (one choice per request)")
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {})
        return cls(max_tokens, float(temperature), float(top_p), seed, stop, logprobs, stream,
                   bool(options.get("include_usage", False)))


@dataclass
class Output:
    """What a request has produced so far: its tokens, their text, their logprobs, its end."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    text: str = ""
    finish: str | None = None


class Server:
    """The routes' state: the engine, the tokenizer, the served model's name, the run's chat template
    bound to its tokenizer (None: the run has none, and chat completions are refused)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, model_name: str, serve: ServeConfig,
                 chat: ChatTokens | None = None):
        self.engine, self.tok, self.model_name, self.serve, self.chat = engine, tokenizer, model_name, serve, chat
        self.created = int(time.time())
        self.draining = False

    # ------------------------------------------------------------------ checks

    def check_model(self, body: dict) -> None:
        model = _field(body, "model", (str,), None)
        if model is None:
            raise _bad("model", "missing (GET /v1/models lists the one served)")
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist: this server serves `{self.model_name}`",
                           "model", code="model_not_found")

    def prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt).ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.decoder.cfg.vocab_size
            if bad := [t for t in prompt if not 0 <= t < vocab]:
                raise _bad("prompt", f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            ids = list(prompt)
        else:
            raise _bad("prompt", f"expected a string or a list of token ids (one prompt), got {json.dumps(prompt)[:80]}")
        if not ids:
            raise _bad("prompt", "encodes to no tokens: a completion needs at least one")
        return ids

    def chat_ids(self, body: dict) -> list[int]:
        if self.chat is None:
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", f"expected a non-empty list of messages, got {json.dumps(messages)[:80]}")
        try:  # rendered as `generate --chat` renders a conversation
            return self.chat.encode(check_turns(messages, "messages"), add_generation_prompt=True, where="messages")
        except BoostJaxError as e:  # the message at fault, or the template's refusal of it
            raise _bad("messages", str(e).removeprefix("messages: ")) from None

    def check_length(self, ids: list[int], sampling: Sampling) -> None:
        context = self.engine.context
        if len(ids) >= context:
            raise _bad("prompt", f"{len(ids)} tokens: the model's context is {context} positions (nothing is truncated)")
        if len(ids) + sampling.max_tokens > context:
            raise _bad("max_tokens", f"{sampling.max_tokens}: with the prompt's {len(ids)} tokens it passes the model's "
                                     f"context of {context} positions; at most {context - len(ids)}")

    # ------------------------------------------------------------------ running one

    async def run(self, ids: list[int], sampling: Sampling, stop_ids: tuple[int, ...] = ()) -> AsyncIterator[Output]:
        """The request's output after each new token (the same Output, updated), to its end."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if len(self.engine.waiting) >= self.serve.queue:
            raise ApiError(503, f"{len(self.engine.waiting)} requests are waiting (serve.queue); retry later",
                           kind="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(r, tokens, logprobs, finish):
            try:
                loop.call_soon_threadsafe(events.put_nowait, (tokens, logprobs, finish))
            except RuntimeError:  # the caller's event loop has closed: no one reads r; the engine thread lives on
                r.cancelled = True

        try:
            request = self.engine.submit(Completion(ids, sampling.max_tokens, on_event, sampling.temperature,
                                                    sampling.top_p, sampling.seed, stop_ids,
                                                    logprobs=sampling.logprobs is not None))
        except EngineFailed as e:
            raise _engine_failed(str(e)) from None
        out = Output()
        try:
            while out.finish is None:
                tokens, logprobs, finish = await events.get()
                if finish == "error":
                    raise _engine_failed(self.engine.failure)
                out.tokens += tokens
                out.logprobs += logprobs
                out.text = self.tok.decode(out.tokens)
                out.finish = finish
                if hit := [i for i in (out.text.find(s) for s in sampling.stop) if i >= 0]:
                    out.text, out.finish = out.text[:min(hit)], "stop"
                yield out
        finally:
            self.engine.cancel(request)  # a no-op when it ended; else (stop string, client gone) frees it now

    def holdback(self, text: str, sampling: Sampling, finished: bool) -> str:
        """`text` less the tail that could still begin a stop string (all of it once finished)."""
        if finished:
            return text
        for cut in range(min(len(text), max((len(s) - 1 for s in sampling.stop), default=0)), 0, -1):
            if any(s.startswith(text[-cut:]) for s in sampling.stop):
                return text[:-cut]
        return text

    # ------------------------------------------------------------------ shapes of the answers

    def token_text(self, token: int) -> str:
        return self.tok.decode([token])

    def completion_logprobs(self, entries: list[dict], top: int, offset: int) -> dict:
        texts = [self.token_text(e["token"]) for e in entries]
        offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in list(e["top"].items())[:top]} for e in entries],
                "text_offset": offsets}

    def chat_logprobs(self, entries: list[dict], top: int) -> dict:
        item = lambda t, lp: {"token": self.token_text(t), "logprob": lp,
                              "bytes": list(self.token_text(t).encode())}
        return {"content": [{**item(e["token"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in list(e["top"].items())[:top]]}
                            for e in entries]}

    def usage(self, ids: list[int], out: Output) -> dict:
        return {"prompt_tokens": len(ids), "completion_tokens": len(out.tokens),
                "total_tokens": len(ids) + len(out.tokens)}

    def metrics(self) -> str:
        """Prometheus' text format."""
        m = self.engine.metrics()
        rows = [("requests_waiting", "gauge", "requests queued for a decode slot"),
                ("requests_running", "gauge", "requests holding a decode slot"),
                ("cache_pages_used", "gauge", "KV cache pages holding tokens"),
                ("cache_pages_free", "gauge", "KV cache pages free"),
                ("cache_page_bytes", "gauge", "bytes of one KV cache page on one device, all layers"),
                ("generated_tokens", "counter", "tokens generated since start-up"),
                ("cancelled_requests", "counter", "requests dropped before their end (a client gone, a stop string)"),
                ("tokens_per_second", "gauge", "tokens generated per second of program time since start-up"),
                ("compilations", "counter", "XLA programs compiled (all at start-up: it does not move while serving)")]
        lines = []
        for name, kind, help_ in rows:
            full = f"boost_jax_serve_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}", f"{full} {m[name]}"]
        return "\n".join(lines) + "\n"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _read(server: Server, request: Request, *, chat: bool) -> tuple[Sampling, list[int]]:
    """A completion request's sampling and prompt ids (chat: its messages rendered), each field checked."""
    body = await _body(request)
    server.check_model(body)
    sampling = Sampling.read(body, server.serve, chat=chat)
    ids = server.chat_ids(body) if chat else server.prompt_ids(body)
    server.check_length(ids, sampling)
    return sampling, ids


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def create_app(server: Server) -> FastAPI:
    """The FastAPI app of `server`'s routes (the engine's thread is started and stopped by the caller)."""
    app = FastAPI(title="boost_jax serve")

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return e.response()

    @app.get("/health")
    async def health():
        if server.engine.failure is not None:  # for an orchestrator to restart it
            return JSONResponse({"status": "failed", "error": server.engine.failure}, status_code=500)
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "boost_jax"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        sampling, ids = await _read(server, request, chat=False)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}

        def choice(text, out, entries, offset, finish):
            logprobs = None if sampling.logprobs is None else server.completion_logprobs(entries, sampling.logprobs, offset)
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

        return await _answer(server, ids, sampling, head, choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        sampling, ids = await _read(server, request, chat=True)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(text, out, entries, offset, finish):
            logprobs = None if sampling.logprobs is None else server.chat_logprobs(entries, sampling.logprobs)
            if sampling.stream:
                delta = {"role": "assistant", "content": text} if offset == 0 else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish}

        kind = "chat.completion.chunk" if sampling.stream else "chat.completion"
        head = {"id": rid, "object": kind, "created": created, "model": server.model_name}
        return await _answer(server, ids, sampling, head, choice, server.chat.stop_ids)

    return app


async def _answer(server: Server, ids: list[int], sampling: Sampling, head: dict, choice: Callable,
                  stop_ids: tuple[int, ...] = ()):
    """The whole answer, or its stream of server-sent events (the first event awaited here, so a
    refusal such as a full queue is still an HTTP error)."""
    outputs = server.run(ids, sampling, stop_ids)
    if not sampling.stream:
        out = None
        async for out in outputs:
            pass
        return {**head, "choices": [choice(out.text, out, out.logprobs, 0, out.finish)], "usage": server.usage(ids, out)}
    first = await anext(outputs)  # raises ApiError before any byte is sent

    async def events():
        sent_text, sent_tokens, out = "", 0, first
        try:
            while True:
                text = server.holdback(out.text, sampling, out.finish is not None)
                if text != sent_text or out.finish is not None:
                    new_tokens = out.logprobs[sent_tokens:]
                    yield _sse({**head, "choices": [choice(text[len(sent_text):], out, new_tokens, len(sent_text),
                                                           out.finish)]})
                    sent_text, sent_tokens = text, len(out.logprobs)
                if out.finish is not None:
                    break
                out = await anext(outputs)
            if sampling.include_usage:
                yield _sse({**head, "choices": [], "usage": server.usage(ids, out)})
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # the client gone: the request cancelled, its slot and pages freed

    return StreamingResponse(events(), media_type="text/event-stream")
