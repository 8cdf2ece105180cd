"""`python -m boost_jax.serve` as a process on 127.0.0.1 (slow tier): 32 concurrent clients of the real
`openai` client get, greedy, what api.generate gives on the same prompts, token for token, with no
compilation while serving; a client that disconnects mid-stream frees its slot and pages at once;
SIGTERM lets a running stream finish, refuses new connections and exits 0."""

import asyncio
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from boost_jax import api

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {k.removeprefix("boost_jax_serve_"): float(v) for k, v in
            (line.split() for line in text.splitlines() if not line.startswith("#"))}


@pytest.fixture(scope="module")
def server(tiny_run_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "boost_jax.serve", str(tiny_run_dir), "--port", str(port),
                             "--model-name", "tiny", "--cache", "full", "serve.slots=8", "serve.page_tokens=8",
                             "serve.prefill_chunk=16", "train.seq_len=2048"], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()
    else:
        proc.kill()
        pytest.fail("the server did not come up in 240 s")
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_32_concurrent_greedy_clients_get_what_generate_gives(server, tiny_run_dir):
    _, base = server
    compiled = metrics(base)["compilations_total"]
    cfg, model, _ = api.restore(tiny_run_dir)
    from boost_jax.model.run_dir import open_run

    run = open_run(tiny_run_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.model.vocab_size, int(rng.integers(1, 40))).tolist() for _ in range(32)]
    lengths = [int(rng.integers(1, 24)) for _ in range(32)]

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as oa:
            return await asyncio.gather(*(oa.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                                                logprobs=0) for p, n in zip(prompts, lengths)))

    got = asyncio.run(go())
    # Greedy is a prefix: each request's tokens are the first max_tokens of one long generation.
    longest = api.generate(model, prompts, max_new_tokens=max(lengths), eos_id=run.eos, cache="full")
    for n, out, full in zip(lengths, got, longest):
        want = full[:n]
        assert out.usage.completion_tokens == len(want)
        assert out.choices[0].text == run.tokenizer.decode(want)
    after = metrics(base)
    assert after["compilations_total"] == compiled and after["cache_pages_used"] == 0


def test_a_client_gone_mid_stream_frees_its_slot_and_pages_at_once(server):
    _, base = server
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 2000, "temperature": 0, "stream": True}
    before = metrics(base)["cancelled_requests_total"]
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        lines = response.iter_lines()  # kept: a generator dropped closes the connection
        next(lines)  # the first token, then the client goes
        assert metrics(base)["requests_running"] == 1
    deadline = time.monotonic() + 5  # 2000 tokens take far longer
    while (m := metrics(base))["requests_running"] or m["cache_pages_used"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["cancelled_requests_total"] == before + 1


def test_sigterm_drains_the_running_stream_refuses_new_ones_and_exits_0(server):
    proc, base = server
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 400, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=5)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"completion_tokens"' in rest[-2]  # the stream ran to its end
    assert proc.wait(timeout=60) == 0
