"""The server's routes (serving/api.py) in-process, through the real `openai` client and httpx over an
ASGI transport: completions equal api.generate token for token (streamed or whole); the fields a
client sends are honoured or refused one at a time in OpenAI's error shape; /metrics reads in
Prometheus' format and its compilation count does not move while serving; an engine that fails ends
every request with a 500 instead of leaving it waiting."""

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from boost_jax import api, configs
from boost_jax.config import ServeConfig
from boost_jax.model.decode import Decoder
from boost_jax.model.run_dir import open_run
from boost_jax.serving.api import Server, create_app
from boost_jax.serving.engine import Engine

MODEL = "tiny"
CHATML = Path(configs.__file__).parent / "chatml.jinja"


@pytest.fixture(scope="module")
def served(tiny_run_dir):
    run = open_run(tiny_run_dir, ["parallel.dp=1", "train.seq_len=128", f"data.chat_template={CHATML}"])
    model, _ = run.model()
    serve = ServeConfig(slots=4, page_tokens=8, prefill_chunk=16, queue=40, buckets=2)
    engine = Engine(model, run.plan, serve, cache="full", eos_id=run.eos, context=run.cfg.train.seq_len)
    engine.warm_up()
    server = Server(engine, run.tokenizer, model_name=MODEL, serve=serve, chat=run.chat)
    engine.start()
    yield server, model, run
    engine.stop()


def client(server):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(server)), base_url="http://serve")


def run_async(coro, timeout_s: float = 300):
    """`coro` run to its end, or a failure after `timeout_s` (a stuck request fails its test, not the run)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_completions_equal_generate_streamed_or_whole_and_compile_nothing(served):
    server, model, run = served
    compiled = server.engine.compilations
    prompts = ["def main(", "import os", "class A:\n    def", "x = 1\ny = 2\n", "for i in range(10):", "return"]
    lengths = [12, 3, 20, 7, 16, 9]

    async def go():
        async with client(server) as http:
            oa = openai.AsyncOpenAI(base_url="http://serve/v1", api_key="none", http_client=http, max_retries=0)

            async def one(i):
                if i % 2:  # streamed
                    text, finish = "", None
                    stream = await oa.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i],
                                                         temperature=0, stream=True)
                    async for chunk in stream:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                    return text, finish, None
                out = await oa.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0)
                return out.choices[0].text, out.choices[0].finish_reason, out.usage

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    got = run_async(go())
    tok = run.tokenizer
    for prompt, n, (text, finish, usage) in zip(prompts, lengths, got):
        ids = tok.encode(prompt).ids
        want = api.generate(model, [ids], max_new_tokens=n, eos_id=run.eos, cache="full")[0]
        assert text == tok.decode(want)
        assert finish == ("length" if len(want) == n else "stop")
        if usage is not None:
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want))
    assert server.engine.compilations == compiled
    assert server.engine.pages.used == 0


def test_stop_logprobs_and_metrics(served):
    server, model, run = served

    async def go():
        async with client(server) as http:
            whole = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "def main(", "max_tokens": 12,
                                                              "temperature": 0, "logprobs": 2})).json()
            text = whole["choices"][0]["text"]
            stop = text[3:5]
            stopped = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "def main(", "max_tokens": 12,
                                                                "temperature": 0, "stop": [stop]})).json()
            for _ in range(50):  # the stopped request's slot is freed at the engine's next step
                metrics = (await http.get("/metrics")).text
                if "boost_jax_serve_requests_running 0" in metrics:
                    break
                await asyncio.sleep(0.1)
            models = (await http.get("/v1/models")).json()
            return whole, text, stop, stopped, metrics, models

    whole, text, stop, stopped, metrics, models = run_async(go())
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == whole["usage"]["completion_tokens"]
    assert all(len(t) <= 2 and max(t.values()) <= 0 for t in lp["top_logprobs"]) and "".join(lp["tokens"]) == text
    assert stopped["choices"][0]["text"] == text[:text.find(stop)] and stopped["choices"][0]["finish_reason"] == "stop"
    assert models["data"][0]["id"] == MODEL
    values = dict(line.split() for line in metrics.splitlines() if not line.startswith("#"))
    assert values["boost_jax_serve_compilations_total"] == str(server.engine.programs)
    assert values["boost_jax_serve_requests_running"] == "0"
    assert int(values["boost_jax_serve_cache_pages_free"]) == server.engine.pages.n_pages - 1


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 300}, 400, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
])
def test_each_bad_field_is_one_error_naming_it_and_the_server_serves_on(served, body, status, param):
    server, _, _ = served

    async def go():
        async with client(server) as http:
            bad = await http.post("/v1/completions", json=body)
            good = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            return bad, good

    bad, good = run_async(go())
    assert bad.status_code == status and bad.json()["error"]["param"] == param, bad.text
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_malformed_json_and_a_full_queue(served):
    server, _, _ = served

    async def go():
        async with client(server) as http:
            malformed = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            listed = await http.post("/v1/completions", json=["a"])
            queue, server.serve = server.serve, ServeConfig(queue=1)
            # One waiting: the queue of one is full. Under the engine's lock, so that its thread does not
            # step meanwhile and meet the placeholder (it did, once in a while: the thread died on it and
            # every later test's request waited for it)
            with server.engine._lock:
                server.engine.waiting.append(None)
                try:
                    full = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                finally:
                    server.engine.waiting.remove(None)
                    server.serve = queue
            return malformed, listed, full

    malformed, listed, full = run_async(go())
    assert server.engine._thread.is_alive()
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
    assert listed.status_code == 400 and "JSON object" in listed.json()["error"]["message"]
    assert full.status_code == 503 and full.headers["retry-after"] == "1" and full.json()["error"]["code"] == "queue_full"


def test_chat_completions_render_the_template_and_stop_at_the_end_of_turn_as_generate(served):
    server, model, run = served
    messages = [{"role": "user", "content": "def main("}]

    async def go():
        async with client(server) as http:
            oa = openai.AsyncOpenAI(base_url="http://serve/v1", api_key="none", http_client=http, max_retries=0)
            whole = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                     logprobs=True, top_logprobs=2)
            text = ""
            async for chunk in await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                                temperature=0, stream=True):
                text += chunk.choices[0].delta.content or ""
            bad = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot",
                                                                                            "content": "hi"}]})
            return whole, text, bad

    whole, streamed, bad = run_async(go())
    ids = run.chat.encode(messages, True)
    want = Decoder(model, server.engine.plan, cache="full", eos_id=(run.eos, *run.chat.stop_ids)).generate([ids], 24)
    reply = run.tokenizer.decode(want.tokens[0])
    assert whole.choices[0].message.content == streamed == reply
    assert whole.usage.prompt_tokens == len(ids) and len(whole.choices[0].logprobs.content) == len(want.tokens[0])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages" and "robot" in bad.text


def test_a_request_whose_event_loop_closed_is_dropped_and_the_engine_serves_on(served):
    """Clients whose event loop closes while their streams still decode (each asyncio.run here) leave the
    engine serving: a later request completes and the engine thread is alive (an event for a closed loop
    cancels its request, serving/api.py, rather than raising in the engine thread)."""
    server, _, _ = served

    async def first_token_then_leave():
        async with client(server) as http:
            async with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "def main(",
                                                                    "max_tokens": 60, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    return  # the loop closes with the request still decoding

    async def whole():
        async with client(server) as http:
            r = await asyncio.wait_for(http.post("/v1/completions", json={"model": MODEL, "prompt": "import os",
                                                                          "max_tokens": 4}), timeout=120)
            return r.status_code, r.json()["usage"]["completion_tokens"]

    for _ in range(3):
        run_async(first_token_then_leave())
    assert run_async(whole()) == (200, 4)
    assert server.engine._thread.is_alive()


def test_an_engine_that_fails_ends_every_request_with_a_500_and_health_says_so(served, capsys):
    """A step that raises (a bug, a device lost) must not leave clients waiting on a dead thread: the
    request in flight and every later one get a 500 naming the failure, and /health turns 500 for an
    orchestrator to restart the server. (Its own engine: the module's serves the other tests.)"""
    _, model, run = served
    serve = ServeConfig(slots=2, page_tokens=8, prefill_chunk=16)
    engine = Engine(model, run.plan, serve, cache="full", eos_id=run.eos, context=run.cfg.train.seq_len)

    def broken_step():
        raise FloatingPointError("the device returned garbage")

    engine.step = broken_step
    server = Server(engine, run.tokenizer, model_name=MODEL, serve=serve, chat=run.chat)

    async def go():
        async with client(server) as http:
            assert (await http.get("/health")).status_code == 200
            engine.start()  # its first step raises, with the request below waiting or about to
            first = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
            later = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
            return first, later, await http.get("/health")

    first, later, health = run_async(go(), timeout_s=60)
    engine.stop()
    for r in (first, later):
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed", r.text
        assert "FloatingPointError: the device returned garbage" in r.json()["error"]["message"]
    assert health.status_code == 500 and health.json()["status"] == "failed"
    assert "FloatingPointError" in capsys.readouterr().err  # the traceback in the server's log
