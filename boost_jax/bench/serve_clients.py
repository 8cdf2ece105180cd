"""The clients of `bench serve`: streamed greedy completions through the `openai` client, in a process
of their own (as a server's clients are: their parsing shares no interpreter with the server's
engine), each chunk's arrival timed.

    python -m boost_jax.bench.serve_clients '{"url": ..., "model": ..., "requests": [[prompt, n], ...],
                                              "together": true, "max_s": 600}'

prints one JSON object: the wall seconds from the first request sent to the last chunk, and per
request its text, its completion tokens (usage), when it was sent and when each chunk of text came.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import openai


async def _stream(client, model: str, prompt: list[int], max_tokens: int, deadline: float) -> dict:
    sent, times, counts, text, tokens = time.perf_counter(), [], [], "", 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             timeout=max(deadline - time.perf_counter(), 1.0))
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            counts.append(len(chunk.choices[0].text.split()))  # bench serve's tokenizer: one word per token
            text += chunk.choices[0].text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"text": text, "tokens": tokens, "sent": sent, "times": times, "counts": counts}


async def clients(url: str, model: str, requests: list, together: bool, max_s: float) -> dict:
    """All `requests` at once (`together`) or each sent when the one before ended."""
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=None) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
        t0 = time.perf_counter()
        deadline = t0 + max_s
        if together:
            results = list(await asyncio.gather(*(_stream(client, model, p, n, deadline) for p, n in requests)))
        else:
            results = [await _stream(client, model, p, n, deadline) for p, n in requests]
        return {"seconds": time.perf_counter() - t0, "results": results}


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    print(json.dumps(asyncio.run(clients(a["url"], a["model"], a["requests"], a["together"], a["max_s"]))))
