"""`bench serve --soak-s S`: the server under clients for S seconds (item 6's bounded soak), its
memory flat and no cache page leaked.

2 x serve.slots clients (the queue always holds some) send, one after another until the time is up,
streamed greedy completions of mixed lengths; one in four goes away after its second chunk (a
client gone mid-stream: its slot and pages freed at the engine's next step). The process's resident
memory, threads and open descriptors (bench/soak.sample) and the cache pages in use are sampled each
second. Past the warm-up share of the time (--soak-warmup, after every program was compiled and the
first requests served), RSS must stay within --rss-bound of its median over the first tenth of the
samples (the last tenth's median against it), threads and descriptors within soak.COUNT_SLACK; at
the end, once the last client is done, no request may run or wait and every page is free. The
clients run in the server's process (their memory is in its RSS too).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import numpy as np

from boost_jax.bench.soak import COUNT_SLACK, sample
from boost_jax.config import ConfigError

CUT_EVERY = 4  # one client in this many goes away mid-stream


async def _client(client, model: str, requests: list, rng: np.random.Generator, until: float, counts: dict) -> None:
    while time.perf_counter() < until:
        prompt, n = requests[int(rng.integers(len(requests)))]
        cut = rng.integers(CUT_EVERY) == 0
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if cut and chunks == 2:
                await stream.close()  # the connection dropped: the server cancels the request
                break
        counts["cut" if cut and chunks == 2 else "done"] += 1


async def _sampler(engine, until: float, samples: list) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() < until:
        samples.append({"s": time.perf_counter() - t0, "pages_used": engine.pages.used,
                        "running": engine.running, **sample(os.getpid())})
        await asyncio.sleep(1.0)


async def _soak(url: str, model: str, engine, requests: list, seconds: float, samples: list, counts: dict) -> None:
    import httpx  # optional: the serve extra's client
    import openai  # optional: the serve extra's client

    clients = 2 * engine.serve.slots
    until = time.perf_counter() + seconds
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4), timeout=None) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
        rngs = [np.random.default_rng(i) for i in range(clients)]
        await asyncio.gather(_sampler(engine, until, samples),
                             *(_client(client, model, requests, rng, until, counts) for rng in rngs))


def soak(loop, engine, requests: list, seconds: float, warmup: float, rss_bound: float) -> dict:
    """The soak on a started LoopbackServer `loop` (bench/serve.py) of `engine`."""
    samples, counts = [], {"done": 0, "cut": 0}
    asyncio.run(_soak(loop.url, loop.server.model_name, engine, requests, seconds, samples, counts))
    settle = time.perf_counter() + 30
    while (engine.running or engine.waiting) and time.perf_counter() < settle:  # the last cancellations
        time.sleep(0.1)
    after = [s for s in samples if s["s"] >= warmup * seconds]
    if len(after) < 4:
        raise ConfigError(f"bench serve --soak-s {seconds:g}: {len(after)} samples (one a second) past the warm-up; "
                          "soak longer")
    tenth = max(2, len(after) // 10)
    start, end = ({k: statistics.median(s[k] for s in part) for k in ("rss_mib", "threads", "fds")}
                  for part in (after[:tenth], after[-tenth:]))
    growth = {"rss": end["rss_mib"] / start["rss_mib"] - 1, "threads": end["threads"] - start["threads"],
              "fds": end["fds"] - start["fds"]}
    flat = {"rss": growth["rss"] <= rss_bound, "threads": growth["threads"] <= COUNT_SLACK,
            "fds": growth["fds"] <= COUNT_SLACK, "no_page_leaked": engine.pages.used == 0 and
            engine.pages.free == engine.pages.n_pages - 1, "nothing_left_running": not (engine.running or engine.waiting)}
    return {"seconds": seconds, "warmup": warmup, "rss_bound": rss_bound, "requests": counts,
            "generated_tokens": engine.generated, "cancelled": engine.cancelled,
            "peak_pages_used": max(s["pages_used"] for s in samples), "after_warmup": start, "end": end,
            "growth": growth, "flat": flat, "ok": all(flat.values()), "samples": samples}
